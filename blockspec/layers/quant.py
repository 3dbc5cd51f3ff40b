"""Weights held as GGUF blocks (Q4_0, Q4_1, Q8_0), multiplied by blockspec's own CPU kernel.

A GGUF file stores each weight row as blocks of 32 weights: an fp16 scale (and for Q4_1 an fp16 offset)
and the quantized values. `QuantWeight` keeps those bytes exactly as stored, one row of blocks per output,
and multiplies fp32 activations by them with fp32 accumulation (blockspec/kernels/quant_matmul.cpp): the
weights dequantize exactly, and each output's summation order is fixed, whatever the number of rows in the
batch or the thread count. A `Linear` (or `Embedding`) whose weight is a QuantWeight owns it the same way it
owns a dense one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from blockspec.errors import ModelLoadError

log = logging.getLogger("blockspec")

BLOCK = 32  # weights per block


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml_id: int  # gguf.GGMLQuantizationType's number
    block_bytes: int


QUANT_TYPES = {t.name: t for t in (QuantType("q4_0", 2, 18), QuantType("q4_1", 3, 20),
                                   QuantType("q8_0", 8, 34))}
BY_GGML_ID = {t.ggml_id: t for t in QUANT_TYPES.values()}


def quant_type(name: str) -> QuantType:
    if name not in QUANT_TYPES:
        raise ModelLoadError(f"quantization {name!r} is not supported; supported block types: "
                             f"{sorted(QUANT_TYPES)}.")
    return QUANT_TYPES[name]


@dataclass
class Blocks:
    """A checkpoint tensor as GGUF stores it: `data` uint8 [rows, cols / 32 * block_bytes]."""

    qtype: QuantType
    data: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], exactly as gguf.quants.dequantize."""
        return kernels().quant_rows(self.data, torch.arange(self.data.shape[0]), self.qtype.ggml_id)


class QuantWeight:
    """A weight [rows, cols] held as blocks, with the matmul and row lookup over them."""

    def __init__(self, rows: int, cols: int, qtype: QuantType) -> None:
        if cols % BLOCK:
            raise ModelLoadError(f"a {qtype.name} weight needs a multiple of {BLOCK} columns "
                                 f"(its block size), got {cols}. Use --quantization none for this model.")
        self.qtype, self.cols = qtype, cols
        self.data = torch.empty((rows, cols // BLOCK * qtype.block_bytes), dtype=torch.uint8)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def load_rows(self, rows: slice, tensor: torch.Tensor | Blocks) -> None:
        """Fill `rows` with a checkpoint tensor: its own blocks (of this type, copied as they are), or a
        dense one (quantized here, as gguf.quants.quantize does)."""
        if isinstance(tensor, Blocks) and tensor.qtype == self.qtype:
            self.data[rows].copy_(tensor.data)
            return
        dense = tensor.dequantize() if isinstance(tensor, Blocks) else tensor  # requantized to this type
        self.data[rows].copy_(quantize(dense, self.qtype))

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., cols] (fp32) @ W^T -> [..., rows], plus `residual` [..., rows] if given."""
        flat = x.reshape(-1, self.cols)
        if flat.dtype != torch.float32:
            flat = flat.float()
        if residual is not None and residual.dtype != torch.float32:
            residual = residual.float()
        out = kernels().quant_matmul(flat, self.data, self.qtype.ggml_id, False, residual)
        return out.view(*x.shape[:-1], self.data.shape[0])

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` [...] -> [..., cols] fp32 (an embedding lookup)."""
        return kernels().quant_rows(self.data, ids.reshape(-1), self.qtype.ggml_id).view(*ids.shape,
                                                                                         self.cols)

    def rows(self, ids: torch.Tensor) -> QuantWeight:
        """A weight over rows `ids` only (a copy of their blocks)."""
        return self._over(self.data[ids.cpu()].contiguous())

    def row_range(self, start: int) -> QuantWeight:
        """The weight's rows start.. (a view: rows of blocks are contiguous)."""
        return self._over(self.data[start:])

    def _over(self, data: torch.Tensor) -> QuantWeight:
        sub = QuantWeight.__new__(QuantWeight)
        sub.qtype, sub.cols, sub.data = self.qtype, self.cols, data
        return sub

    def dequantize(self) -> torch.Tensor:
        return Blocks(self.qtype, self.data, self.cols).dequantize()


def quantize(weight: torch.Tensor, qtype: QuantType) -> torch.Tensor:
    """A dense weight [rows, cols] as blocks (uint8), by gguf's reference quantizer."""
    import gguf

    rows = weight.detach().float().cpu().numpy()
    blocks = gguf.quants.quantize(np.ascontiguousarray(rows), gguf.GGMLQuantizationType(qtype.ggml_id))
    return torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(rows.shape[0], -1)


_KERNELS = None


def kernels():
    """torch.ops.blockspec, loaded once (the compiled extension, blockspec/_kernels*.so)."""
    global _KERNELS
    if _KERNELS is None:
        try:
            import blockspec._kernels  # noqa: F401  (registers torch.ops.blockspec)
        except ImportError as exc:
            raise ModelLoadError(
                f"blockspec's CPU kernels are not built ({exc}). Reinstall the package so its extension "
                f"compiles: pip install --no-build-isolation -e . (with torch installed first), "
                f"or use --quantization none."
            ) from exc
        ops = torch.ops.blockspec
        if not ops.avx2_available():
            log.warning("this CPU lacks AVX2+FMA+F16C: blockspec's block-quantized kernels run a portable "
                        "path, several times slower. --quantization none (fp32) may be faster here.")
        _KERNELS = ops
    return _KERNELS
