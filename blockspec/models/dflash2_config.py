"""DFlash2 drafts (`architectures: ["DFlash2DraftModel"]`): the settings of the local convolution and the
candidate selector that a DFlash draft lacks, resolved from `dflash_config` before any weight is read, and
their tensors checked against the checkpoint's header. Every failure is a `DraftConfigError` that names the
field or tensor, the value, the limit and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass

from blockspec.errors import DraftConfigError
from blockspec.models.draft_values import FIX, get, int_value, positive_float

ARCHITECTURE2 = "DFlash2DraftModel"
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "output_multiplier",
        "final_logit_softcapping", "input_embedding_scale")
SELECTOR = "candidate_selector"
CONVS = ("attention_conv", "mlp_conv")


@dataclass(frozen=True)
class Dflash2Config:
    """What a DFlash2 draft adds to its DFlash backbone."""

    conv_kernel_size: int  # taps of each causal convolution (k)
    conv_group_size: int  # channels sharing one predicted kernel value (H / G)
    selector_rank: int  # r of the codebooks [V, r] and the hidden projection H -> r
    selector_top_k: int  # K candidates per drafted position
    vocab_size: int  # the target's vocabulary: the codebooks' rows
    output_multiplier: float = 1.0  # scales the unary logits (before the softcap)
    final_logit_softcapping: float | None = None  # tanh(x / cap) * cap on the unary logits
    input_embedding_scale: float = 1.0  # scales the block's embeddings, the anchor's included

    def groups(self, hidden_size: int) -> int:
        return hidden_size // self.conv_group_size

    def json_keys(self) -> dict:
        """The `dflash_config` entries of the z-lab format."""
        out = {key: getattr(self, key) for key in KEYS}
        if out["final_logit_softcapping"] is None:
            del out["final_logit_softcapping"]
        return out


def resolve_dflash2(raw: dict, dcfg: dict, source: str, hidden: int, vocab: int) -> Dflash2Config:
    """The DFlash2 settings of a draft config.json for a target of hidden size `hidden` and vocabulary
    `vocab` (z-lab reads each key from `dflash_config` first, then from the top level)."""
    values = {}
    for key in KEYS[:4]:
        value, where = get(raw, dcfg, key)
        if value is None:
            raise DraftConfigError(f"DFLASH {source}: a {ARCHITECTURE2} draft needs dflash_config.{key}, "
                                   f"which is missing. {FIX}")
        values[key] = int_value(value, where, source)
    group, where = values["conv_group_size"], get(raw, dcfg, "conv_group_size")[1]
    if hidden % group:
        raise DraftConfigError(f"DFLASH {source}: {where}={group} does not divide hidden_size={hidden}; the "
                               f"convolution predicts one kernel value per group of {group} channels. {FIX}")
    top_k, where = values["selector_top_k"], get(raw, dcfg, "selector_top_k")[1]
    if top_k > vocab:
        raise DraftConfigError(f"DFLASH {source}: {where}={top_k} is larger than the target's vocabulary "
                               f"(vocab_size={vocab}); the selector picks among at most that many "
                               f"candidates. Use selector_top_k <= {vocab}.")
    declared = raw.get("vocab_size")
    if declared is not None and declared != vocab:
        raise DraftConfigError(f"DFLASH {source}: vocab_size={declared!r}, but the target's vocabulary has "
                               f"{vocab} tokens; a DFlash2 draft's selector codebooks hold one row per "
                               f"target token. Use the DFlash2 draft made for this target.")
    scales = {key: positive_float(get(raw, dcfg, key)[0], get(raw, dcfg, key)[1], source, 1.0)
              for key in ("output_multiplier", "input_embedding_scale")}
    cap, where = get(raw, dcfg, "final_logit_softcapping")
    # z-lab applies the softcap only when it is > 0: 0 (like null) means none
    cap = None if cap in (None, 0) else positive_float(cap, where, source, 0.0)
    return Dflash2Config(vocab_size=vocab, final_logit_softcapping=cap, **values, **scales)


def dflash2_tensor_shapes(d2: Dflash2Config, hidden: int, layers: int) -> dict[str, tuple[int, ...]]:
    """The tensors a DFlash2 draft holds beyond its DFlash backbone's (the codebooks without `.weight`)."""
    k, r = d2.conv_kernel_size, d2.selector_rank
    out: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        for conv in CONVS:
            out[f"layers.{i}.{conv}.base_kernel"] = (2, k, hidden)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * d2.groups(hidden), hidden)
    out.update({f"{SELECTOR}.predecessor_codebook": (d2.vocab_size, r),
                f"{SELECTOR}.successor_codebook": (d2.vocab_size, r),
                f"{SELECTOR}.hidden_projection.weight": (r, hidden)})
    return out


def check_dflash2_tensors(d2: Dflash2Config, hidden: int, layers: int, got: dict[str, tuple[int, ...]],
                          source: str) -> None:
    """Check the header's ({name: shape}) convolution and selector tensors against `d2`, naming which
    setting a wrong shape contradicts."""
    want = dflash2_tensor_shapes(d2, hidden, layers)
    missing = [name for name in want if name not in got]
    if missing:
        more = f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""
        bare = [n for n in missing if f"{n}.weight" in got]
        hint = (f" The checkpoint names {bare[0]} with a '.weight' suffix; the format stores the codebooks "
                f"bare: rename them." if bare else "")
        raise DraftConfigError(f"DFLASH {source}: the {ARCHITECTURE2} checkpoint is missing "
                               f"{', '.join(missing[:4])}{more}: every layer needs attention_conv and "
                               f"mlp_conv (base_kernel, kernel_projection.weight) and the draft needs "
                               f"{SELECTOR} "
                               f"(predecessor_codebook, successor_codebook, hidden_projection.weight).{hint} "
                               f"Use a complete DFlash2 checkpoint, or architectures [\"DFlashDraftModel\"] "
                               f"for a DFlash one.")
    k, r, groups = d2.conv_kernel_size, d2.selector_rank, d2.groups(hidden)
    for name, shape in ((n, got[n]) for n in want):
        if shape == want[name] or len(shape) != len(want[name]):
            continue  # right, or for the generic shape check to report
        if name.endswith("base_kernel") and shape[1] != k:
            _mismatch(source, name, shape, f"conv_kernel_size={k}", f"{shape[1]} taps")
        rows = shape[0]
        if name.endswith("kernel_projection.weight") and rows != 2 * k * groups and rows % (2 * k) == 0:
            implied = hidden * 2 * k / rows
            _mismatch(source, name, shape, f"conv_group_size={d2.conv_group_size} ({groups} groups: "
                      f"{2 * k * groups} rows)", f"{rows} rows (group size {implied:g})")
        if SELECTOR in name and shape[-1 if "codebook" in name else 0] != r:
            _mismatch(source, name, shape, f"selector_rank={r}",
                      f"rank {shape[-1 if 'codebook' in name else 0]}")
        if "codebook" in name and shape[0] != d2.vocab_size:
            raise DraftConfigError(f"DFLASH {source}: {name} has {shape[0]} rows, but the target's "
                                   f"vocabulary has {d2.vocab_size} tokens (one row per token). The draft "
                                   f"was trained for another tokenizer; use the DFlash2 draft made for this "
                                   f"target.")


def _mismatch(source: str, name: str, shape: tuple[int, ...], setting: str, theirs: str) -> None:
    raise DraftConfigError(f"DFLASH {source}: {name} has shape {list(shape)} ({theirs}), which disagrees "
                           f"with dflash_config.{setting}. config.json and the weights come from different "
                           f"drafts; use a matching pair.")
