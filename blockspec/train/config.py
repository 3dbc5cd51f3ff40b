"""Training configuration: every `train-draft` setting, validated when constructed (the DFlash2 selector's
flags included), and the training dtype. The draft a run trains is built from it in new_draft.py."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from blockspec.device import has_fast_bf16
from blockspec.errors import BlockspecError, setting
from blockspec.paths import draft_folder

SAVE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Fields that may change between a run and its --resume (they do not affect the trained weights).
RESUMABLE_CHANGES = {"output", "resume", "save_every", "eval_every", "stop_after_steps", "device",
                     "cache_dir", "command", "extract_batch_size", "gen_batch_size", "time_budget"}
FEATURES = ("auto", "disk", "online")
ARCHITECTURES = ("dflash", "dflash2")


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


def check_architecture(cfg: TrainConfig) -> None:
    """--architecture and the selector flags, which only a DFlash2 draft takes; sets the default alpha."""
    if cfg.architecture not in ARCHITECTURES:
        raise BlockspecError(f"train-draft: {setting('architecture')}={cfg.architecture!r}; "
                             f"use one of {', '.join(ARCHITECTURES)}.")
    given = [name for name in ("selector_rank", "selector_top_k", "selector_alpha", "selector_lr_scale")
             if getattr(cfg, name) is not None]
    if cfg.architecture == "dflash" and given:
        raise BlockspecError(f"train-draft: {setting(given[0])} applies to DFlash2 drafts only; pass "
                             f"{setting('architecture')} dflash2, or drop it.")
    if cfg.architecture == "dflash2":
        alpha = 1.0 if cfg.selector_alpha is None else cfg.selector_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha < math.inf:
            raise BlockspecError(f"train-draft: {setting('selector_alpha')}={alpha!r} must be a number "
                                 f">= 0 (the selector loss's weight; 0 trains the backbone only).")
        cfg.selector_alpha = float(alpha)
        scale = 1.0 if cfg.selector_lr_scale is None else cfg.selector_lr_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
            raise BlockspecError(f"train-draft: {setting('selector_lr_scale')}={scale!r} must be a number "
                                 f"> 0 (the selector's learning rate is --lr times it).")
        cfg.selector_lr_scale = float(scale)


def resolve_train_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 where bf16 matmuls are fast (CUDA, CPUs with AMX / AVX512-BF16), else float32."""
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if has_fast_bf16(device) else torch.float32
