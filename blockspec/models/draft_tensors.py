"""The draft checkpoint's tensors checked against its resolved `DraftConfig`: every required tensor
present with its shape, read from the safetensors header before any tensor data, and the optional
`draft_vocab` tensor's values. Failures are `DraftConfigError`s that name the tensor, shape and fix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from blockspec.errors import DraftConfigError
from blockspec.models.dflash2_config import ARCHITECTURE2, check_dflash2_tensors, dflash2_tensor_shapes
from blockspec.models.draft_config import DRAFT_VOCAB, DraftConfig, Warn
from blockspec.models.mask_token import vocab_note

_log = logging.getLogger(__name__)


def check_draft_vocab(ids: torch.Tensor, vocab_size: int, source: str) -> torch.Tensor:
    """The optional `draft_vocab` tensor's values: distinct token ids < vocab_size, returned sorted
    (int64)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise DraftConfigError(f"DFLASH {source}: {DRAFT_VOCAB} has dtype {ids.dtype}; it must hold integer "
                               f"token ids. Re-export the draft, or drop the tensor.")
    ids = ids.long().sort().values
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel() or (ids[1:] == ids[:-1]).any():
        what = f"id {int(bad[0])} is outside [0, {vocab_size})" if bad.numel() else "it repeats an id"
        raise DraftConfigError(f"DFLASH {source}: {DRAFT_VOCAB} must list distinct token ids of the "
                               f"target's vocabulary (vocab_size={vocab_size}), but {what}. The draft was "
                               f"trained for another tokenizer; use a draft trained on this target's "
                               f"vocabulary.")
    return ids


def draft_tensor_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a z-lab draft checkpoint must hold, with its shape (-1: any size)."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    out: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    out.update({"norm.weight": (h,), "fc.weight": (h, len(cfg.target_layer_ids) * h),
                "hidden_norm.weight": (h,)})
    if cfg.has_embed_tokens:
        out["embed_tokens.weight"] = (cfg.vocab_size or -1, h)
    if cfg.dflash2 is not None:
        out.update(dflash2_tensor_shapes(cfg.dflash2, h, cfg.num_hidden_layers))
    return out


def _fits(want: tuple[int, ...], got: tuple[int, ...]) -> bool:
    return len(want) == len(got) and all(w in (-1, g) for w, g in zip(want, got))


def check_draft_tensors(cfg: DraftConfig, shapes: dict[str, Any], source: str, *,
                        warn: Warn = _log.warning) -> None:
    """Check a safetensors header ({name: shape}) against `cfg`, before any tensor data is read."""
    got = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
    want = draft_tensor_shapes(cfg)
    h, k = cfg.hidden_size, len(cfg.target_layer_ids)
    fc = got.get("fc.weight")
    if fc is not None and len(fc) == 2 and fc[0] == h and fc[1] != k * h:
        trained = f" ({fc[1] // h} target layers)" if fc[1] % h == 0 else ""
        raise DraftConfigError(
            f"DFLASH {source}: fc.weight has shape {fc}, but K=len(target_layer_ids)={k} "
            f"({list(cfg.target_layer_ids)}) with hidden size H={h} needs width K*H={k * h}; the actual "
            f"width is {fc[1]}{trained}. The checkpoint was trained for a different number of target "
            f"layers: set dflash_config.target_layer_ids to the ids it was trained with, or use the "
            f"matching config.json.")
    if cfg.has_embed_tokens and "embed_tokens.weight" not in got:
        raise DraftConfigError(
            f"DFLASH {source}: the draft config declares has_embed_tokens=true but the checkpoint has no "
            f"embed_tokens.weight. Use the complete checkpoint (re-export it with its embedding), or drop "
            f"has_embed_tokens if the draft was trained on the target's embedding.")
    if cfg.dflash2 is not None:
        top_k = cfg.dflash2.selector_top_k
        if DRAFT_VOCAB in got and got[DRAFT_VOCAB][:1] < (top_k,):
            raise DraftConfigError(
                f"DFLASH {source}: dflash_config.selector_top_k={top_k} is larger than the draft's "
                f"vocabulary ({DRAFT_VOCAB} holds {got[DRAFT_VOCAB][0]} ids); the selector picks among its "
                f"top-K. Use selector_top_k <= that, or drop {DRAFT_VOCAB}.")
        check_dflash2_tensors(cfg.dflash2, h, cfg.num_hidden_layers, got, source)
    missing = [n for n in want if n not in got]
    if missing:
        hint = (" The checkpoint names tensors with a 'model.' prefix; strip it."
                if f"model.{missing[0]}" in got else "")
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise DraftConfigError(f"DFLASH {source}: the draft checkpoint is missing {len(missing)} required "
                               f"tensor(s): {', '.join(missing[:5])}{more}.{hint} Use a complete z-lab "
                               f"format draft checkpoint, or check that config.json matches it.")
    bad = [f"{n} is {got[n]}, expected {want[n]}" for n in want if not _fits(want[n], got[n])]
    if bad:
        raise DraftConfigError(f"DFLASH {source}: tensor shapes do not match config.json: "
                               f"{'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}. config.json and the "
                               f"weights come from different drafts; use a matching pair.")
    if cfg.has_embed_tokens and cfg.mask_token_id >= got["embed_tokens.weight"][0]:
        rows = got["embed_tokens.weight"][0]
        raise DraftConfigError(
            f"DFLASH {source}: mask_token_id={cfg.mask_token_id} is outside {vocab_note(True, rows)}; ids "
            f"must be < {rows}. Pass --mask-token-id with the id the draft was trained with.")
    vocab = got.get(DRAFT_VOCAB)
    if vocab is not None and (len(vocab) != 1 or vocab[0] < 1):
        raise DraftConfigError(
            f"DFLASH {source}: {DRAFT_VOCAB} has shape {list(vocab)}; it must be a non-empty list of token "
            f"ids (1-D). Re-export the draft, or drop the tensor to let the draft propose any token.")
    extra = sorted(set(got) - set(want) - {DRAFT_VOCAB})
    if extra:
        note = (" embed_tokens.weight is ignored: the config does not set has_embed_tokens, so the target's "
                "embedding is used." if "embed_tokens.weight" in extra else "")
        warn(f"DFLASH {source}: ignoring {len(extra)} unexpected tensor(s): {', '.join(extra[:5])}"
             f"{' ...' if len(extra) > 5 else ''}.{note}")
