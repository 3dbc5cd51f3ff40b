"""The product of a dense weight: x W^T (+ b) (+ residual), and on the CPU in fp32 inference through our own
kernel (kernels/dense_matmul.cpp), whose every output sums its inputs in one fixed order: a row gets the
same bits alone or beside any number of rows, in any prefill chunk, at any thread count, under every
instruction set the CPU has, from a column-major weight (as the engine holds them) or a row-major one.

A BLAS cannot promise that: it picks its GEMM form and blocking by the row count (one row as a GEMV, a few
as packed panels), so a token's K/V, and then a batched request's text, would depend on its neighbours. The
kernel's order is a tree of halves over the inputs, so row-parallel ranks' parts summed the same way are one
rank's sums (tensor parallelism equals one rank on the dense path too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from blockspec.layers.fused import fused_ops
from blockspec.layers.quant import kernels

VARIANTS = {0: "auto", 1: "portable", 2: "avx2", 3: "avx512"}
LEVELS = 3  # the kernel's tree of halves over the inputs: 8 leaves, so up to 8 row-parallel ranks are exact
_variant = 0  # the instruction set the kernel runs (0: the widest this CPU has); tests force each one


def dense_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, levels: int = LEVELS) -> torch.Tensor:
    """x [..., in] W^T for a weight [out, in] (+ bias [out]) (+ residual [..., out]). `levels`: the depth of
    the summation tree; a row-parallel rank's part of 2^t ranks sums as the subtree LEVELS - t deep."""
    ops = fused_ops(x, weight)
    if ops is None:  # training, a GPU, another dtype: torch's own (its rounding is not promised)
        out = F.linear(x, weight, bias)
        return out if residual is None else residual + out
    flat = x.reshape(-1, x.shape[-1])
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()  # the kernel reads rows of inputs
    res = None if residual is None else residual.reshape(flat.shape[0], -1)
    out = ops.dense_matmul(flat, weight, bias, res, _variant, levels)
    return out.view(*x.shape[:-1], weight.shape[0])


def available_variants() -> list[int]:
    """The kernel's instruction-set variants this CPU runs (1 portable, 2 AVX2, 3 AVX-512)."""
    return list(kernels().dense_variants())


@contextlib.contextmanager
def dense_variant(variant: int) -> Iterator[None]:
    """Run the dense kernel in one variant (all give the same bits) inside the block."""
    global _variant
    if variant not in VARIANTS or (variant and variant not in available_variants()):
        raise ValueError(f"dense_variant: {variant} is not available here; this CPU runs "
                         f"{[VARIANTS[v] for v in available_variants()]}")
    previous, _variant = _variant, variant
    try:
        yield
    finally:
        _variant = previous
