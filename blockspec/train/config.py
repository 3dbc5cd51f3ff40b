"""Training configuration (validated when constructed) and the draft it describes: config + initial weights
(from the target's top layers, or a previous draft grown by layers), and the training dtype."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from blockspec.device import has_fast_bf16
from blockspec.errors import BlockspecError, setting
from blockspec.models.config import ModelConfig
from blockspec.models.dflash2 import dflash2_from
from blockspec.models.dflash2_config import ARCHITECTURE2, Dflash2Config
from blockspec.models.draft import DFlashDraft
from blockspec.models.draft_config import DraftConfig, default_target_layer_ids, resolve_draft_config
from blockspec.models.loader import copy_layer, load_draft, model_tensors
from blockspec.models.target import CausalLM
from blockspec.paths import draft_folder
from blockspec.train.dflash2_setup import SELECTOR_INIT_STD, check_architecture, dflash2_keys

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Tried in order when no --mask-token(-id) is given: dedicated mask tokens, then rarely used specials.
MASK_CANDIDATES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>", "<empty_output>")
# Fields that may change between a run and its --resume (they do not affect the trained weights).
FINAL_NORM_SCALE = 0.3
RESUMABLE_CHANGES = {"output", "resume", "save_every", "eval_every", "stop_after_steps", "device",
                     "cache_dir", "command", "extract_batch_size", "gen_batch_size", "time_budget"}
FEATURES = ("auto", "disk", "online")


@dataclass
class TrainConfig:
    output: Path
    target: str = "default"  # an HF folder, or "default" for the embedded SmolLM2-135M-Instruct
    num_draft_layers: int = 1
    block_size: int = 16
    # default: default_target_layer_ids(L, num_target_features)
    target_layer_ids: tuple[int, ...] | None = None
    num_target_features: int = 5
    mask_token_id: int | None = None
    mask_token: str | None = None
    data: str = "stdlib"
    tokens: int | None = None  # cap on training-data tokens (features extracted and trained on)
    steps: int | None = None  # default: epochs over the data
    epochs: float = 1.0
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 4
    seq_len: int = 512
    anchors_per_seq: int = 32
    loss_gamma: float | None = None
    distill: float = 0.0  # weight of KL(target || draft) against the hard-label CE (0: labels only)
    train_vocab: int | None = None  # training softmax over the N most frequent label tokens (None: all)
    # "target": draft layers start as the target's top layers; "random"; or a draft folder
    init: str = "target"
    architecture: str = "dflash"  # "dflash2": + local convolutions and a candidate selector
    selector_rank: int | None = None  # dflash2 only (default: the --init draft's, else 64)
    selector_top_k: int | None = None  # dflash2 only (default: the --init draft's, else 16)
    selector_alpha: float | None = None  # dflash2 only: weight of the selector's loss (default 1.0)
    selector_lr_scale: float | None = None  # dflash2 only: the selector's lr / --lr (default 1.0)
    device: str = "auto"
    dtype: str = "auto"  # target dtype for feature extraction / response generation
    # autocast dtype of the draft's forward ("auto": bf16 where bf16 matmuls are fast)
    train_dtype: str = "auto"
    save_dtype: str = "float16"
    seed: int = 0
    resume: bool = False
    save_every: int = 200
    eval_every: int = 100
    eval_seqs: int = 16
    eval_anchors: int = 16
    response_tokens: int = 256
    gen_batch_size: int = 8
    extract_batch_size: int = 4
    cache_dir: Path | None = None
    # stop early (checkpoint saved) after this many steps in this invocation
    stop_after_steps: int | None = None
    # "disk": extract once, cache, reuse; "online": run the target per batch; auto: by device
    features: str = "auto"
    time_budget: float | None = None  # seconds of training: the schedule's length is fitted to it
    command: str = ""

    def __post_init__(self) -> None:
        self.output = Path(self.output)
        self.init = draft_folder(self.init)  # "default": the shipped draft
        self.cache_dir = None if self.cache_dir is None else Path(self.cache_dir)
        positive = ["num_draft_layers", "block_size", "num_target_features", "batch_size", "seq_len",
                    "anchors_per_seq", "save_every", "eval_every", "eval_seqs", "eval_anchors",
                    "response_tokens", "gen_batch_size", "extract_batch_size"]
        optional = ["tokens", "steps", "stop_after_steps", "train_vocab", "selector_rank", "selector_top_k"]
        for name in positive + optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BlockspecError(f"train-draft: {setting(name)}={value!r} "
                                     f"must be an integer >= 1.")
        if self.block_size < 2:
            raise BlockspecError(f"train-draft: {setting('block_size')}={self.block_size} must be >= 2 "
                                 f"(anchor + >= 1 prediction).")
        if self.seq_len < 32:
            raise BlockspecError(f"train-draft: {setting('seq_len')}={self.seq_len} must be >= 32.")
        for name, low, high in (("lr", 0.0, 1.0), ("epochs", 0.0, math.inf), ("grad_clip", 0.0, math.inf)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not low < value < high:
                raise BlockspecError(f"train-draft: {setting(name)}={value!r} "
                                     f"must be in ({low}, {high}).")
        if not 0.0 <= self.warmup_ratio < 1.0 or not 0.0 <= self.weight_decay < 1.0:
            raise BlockspecError(f"train-draft: {setting('warmup_ratio')}={self.warmup_ratio} and "
                                 f"{setting('weight_decay')}={self.weight_decay} must be in [0, 1).")
        if (isinstance(self.distill, bool) or not isinstance(self.distill, (int, float)) or
                not 0 <= self.distill <= 1):
            raise BlockspecError(f"train-draft: {setting('distill')}={self.distill!r} must be in [0, 1] "
                                 f"(the KL term's share of the loss; 0 trains on hard labels only).")
        if self.loss_gamma is not None and not 0 < self.loss_gamma < math.inf:
            raise BlockspecError(f"train-draft: {setting('loss_gamma')}={self.loss_gamma} must be a number "
                                 f"> 0.")
        if (self.init not in ("target", "random") and
                not (Path(self.init).expanduser() / "config.json").is_file()):
            raise BlockspecError(f"train-draft: {setting('init')}={self.init!r}: use 'target', 'random', "
                                 f"'default' (the shipped draft) or a draft folder (config.json + "
                                 f"model.safetensors) to continue training "
                                 f"from.")
        check_architecture(self)
        if self.features not in FEATURES:
            raise BlockspecError(f"train-draft: {setting('features')}={self.features!r}; "
                                 f"use one of {', '.join(FEATURES)}.")
        if self.time_budget is not None and (isinstance(self.time_budget, bool) or
                                             not isinstance(self.time_budget, (int, float)) or
                                             not 0 < self.time_budget < math.inf):
            raise BlockspecError(f"train-draft: {setting('time_budget')}={self.time_budget!r} "
                                 f"must be a number of seconds > 0.")
        if self.train_dtype not in ("auto", "float32", "bfloat16"):
            raise BlockspecError(f"train-draft: {setting('train_dtype')}={self.train_dtype!r}; "
                                 f"use auto, float32 or bfloat16.")
        if self.save_dtype not in SAVE_DTYPES:
            raise BlockspecError(f"train-draft: {setting('save_dtype')}={self.save_dtype!r}; "
                                 f"use one of {sorted(SAVE_DTYPES)}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise BlockspecError(f"train-draft: {setting('seed')}={self.seed!r} must be an integer in "
                                 f"[0, 2**63).")
        if self.target_layer_ids is not None:
            self.target_layer_ids = tuple(self.target_layer_ids)

    def fingerprint(self) -> dict:
        """The fields a --resume must keep unchanged."""
        return {f.name: str(getattr(self, f.name)) for f in fields(self) if f.name not in RESUMABLE_CHANGES}

    def to_dict(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def pick_mask_token(tokenizer, vocab_size: int) -> tuple[str | None, int]:
    """An existing token for the MASK slots (the embedding is frozen, so no new row can be trained):
    a dedicated mask token if the tokenizer has one, else the first embedding row past the tokenizer's
    vocabulary (padding rows, as z-lab's Qwen3 drafts use), else a rarely used special token."""
    if tokenizer is not None:
        for token in MASK_CANDIDATES[:4]:
            if (i := tokenizer.token_to_id(token)) is not None and i < vocab_size:
                return token, i
        if tokenizer.vocab_size < vocab_size:
            return None, tokenizer.vocab_size
        for token in MASK_CANDIDATES[4:]:
            if (i := tokenizer.token_to_id(token)) is not None and i < vocab_size:
                return token, i
    raise BlockspecError(
        "train-draft: cannot pick a mask token: the target's tokenizer has no mask or spare token. Pass "
        "--mask-token-id with an existing, rarely used special token id (blockspec never adds new tokens).")


def make_draft_config(cfg: TrainConfig, target: ModelConfig, tokenizer,
                      init: Dflash2Config | None = None) -> DraftConfig:
    """Build the z-lab config.json content for the new draft (`init`: the --init draft's DFlash2 settings)
    and resolve it through the same validation every loaded draft goes through."""
    token, token_id = cfg.mask_token, cfg.mask_token_id
    if token_id is None and token is None:
        token, token_id = pick_mask_token(tokenizer, target.vocab_size)
    ids = cfg.target_layer_ids or default_target_layer_ids(target.num_hidden_layers, cfg.num_target_features)
    dflash: dict = {"target_layer_ids": list(ids), **dflash2_keys(cfg, init)}
    raw = {
        "architectures": [ARCHITECTURE2 if cfg.architecture == "dflash2" else "DFlashDraftModel"],
        "hidden_size": target.hidden_size,
        "num_hidden_layers": cfg.num_draft_layers, "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
        "intermediate_size": target.intermediate_size, "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta, "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "num_target_layers": target.num_hidden_layers, "block_size": cfg.block_size, "dflash_config": dflash,
    }
    token_to_id = tokenizer.token_to_id if tokenizer is not None else None
    # the mask token as given on the command line: a name the vocabulary lacks is refused, not ignored
    return resolve_draft_config(raw, target=target, source="train-draft arguments", token_to_id=token_to_id,
                                cli_mask_token=token, cli_mask_token_id=token_id)


@torch.no_grad()
def init_draft(draft: DFlashDraft, target: CausalLM, how: str, generator: torch.Generator) -> None:
    """'random': small normal weights, unit norms. 'target': draft layer i starts as target layer
    L-n+i (the top layers) and `fc` picks the last tapped feature, so an untrained draft already reads
    the deepest tapped hidden state as its context. Both: the final norm is the target's, scaled down."""
    for name, (layer, own_name, tensor) in model_tensors(draft).items():
        random = torch.randn(tensor.shape, generator=generator) * 0.02
        layer.load(own_name, torch.ones(tensor.shape) if "norm" in name else random)
    # The final norm feeds the shared LM head (often tied to the embedding), which turns unit-RMS states
    # into very large logits: an untrained draft would be confidently wrong (SmolLM2: loss 17 with the
    # target's norm, 70 with ones, ~9.4 at 0.3x), and Adam moves a weight only ~lr per step. Start soft.
    copy_layer(draft.norm, target.norm, FINAL_NORM_SCALE)
    if draft.config.dflash2 is not None:  # identity convolutions: the draft starts as its DFlash backbone
        for layer in draft.layers:
            layer.attention_conv.set_identity()
            layer.mlp_conv.set_identity()
        draft.candidate_selector.init_random(generator, SELECTOR_INIT_STD)
    if how != "target":
        return
    n, big_l, h = len(draft.layers), len(target.layers), draft.config.hidden_size
    if target.layers[0].input_layernorm.folded:
        raise ValueError("init 'target' needs the checkpoint's layers: "
                         "load the target without fold_norm_weights()")
    for i, layer in enumerate(draft.layers):
        src = target.layers[big_l - n + i]
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj",
                     "input_layernorm", "post_attention_layernorm"):
            copy_layer(layer.get_submodule(name), src.get_submodule(name))
        if src.self_attn.q_norm is not None:
            copy_layer(layer.self_attn.q_norm, src.self_attn.q_norm)
            copy_layer(layer.self_attn.k_norm, src.self_attn.k_norm)
    picks_last = torch.zeros(h, len(draft.config.target_layer_ids) * h)
    picks_last[:, -h:] = torch.eye(h)
    draft.fc.load("fc.weight", picks_last)
    copy_layer(draft.hidden_norm, draft.layers[0].input_layernorm)


