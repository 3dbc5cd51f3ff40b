"""The DFlash draft: Qwen3-style layers that fill a whole block in one non-causal pass.

Target features (hidden states tapped from several target layers) are projected by `fc` and
`hidden_norm` and become extra K/V in every draft layer: written into the draft's cache for committed
tokens (`inject`), or, in a forward without a cache (training), passed along with the batch. The block
`[bonus, MASK x (B-1)]` attends to that context plus itself in both directions. The draft has no LM
head: the target's scores its output (over the draft's vocabulary, if it has one).

A DFlash2 draft (`config.dflash2`) is the same with a causal convolution around each layer's attention and
MLP (layers/conv.py) and a candidate selector (layers/selector.py; its walk: models/dflash2.py).
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.layers.attention import Attention
from blockspec.layers.conv import DynamicConv
from blockspec.layers.embedding import Embedding
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.linear import Linear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.fused import fused_ops
from blockspec.layers.rotary import Rope, Rotary, rotate
from blockspec.layers.selector import CandidateSelector
from blockspec.models.draft_config import DraftConfig
from blockspec.models.target import MLP, BlockStack, block_stack

ContextKV = tuple[torch.Tensor, torch.Tensor]  # K, V [b, T, kv_heads, d] of projected target features


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_width, kv_width, kv_width],
                               shard_names=("q_proj", "k_proj", "v_proj"))
        self.o_proj = Linear(q_width, cfg.hidden_size)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        sliding = cfg.layer_types[layer_id] == "sliding_attention"
        self.attn = Attention(layer_id, self.heads, self.kv_heads, self.head_dim,
                              cfg.sliding_window if sliding else None)

    def context_kv(self, ctx: torch.Tensor, rope: Rope) -> ContextKV:
        """K/V of projected target features ctx [b, n, H] (the fused projection's Q part is skipped)."""
        b, n, _ = ctx.shape
        kv = self.qkv_proj.forward_shards(ctx, 1)
        k, v = kv.view(b, n, 2 * self.kv_heads, self.head_dim).split(self.kv_heads, dim=2)
        return rotate(self.k_norm(k), *rope), v

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope,
                context: ContextKV | None = None) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.shards, dim=-1)
        q = rotate(self.q_norm(q.view(b, n, self.heads, self.head_dim)), *rope)
        k = rotate(self.k_norm(k.view(b, n, self.kv_heads, self.head_dim)), *rope)
        return self.o_proj(self.attn(q, k, v.view(b, n, self.kv_heads, self.head_dim), batch, context))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        d2 = cfg.dflash2
        convs = [DynamicConv(cfg.hidden_size, d2.conv_kernel_size, d2.conv_group_size)
                 for _ in range(2)] if d2 is not None else [None, None]
        self.attention_conv, self.mlp_conv = convs

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope,
                context: ContextKV | None) -> torch.Tensor:
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), batch, rope, context)
            return x + self.mlp(self.post_attention_layernorm(x))
        offsets = batch.block_offsets()
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x), offsets)
        x = x + self.attention_conv.finish(self.self_attn(h, batch, rope, context), kernel, offsets)
        h, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(x), offsets)
        return x + self.mlp_conv.finish(self.mlp(h), kernel, offsets)


