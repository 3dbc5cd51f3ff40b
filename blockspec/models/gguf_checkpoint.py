"""A Llama GGUF as a checkpoint: its tensors under Hugging Face names, block-quantized ones as they are
stored.

This is how the target runs the file's own blocks (`loader.load_target(..., gguf=...)`) instead of the fp32
copy `gguf_convert.py` writes: a quantized tensor becomes `Blocks` (its rows of GGUF blocks, q/k rows put
back in Hugging Face order, which moves whole rows and so whole blocks), a float one a dense tensor. With
--quantization none every tensor arrives dequantized (a layer holding dense weights dequantizes Blocks).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from blockspec.errors import ModelLoadError
from blockspec.layers.quant import BY_GGML_ID, Blocks, QuantType
from blockspec.models.gguf_convert import INSTALL_HINT, hf_name, unpermute
from blockspec.models.gguf_file import BF16, F16, F32, GGUFFile

READ_TYPES = ", ".join([t.name.upper() for t in BY_GGML_ID.values()] + ["F32"])


class GGUFCheckpoint:
    """Every tensor of a Llama GGUF under its HF name: `Blocks` for the types blockspec's kernels read (each
    tensor in its own type), dense fp32 for float types. Another quantized type is refused, named, when held
    as blocks."""

    def __init__(self, path: Path) -> None:
        self.source, self.file = path, _open(path)
        fields = self.file.fields
        if fields.get("general.architecture") != "llama" or "llama.attention.head_count" not in fields:
            raise ModelLoadError(f"{path}: GGUF architecture is {fields.get('general.architecture')!r}; "
                                 f"blockspec runs 'llama' GGUFs only.")
        heads = int(fields["llama.attention.head_count"])
        self._heads = {".attn_q.": heads, ".attn_k.": int(fields.get("llama.attention.head_count_kv", heads))}
        self._tensors = {hf_name(t.name): t for t in self.file.tensors}

    def shape(self, name: str) -> tuple[int, ...] | None:
        tensor = self._tensors.get(name)
        # GGUF: innermost first
        return None if tensor is None else tuple(int(d) for d in reversed(tensor.shape))

    def stored_type(self, name: str) -> QuantType | None:
        """The block type the tensor is stored in (F16 and BF16 too: held as stored), None for F32."""
        kind = self._tensors[name].tensor_type
        if kind == F32:
            return None
        if kind not in BY_GGML_ID:
            import gguf  # its name, for the message

            raise ModelLoadError(
                f"{self.source}: tensor {self._tensors[name].name} is "
                f"{gguf.GGMLQuantizationType(kind).name}, "
                f"which blockspec's kernels do not read (they read {READ_TYPES}). Requantize the file with "
                f"llama.cpp: `llama-quantize --allow-requantize {self.source.name} out.gguf Q4_K_M` (or "
                f"Q5_K_M, Q6_K, Q8_0), or pass --quantization none to run it dequantized in fp32 (4-8x the "
                f"memory).")
        return BY_GGML_ID[int(kind)]

    def get(self, name: str, source: tuple[int, int, int, int] | None = None) -> torch.Tensor | Blocks:
        """The tensor, or only its part `source` (dim, start, length, full; a tensor-parallel rank's): rows
        of blocks, or inputs on block boundaries (whole blocks), read from the memory-mapped file."""
        tensor = self._tensors[name]
        data, kind = np.asarray(tensor.data), tensor.tensor_type
        heads = next((n for part, n in self._heads.items() if part in tensor.name), None)
        cols = self.shape(name)[-1]
        if source is not None:
            dim, start, length, full = source
            if dim == 0:  # whole heads for q/k (the split is by heads): the row order is per head
                if heads is not None:
                    heads = heads * length // full
                data = data[start : start + length]
            else:
                per_col = data.shape[1] / cols  # bytes (a block type) or values (float) per input
                elems = BY_GGML_ID[kind].block_elems if kind in BY_GGML_ID else 1
                if start % elems or length % elems:
                    raise ModelLoadError(f"{self.source}: {name} cannot be split at input {start} "
                                         f"(+{length}): its blocks hold {elems} inputs. Use another "
                                         f"--tp-size.")
                data = data[:, int(start * per_col) : int((start + length) * per_col)]
                cols = length
        if heads is not None:  # llama.cpp's row order of q and k: whole rows move, blocks stay intact
            data = unpermute(data, heads)
        if kind in (F32, F16):
            return torch.from_numpy(np.array(data, dtype=np.float32))
        if kind == BF16:  # the top half of a float32
            return torch.from_numpy((np.ascontiguousarray(data).astype(np.uint32) << 16).view(np.float32))
        if kind in BY_GGML_ID:
            return Blocks(BY_GGML_ID[kind], torch.from_numpy(np.array(data, dtype=np.uint8)), cols)
        # a type the kernels do not read, for a dense layer (`stored_type` refuses it for blocks)
        import gguf

        return torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType(kind))
                                .astype(np.float32))


def _open(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{exc} Reinstall it: {INSTALL_HINT}.") from exc