def load_init_weights(folder: Path, mine: DraftConfig, target: ModelConfig, tokenizer,
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """--init FOLDER: the weights of an existing draft of the same shape. The block size may differ (the
    weights do not depend on it: a draft trained at 16 can be tuned for 4), and the draft may grow:
    extra layers are copies of its last layer with o_proj and down_proj zeroed, i.e. identity residual
    blocks, so the deeper draft starts out computing exactly what the old one did. A DFlash draft trained
    on as a DFlash2 one gets identity convolutions (the same hidden states) and a selector ~ N(0, 0.02)
    drawn from `seed`."""
    token_to_id = tokenizer.token_to_id if tokenizer else None
    old = load_draft(folder, target, torch.float32, torch.device("cpu"), token_to_id)
    theirs = old.config
    if mine.dflash2 is not None and theirs.dflash2 is None:
        old = dflash2_from(old, mine.dflash2, torch.Generator().manual_seed(seed), SELECTOR_INIT_STD)
        theirs = old.config
    for name in ("target_layer_ids", "mask_token_id", "num_hidden_layers", "has_embed_tokens", "dflash2"):
        if name == "num_hidden_layers" and mine.num_hidden_layers > theirs.num_hidden_layers:
            continue
        if getattr(mine, name) != getattr(theirs, name):
            raise BlockspecError(f"train-draft: {setting('init')} {folder} has {name}="
                                 f"{getattr(theirs, name)}, but this run trains {name}="
                                 f"{getattr(mine, name)}. Match the flags to that draft (see its "
                                 f"MODEL_CARD.md; it may be grown to more layers, not fewer), or start from "
                                 f"{setting('init')} target.")
    weights = old.state_dict()
    last = f"layers.{theirs.num_hidden_layers - 1}."
    for layer in range(theirs.num_hidden_layers, mine.num_hidden_layers):
        for key, value in list(weights.items()):
            if key.startswith(last):
                zero = key.endswith(("o_proj.weight", "down_proj.weight", "o_proj.bias", "down_proj.bias"))
                weights[f"layers.{layer}." + key[len(last):]] = (torch.zeros_like(value) if zero
                                                                 else value.clone())
    return weights


def resolve_train_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 where bf16 matmuls are fast (CUDA, CPUs with AMX / AVX512-BF16), else float32."""
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if has_fast_bf16(device) else torch.float32
