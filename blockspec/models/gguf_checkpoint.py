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
from blockspec.layers.quant import BY_GGML_ID, QUANT_TYPES, Blocks, QuantType
from blockspec.models.gguf_convert import INSTALL_HINT, hf_name, read_config, unpermute


class GGUFCheckpoint:
    """Every tensor of a Llama GGUF under its HF name: `Blocks` for the types blockspec's kernels read, dense
    fp32 for float types. Another quantized type is refused, named, when read."""

    def __init__(self, path: Path) -> None:
        self.source, self.reader = path, _reader(path)
        config = read_config(self.reader)
        self._heads = {".attn_q.": config["num_attention_heads"], ".attn_k.": config["num_key_value_heads"]}
        self._tensors = {hf_name(t.name): t for t in self.reader.tensors}

    def shape(self, name: str) -> tuple[int, ...] | None:
        tensor = self._tensors.get(name)
        # GGUF: innermost first
        return None if tensor is None else tuple(int(d) for d in reversed(tensor.shape))

    def stored_type(self, name: str) -> QuantType | None:
        """The block type the tensor is stored in, None for a float tensor."""
        import gguf

        kind = self._tensors[name].tensor_type
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return None
        if int(kind) not in BY_GGML_ID:
            raise ModelLoadError(
                f"{self.source}: tensor {self._tensors[name].name} is {kind.name}, which blockspec's "
                f"kernels do not read (they read {', '.join(sorted(QUANT_TYPES))}). Use --quantization none "
                f"to run it dequantized in fp32, or --quantization q8_0 to requantize it.")
        return BY_GGML_ID[int(kind)]

    def get(self, name: str, source: tuple[int, int, int, int] | None = None) -> torch.Tensor | Blocks:
        """The tensor, or only its part `source` (dim, start, length, full; a tensor-parallel rank's): rows
        of blocks, or inputs on block boundaries (whole blocks), read from the memory-mapped file."""
        import gguf

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
                if int(kind) in BY_GGML_ID and (start % 32 or length % 32):
                    raise ModelLoadError(f"{self.source}: {name} cannot be split at input {start} "
                                         f"(+{length}): blocks hold 32 inputs. Use another --tp-size.")
                data = data[:, int(start * per_col) : int((start + length) * per_col)]
                cols = length
        if heads is not None:  # llama.cpp's row order of q and k: whole rows move, blocks stay intact
            data = unpermute(data, heads)
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return torch.from_numpy(np.array(data, dtype=np.float32))
        if int(kind) in BY_GGML_ID:
            return Blocks(BY_GGML_ID[int(kind)], torch.from_numpy(np.array(data, dtype=np.uint8)), cols)
        # a type the kernels do not read, for a dense layer (`stored_type` refuses it for blocks)
        return torch.from_numpy(gguf.quants.dequantize(data, kind).astype(np.float32))


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises bare ValueError/struct errors on damaged files
        raise ModelLoadError(f"{path} is not a readable GGUF ({exc}). Reinstall it: "
                             f"{INSTALL_HINT}.") from exc
