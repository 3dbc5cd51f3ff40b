"""What an `EngineConfig` asks to load, decided before any weight is read: the target's folder (the embedded
model's, converted once, by default), its config and the context length it allows, and the draft (the
shipped one for the embedded target unless told otherwise)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from blockspec.config import EngineConfig
from blockspec.errors import BlockspecError, DraftConfigError, setting
from blockspec.models.config import ModelConfig
from blockspec.models.default_model import ensure_default_model
from blockspec.paths import SHIPPED_DRAFT

log = logging.getLogger("blockspec")


@dataclass(frozen=True)
class ModelChoice:
    model_path: Path
    target_cfg: ModelConfig
    max_model_len: int
    draft_path: str | None  # None: plain decoding


def target_folder(cfg: EngineConfig) -> Path:
    # The embedded model's own GGUF blocks need only its config and tokenizer converted, not its weights.
    embedded = cfg.model_path is None
    return Path(cfg.model_path) if not embedded else ensure_default_model(
        weights=cfg.weight_blocks(embedded) is None)


def choose_models(cfg: EngineConfig) -> ModelChoice:
    model_path = target_folder(cfg)
    draft_path = cfg.draft_model_path
    if draft_path is None and cfg.model_path is None and cfg.speculative_algorithm != "NONE" \
            and SHIPPED_DRAFT.is_dir():
        draft_path = str(SHIPPED_DRAFT)
    if cfg.speculative_algorithm == "DFLASH" and draft_path is None:
        raise DraftConfigError(
            f"DFLASH speculative decoding requires a draft: pass {setting('draft_model_path')}, or use "
            f"{setting('speculative_algorithm')}=NONE for plain decoding.")
    if cfg.speculative_algorithm == "NONE" and draft_path is not None:
        log.warning("speculative_algorithm=NONE: ignoring draft_model_path=%s", draft_path)
        draft_path = None
    target_cfg = ModelConfig.from_folder(model_path)
    max_model_len = cfg.max_model_len or min(target_cfg.max_position_embeddings, 4096)
    if max_model_len > target_cfg.max_position_embeddings:
        raise BlockspecError(
            f"{setting('max_model_len')}={max_model_len} exceeds the target's "
            f"max_position_embeddings={target_cfg.max_position_embeddings}; lower it.")
    return ModelChoice(model_path, target_cfg, max_model_len, draft_path)
