"""The target model: Llama family (SmolLM2, Llama 3) and Qwen3, in plain PyTorch.

`forward` runs new tokens of a batch of sequences against the KV cache and can capture the hidden
state after chosen layers (HF indexing: layer id l is the output of layer l = `hidden_states[l+1]`),
which is what a DFlash draft is conditioned on.
"""

from __future__ import annotations

from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.config import ModelConfig
from blockspec.engine.kv_cache import Batch, KVCache
from blockspec.models.layers import Linear, RMSNorm, Rotary, apply_rope, attention, fold_mask


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_width, kv_width, kv_width], cfg.attention_bias, "column")
        self.o_proj = Linear(q_width, cfg.hidden_size, cfg.attention_bias, "row")
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple, batch: Batch, cache: KVCache, length: int, mask) -> torch.Tensor:
        b, n, _ = x.shape
        qkv = self.qkv_proj(x).view(b, n, self.heads + 2 * self.kv_heads, self.head_dim)
        qk, v = qkv.split([self.heads + self.kv_heads, self.kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = qk.split([self.heads, self.kv_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        q, k = apply_rope(qk, *rope).split([self.heads, self.kv_heads], dim=2)  # one rotation for q and k
        cache.write(self.layer_id, batch, k, v)
        keys, values = cache.read(self.layer_id, batch, length)
        return self.o_proj(attention(q, keys, values, mask))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], bias, "column")
        self.down_proj = Linear(intermediate, hidden, bias, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x, rope, batch, cache, length, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, batch, cache, length, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def causal_mask(positions: torch.Tensor, length: int) -> torch.Tensor | None:
    """bool [b, n, length]: key j is visible to the query at absolute position p iff j <= p."""
    b, n = positions.shape
    if b == 1 and n == 1:
        return None  # one new token sees the whole prefix: no mask needed
    keys = torch.arange(length, device=positions.device)
    return keys.view(1, 1, -1) <= positions.unsqueeze(-1)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, parallel="column")
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        cfg, w = self.config, self.embed_tokens.weight
        return KVCache(cfg.num_hidden_layers, num_slots, max_len, cfg.num_key_value_heads, cfg.head_dim, w.dtype, w.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: Batch,
        cache: KVCache,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run `input_ids` [b, n] at positions batch.starts[i]..+n, appending their K/V to the cache.

        Returns the last layer's hidden states [b, n, H] (before the final norm) and, if `capture`
        is given, the captured layer outputs concatenated in `capture` order: [b, n, len(capture)*H].
        """
        return self.run_layers(self.embed_tokens(input_ids), 0, batch, cache, capture)

    def run_layers(
        self,
        x: torch.Tensor,
        first: int,
        batch: Batch,
        cache: KVCache,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` from layer `first` on: x [b, n, H] is layer first-1's output (the embeddings when
        first is 0). Training's distillation runs a target's top layers on captured features this way."""
        n = x.shape[1]
        positions = batch.positions(n, x.device)
        length = max(batch.starts) + n
        cache.prepare(batch, length)
        mask = causal_mask(positions, length)
        if mask is not None:
            cfg = self.config
            mask = fold_mask(mask, cfg.num_attention_heads // cfg.num_key_value_heads, self.embed_tokens.weight.dtype)
        rope = self.rotary.table(positions, self.embed_tokens.weight.dtype)
        captured: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for i, layer in islice(enumerate(self.layers), first, None):  # no ModuleList indexing per layer
            x = layer(x, rope, batch, cache, length, mask)
            if i in capture:
                # HF's hidden_states[L] (layer id L-1) is taken after the final norm; drafts train on that.
                captured[i] = self.norm(x) if i == last else x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return x, features

    @torch.no_grad()
    def fold_norm_weights(self) -> None:
        """For inference: fold each layer's two RMSNorm weights into the projection they feed
        (W (g * x) == (W diag g) x), saving 60 vector multiplies per decoded token (~1 ms on CPU).
        Logits move by rounding only. The model then no longer holds the checkpoint's tensors, so
        training (which copies target layers into a draft) loads an unfolded target."""
        for layer in self.layers:
            for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                               (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                if norm.weight is not None:
                    proj.weight.mul_(norm.weight)  # [out, in] * [in]: scales input columns
                    norm.weight = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()
