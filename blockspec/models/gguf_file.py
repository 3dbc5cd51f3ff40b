"""A GGUF file's header, read directly: its scalar metadata and its tensor table, tensors memory-mapped.

gguf-py's `GGUFReader` builds Python objects for every metadata field and every element of every array.
A model that carries its tokenizer holds ~100k vocabulary and merge strings, so that costs seconds on every
start (7 s for the embedded SmolLM2 on a 2-core VM). Loading weights needs only the tensor table and a few
numbers: this reader steps over arrays without building them (tens of ms) and maps the tensors' bytes as
numpy views shaped as `GGUFReader` shapes them. The conversion (once) still uses `GGUFReader`, which it
needs for the tokenizer's arrays.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockspec.errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
F32, F16, BF16 = 0, 1, 30  # GGMLQuantizationType ids of the float types
# Metadata value types (GGUFValueType): fixed-size scalars by struct format, then STRING=8, ARRAY=9.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: innermost dimension first (as gguf-py's ReaderTensor.shape)
    tensor_type: int  # GGMLQuantizationType id
    # float32/float16 (BF16: its uint16 bits) [..., inner], or uint8 rows of blocks [..., bytes]: a view of
    # the map
    data: np.ndarray


class GGUFFile:
    """`fields`: scalar and string metadata (arrays are skipped: `array_lengths` has their lengths);
    `tensors`: the tensor table, in file order."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            self.fields, self.array_lengths, self.tensors = self._parse()
        except (OSError, ValueError, struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ModelLoadError(f"{self.path} is not a readable GGUF ({type(exc).__name__}: "
                                 f"{exc}).") from exc

    def _parse(self) -> tuple[dict, dict, list[GGUFTensor]]:
        buf = self._map
        if buf[:4] != MAGIC:
            raise ValueError(f"it does not start with {MAGIC!r}")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (a big-endian file, or a format this reader does not "
                             f"know; versions 2 and 3 are read)")
        pos = 24
        fields: dict = {}
        lengths: dict[str, int] = {}
        for _ in range(kv_count):
            key, pos = _string(buf, pos)
            (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            if kind == _ARRAY:
                (item, count), pos = struct.unpack_from("<IQ", buf, pos), pos + 12
                lengths[key] = count
                pos = _skip_array(buf, pos, item, count)
            else:
                fields[key], pos = _value(buf, pos, kind)
        table = []
        for _ in range(tensor_count):
            name, pos = _string(buf, pos)
            (dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            shape = struct.unpack_from(f"<{dims}Q", buf, pos)
            pos += 8 * dims
            kind, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            table.append((name, tuple(int(d) for d in shape), kind, offset))
        alignment = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-pos // alignment) * alignment
        tensors = [GGUFTensor(name, shape, kind, self._view(name, shape, kind, start + offset))
                   for name, shape, kind, offset in table]
        return fields, lengths, tensors

    def _view(self, name: str, shape: tuple[int, ...], kind: int, offset: int) -> np.ndarray:
        rows = tuple(reversed(shape[1:]))
        if kind in (F32, F16, BF16):
            dtype = {F32: np.float32, F16: np.float16, BF16: np.uint16}[kind]
            count = int(np.prod(shape))
            array = np.frombuffer(self._map, dtype=dtype, count=count, offset=offset)
            return array.reshape(*rows, shape[0])
        block, block_bytes = _block_size(name, kind)
        if shape[0] % block:
            raise ValueError(f"tensor {name}: {shape[0]} inputs are not whole blocks of {block}")
        per_row = shape[0] // block * block_bytes
        count = int(np.prod(rows, dtype=np.int64)) * per_row
        return np.frombuffer(self._map, dtype=np.uint8, count=count, offset=offset).reshape(*rows, per_row)


def _block_size(name: str, kind: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a block type: blockspec's own types without importing gguf."""
    from blockspec.layers.quant import BY_GGML_ID

    if kind in BY_GGML_ID:
        return BY_GGML_ID[kind].block_elems, BY_GGML_ID[kind].block_bytes
    import gguf  # another type (refused, or read dequantized): gguf-py knows its block layout

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
    except (KeyError, ValueError) as exc:
        raise ValueError(f"tensor {name} has type id {kind}, which is not a GGML type gguf-py knows "
                         f"(ik_llama.cpp writes such ids, e.g. its _R4/_R8 repacks); requantize the file "
                         f"with llama.cpp's llama-quantize (to Q4_K_M, say)") from exc


def _string(buf, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return bytes(buf[pos : pos + length]).decode("utf-8"), pos + length


def _value(buf, pos: int, kind: int) -> tuple[object, int]:
    if kind == _STRING:
        return _string(buf, pos)
    fmt = _SCALARS.get(kind)
    if fmt is None:
        raise ValueError(f"unknown metadata value type {kind}")
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def _skip_array(buf, pos: int, item: int, count: int) -> int:
    """The position after an array of `count` items of type `item`, nothing built."""
    if item in _SCALARS:
        return pos + count * struct.calcsize(_SCALARS[item])
    if item == _STRING:
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            pos += 8 + unpack(buf, pos)[0]
        return pos
    if item == _ARRAY:
        for _ in range(count):
            inner, n = struct.unpack_from("<IQ", buf, pos)
            pos = _skip_array(buf, pos + 12, inner, n)
        return pos
    raise ValueError(f"unknown metadata array type {item}")
