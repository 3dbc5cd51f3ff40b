"""The fused CPU inference ops (blockspec/kernels/fused_ops.cpp: RMSNorm, rotary embedding, SiLU gate,
attention) and when the layers take them: fp32 CPU tensors with autograd off. Elsewhere (training, GPUs,
other dtypes, or an install whose extension did not build) the layers run their torch ops."""

from __future__ import annotations

import torch

_OPS: object | None = None
_LOADED = False


def fused_ops(x: torch.Tensor):
    """torch.ops.blockspec where the fused ops apply to x, else None."""
    global _OPS, _LOADED
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
        return None
    if not _LOADED:
        _LOADED = True
        try:
            import blockspec._kernels  # noqa: F401  (registers torch.ops.blockspec)

            _OPS = torch.ops.blockspec
        except ImportError:
            _OPS = None
    return _OPS
