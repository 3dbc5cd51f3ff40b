"""Draft configuration resolution and validation: every rule, its message, the defaults and the warnings."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from blockspec.cli import build_parser, flag_names, subcommand_parser
from blockspec.models.config import ModelConfig
from blockspec.errors import BlockspecError, DraftConfigError, cli_flags
from blockspec.device import resolve_device
from blockspec.models.draft_config import DraftConfig, default_target_layer_ids, resolve_draft_config
from blockspec.models.draft_tensors import check_draft_tensors, draft_tensor_shapes

QWEN3_8B = ModelConfig(
    family="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, intermediate_size=12288, rope_theta=1000000.0,
    max_position_embeddings=40960, eos_token_ids=(151645,))
SMOL = ModelConfig(
    family="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, intermediate_size=1536)


def zlab_qwen3_8b() -> dict[str, Any]:
    """The fields of the published z-lab/Qwen3-8B-DFlash-b16 config.json."""
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "block_size": 16, "bos_token_id": 151643, "eos_token_id": 151645,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288,
        "layer_types": ["full_attention"] * 5, "max_position_embeddings": 40960, "num_attention_heads": 32,
        "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 36, "rms_norm_eps": 1e-6,
        "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
        "use_sliding_window": False, "vocab_size": 151936,
    }


def smol_draft(**over: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"], "hidden_size": 576, "num_hidden_layers": 2,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
        "num_target_layers": 30, "block_size": 8,
        "dflash_config": {"mask_token_id": 2, "target_layer_ids": [1, 27]},
    }
    raw.update(over)
    return raw


class Warnings(list):
    def __call__(self, msg: str) -> None:
        self.append(msg)


# The messages name what the user typed; these tests check the command line's wording (the flags).
CLI = flag_names(subcommand_parser(build_parser(), "generate"))


def resolve(raw: dict, target: ModelConfig = SMOL, **kw: Any) -> DraftConfig:
    kw.setdefault("warn", Warnings())
    with cli_flags(CLI):
        return resolve_draft_config(raw, target=target, **kw)


def fails(raw: dict, pattern: str, target: ModelConfig = SMOL, **kw: Any) -> str:
    with pytest.raises(DraftConfigError, match=pattern) as info:
        resolve(raw, target, **kw)
    assert str(info.value).startswith("DFLASH ")
    return str(info.value)


# ---------------------------------------------------------------- default layer ids


def test_default_layer_ids_match_zlab_formula() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(36, 1) == (18,)
    assert default_target_layer_ids(30, 1) == (15,)
    assert default_target_layer_ids(30, 2) == (1, 27)
    assert default_target_layer_ids(30, 3) == (1, 14, 27)
    # 1 + i * 26 / 4 = 1, 7.5, 14, 20.5, 27: Python's round-half-even, exactly like z-lab/SGLang
    assert default_target_layer_ids(30, 5) == (1, 8, 14, 20, 27)
    assert default_target_layer_ids(4, 2) == (1, 1)
    assert default_target_layer_ids(2, 1) == (1,)


def test_default_layer_ids_need_four_target_layers() -> None:
    with pytest.raises(DraftConfigError, match=r"num_target_layers=3 .*needs num_target_layers >= 4"):
        default_target_layer_ids(3, 2)
    with pytest.raises(DraftConfigError, match="num_draft_layers=0"):
        default_target_layer_ids(30, 0)
    with pytest.raises(DraftConfigError, match="num_target_layers=True"):
        default_target_layer_ids(True, 2)  # type: ignore[arg-type]


def test_default_layer_ids_used_when_absent() -> None:
    raw = smol_draft(dflash_config={"mask_token_id": 2})
    assert resolve(raw).target_layer_ids == (1, 27)
    raw["num_hidden_layers"] = 5
    assert resolve(raw).target_layer_ids == (1, 8, 14, 20, 27)


# ---------------------------------------------------------------- z-lab config, round trip


def test_zlab_qwen3_8b_config_resolves() -> None:
    warns = Warnings()
    cfg = resolve(zlab_qwen3_8b(), QWEN3_8B, warn=warns)
    assert warns == []
    assert cfg == DraftConfig(
        hidden_size=4096, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=12288, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        max_position_embeddings=40960, layer_types=("full_attention",) * 5, sliding_window=None,
        num_target_layers=36, target_layer_ids=(1, 9, 17, 25, 33), block_size=16, mask_token=None,
        mask_token_id=151669, has_embed_tokens=False, vocab_size=151936)
    shapes = draft_tensor_shapes(cfg)
    assert shapes["fc.weight"] == (4096, 5 * 4096)
    assert shapes["layers.4.self_attn.k_proj.weight"] == (1024, 4096)
    assert len(shapes) == 5 * 11 + 3


@pytest.mark.parametrize("raw,target", [(zlab_qwen3_8b(), QWEN3_8B), (smol_draft(), SMOL)])
def test_to_json_dict_round_trip(raw: dict, target: ModelConfig) -> None:
    cfg = resolve(raw, target)
    out = cfg.to_json_dict()
    assert out["architectures"] == ["DFlashDraftModel"]
    assert out["dflash_config"]["target_layer_ids"] == list(cfg.target_layer_ids)
    assert "has_embed_tokens" not in out
    assert resolve(copy.deepcopy(out), target) == cfg


def test_to_json_dict_round_trip_with_everything_set() -> None:
    raw = smol_draft(layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                     has_embed_tokens=True, vocab_size=500, rope_theta=10000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=8192, rope_scaling={"rope_type": "linear", "factor": 2.0})
    raw["dflash_config"]["mask_token"] = "<|MASK|>"
    cfg = resolve(raw)
    out = cfg.to_json_dict()
    assert out["has_embed_tokens"] is True and out["dflash_config"]["mask_token"] == "<|MASK|>"
    assert resolve(copy.deepcopy(out)) == cfg


def test_defaults_when_fields_absent() -> None:
    raw = smol_draft()
    del raw["head_dim"], raw["num_key_value_heads"]
    cfg = resolve(raw)
    assert (cfg.head_dim, cfg.num_key_value_heads) == (64, 9)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-6, 1000000.0, 32768)
    assert cfg.layer_types == ("full_attention", "full_attention") and cfg.sliding_window is None
    assert cfg.has_embed_tokens is False


def test_dflash_config_wins_over_top_level() -> None:
    raw = smol_draft(block_size=4, target_layer_ids=[3], mask_token_id=7)
    raw["dflash_config"]["block_size"] = 6
    cfg = resolve(raw)
    assert (cfg.block_size, cfg.target_layer_ids, cfg.mask_token_id) == (6, (1, 27), 2)
    raw = smol_draft(target_layer_ids=[3, 4], mask_token_id=7, dflash_config=None)
    cfg = resolve(raw)
    assert (cfg.target_layer_ids, cfg.mask_token_id) == ((3, 4), 7)


# ---------------------------------------------------------------- integer and structural fields


@pytest.mark.parametrize("field,value", [
    ("num_hidden_layers", True), ("num_hidden_layers", 2.0), ("num_hidden_layers", "2"),
    ("num_hidden_layers", None), ("num_attention_heads", 9.5), ("num_key_value_heads", False),
    ("head_dim", "64"), ("intermediate_size", [1536]), ("max_position_embeddings", 1.5e4),
    ("num_target_layers", "30"), ("block_size", 8.0), ("vocab_size", True)])
def test_integer_fields_reject_junk(field: str, value: object) -> None:
    fails(smol_draft(**{field: value}),
          rf"invalid {field}={re.escape(repr(value))} \(a {type(value).__name__}\)")


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_target_layers", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "head_dim"])
def test_counts_must_be_positive(field: str) -> None:
    fails(smol_draft(**{field: 0}), rf"{field}=0 must be positive")
    fails(smol_draft(**{field: -3}), rf"{field}=-3 must be positive")


def test_hidden_size_must_be_positive_and_match_target() -> None:
    fails(smol_draft(hidden_size=0), "hidden_size=0 must be positive")
    msg = fails(smol_draft(hidden_size=4096),
                r"draft hidden_size=4096 differs from the target's hidden_size=576")
    assert "Use the draft made for this target" in msg


def test_heads_and_head_dim() -> None:
    fails(smol_draft(num_key_value_heads=4),
          r"num_attention_heads=9 is not a multiple of num_key_value_heads=4")
    raw = smol_draft(num_attention_heads=7, num_key_value_heads=7)
    del raw["head_dim"]
    fails(raw, r"hidden_size=576 is not divisible by num_attention_heads=7; set head_dim")


def test_hidden_act_must_be_silu() -> None:
    fails(smol_draft(hidden_act="gelu"), r"hidden_act='gelu' is not supported")


@pytest.mark.parametrize("field,value", [("rms_norm_eps", 0), ("rms_norm_eps", "1e-6"), ("rope_theta", -1.0),
                                         ("rope_theta", True), ("rope_theta", float("inf")),
                                         ("rope_theta", 10**400)])
def test_float_fields(field: str, value: object) -> None:
    fails(smol_draft(**{field: value}), rf"invalid {field}=.*finite number > 0")


def test_structure_errors() -> None:
    with pytest.raises(DraftConfigError, match="expected a JSON object, got list"):
        resolve([1, 2])  # type: ignore[arg-type]
    fails(smol_draft(dflash_config=[1]), r"dflash_config=\[1\] must be an object")
    fails(smol_draft(architectures=["Qwen3ForCausalLM"]),
          r"architectures=\['Qwen3ForCausalLM'\] is not a DFlash")
    fails(smol_draft(rope_scaling={"rope_type": "yarn"}), r"rope_scaling=.*yarn.* is not supported")
    fails(smol_draft(conv_kernel_size=4), r"conv_kernel_size=4 is a DFlash2 setting")
    fails(smol_draft(attention_bias=True), r"attention_bias=True selects a feature")
    fails(smol_draft(has_embed_tokens="yes"), r"has_embed_tokens='yes' must be true or false")


# ---------------------------------------------------------------- layer types


def test_layer_types() -> None:
    fails(smol_draft(layer_types="full_attention"), r"layer_types='full_attention' must be a list")
    fails(smol_draft(layer_types=["full_attention"]), r"layer_types has 1 entries but .*num_hidden_layers=2")
    fails(smol_draft(layer_types=["full_attention", "linear_attention"]),
          r"unsupported layer_types\[1\]='linear_attention'")
    fails(smol_draft(layer_types=["sliding_attention", "full_attention"]), r"sliding_window is not set")
    fails(smol_draft(layer_types=["sliding_attention"] * 2, sliding_window=0),
          r"sliding_window=0 must be positive")
    cfg = resolve(smol_draft(layer_types=["sliding_attention", "full_attention"], sliding_window=128))
    assert cfg.layer_types == ("sliding_attention", "full_attention") and cfg.sliding_window == 128


# ---------------------------------------------------------------- target layers


def test_target_layer_ids_validation() -> None:
    def ids(value: object) -> dict:
        return smol_draft(dflash_config={"mask_token_id": 2, "target_layer_ids": value})

    fails(ids([]), r"dflash_config.target_layer_ids=\[\] must be a non-empty list")
    fails(ids("1,2"), r"'1,2' must be a non-empty list")
    fails(ids([1, 30]),
          r"dflash_config.target_layer_ids\[1\]=30 .*\[0, 30\) \(the target has num_hidden_layers=30\)")
    fails(ids([-1]), r"target_layer_ids\[0\]=-1 ")
    fails(ids([1, True]), r"target_layer_ids\[1\]=True ")
    fails(ids([1, 2.0]), r"target_layer_ids\[1\]=2.0 ")
    fails(ids([3, 5, 3, 5, 9]), r"target_layer_ids=\[3, 5, 3, 5, 9\] repeats layer ids \[3, 5\]")
    assert resolve(ids([20, 4, 12])).target_layer_ids == (20, 4, 12)  # order kept: it is fc's concat order


def test_num_target_layers_mismatch_warns_and_uses_runtime() -> None:
    warns = Warnings()
    raw = smol_draft(num_target_layers=36, dflash_config={"mask_token_id": 2})
    cfg = resolve(raw, warn=warns)
    assert cfg.num_target_layers == 30 and cfg.target_layer_ids == (1, 27)
    assert len(warns) == 1 and "num_target_layers=36" in warns[0] and "num_hidden_layers=30" in warns[0]
    # a Qwen3-8B draft on SmolLM2: named as a hidden size mismatch, not found later as a fc shape mismatch
    fails(zlab_qwen3_8b(), r"draft hidden_size=4096 differs from the target's hidden_size=576")


# ---------------------------------------------------------------- block size


def test_block_size_resolution_order() -> None:
    warns = Warnings()
    assert resolve(smol_draft(), cli_block_size=4, warn=warns).block_size == 4
    assert len(warns) == 1 and "--block-size=4" in warns[0] and "block_size=8" in warns[0]
    assert "LARGER" not in warns[0]
    warns.clear()
    assert resolve(smol_draft(), cli_block_size=12, warn=warns).block_size == 12
    assert "LARGER" in warns[0] and "acceptance will drop" in warns[0]
    warns.clear()
    assert resolve(smol_draft(), cli_block_size=8, warn=warns).block_size == 8 and warns == []
    assert resolve(smol_draft(), warn=warns).block_size == 8 and warns == []
    raw = smol_draft()
    del raw["block_size"]
    assert resolve(raw, warn=warns).block_size == 16
    assert len(warns) == 1 and "using 16" in warns[0]
    warns.clear()
    assert resolve(raw, cli_block_size=5, warn=warns).block_size == 5 and warns == []
    # a draft run at a smaller default than it was trained at (blockspec's dflash_config.trained_block_size)
    raw = smol_draft()
    raw["block_size"], raw["dflash_config"]["trained_block_size"] = 2, 4
    assert resolve(raw, cli_block_size=4, warn=warns).block_size == 4
    assert len(warns) == 1 and "LARGER" not in warns[0] and "trained at" in warns[0]
    warns.clear()
    assert resolve(raw, cli_block_size=8, warn=warns).block_size == 8
    assert "LARGER" in warns[0] and "trained_block_size=4" in warns[0]
    raw["dflash_config"]["trained_block_size"] = "four"
    with pytest.raises(DraftConfigError, match="trained_block_size"):
        resolve(raw, warn=warns)


def test_block_size_must_be_at_least_two() -> None:
    msg = fails(smol_draft(), r"--block-size=1 is too small", cli_block_size=1)
    assert "--speculative-algorithm=NONE" in msg
    fails(smol_draft(block_size=1), r"block_size=1 is too small.*--speculative-algorithm=NONE")
    fails(smol_draft(block_size=0), r"block_size=0 must be positive")
    fails(smol_draft(), r"invalid --block-size=True", cli_block_size=True)
    fails(smol_draft(), r"invalid --block-size='16'", cli_block_size="16")
    fails(smol_draft(), r"--block-size=-2 must be positive", cli_block_size=-2)


# ---------------------------------------------------------------- mask token


def vocab(table: dict[str, int]):
    return table.get


def test_mask_token_must_be_non_empty_string() -> None:
    fails(smol_draft(), r"mask_token must be a non-empty string, got --speculative-dflash-mask-token=''",
          cli_mask_token="")
    raw = smol_draft()
    raw["dflash_config"]["mask_token"] = 5
    fails(raw, r"mask_token must be a non-empty string, got dflash_config.mask_token=5")
    raw["dflash_config"]["mask_token"] = None  # null is absent
    assert resolve(raw).mask_token is None
    raw["dflash_config"]["mask_token"] = ""
    fails(raw, r"got dflash_config.mask_token=''")


@pytest.mark.parametrize("value,pattern", [
    (True, r"invalid dflash_config.mask_token_id=True \(a bool\)"), ("2", r"mask_token_id='2' \(a str\)"),
    (2.0, r"mask_token_id=2.0 \(a float\)"), (-1, r"mask_token_id=-1 must be >= 0")])
def test_mask_token_id_type_and_sign(value: object, pattern: str) -> None:
    fails(smol_draft(dflash_config={"mask_token_id": value}), pattern)


def test_cli_mask_token_id_type() -> None:
    fails(smol_draft(), r"invalid --mask-token-id=False", cli_mask_token_id=False)
    fails(smol_draft(), r"--mask-token-id=-5 must be >= 0", cli_mask_token_id=-5)


def test_mask_token_id_resolution_order() -> None:
    lookup = vocab({"<|MASK|>": 40, "<pad>": 2})
    raw = smol_draft(dflash_config={"mask_token": "<|MASK|>"})
    assert resolve(raw, token_to_id=lookup).mask_token_id == 40  # tokenizer lookup last
    raw = smol_draft(dflash_config={"mask_token": "<|MASK|>", "mask_token_id": 40})
    assert resolve(raw, token_to_id=lookup).mask_token_id == 40
    warns = Warnings()
    raw = smol_draft(dflash_config={"mask_token_id": 40})
    assert resolve(raw, cli_mask_token_id=7, warn=warns).mask_token_id == 7  # CLI first
    assert "--mask-token-id=7" in warns[0] and "mask_token_id=40" in warns[0]
    cfg = resolve(smol_draft(), cli_mask_token="<pad>", token_to_id=lookup)
    assert (cfg.mask_token, cfg.mask_token_id) == ("<pad>", 2)


def test_a_mask_token_the_vocabulary_lacks() -> None:
    """Named on the command line, it is refused even when the config has an id (never silently replaced);
    named in the config beside an id, it is warned about and the id used."""
    lookup = vocab({"<|MASK|>": 40})
    raw = smol_draft(dflash_config={"mask_token_id": 40})
    msg = fails(raw, r"--speculative-dflash-mask-token='notatoken' is not in the target tokenizer's "
                     r"vocabulary", cli_mask_token="notatoken", token_to_id=lookup)
    assert "dflash_config.mask_token_id=40" in msg
    with pytest.raises(DraftConfigError, match=r"^DFLASH mask_token='notatoken' is not in"):
        resolve_draft_config(raw, target=SMOL, cli_mask_token="notatoken", token_to_id=lookup)  # the API
    warns = Warnings()
    raw = smol_draft(dflash_config={"mask_token": "<|gone|>", "mask_token_id": 40})
    assert resolve(raw, token_to_id=lookup, warn=warns).mask_token_id == 40
    assert len(warns) == 1 and "'<|gone|>' is not in the target tokenizer's vocabulary" in warns[0]


def test_mask_token_id_conflicts_with_tokenizer() -> None:
    raw = smol_draft(dflash_config={"mask_token": "<|MASK|>", "mask_token_id": 41})
    msg = fails(raw, r"dflash_config.mask_token_id=41 conflicts .*mask_token='<\|MASK\|>' to id 40",
                token_to_id=vocab({"<|MASK|>": 40}))
    assert msg.startswith("DFLASH config mismatch")
    fails(smol_draft(), r"--mask-token-id=9 conflicts .*'<pad>' to id 2", cli_mask_token_id=9,
          cli_mask_token="<pad>", token_to_id=vocab({"<pad>": 2}))


def test_unresolvable_mask_token_refuses_vocab_expansion() -> None:
    raw = smol_draft(dflash_config={"mask_token": "<|MASK|>"})
    msg = fails(raw, r"mask_token='<\|MASK\|>'.*not in the target tokenizer's vocabulary",
                token_to_id=vocab({"a": 1}))
    assert "vocab expansion" in msg and "no trained row" in msg and "--mask-token-id" in msg
    fails(raw, r"no tokenizer is loaded to look it up")
    fails(smol_draft(dflash_config={}), r"mask_token=None.*sets neither dflash_config.mask_token_id")


def test_mask_token_id_bounded_by_target_vocab() -> None:
    msg = fails(smol_draft(dflash_config={"mask_token_id": 49152}),
                r"mask_token_id=49152 is outside the target embedding \(target vocab_size=49152\)")
    assert "< 49152" in msg
    fails(smol_draft(), r"--mask-token-id=60000 is outside the target embedding", cli_mask_token_id=60000)
    fails(smol_draft(dflash_config={"mask_token": "<m>"}),
          r"mask_token_id=50000 \(mask_token='<m>', from the tokenizer\) is outside",
          token_to_id=vocab({"<m>": 50000}))
    assert resolve(smol_draft(dflash_config={"mask_token_id": 49151})).mask_token_id == 49151


def test_mask_token_id_out_of_range_says_so_first() -> None:
    """--mask-token-id 999999 beside a draft whose mask token the tokenizer knows: one error, out of the
    vocabulary's range (not a warning, then a conflict with the tokenizer blamed)."""
    raw = smol_draft(dflash_config={"mask_token_id": 2, "mask_token": "<m>", "target_layer_ids": [1, 27]})
    warnings = Warnings()
    msg = fails(raw, r"--mask-token-id=999999 is outside the target embedding \(target vocab_size=49152\), "
                r"out of the vocabulary's range: ids must be < 49152", cli_mask_token_id=999999,
                token_to_id=vocab({"<m>": 2}), warn=warnings)
    assert "conflicts" not in msg and "(the draft's own: 2)" in msg and not warnings