class DFlashDraft(nn.Module):
    def __init__(self, cfg: DraftConfig, vocab_size: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)
        self.embed_tokens = Embedding(vocab_size, cfg.hidden_size) if cfg.has_embed_tokens else None
        self.target_embedding: Embedding | None = None  # see use_target_embedding
        # Optional draft vocabulary (checkpoint tensor `draft_vocab`): the sorted token ids the draft may
        # propose; the proposals are ranked over these rows of the LM head only.
        self.register_buffer("vocab", None, persistent=False)
        d2 = cfg.dflash2
        self.candidate_selector = (CandidateSelector(cfg.hidden_size, d2.selector_rank, d2.vocab_size)
                                   if d2 is not None else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.device

    def use_int8_activations(self) -> None:
        """Multiply every block-held weight with int8 activations from now on (as CausalLM's)."""
        for module in self.modules():
            if getattr(module, "quant", None) is not None:
                module.quant.use_int8()
        self.__dict__.pop("_block_stack", None)
        self.__dict__.pop("_context_stack", None)

    def block_stack(self) -> BlockStack | None:
        """The layers as the one-op CPU layer stack takes them (models/target.py), or None (dense layers,
        sliding-window layers: the op has one mask for every layer; DFlash2 layers: it has no convolution)."""
        if "_block_stack" not in self.__dict__:
            full = all(kind == "full_attention" for kind in self.config.layer_types)
            runs = full and self.config.dflash2 is None
            self.__dict__["_block_stack"] = block_stack(self.layers) if runs else None
        return self.__dict__["_block_stack"]

    def use_target_embedding(self, embedding: Embedding) -> None:
        """Embed block tokens with the target's embedding (a draft without its own embedding shares it)."""
        object.__setattr__(self, "target_embedding", embedding)  # not a submodule: the target owns it

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        embedding = self.embed_tokens if self.embed_tokens is not None else self.target_embedding
        if embedding is None:
            raise ValueError("DFlashDraft: no embedding: call use_target_embedding(target.embed_tokens) "
                             "first.")
        scale = self.config.dflash2.input_embedding_scale if self.config.dflash2 is not None else 1.0
        out = embedding(ids).to(self.dtype)
        return out if scale == 1.0 else out * scale  # the whole block, anchor included (as z-lab)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [b, n, K*H] projected into the draft: hidden_norm(fc(features)) [b, n, H]."""
        return self.hidden_norm(self.fc(features))

    def context_stack(self) -> tuple | None:
        """fc, hidden_norm and every layer's k/v blocks and k_norm as the one-op CPU injection
        (`draft_context`, blockspec/kernels/layer_stack.cpp) takes them, or None where it cannot."""
        if "_context_stack" not in self.__dict__:
            linears = [self.fc] + [layer.self_attn.qkv_proj for layer in self.layers]
            runs = all(linear.quant is not None and linear.bias is None and linear.parallel is None
                       for linear in linears) and len({linear.quant.activations for linear in linears}) == 1
            kv = [layer.self_attn.qkv_proj.quant.row_range(layer.self_attn.qkv_proj.shards[0])
                  for layer in self.layers] if runs else []
            fc = self.fc.quant
            self.__dict__["_context_stack"] = None if not runs else (
                fc.data, fc.qtype.ggml_id, self.hidden_norm.weight, [w.data for w in kv],
                [w.qtype.ggml_id for w in kv], [layer.self_attn.k_norm.weight for layer in self.layers],
                fc.activations == "int8")
        return self.__dict__["_context_stack"]

    def inject(self, features: torch.Tensor, batch: ForwardBatch) -> None:
        """Write context K/V into the batch's cache for target features [b, n, K*H] at its positions."""
        stack = self.context_stack()
        if stack is not None and (ops := fused_ops(features)) is not None:
            fc, fc_qtype, norm, kv, qtypes, k_norms, int8 = stack
            cache = batch.cache
            rope = self.rotary.table(batch.positions, features.dtype)
            ops.draft_context(features, fc, fc_qtype, norm, kv, qtypes, k_norms, self.config.rms_norm_eps,
                              self.config.num_key_value_heads, *rope, cache.k_layers, cache.v_layers,
                              batch.slots, batch.starts, int8)
            return
        ctx = self.context(features)
        rope = self.rotary.table(batch.positions, ctx.dtype)
        for layer in self.layers:
            attn = layer.self_attn
            attn.attn.store(*attn.context_kv(ctx, rope), batch)

    def forward(self, batch: ForwardBatch, features: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [b, n, H] for the batch's block tokens ([bonus, MASK...] per block).
        With a cache, the context is what `inject` wrote there (the block's own K/V are scratch past the
        commit point). Without one (training, many blocks per row), the context is the raw target features
        [b, T, K*H] at batch.context_positions."""
        x = self.embed(batch.input_ids)
        rope = self.rotary.table(batch.positions, x.dtype)
        stack = self.block_stack() if batch.cache is not None and features is None else None
        if stack is not None and (ops := fused_ops(x)) is not None:
            weights, qtypes, norms, qk_norms, int8, parts = stack
            attn, cache, cfg = self.layers[0].self_attn, batch.cache, self.config
            x = ops.decoder_layers(x, weights, qtypes, norms, qk_norms, cfg.rms_norm_eps, attn.heads,
                                   attn.kv_heads, cfg.intermediate_size, *rope, cache.k_layers,
                                   cache.v_layers, batch.slots, batch.starts, batch.kv_length,
                                   batch.visible(), [], int8, parts)[0]
            return self.norm(x)
        ctx = ctx_rope = None
        if features is not None:
            ctx = self.context(features)
            ctx_rope = self.rotary.table(batch.context_positions, ctx.dtype)
        for layer in self.layers:
            context = layer.self_attn.context_kv(ctx, ctx_rope) if ctx is not None else None
            x = layer(x, batch, rope, context)
        return self.norm(x)
