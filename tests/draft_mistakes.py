"""The draft mistakes blockspec refuses, as one table: each a change to a tiny valid checkpoint (its
config.json, its tensors) and words its error must hold. test_draft_format.py and test_dflash2.py load each
and expect that error before a weight is read; docs/draft-format.md lists exactly these rows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class Mistake:
    what: str  # the mistake, as the reference lists it
    says: str  # words the error holds (a plain substring)
    config: dict = field(default_factory=dict)  # dflash_config keys; "/key": top level; None: removed
    drop: tuple[str, ...] = ()  # tensors removed
    reshape: dict = field(default_factory=dict)  # tensors replaced by zeros of another shape
    add: dict = field(default_factory=dict)  # tensors added


def edit(folder, mistake: Mistake) -> None:
    """Write the mistake into a checkpoint folder."""
    from safetensors import safe_open

    raw = json.loads((folder / "config.json").read_text())
    for key, value in mistake.config.items():
        where, key = (raw, key[1:]) if key.startswith("/") else (raw["dflash_config"], key)
        if value is None:
            where.pop(key, None)
        else:
            where[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if n not in mistake.drop}
    for name, shape in mistake.reshape.items():
        tensors[name] = torch.zeros(shape)
    tensors.update(mistake.add)
    save_file(tensors, str(folder / "model.safetensors"))


# On the tiny DFlash draft of tests/tiny.py: a 64-wide, 4-layer target of 97 tokens; 2 draft layers of 4
# heads (2 KV heads, 16 wide), tapping target layers [0, 2], mask token 5.
DFLASH = [
    Mistake("not a DFlash draft (a plain model's folder)", "is not a DFlash draft",
            {"/architectures": ["LlamaForCausalLM"]}),
    Mistake("a feature of another DFlash variant", "selects a feature of another DFlash variant",
            {"projector_type": "mlp"}),
    Mistake("an activation other than SiLU", "hidden_act='gelu' is not supported", {"/hidden_act": "gelu"}),
    Mistake("a missing or non-integer size", "invalid num_hidden_layers=None",
            {"/num_hidden_layers": None}),
    Mistake("an implausible layer count", "num_hidden_layers=100000 is implausible for a draft",
            {"/num_hidden_layers": 100000}),
    Mistake("a draft for another target family (hidden size)", "differs from the target's hidden_size=64",
            {"/hidden_size": 128}),
    Mistake("attention heads not a multiple of the KV heads",
            "num_attention_heads=4 is not a multiple of num_key_value_heads=3", {"/num_key_value_heads": 3}),
    Mistake("a target layer the target does not have", "is not a layer of the runtime target",
            {"target_layer_ids": [0, 9]}),
    Mistake("a target layer tapped twice", "repeats layer ids [2]", {"target_layer_ids": [2, 2]}),
    Mistake("one attention type per layer, not", "layer_types has 3 entries",
            {"/layer_types": ["full_attention"] * 3}),
    Mistake("sliding attention without a window", "sliding_window is not set",
            {"/layer_types": ["sliding_attention", "full_attention"]}),
    Mistake("an unsupported RoPE scaling", "is not supported (rope_type must be one of",
            {"/rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
    Mistake("a non-positive norm epsilon or RoPE base", "invalid rms_norm_eps=0",
            {"/rms_norm_eps": 0}),
    Mistake("a block of one token", "a DFlash block needs >= 2 tokens", {"/block_size": 1}),
    Mistake("a mask token id outside the vocabulary", "out of the vocabulary's range: ids must be < 97",
            {"mask_token_id": 97}),
    Mistake("no mask token at all", "sets neither dflash_config.mask_token_id nor dflash_config.mask_token",
            {"mask_token_id": None}),
    Mistake("fc sized for another number of target layers", "fc.weight has shape (64, 192)",
            reshape={"fc.weight": (64, 192)}),
    Mistake("a required tensor missing", "missing 1 required tensor(s): hidden_norm.weight",
            drop=("hidden_norm.weight",)),
    Mistake("a tensor of another shape", "tensor shapes do not match config.json",
            reshape={"layers.0.mlp.down_proj.weight": (64, 32)}),
    Mistake("an own embedding declared but absent",
            "declares has_embed_tokens=true but the checkpoint has no",
            {"/has_embed_tokens": True, "/vocab_size": 97}),
    Mistake("a draft vocabulary that repeats ids", "it repeats an id",
            add={"draft_vocab": torch.tensor([3, 3, 7])}),
    Mistake("a draft vocabulary that is not 1-D", "draft_vocab has shape [2, 2]",
            add={"draft_vocab": torch.tensor([[3, 4], [5, 6]])}),
]

# On test_dflash2.py's tiny DFlash2 draft (from the tiny target: 64 wide, 97 tokens; selector rank 16,
# top-K 8, convolution 2 taps in groups of 16, block 8).
DFLASH2 = [
    Mistake("a DFlash2 key missing", "needs dflash_config.conv_kernel_size, which is missing",
            {"conv_kernel_size": None}),
    Mistake("a non-positive selector size", "selector_top_k=0 must be positive", {"selector_top_k": 0}),
    Mistake("a non-integer selector size", "invalid dflash_config.selector_rank=2.5", {"selector_rank": 2.5}),
    Mistake("a group size that does not divide the hidden size", "conv_group_size=24 does not divide "
            "hidden_size=64", {"conv_group_size": 24}),
    Mistake("top-K larger than the target's vocabulary",
            "selector_top_k=98 is larger than the target's vocabulary (vocab_size=97)",
            {"selector_top_k": 98}),
    Mistake("a draft for another tokenizer", "vocab_size=120, but the target's vocabulary has 97 tokens",
            {"/vocab_size": 120}),
    Mistake("a non-positive output multiplier", "invalid dflash_config.output_multiplier=-1",
            {"output_multiplier": -1}),
    Mistake("a non-positive softcap", "final_logit_softcapping=-3.0", {"final_logit_softcapping": -3.0}),
    Mistake("a non-numeric embedding scale", "invalid dflash_config.input_embedding_scale='big'",
            {"input_embedding_scale": "big"}),
    Mistake("two block sizes that disagree", "block_size=8 and dflash_config.block_size=6 disagree",
            {"block_size": 6, "/block_size": 8}),
    Mistake("DFlash2 keys on a draft declared DFlash", "conv_kernel_size=2 is a DFlash2 setting",
            {"/architectures": ["DFlashDraftModel"]}),
    Mistake("a layer without its convolutions", "missing layers.1.mlp_conv.base_kernel: every layer needs "
            "attention_conv and mlp_conv", drop=("layers.1.mlp_conv.base_kernel",)),
    Mistake("a codebook saved with a '.weight' suffix", "with a '.weight' suffix",
            drop=("candidate_selector.successor_codebook",),
            add={"candidate_selector.successor_codebook.weight": torch.zeros(97, 16)}),
    Mistake("codebooks of another rank than the config's",
            "predecessor_codebook has shape [97, 16] (rank 16)",
            {"selector_rank": 32}),
    Mistake("a kernel of another tap count than the config's", "base_kernel has shape [2, 2, 64] (2 taps)",
            {"conv_kernel_size": 3}),
    Mistake("a kernel projection of another group size", "kernel_projection.weight has shape [16, 64]",
            {"conv_group_size": 8}),
    Mistake("codebooks for another vocabulary", "predecessor_codebook has 90 rows, but the target's "
            "vocabulary has 97 tokens", reshape={"candidate_selector.predecessor_codebook": (90, 16)}),
    Mistake("top-K larger than the draft's own vocabulary",
            "selector_top_k=8 is larger than the draft's vocabulary (draft_vocab holds 5 ids)",
            add={"draft_vocab": torch.arange(5)}),
]


def table(mistakes: list[Mistake]) -> str:
    """The rows docs/draft-format.md shows."""
    return "\n".join(["| mistake | the error says |", "|---|---|",
                      *(f"| {m.what} | `{m.says}` |" for m in mistakes)])