def test_mask_token_id_bounded_by_draft_embedding_when_it_embeds() -> None:
    raw = smol_draft(has_embed_tokens=True, dflash_config={"mask_token_id": 49152})
    # beyond the target vocab is fine: the draft's embedding is used
    assert resolve(raw).mask_token_id == 49152
    raw["vocab_size"] = 49153
    assert resolve(raw).mask_token_id == 49152
    raw["vocab_size"] = 49152
    fails(raw, r"mask_token_id=49152 is outside the draft's own embedding "
               r"\(embed_tokens.weight, vocab_size=49152\)")
    raw = smol_draft(dflash_config={"mask_token_id": 60000, "has_embed_tokens": True})
    assert resolve(raw).has_embed_tokens is True


# ---------------------------------------------------------------- checkpoint tensors


def header(cfg: DraftConfig, **over: Any) -> dict[str, Any]:
    shapes: dict[str, Any] = {name: list(shape) for name, shape in draft_tensor_shapes(cfg).items()}
    if cfg.has_embed_tokens and cfg.vocab_size is None:
        shapes["embed_tokens.weight"] = [49152, cfg.hidden_size]
    shapes.update(over)
    return {k: v for k, v in shapes.items() if v is not None}


def test_check_tensors_accepts_a_complete_checkpoint() -> None:
    warns = Warnings()
    cfg = resolve(zlab_qwen3_8b(), QWEN3_8B)
    check_draft_tensors(cfg, header(cfg), "model.safetensors", warn=warns)
    assert warns == []


