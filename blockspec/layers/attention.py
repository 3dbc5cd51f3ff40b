"""Grouped-query attention of a forward's new tokens over their keys: the KV cache's rows, or (without a
cache) context K/V given by the caller plus the new tokens' own."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.fused import fused_ops


class Attention(nn.Module):
    """Writes the new tokens' K/V to the cache and attends over what `ForwardBatch` lets each query see.
    `window`: a sliding-window layer (context keys more than window - 1 positions back are hidden)."""

    def __init__(self, layer_id: int, heads: int, kv_heads: int, head_dim: int,
                 window: int | None = None) -> None:
        super().__init__()
        self.layer_id, self.heads, self.kv_heads, self.head_dim = layer_id, heads, kv_heads, head_dim
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                context: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q [b, n, heads, d], k/v [b, n, kv_heads, d]; `context` (no cache only): the context's K/V, each
        [b, T, kv_heads, d]. Returns [b, n, heads * d]."""
        ops = fused_ops(q, k, v)
        if batch.cache is not None and ops is not None:
            return ops.cache_attention(q, k, v, batch.cache.k_layers[self.layer_id],
                                       batch.cache.v_layers[self.layer_id], batch.slots, batch.starts,
                                       batch.kv_length, batch.visible(self.window))
        if batch.cache is not None:
            self.store(k, v, batch)
            keys, values = self.cached(batch)
        else:
            if context is not None:
                k, v = torch.cat([context[0], k], dim=1), torch.cat([context[1], v], dim=1)
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        if ops is not None:
            return ops.attention(q, keys, values, batch.visible(self.window))
        mask = batch.attention_mask(self.heads // self.kv_heads, q.dtype, self.window)
        return attention(q, keys, values, mask)

    def store(self, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> None:
        """Write K/V [b, n, kv_heads, d] to the new tokens' cache rows (on its own: a draft's context)."""
        cache_k, cache_v = batch.cache.k_layers[self.layer_id], batch.cache.v_layers[self.layer_id]
        if batch.size == 1:
            slot, start, n = batch.slots[0], batch.starts[0], k.shape[1]
            cache_k[slot].narrow(1, start, n).copy_(k[0].transpose(0, 1))
            cache_v[slot].narrow(1, start, n).copy_(v[0].transpose(0, 1))
            return
        slot_idx, row_idx = batch.write_index()
        heads = torch.arange(k.shape[2], device=k.device).view(1, -1, 1)
        cache_k.index_put_((slot_idx, heads, row_idx), k.transpose(1, 2))
        cache_v.index_put_((slot_idx, heads, row_idx), v.transpose(1, 2))

    def cached(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of cache rows 0..kv_length of every slot in the batch: [b, kv_heads, kv_length, d]."""
        k, v = batch.cache.k_layers[self.layer_id], batch.cache.v_layers[self.layer_id]
        length = batch.kv_length
        if batch.size == 1:
            slot = batch.slots[0]
            return k[slot : slot + 1, :, :length], v[slot : slot + 1, :, :length]
        if batch.contiguous:  # a view: no copy of every row's K/V per layer
            lo = batch.slots[0]
            return k[lo : lo + batch.size, :, :length], v[lo : lo + batch.size, :, :length]
        index = batch.slot_tensor()
        return k[index, :, :length], v[index, :, :length]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention without repeating K/V.

    q: [b, n, heads, d]; k, v: [b, kv_heads, L, d]; mask: a `fold_mask` result or None. The query heads of
    one KV group are folded into the sequence axis so SDPA sees kv_heads heads. Returns [b, n, heads * d].
    """
    b, n, heads, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    if n == 1 and mask is None:  # decode: the fold is a plain view, no permutes
        out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, groups, d), k, v)
        return out.reshape(b, 1, heads * d)
    q = q.view(b, n, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, groups * n, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.view(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, heads * d)
