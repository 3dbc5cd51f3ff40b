"""The target model: Llama family (SmolLM2, Llama 3) and Qwen3, in plain PyTorch.

`forward` runs a `ForwardBatch` and can capture the hidden state after chosen layers (HF indexing: layer
id l is the output of layer l = `hidden_states[l+1]`), which is what a DFlash draft is conditioned on.
"""

from __future__ import annotations

from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.attention import Attention
from blockspec.layers.embedding import Embedding, LMHead
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.fused import fused_ops
from blockspec.layers.linear import Linear
from blockspec.layers.norm import RMSNorm
from blockspec.layers.rotary import Rope, Rotary, rotate
from blockspec.models.config import ModelConfig


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        q_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [q_width, kv_width, kv_width], cfg.attention_bias,
                               shard_names=("q_proj", "k_proj", "v_proj"))
        self.o_proj = Linear(q_width, cfg.hidden_size, cfg.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn = Attention(layer_id, self.heads, self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output (plus `residual`, if given) for x [b, n, H]."""
        b, n, _ = x.shape
        qkv = self.qkv_proj(x).view(b, n, self.heads + 2 * self.kv_heads, self.head_dim)
        qk, v = qkv.split([self.heads + self.kv_heads, self.kv_heads], dim=2)
        if self.q_norm is not None:
            q, k = qk.split([self.heads, self.kv_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        q, k = rotate(qk, *rope).split([self.heads, self.kv_heads], dim=2)  # one rotation for q and k
        return self.o_proj(self.attn(q, k, v, batch), residual)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, [intermediate, intermediate], bias,
                                   shard_names=("gate_proj", "up_proj"))
        self.down_proj = Linear(intermediate, hidden, bias)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if (ops := fused_ops(gate_up)) is not None:
            return self.down_proj(ops.silu_mul(gate_up), residual)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: Rope) -> torch.Tensor:
        # The residual adds happen inside the output projections (one op less each on the CPU kernels).
        x = self.self_attn(self.input_layernorm(x), batch, rope, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)

    def fold_norms(self) -> None:
        self.input_layernorm.fold_into(self.self_attn.qkv_proj)
        self.post_attention_layernorm.fold_into(self.mlp.gate_up_proj)


# A layer stack for blockspec/kernels/layer_stack.cpp: every layer's blocks (qkv, o, gate_up, down; a fused
# weight whose parts are of several types as its parts, side by side), their GGML types, norm weights (input,
# post-attention), per-head q/k norm weights (Qwen3; else none), whether the blocks take int8 activations,
# and how many parts each of the 4 weights a layer has (all 1: none).
BlockStack = tuple[list[torch.Tensor], list[int], list[torch.Tensor], list[torch.Tensor], bool, list[int]]


def block_stack(layers) -> BlockStack | None:
    """Decoder layers (the target's, a draft's: each with self_attn.{qkv_proj, o_proj, q_norm, k_norm},
    mlp.{gate_up_proj, down_proj} and two norms) as one stack, or None where a layer cannot run there:
    dense, biased or row-parallel linears, folded norms, layers in mixed forms."""
    linears = [linear for layer in layers for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    if not all(linear.quant is not None and linear.bias is None and linear.parallel is None
               for linear in linears) or any(layer.input_layernorm.folded for layer in layers):
        return None
    parts = [getattr(linear.quant, "parts", [linear.quant]) for linear in linears]
    forms = {w.activations for ws in parts for w in ws}
    qk = [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in layers]
    if len(forms) != 1 or len({q is None for q, _ in qk}) != 1:
        return None
    norms = [norm.weight for layer in layers
             for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
    qk_norms = [norm.weight for pair in qk for norm in pair if norm is not None]
    counts = [len(ws) for ws in parts] if any(len(ws) > 1 for ws in parts) else []
    return ([w.data for ws in parts for w in ws], [w.qtype.ggml_id for ws in parts for w in ws], norms,
            qk_norms, forms == {"int8"}, counts)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, tied)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling)
        self.tp = None  # its TPGroup once sharded (models/parallel.py)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, batch: ForwardBatch,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the batch's new tokens (writing their K/V to its cache, if it has one).

        Returns the last layer's hidden states [b, n, H] (before the final norm) and, if `capture` is
        given, the captured layer outputs concatenated in `capture` order: [b, n, len(capture)*H].
        """
        return self.run_layers(self.embed_tokens(batch.input_ids), batch, 0, capture)

    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, first: int = 0,
                   capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` from layer `first` on: x [b, n, H] is layer first-1's output (the embeddings when
        first is 0). Training's distillation runs a target's top layers on captured features this way."""
        rope = self.rotary.table(batch.positions, self.dtype)
        last = len(self.layers) - 1
        ops = fused_ops(x) if batch.cache is not None else None
        if ops is not None and self.block_stack() is not None:
            x, features = self.run_block_stack(ops, x, batch, rope, first, capture)
            if last in capture:  # HF's last hidden state is taken after the final norm
                at = capture.index(last) * x.shape[-1]
                features[..., at : at + x.shape[-1]] = self.norm(features[..., at : at + x.shape[-1]])
            return x, features if capture else None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in islice(enumerate(self.layers), first, None):  # no ModuleList indexing per layer
            x = layer(x, batch, rope)
            if i in capture:
                # HF's hidden_states[L] (layer id L-1) is taken after the final norm; drafts train on that.
                captured[i] = self.norm(x) if i == last else x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return x, features

    def run_block_stack(self, ops, x: torch.Tensor, batch: ForwardBatch, rope: Rope, first: int,
                        capture: tuple[int, ...]) -> list[torch.Tensor]:
        """Layers first.. as one op (`block_stack`): [last output, the outputs of layers `capture` side by
        side]."""
        weights, qtypes, norms, qk_norms, int8, parts = self.block_stack()
        attn, cache = self.layers[0].self_attn, batch.cache
        skip = sum(parts[: 4 * first]) if parts else 4 * first  # weights of the layers below `first`
        return ops.decoder_layers(
            x, weights[skip:], qtypes[skip:], norms[2 * first :], qk_norms[2 * first :],
            self.config.rms_norm_eps,
            attn.heads, attn.kv_heads, self.config.intermediate_size, *rope, cache.k_layers[first:],
            cache.v_layers[first:], batch.slots, batch.starts, batch.kv_length, batch.visible(),
            [i - first for i in capture], int8, parts[4 * first :])

    def block_stack(self) -> BlockStack | None:
        """The layers as the one-op CPU layer stack takes them (`block_stack`), or None where it cannot
        (under tensor parallelism the op has no all-reduce between its layers, so they run one by one).
        Gathered once: the layers hold their weights for good after loading."""
        if "_block_stack" not in self.__dict__:
            self.__dict__["_block_stack"] = None if self.tp is not None else block_stack(self.layers)
        return self.__dict__["_block_stack"]

    def use_int8_activations(self) -> None:
        """Multiply every block-held weight with int8 activations from now on (layers/quant.py): the blocks
        are repacked once, after loading."""
        for module in self.modules():
            if getattr(module, "quant", None) is not None:
                module.quant.use_int8()
        self.__dict__.pop("_block_stack", None)

    def fold_norm_weights(self) -> None:
        """For inference: fold each layer's two RMSNorm weights into the projection they feed, saving 60
        vector multiplies per decoded token (~1 ms on CPU). Logits move by rounding only. The model then no
        longer holds the checkpoint's tensors, so training (which copies target layers into a draft) loads
        an unfolded target."""
        for layer in self.layers:
            layer.fold_norms()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for last-layer hidden states (before the final norm)."""
        return self.lm_head.logits(self.norm(hidden))

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The exact greedy token ids [...] for last-layer hidden states [..., H] (before the final norm)."""
        return self.lm_head.greedy(self.norm(hidden))