def test_check_tensors_missing_and_shape() -> None:
    cfg = resolve(smol_draft())
    with pytest.raises(DraftConfigError,
                       match=r"missing 1 required tensor\(s\): layers.1.mlp.up_proj.weight\."):
        check_draft_tensors(cfg, header(cfg, **{"layers.1.mlp.up_proj.weight": None}), "d")
    prefixed = {f"model.{k}": v for k, v in header(cfg).items()}
    with pytest.raises(DraftConfigError, match=r"missing 25 .*\(and 20 more\).*'model.' prefix"):
        check_draft_tensors(cfg, prefixed, "d")
    with pytest.raises(DraftConfigError,
                       match=r"layers.0.self_attn.k_proj.weight is \(576, 576\), expected \(192, 576\)"):
        check_draft_tensors(cfg, header(cfg, **{"layers.0.self_attn.k_proj.weight": [576, 576]}), "d")


def test_check_tensors_fc_width_names_k_and_h() -> None:
    cfg = resolve(smol_draft())
    with pytest.raises(DraftConfigError) as info:
        check_draft_tensors(cfg, header(cfg, **{"fc.weight": [576, 5 * 576]}), "draft/model.safetensors")
    msg = str(info.value)
    for part in ["K=len(target_layer_ids)=2", "H=576", "K*H=1152", "actual width is 2880 (5 target layers)",
                 "trained for a different number of target layers", "draft/model.safetensors"]:
        assert part in msg


