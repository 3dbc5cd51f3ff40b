"""DFlash draft configuration: resolved and validated in one place, before any weight is touched.

`resolve_draft_config` turns a z-lab style draft `config.json` (plus CLI overrides, the runtime
target's config and its tokenizer lookup) into a frozen `DraftConfig`; `draft_tensors.check_draft_tensors`
then checks the checkpoint's safetensors header against it. Every failure is a `DraftConfigError` that
names the field, the offending value, the limit and the fix.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable

from blockspec.errors import DraftConfigError, setting
from blockspec.models.config import ModelConfig
from blockspec.models.dflash2_config import ARCHITECTURE2, Dflash2Config, resolve_dflash2
from blockspec.models.draft_values import FIX as _FIX
from blockspec.models.draft_values import Warn
from blockspec.models.draft_values import get as _get
from blockspec.models.draft_values import int_value as _int
from blockspec.models.draft_values import is_int as _is_int
from blockspec.models.draft_values import positive_float as _positive_float
from blockspec.models.mask_token import resolve_mask

_log = logging.getLogger(__name__)

ARCHITECTURE = "DFlashDraftModel"
DEFAULT_BLOCK_SIZE = 16
DRAFT_VOCAB = "draft_vocab"  # optional int tensor [Vd] (a blockspec extension of the z-lab format)
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "llama3")
_DFLASH2_ONLY = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# Features of other DFlash variants (Domino, MiMo) that blockspec does not implement.
_UNSUPPORTED = ("projector_type", "attention_sink_bias", "attention_value_scale", "attention_bias")


@dataclass(frozen=True)
class DraftConfig:
    """A fully resolved, validated DFlash draft configuration (see INTERFACE.md, checkpoint format)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # one per draft layer
    sliding_window: int | None
    num_target_layers: int  # the runtime target's layer count
    target_layer_ids: tuple[int, ...]  # feature concat order for fc; HF hidden_states[id + 1]
    block_size: int  # effective block size (CLI override applied)
    mask_token: str | None
    mask_token_id: int
    has_embed_tokens: bool
    vocab_size: int | None = None  # as declared by the draft config; bounds mask_token_id if it embeds
    dflash2: Dflash2Config | None = None  # a DFlash2 draft's convolution and selector

    def to_json_dict(self) -> dict:
        """The z-lab format config.json content for this draft."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": "qwen3", "hidden_act": "silu",
                               "attention_bias": False}
        out.update({k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()})
        del out["dflash2"]
        dflash = {k: out.pop(k) for k in ("mask_token_id", "target_layer_ids", "mask_token")}
        out["dflash_config"] = {k: v for k, v in dflash.items() if v is not None}
        if self.dflash2 is not None:  # z-lab sizes the codebooks by vocab_size; its layers are causal unless
            out.update(architectures=[ARCHITECTURE2], vocab_size=self.dflash2.vocab_size, is_causal=False)
            out["dflash_config"].update(self.dflash2.json_keys())
        for key in ("vocab_size", "has_embed_tokens"):  # written only when set
            if not out[key]:
                del out[key]
        return out


MAX_DRAFT_LAYERS = 1024


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default pick: 1 draft layer -> (L // 2,); n > 1 -> n ids spread over 1..L-3, rounded."""
    fix = "Set dflash_config.target_layer_ids explicitly."
    big_l = _int(num_target_layers, "num_target_layers", "target layer selection", fix=fix)
    n = _int(num_draft_layers, "num_draft_layers", "target layer selection", fix=fix)
    if n == 1:
        return (big_l // 2,)
    if big_l < 4:
        raise DraftConfigError(
            f"DFLASH cannot pick default target_layer_ids for num_target_layers={big_l} and "
            f"{n} draft layers: the formula spreads ids over layers 1..L-3 and "
            f"needs num_target_layers >= 4. {fix}")
    span = big_l - 4  # end (L - 3) minus start (1)
    return tuple(int(round(1 + i * span / (n - 1))) for i in range(n))


def _layer_ids(value: object, source: str, where: str, big_l: int) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise DraftConfigError(f"DFLASH {source}: {where}={value!r} must be a non-empty list of target "
                               f"layer ids (ints in [0, {big_l})). {_FIX}")
    for i, v in enumerate(value):
        if not _is_int(v) or not 0 <= v < big_l:
            raise DraftConfigError(
                f"DFLASH {source}: {where}[{i}]={v!r} is not a layer of the runtime target: ids must be "
                f"ints in [0, {big_l}) (the target has num_hidden_layers={big_l}). The draft was probably "
                f"trained for another target; use the draft made for this target, or fix {where}.")
    dups = sorted({v for v in value if value.count(v) > 1})
    if dups:
        raise DraftConfigError(f"DFLASH {source}: {where}={list(value)} repeats layer ids {dups}; each "
                               f"target layer may be tapped once. {_FIX}")
    return tuple(value)


def _layer_types(raw: dict, n: int, where: str) -> tuple[tuple[str, ...], int | None]:
    types, window = raw.get("layer_types"), raw.get("sliding_window")
    if window is not None:
        window = _int(window, "sliding_window", where)
    if types is None:
        return ("full_attention",) * n, window
    if isinstance(types, str) or not isinstance(types, (list, tuple)):
        raise DraftConfigError(f"DFLASH {where}: layer_types={types!r} must be a list of attention types "
                               f"{list(LAYER_TYPES)}, one per draft layer. {_FIX}")
    if len(types) != n:
        raise DraftConfigError(f"DFLASH {where}: layer_types has {len(types)} entries but the draft has "
                               f"num_hidden_layers={n}; it needs one entry per draft layer. {_FIX}")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise DraftConfigError(f"DFLASH {where}: unsupported layer_types[{i}]={t!r}; "
                                   f"supported: {list(LAYER_TYPES)}. {_FIX}")
    if "sliding_attention" in types and window is None:
        raise DraftConfigError(f"DFLASH {where}: layer_types has sliding_attention layers but "
                               f"sliding_window is not set; set sliding_window to the positive window the "
                               f"draft was trained with.")
    return tuple(types), window


def _block_size(raw: dict, dcfg: dict, source: str, cli: int | None, warn: Warn) -> int:
    trained, where = _get(raw, dcfg, "block_size")
    if trained is not None:
        _int(trained, where, source)
    if cli is not None:
        _int(cli, setting("block_size"), "given",
             fix=f"Pass an integer such as {setting('block_size')}=16.")
    size = cli if cli is not None else trained
    if size is None:
        warn(f"DFLASH {source} declares no block_size and {setting('block_size')} was not given; using "
             f"{DEFAULT_BLOCK_SIZE}.")
        size = DEFAULT_BLOCK_SIZE
    if size < 2:
        flag = setting("block_size") if cli is not None else where
        raise DraftConfigError(
            f"DFLASH {flag}={size} is too small: a DFlash block needs >= 2 tokens (the bonus plus at least "
            f"one drafted token); block size 1 is just plain decoding. Use "
            f"{setting('speculative_algorithm')}=NONE for plain decoding, or {setting('block_size')} >= 2.")
    # blockspec extension: a draft whose block_size is the size it runs at best may record the larger size it
    # was trained at (other loaders ignore the key)
    trained_on = dcfg.get("trained_block_size")
    if trained_on is not None:
        _int(trained_on, "dflash_config.trained_block_size", source)
    if cli is not None and trained is not None and cli != trained:
        limit, limit_where = ((trained, where) if trained_on is None
                              else (trained_on, "dflash_config.trained_block_size"))
        if cli > limit:
            warn(f"DFLASH {setting('block_size')}={cli} is LARGER than the draft's trained "
                 f"{limit_where}={limit} "
                 f"({source}): positions past {limit} were never trained, so acceptance will drop. "
                 f"Prefer <= {limit}.")
        elif trained_on is not None:
            warn(f"DFLASH {setting('block_size')}={cli} overrides the draft's default {where}={trained} "
                 f"({source}), "
                 f"within the {trained_on} it was trained at.")
        else:
            warn(f"DFLASH {setting('block_size')}={cli} overrides the draft's trained {where}={trained} "
                 f"({source}); "
                 f"a draft trained on larger blocks runs on smaller ones.")
    return size


def resolve_draft_config(raw: dict, *, target: ModelConfig, source: str = "config.json",
                         cli_block_size: int | None = None, cli_mask_token: str | None = None,
                         cli_mask_token_id: int | None = None,
                         token_to_id: Callable[[str], int | None] | None = None,
                         warn: Warn = _log.warning) -> DraftConfig:
    """Resolve and validate a draft config.json against the runtime target (see module docstring)."""
    if not isinstance(raw, dict):
        raise DraftConfigError(f"DFLASH {source}: expected a JSON object, got {type(raw).__name__}. {_FIX}")
    dcfg = raw.get("dflash_config")
    dcfg = {} if dcfg is None else dcfg
    if not isinstance(dcfg, dict):
        raise DraftConfigError(f"DFLASH {source}: dflash_config={dcfg!r} must be an object. {_FIX}")
    archs = raw.get("architectures")
    if archs is not None and (not isinstance(archs, list) or not {ARCHITECTURE, ARCHITECTURE2} & set(archs)):
        raise DraftConfigError(
            f"DFLASH {source}: architectures={archs!r} is not a DFlash draft (expected [{ARCHITECTURE!r}] or "
            f"[{ARCHITECTURE2!r}]). Point {setting('draft_model_path')} at a DFlash draft checkpoint, not at "
            f"a regular model.")
    dflash2 = archs is not None and ARCHITECTURE2 in archs
    for key in _DFLASH2_ONLY if not dflash2 else ():
        value, where = _get(raw, dcfg, key)
        if value not in (None, 0, False):
            raise DraftConfigError(f"DFLASH {source}: {where}={value!r} is a DFlash2 setting, but "
                                   f"architectures={archs!r} does not declare {ARCHITECTURE2!r}. Set "
                                   f"architectures to [{ARCHITECTURE2!r}] if the checkpoint holds the "
                                   f"convolutions and the selector, else drop the key.")
    for key in _UNSUPPORTED:
        value, where = _get(raw, dcfg, key)
        if value not in (None, 0, False):
            raise DraftConfigError(f"DFLASH {source}: {where}={value!r} selects a feature of another DFlash "
                                   f"variant that blockspec does not implement; only DFlashDraftModel and "
                                   f"{ARCHITECTURE2} drafts run.")
    if raw.get("hidden_act") not in (None, "silu"):
        raise DraftConfigError(f"DFLASH {source}: hidden_act={raw['hidden_act']!r} is not supported; "
                               f"DFlash drafts use silu (SwiGLU). {_FIX}")
    layers = _int(raw.get("num_hidden_layers"), "num_hidden_layers", source)
    if layers > MAX_DRAFT_LAYERS:  # found by the junk-config property test: a huge count exhausted memory
        raise DraftConfigError(f"DFLASH {source}: num_hidden_layers={layers} is implausible for a draft "
                               f"(DFlash drafts have 1-8 layers; the limit is {MAX_DRAFT_LAYERS}). {_FIX}")
    hidden = _int(raw.get("hidden_size"), "hidden_size", source)
    if hidden != target.hidden_size:
        raise DraftConfigError(
            f"DFLASH {source}: draft hidden_size={hidden} differs from the target's hidden_size="
            f"{target.hidden_size}; a draft works only with the target family it was trained for. "
            f"Use the draft made for this target.")
    heads = _int(raw.get("num_attention_heads"), "num_attention_heads", source)
    kv = raw.get("num_key_value_heads")
    kv = heads if kv is None else _int(kv, "num_key_value_heads", source)
    if heads % kv:
        raise DraftConfigError(f"DFLASH {source}: num_attention_heads={heads} is not a multiple of "
                               f"num_key_value_heads={kv}. {_FIX}")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise DraftConfigError(f"DFLASH {source}: hidden_size={hidden} is not divisible by "
                                   f"num_attention_heads={heads}; set head_dim explicitly. {_FIX}")
        head_dim = hidden // heads
    head_dim = _int(head_dim, "head_dim", source)
    inter = _int(raw.get("intermediate_size"), "intermediate_size", source)
    max_pos = raw.get("max_position_embeddings")
    max_pos = 32768 if max_pos is None else _int(max_pos, "max_position_embeddings", source)
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is not None and (
            not isinstance(rope_scaling, dict)
            or rope_scaling.get("rope_type", rope_scaling.get("type")) not in ROPE_TYPES):
        raise DraftConfigError(f"DFLASH {source}: rope_scaling={rope_scaling!r} is not supported "
                               f"(rope_type must be one of {list(ROPE_TYPES)}, or rope_scaling null). "
                               f"{_FIX}")
    layer_types, window = _layer_types(raw, layers, source)

    big_l = target.num_hidden_layers
    declared_l, where = _get(raw, dcfg, "num_target_layers")
    if declared_l is not None and _int(declared_l, where, source) != big_l:
        warn(f"DFLASH {source}: the draft was trained for a target with {where}={declared_l} layers, but "
             f"the runtime target has num_hidden_layers={big_l}; using {big_l}.")
    ids, where = _get(raw, dcfg, "target_layer_ids")
    layer_ids = (default_target_layer_ids(big_l, layers) if ids is None
                 else _layer_ids(ids, source, where, big_l))

    has_embed, where = _get(raw, dcfg, "has_embed_tokens")
    if has_embed is not None and not isinstance(has_embed, bool):
        raise DraftConfigError(f"DFLASH {source}: {where}={has_embed!r} must be true or false. {_FIX}")
    has_embed = bool(has_embed)
    vocab = raw.get("vocab_size")
    vocab = None if vocab is None else _int(vocab, "vocab_size", source)
    bound = (vocab if has_embed else target.vocab_size)  # None: checked in check_draft_tensors
    mask_token, mask_id = resolve_mask(raw, dcfg, source, has_embed, bound, cli_mask_token,
                                       cli_mask_token_id, token_to_id, warn)
    d2 = resolve_dflash2(raw, dcfg, source, hidden, target.vocab_size) if dflash2 else None
    if d2 is not None:  # its codebooks have the target's vocabulary, declared or not
        vocab = d2.vocab_size
    if dflash2 and None not in (raw.get("block_size"), dcfg.get("block_size")) \
            and raw["block_size"] != dcfg["block_size"]:
        raise DraftConfigError(f"DFLASH {source}: block_size={raw['block_size']!r} and "
                               f"dflash_config.block_size={dcfg['block_size']!r} disagree; keep one of them "
                               f"(the size the draft was trained at).")
    return DraftConfig(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, intermediate_size=inter,
        rms_norm_eps=_positive_float(raw.get("rms_norm_eps"), "rms_norm_eps", source, 1e-6),
        rope_theta=_positive_float(raw.get("rope_theta"), "rope_theta", source, 1000000.0),
        rope_scaling=rope_scaling, max_position_embeddings=max_pos, layer_types=layer_types,
        sliding_window=window, num_target_layers=big_l, target_layer_ids=layer_ids,
        block_size=_block_size(raw, dcfg, source, cli_block_size, warn), mask_token=mask_token,
        mask_token_id=mask_id, has_embed_tokens=has_embed, vocab_size=vocab, dflash2=d2)
