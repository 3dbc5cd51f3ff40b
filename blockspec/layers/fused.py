"""The fused CPU inference ops (blockspec/kernels/fused_ops.cpp: RMSNorm, rotary embedding, SiLU gate,
attention) and when the layers take them: fp32 CPU tensors with autograd and autocast off. Elsewhere
(training, GPUs, other dtypes, or an install whose extension did not build) the layers run their torch
ops."""

from __future__ import annotations

import torch

from blockspec.errors import ModelLoadError
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.quant import kernels

# The fused attention walks each query over its keys on its own: fastest for a step's few new tokens per
# row, while for long prompt chunks SDPA's blocked kernel is (a 3,900-token prompt in 512-token chunks:
# 37 s vs 22 s on 2 cores).
MAX_FUSED_QUERIES = 16
# A tree's verify pass takes it at any width: it gathers each node's visible keys (context and ancestors,
# wherever they sit among the new rows), so a node's sums are those of its token decoded on its own.


def fused_attention_fits(batch: ForwardBatch) -> bool:
    """Whether the fused attention (and layer stack) takes this forward: few new tokens, or a tree."""
    tree = batch.cache is not None and isinstance(batch.among_new, torch.Tensor)
    return tree or batch.num_new <= MAX_FUSED_QUERIES

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