def test_check_tensors_embedding() -> None:
    cfg = resolve(smol_draft(has_embed_tokens=True, dflash_config={"mask_token_id": 49160}))
    with pytest.raises(DraftConfigError, match=r"declares has_embed_tokens=true .*no embed_tokens.weight"):
        check_draft_tensors(cfg, header(cfg, **{"embed_tokens.weight": None}), "d")
    check_draft_tensors(cfg, header(cfg, **{"embed_tokens.weight": [49200, 576]}), "d")
    with pytest.raises(DraftConfigError, match=r"mask_token_id=49160 is outside the draft's own embedding "
                                               r"\(embed_tokens.weight, vocab_size=49152\)"):
        check_draft_tensors(cfg, header(cfg, **{"embed_tokens.weight": [49152, 576]}), "d")
    cfg = resolve(smol_draft(has_embed_tokens=True, vocab_size=49200))
    with pytest.raises(DraftConfigError,
                       match=r"embed_tokens.weight is \(49152, 576\), expected \(49200, 576\)"):
        check_draft_tensors(cfg, header(cfg, **{"embed_tokens.weight": [49152, 576]}), "d")


def test_check_tensors_warns_on_extras() -> None:
    cfg, warns = resolve(smol_draft()), Warnings()
    check_draft_tensors(cfg, header(cfg, **{"embed_tokens.weight": [49152, 576],
                                            "lm_head.weight": [1, 1]}), "d", warn=warns)
    assert len(warns) == 1 and "2 unexpected" in warns[0] and "has_embed_tokens" in warns[0]


