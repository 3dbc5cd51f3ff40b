"""The fused CPU inference ops (blockspec/kernels/fused_ops.cpp: RMSNorm, rotary embedding, SiLU gate,
attention) and when the layers take them: fp32 CPU tensors with autograd and autocast off. Elsewhere
(training, GPUs, other dtypes, or an install whose extension did not build) the layers run their torch
ops."""

from __future__ import annotations

import torch

# The fused attention walks each query over its keys on its own: fastest for a step's few new tokens per
# row, while for long prompt chunks SDPA's blocked kernel is (a 3,900-token prompt in 512-token chunks:
# 37 s vs 22 s on 2 cores).
MAX_FUSED_QUERIES = 16

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
