"""DFlash draft training: `train(TrainConfig(...))` or `blockspec train-draft` (see trainer.py)."""

from blockspec.train.config import TrainConfig

__all__ = ["TrainConfig", "train"]


def train(cfg: TrainConfig) -> dict:
    from blockspec.train.trainer import train as _train

    return _train(cfg)