# ---------------------------------------------------------------- device


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu") == resolve_device("auto")
    for name in ["cuda", "cuda:1"]:
        with pytest.raises(BlockspecError,
                           match=rf"device='{name}': no CUDA device is visible.*device=cpu"):
            resolve_device(name)  # an API message names the API's field
        with pytest.raises(BlockspecError, match=rf"--device='{name}': no CUDA device is visible"):
            with cli_flags(CLI):
                resolve_device(name)  # the CLI's, the flag
    for name in ["npu", "mps", "tpu", "gpu", "cuda:x", "", 3]:
        with pytest.raises(BlockspecError,
                           match=r"Unsupported device=.*'cpu', 'cuda', 'cuda:N' or 'auto'"):
            resolve_device(name)  # type: ignore[arg-type]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(BlockspecError, match=r"'cuda:2': only 2 CUDA device"):
        resolve_device("cuda:2")


# ---------------------------------------------------------------- properties

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**30, 10**30), st.floats(allow_nan=True),
                 st.text(max_size=5), st.lists(st.integers(-3, 40), max_size=4),
                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
FIELDS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "max_position_embeddings", "num_target_layers", "block_size", "vocab_size",
          "rms_norm_eps", "rope_theta", "sliding_window", "layer_types", "has_embed_tokens", "rope_scaling",
          "mask_token_id", "target_layer_ids", "mask_token", "dflash_config"]


