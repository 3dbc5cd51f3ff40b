"""A training run's checkpoint, OUTPUT/checkpoint/state.pt: the draft, optimizer and scheduler states, the
step, the history, the schedule and the RNG states, written atomically; a --resume continues one only with
the settings it was trained with (`TrainConfig.fingerprint`)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from blockspec.errors import BlockspecError, setting
from blockspec.train.config import TrainConfig


def state_path(cfg: TrainConfig) -> Path:
    """Where the run's checkpoint lives; one there must be resumed (--resume), and --resume needs one."""
    path = cfg.output / "checkpoint" / "state.pt"
    if path.is_file() and not cfg.resume:
        raise BlockspecError(f"{cfg.output} already holds a training checkpoint ({path}). Pass "
                             f"{setting('resume', 'resume=True')} to continue it, or choose another "
                             f"{setting('output')}.")
    if cfg.resume and not path.is_file():
        raise BlockspecError(f"{setting('resume', 'resume=True')}: {cfg.output} holds no training "
                             f"checkpoint (no {path}). Drop it to start a new run there, or point "
                             f"{setting('output')} at the run to continue.")
    return path


def write_state(path: Path, state: dict) -> None:
    """`state` and the RNG states, replacing the previous checkpoint only once written in full."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {**state, "rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def read_state(path: Path, cfg: TrainConfig) -> dict:
    """The checkpoint, checked against `cfg` before anything is prepared."""
    state = torch.load(path, map_location="cpu", weights_only=False)  # the RNG states are CPU tensors
    old, new = state["fingerprint"], cfg.fingerprint()
    default = {f.name: str(f.default) for f in fields(TrainConfig)}  # a field newer than the checkpoint
    diff = [f"{setting(k)}: {old.get(k, default[k])} -> {new[k]}" for k in new
            if old.get(k, default[k]) != new[k]]
    if diff:
        raise BlockspecError(f"{setting('resume', 'resume=True')}: the checkpoint in {path} was trained "
                             f"with other settings ({'; '.join(diff)}). Rerun with the original settings, or "
                             f"use a new {setting('output')}.")
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
