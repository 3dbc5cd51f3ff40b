"""The DFlash draft: Qwen3-style layers that fill a whole block in one non-causal pass.

Target features (hidden states tapped from several target layers) are projected by `fc` and
`hidden_norm` and injected as extra K/V into every draft layer's cache, for committed tokens only
(`inject`). The block `[bonus, MASK x (B-1)]` then attends to that context plus itself in both
directions (`forward`). The draft has no LM head; the target's scores its output (over the draft's
vocabulary, if it has one).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.engine.kv_cache import Batch, KVCache
from blockspec.models.layers import Linear, RMSNorm, Rotary, apply_rope, attention
from blockspec.models.target import MLP
from blockspec.spec.draft_config import DraftConfig


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_width, kv_width, kv_width], parallel="column")
        self.o_proj = Linear(q_width, cfg.hidden_size, parallel="row")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        sliding = cfg.layer_types[layer_id] == "sliding_attention"
        self.sliding_window = cfg.sliding_window if sliding else None

    def context_kv(self, ctx: torch.Tensor, rope: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of projected target features ctx [b, n, H]; the Q rows of the weight are skipped."""
        b, n, _ = ctx.shape
        q_width = self.heads * self.head_dim
        kv = torch.nn.functional.linear(ctx, self.qkv_proj.weight[q_width:])
        k, v = kv.view(b, n, 2 * self.kv_heads, self.head_dim).split(self.kv_heads, dim=2)
        return apply_rope(self.k_norm(k), *rope), v

    def forward(self, x, rope, batch: Batch, cache: KVCache, length: int, mask) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shards, dim=-1)
        q = apply_rope(self.q_norm(q.view(b, n, self.heads, self.head_dim)), *rope)
        k = apply_rope(self.k_norm(k.view(b, n, self.kv_heads, self.head_dim)), *rope)
        cache.write(self.layer_id, batch, k, v.view(b, n, self.kv_heads, self.head_dim))
        keys, values = cache.read(self.layer_id, batch, length)
        return self.o_proj(attention(q, keys, values, mask))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, batch, cache, length, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, cache, length, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def block_mask(batch: Batch, block: int, length: int, window: int | None, device) -> torch.Tensor | None:
    """bool [b, block, length]: the block sees its own row's context and the whole block (non-causal);
    a sliding window hides context keys older than `window - 1` positions before each query."""
    if batch.size == 1 and window is None:
        return None
    starts = torch.tensor(batch.starts, device=device).view(-1, 1, 1)
    keys = torch.arange(length, device=device).view(1, 1, -1)
    visible = keys < starts + block
    if window is not None:
        queries = starts + torch.arange(block, device=device).view(1, -1, 1)
        visible = visible & ((keys >= starts) | (keys >= queries - (window - 1)))
    return visible.expand(batch.size, block, length)


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, vocab_size: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(vocab_size, cfg.hidden_size) if cfg.has_embed_tokens else None
        # Optional draft vocabulary (checkpoint tensor `draft_vocab`): the sorted token ids the draft may
        # propose; the proposals are ranked over these rows of the LM head only (see ModelRunner).
        self.register_buffer("vocab", None, persistent=False)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        cfg, w = self.config, self.fc.weight
        return KVCache(cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, w.dtype, w.device)

    def inject(self, features: torch.Tensor, batch: Batch, cache: KVCache) -> None:
        """Write context K/V for target features [b, n, K*H] at positions batch.starts[i]..+n."""
        ctx = self.hidden_norm(self.fc(features))
        cache.prepare(batch, max(batch.starts) + ctx.shape[1])
        rope = self.rotary.table(batch.positions(ctx.shape[1], ctx.device), ctx.dtype)
        for layer in self.layers:
            k, v = layer.self_attn.context_kv(ctx, rope)
            cache.write(layer.self_attn.layer_id, batch, k, v)

    def forward(self, block_embeds: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        """block_embeds [b, B, H] at positions batch.starts[i]..+B (after each row's committed context).
        Returns final-normed hidden states [b, B, H]; the block's K/V are scratch past the commit point."""
        block = block_embeds.shape[1]
        positions = batch.positions(block, block_embeds.device)
        length = max(batch.starts) + block
        cache.prepare(batch, length)
        rope = self.rotary.table(positions, block_embeds.dtype)
        masks: dict[int | None, torch.Tensor | None] = {}
        x = block_embeds
        for layer in self.layers:
            window = layer.self_attn.sliding_window
            if window not in masks:
                masks[window] = block_mask(batch, block, length, window, x.device)
            x = layer(x, rope, batch, cache, length, masks[window])
        return self.norm(x)

    def forward_train(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_features: torch.Tensor,
        ctx_positions: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Cache-free pass over many blocks at once (training): block_embeds [b, n, H] at absolute
        block_positions [b, n]; raw target features ctx_features [b, T, K*H] at ctx_positions [b, T];
        mask bool [b, n, T + n] over the keys [context; blocks] (True = visible). Same layer modules
        and math as `inject` + `forward`. Returns final-normed hidden states [b, n, H]."""
        b, n, _ = block_embeds.shape
        ctx = self.hidden_norm(self.fc(ctx_features))
        ctx_rope = self.rotary.table(ctx_positions, ctx.dtype)
        rope = self.rotary.table(block_positions, block_embeds.dtype)
        key_positions = torch.cat([ctx_positions, block_positions], dim=1)
        is_block_key = torch.arange(key_positions.shape[1], device=mask.device) >= ctx_positions.shape[1]
        x = block_embeds
        for layer in self.layers:
            attn = layer.self_attn
            layer_mask = mask
            if attn.sliding_window is not None:  # as block_mask: old context keys fall out of the window
                near = key_positions.unsqueeze(1) >= block_positions.unsqueeze(2) - (attn.sliding_window - 1)
                layer_mask = mask & (is_block_key | near)
            ctx_k, ctx_v = attn.context_kv(ctx, ctx_rope)
            q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split(attn.qkv_proj.shards, dim=-1)
            q = apply_rope(attn.q_norm(q.view(b, n, attn.heads, attn.head_dim)), *rope)
            k = apply_rope(attn.k_norm(k.view(b, n, attn.kv_heads, attn.head_dim)), *rope)
            keys = torch.cat([ctx_k, k], dim=1).transpose(1, 2)
            values = torch.cat([ctx_v, v.view(b, n, attn.kv_heads, attn.head_dim)], dim=1).transpose(1, 2)
            x = x + attn.o_proj(attention(q, keys, values, layer_mask))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)