@settings(max_examples=300, deadline=None)
@example({"num_hidden_layers": 3304365211}, None, None)  # once exhausted memory building layer_types
@given(st.dictionaries(st.sampled_from(FIELDS), JUNK, min_size=1, max_size=4),
       st.one_of(st.none(), JUNK), st.one_of(st.none(), JUNK))
def test_junk_never_raises_anything_but_draft_config_error(junk: dict, cli_block: Any, cli_id: Any) -> None:
    try:
        cfg = resolve(smol_draft(**junk), cli_block_size=cli_block, cli_mask_token_id=cli_id,
                      token_to_id=vocab({"<m>": 3}))
    except DraftConfigError as exc:
        assert str(exc).startswith("DFLASH ")
        return
    assert cfg.block_size >= 2 and 0 <= cfg.mask_token_id
    assert len(set(cfg.target_layer_ids)) == len(cfg.target_layer_ids)
    assert all(0 <= i < 30 for i in cfg.target_layer_ids)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["mask_token_id", "target_layer_ids", "mask_token", "block_size",
                                        "num_target_layers", "has_embed_tokens"]), JUNK, max_size=3),
       st.sampled_from(["hidden_act", "architectures", "layer_types", "rope_scaling", "attention_bias"]),
       JUNK, st.one_of(st.none(), JUNK))
