"""The fused CPU inference ops (blockspec/kernels/fused_ops.cpp: RMSNorm, rotary embedding, SiLU gate,
attention) and when the layers take them: fp32 CPU tensors with autograd and autocast off. Elsewhere
(training, GPUs, other dtypes, or an install whose extension did not build) the layers run their torch
ops."""

from __future__ import annotations

import torch

_OPS: object | None = None
_LOADED = False


def fused_ops(*tensors: torch.Tensor):
    """torch.ops.blockspec where the fused ops apply to these inputs, else None."""
    global _OPS, _LOADED
    if torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return None
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    if not _LOADED:
        _LOADED = True
        try:
            import blockspec._kernels  # noqa: F401  (registers torch.ops.blockspec)

            _OPS = torch.ops.blockspec
        except ImportError:
            _OPS = None
    return _OPS
