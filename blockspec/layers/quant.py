"""Weights held as GGUF blocks, multiplied by blockspec's own CPU kernels.

A GGUF file stores each weight row as blocks: 32 weights with an fp16 scale (Q4_0, Q5_0, Q8_0; Q4_1 and
Q5_1 also an fp16 min) or the K-quants' super-blocks of 256 (Q4_K, Q5_K: 8 sub-blocks with 6-bit scales and
mins; Q6_K: 16 sub-blocks with int8 scales), and the quantized values (kernels/gguf_blocks.h has the
layouts). `QuantWeight` keeps those bytes exactly, and multiplies activations by them in one of two ways
(`activations`):
- "fp32": rows of blocks as stored; fp32 activations, fp32 accumulation (kernels/quant_matmul.cpp). The
  exact reference: the weights dequantize exactly, each output's summation order is fixed.
- "int8": the blocks repacked once, 8 output rows interleaved (kernels/int8_matmul.cpp); each activation row
  is quantized to int8 blocks of 32 once per matmul and every block dot product runs in integers, 3-4x the
  multiply-adds per second of the fp32 form on a verify block or prompt chunk. The repacked form holds every
  stored bit (`stored()` gives the file's blocks back); 5- and 6-bit quants are widened to a byte there.
Either way a row's result depends on that row alone, not on the batch, its position or the thread count.
A `Linear` (or `Embedding`) whose weight is a QuantWeight owns it the same way it owns a dense one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from blockspec.errors import ModelLoadError

log = logging.getLogger("blockspec")

BLOCK = 32  # weights per (sub-)block: the unit every kernel steps by
ACTIVATIONS = ("int8", "fp32")  # how block weights meet activations on the CPU (QuantWeight.activations)


@dataclass(frozen=True)
class QuantType:
    name: str
    ggml_id: int  # gguf.GGMLQuantizationType's number
    block_bytes: int
    block_elems: int = BLOCK  # weights per stored block (256: a K-quant super-block)
    requantizable: bool = True  # gguf.quants.quantize makes it (not the K-quants)

    @property
    def floats(self) -> bool:
        """F16 / BF16: values as stored (blocks of 32 of them), multiplied with fp32 activations only."""
        return self.name in ("f16", "bf16")


QUANT_TYPES = {t.name: t for t in (
    QuantType("q4_0", 2, 18), QuantType("q4_1", 3, 20), QuantType("q5_0", 6, 22), QuantType("q5_1", 7, 24),
    QuantType("q8_0", 8, 34), QuantType("q4_k", 12, 144, 256, False), QuantType("q5_k", 13, 176, 256, False),
    QuantType("q6_k", 14, 210, 256, False), QuantType("f16", 1, 64, 32, False),
    QuantType("bf16", 30, 64, 32, False))}
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
        if cols % qtype.block_elems:
            raise ModelLoadError(f"a {qtype.name} weight needs a multiple of {qtype.block_elems} columns "
                                 f"(its block size), got {cols}. Use --quantization none for this model.")
        self.qtype, self.cols, self.num_rows = qtype, cols, rows
        self.data = torch.empty((rows, cols // qtype.block_elems * qtype.block_bytes), dtype=torch.uint8)
        self.activations = "fp32"  # "int8" once repacked (use_int8)

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.cols

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def packed(self) -> bool:
        return self.activations == "int8"

    def use_int8(self) -> None:
        """Repack the loaded blocks for int8 activations (in place, once; the stored rows are not kept).
        F16 / BF16 weights stay as they are (fp32 activations: there is no integer form of a float)."""
        if not self.packed and not self.qtype.floats:
            self.data = kernels().int8_pack(self.data, self.qtype.ggml_id)
            self.activations = "int8"

    def stored(self) -> torch.Tensor:
        """The blocks as GGUF stores them, [rows, cols / 32 * block_bytes] (a copy when repacked)."""
        if not self.packed:
            return self.data
        return kernels().int8_unpack(self.data, self.qtype.ggml_id, self.num_rows)

    def load_rows(self, rows: slice, tensor: torch.Tensor | Blocks) -> None:
        """Fill `rows` with a checkpoint tensor: its own blocks (of this type, copied as they are), or a
        dense one (quantized here, as gguf.quants.quantize does)."""
        if self.packed:
            raise ValueError("QuantWeight.load_rows: load a weight before repacking it (use_int8).")
        if isinstance(tensor, Blocks) and tensor.qtype == self.qtype:
            self.data[rows].copy_(tensor.data)
            return
        if self.qtype.floats:  # a file's F16 / BF16 values arrive as fp32: converted back exactly
            dense = tensor.dequantize() if isinstance(tensor, Blocks) else tensor
            half = dense.to(torch.float16 if self.qtype.name == "f16" else torch.bfloat16).contiguous()
            self.data[rows].copy_(half.view(torch.uint8).view(dense.shape[0], -1))
            return
        if not self.qtype.requantizable:
            given = tensor.qtype.name if isinstance(tensor, Blocks) else "a float tensor"
            raise ModelLoadError(f"a {self.qtype.name} weight loads only {self.qtype.name} blocks (no "
                                 f"quantizer here makes them), got {given}. Hold the layer in a type its "
                                 f"parts share.")
        dense = tensor.dequantize() if isinstance(tensor, Blocks) else tensor  # requantized to this type
        self.data[rows].copy_(quantize(dense, self.qtype))

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., cols] (fp32) @ W^T -> [..., rows], plus `residual` [..., rows] if given."""
        flat = x.reshape(-1, self.cols)
        if flat.dtype != torch.float32:
            flat = flat.float()
        if residual is not None and residual.dtype != torch.float32:
            residual = residual.float()
        if self.packed:
            out = kernels().int8_matmul(flat, self.data, self.qtype.ggml_id, self.num_rows, residual)
        else:
            out = kernels().quant_matmul(flat, self.data, self.qtype.ggml_id, False, residual)
        return out.view(*x.shape[:-1], self.num_rows)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `ids` [...] -> [..., cols] fp32 (an embedding lookup)."""
        lookup = kernels().int8_rows if self.packed else kernels().quant_rows
        return lookup(self.data, ids.reshape(-1), self.qtype.ggml_id).view(*ids.shape, self.cols)

    def rows(self, ids: torch.Tensor) -> QuantWeight:
        """A weight over rows `ids` only (a copy of their blocks, in this weight's form)."""
        return self._over(self.stored()[ids.cpu()].contiguous())

    def row_range(self, start: int) -> QuantWeight:
        """The weight's rows start.. (a view where the rows' layout allows it, else a copy)."""
        if not self.packed:
            return self._over(self.data[start:])
        if start % 8 == 0:  # whole groups of 8 interleaved rows
            view = self._over(self.data[start // 8 :], packed=True)
            view.num_rows = self.num_rows - start
            return view
        return self._over(self.stored()[start:].contiguous())

    def _over(self, data: torch.Tensor, packed: bool = False) -> QuantWeight:
        """A weight over `data`: stored rows, repacked to this weight's form; or already packed ones."""
        sub = QuantWeight.__new__(QuantWeight)
        sub.qtype, sub.cols, sub.data, sub.num_rows = self.qtype, self.cols, data, data.shape[0]
        sub.activations = "int8" if packed else "fp32"
        if self.packed and not packed:
            sub.use_int8()
        return sub

    def dequantize(self) -> torch.Tensor:
        if self.packed:
            return self.lookup(torch.arange(self.num_rows))
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
