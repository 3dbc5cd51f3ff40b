"""The fused CPU inference ops (blockspec/kernels/fused_ops.cpp: RMSNorm, rotary embedding, SiLU gate,
attention) and when the layers take them: fp32 CPU tensors with autograd and autocast off. Elsewhere
(training, GPUs, other dtypes, or an install whose extension did not build) the layers run their torch
ops."""

from __future__ import annotations

import torch

from blockspec.errors import ModelLoadError
from blockspec.layers.quant import kernels

_UNBUILT = False  # the extension failed to load once: the torch ops from then on


def fused_ops(*tensors: torch.Tensor):
    """torch.ops.blockspec where the fused ops apply to these inputs, else None."""
    global _UNBUILT
    if _UNBUILT or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return None
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    try:
        return kernels()
    except ModelLoadError:
        _UNBUILT = True
        return None
