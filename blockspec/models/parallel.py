"""Tensor parallelism for the target: which heads, MLP columns and vocabulary rows each rank holds, checked
against the model's shapes with clear errors, and the pass that shards a freshly built `CausalLM` before its
weights are read (each layer then loads only its own slice of the checkpoint).

Attention is split by KV groups: a rank holds whole groups (its KV heads and their query heads). Where the
ranks do not divide the KV heads evenly the split is uneven (SmolLM2's 3 KV heads over 2 ranks: 2 and 1);
where there are fewer KV heads than ranks, each KV head is replicated on tp_size / num_key_value_heads
ranks, which then split its query heads. The MLP splits its intermediate columns evenly; the vocabulary is
split in ceil(vocab / tp_size) rows, the last rank's shard padded.
"""

from __future__ import annotations

from blockspec.distributed import TPGroup
from blockspec.errors import BlockspecError
from blockspec.models.config import ModelConfig


def head_split(heads: int, kv_heads: int, rank: int, size: int) -> tuple[int, int, int, int]:
    """(first query head, query heads, first KV head, KV heads) of `rank`."""
    if kv_heads >= size:
        group = heads // kv_heads
        first, stop = rank * kv_heads // size, (rank + 1) * kv_heads // size
        return first * group, (stop - first) * group, first, stop - first
    per = heads // size  # replicated KV heads: size % kv_heads == 0 and heads % size == 0 (check_tp)
    return rank * per, per, rank * per // (heads // kv_heads), 1


def check_tp(cfg: ModelConfig, tp_size: int, source: str = "the target") -> None:
    """Raise a BlockspecError naming the values if `cfg` cannot be split over tp_size ranks."""
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if kv_heads < tp_size and (tp_size % kv_heads or heads % tp_size):
        raise BlockspecError(
            f"--tp-size {tp_size} cannot split {source}'s attention: num_key_value_heads={kv_heads} is "
            f"below tp_size, so each KV head is replicated, which needs tp_size to be a multiple of "
            f"num_key_value_heads and to divide num_attention_heads={heads}. Use a --tp-size that divides "
            f"{kv_heads} or a multiple of it that divides {heads}.")
    if cfg.intermediate_size % tp_size:
        raise BlockspecError(
            f"--tp-size {tp_size} does not divide {source}'s intermediate_size={cfg.intermediate_size} (the "
            f"MLP columns each rank holds). Use a --tp-size that divides it.")
    per = -(-cfg.vocab_size // tp_size)
    if per * (tp_size - 1) >= cfg.vocab_size:
        raise BlockspecError(f"--tp-size {tp_size} leaves a rank without vocabulary rows (vocab_size="
                             f"{cfg.vocab_size}); use a smaller --tp-size.")


def shard_target(model, group: TPGroup) -> None:
    """Shard a freshly built CausalLM (before `hold_as_blocks` and loading): column-parallel q/k/v and
    gate/up, row-parallel o and down, vocabulary-parallel embedding and LM head. The final norm and the
    rotary table stay whole; hidden states between layers are whole on every rank."""
    cfg = model.config
    check_tp(cfg, group.size)
    d = cfg.head_dim
    q0, nq, kv0, nkv = head_split(cfg.num_attention_heads, cfg.num_key_value_heads, group.rank, group.size)
    inter = cfg.intermediate_size // group.size
    for layer in model.layers:
        attn = layer.self_attn
        attn.qkv_proj.shard_columns(group, [(q0 * d, nq * d), (kv0 * d, nkv * d), (kv0 * d, nkv * d)])
        attn.o_proj.shard_rows(group, q0 * d, nq * d)
        attn.heads = attn.attn.heads = nq
        attn.kv_heads = attn.attn.kv_heads = nkv
        mlp = layer.mlp
        mlp.gate_up_proj.shard_columns(group, [(group.rank * inter, inter)] * 2)
        mlp.down_proj.shard_rows(group, group.rank * inter, inter)
    model.embed_tokens.shard_vocab(group)
    model.lm_head.shard_vocab(group)
    model.tp = group
