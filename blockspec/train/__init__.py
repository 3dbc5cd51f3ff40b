"""DFlash draft training: `train(TrainConfig(...))` or `blockspec train-draft` (see trainer.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blockspec.train.config import TrainConfig

__all__ = ["TrainConfig", "train"]


def __getattr__(name: str) -> Any:
    if name == "TrainConfig":  # torch: imported on first use, not by the command line's parser
        from blockspec.train.config import TrainConfig

        return TrainConfig
    raise AttributeError(f"module 'blockspec.train' has no attribute {name!r}")


def train(cfg: TrainConfig) -> dict:
    from blockspec.train.trainer import train as _train

    return _train(cfg)