def test_junk_in_dflash_config(dflash: dict, top: str, top_value: Any, cli_token: Any) -> None:
    raw = smol_draft(**{top: top_value})
    raw["dflash_config"].update(dflash)
    try:
        cfg = resolve(raw, cli_mask_token=cli_token, token_to_id=vocab({"<m>": 3, "": 4}))
    except DraftConfigError as exc:
        assert str(exc).startswith("DFLASH ")
        return
    assert cfg.mask_token is None or (isinstance(cfg.mask_token, str) and cfg.mask_token)
    assert 0 <= cfg.mask_token_id < SMOL.vocab_size or cfg.has_embed_tokens


@settings(max_examples=200, deadline=None)
@given(st.integers(4, 200), st.integers(1, 64))
def test_default_layer_ids_property(big_l: int, n: int) -> None:
    ids = default_target_layer_ids(big_l, n)
    assert len(ids) == n and all(0 <= i < big_l for i in ids) and list(ids) == sorted(ids)
    if n > 1:
        assert ids[0] == 1 and ids[-1] == big_l - 3


@settings(max_examples=100, deadline=None)
@given(st.integers(-5, 10**6) | st.booleans() | st.floats() | st.text(max_size=3))
def test_integer_validators_on_cli_block_size(value: Any) -> None:
    try:
        assert resolve(smol_draft(), cli_block_size=value).block_size == value
    except DraftConfigError as exc:
        assert "--block-size" in str(exc)
