"""Training data, before the first step: the target's on-policy responses (generated once and cached on
disk) and, with `--features disk`, one target-feature store per (source, split), so a new mix of sources
reuses every source already extracted; with `--features online`, the sequences alone, in memory.
--tokens is shared out evenly, finite sources (responses, jsonl) first and what they leave over going to
the rest. The held-out split uses the on-policy responses when the data has them (exact greedy labels),
else every source's held-out split.
"""

from __future__ import annotations

from pathlib import Path

import torch

from blockspec.device import resolve_dtype
from blockspec.home import blockspec_home
from blockspec.models.loader import load_target
from blockspec.models.target import CausalLM
from blockspec.train import data as D
from blockspec.train.config import TrainConfig
from blockspec.train.features import (FeatureStore, SequenceStore, StoreSet, cache_key, extract,
                                      target_identity)

CORPORA = ("stdlib", "pydoc")


def prepare_stores(
    cfg: TrainConfig, spec: D.DataSpec, target_path: Path, tokenizer, capture: tuple[int, ...],
    device: torch.device, stats: dict, online: bool = False,
) -> tuple[CausalLM, dict[str, StoreSet]]:
    """(the loaded target, {"train": StoreSet, "eval": StoreSet}); extraction figures and the share of
    each source used go into `stats` (for the model card). `online`: the sequences only, in memory
    (the trainer computes their features per batch)."""
    tdtype = resolve_dtype(cfg.dtype, device)
    root = cfg.cache_dir or blockspec_home() / "train-cache"
    ident = target_identity(target_path)
    responses = {source: _responses(cfg, source, root, ident, target_path, str(tdtype), device)
                 for source in spec.sources if source.startswith("responses:")}
    target = load_target(target_path, tdtype, device)
    order = sorted(spec.sources, key=lambda source: source in CORPORA)
    eval_sources = [s for s in order if s in responses] or order
    stores = {}
    for split, heldout, sources in (("train", False, order), ("eval", True, eval_sources)):
        parts, budget = [], cfg.tokens if split == "train" else cfg.eval_seqs
        rows = {k: v[heldout] for k, v in responses.items()}
        for i, source in enumerate(sources):
            share = None if budget is None else max(1, budget // (len(sources) - i))
            # The rows of responses:N are the first N of one growing cache: its store is keyed without N
            # and capped at those rows' sequences, so a larger N extracts only the new rows.
            args = (source, tokenizer, cfg.seq_len, cfg.seed, heldout, rows)
            cap = sum(1 for _ in D.source_sequences(*args)) if source in rows else None
            fields = dict(target=ident, layer_ids=list(capture),
                          data=["responses" if cap is not None else source],
                          seq_len=cfg.seq_len, seed=cfg.seed, dtype=str(tdtype), split=split,
                          response_tokens=cfg.response_tokens)
            if split == "train":
                limit = (share, cap)
            else:
                limit = (None, share if cap is None else min(share, cap))
            if online:
                store = SequenceStore(D.source_sequences(*args), *limit)
                got = {"tokens": 0}
            else:
                store = FeatureStore(root / "features" / cache_key(**fields), fields)
                got = extract(store, D.source_sequences(*args), target, capture, *limit,
                              cfg.extract_batch_size, desc=f"target features ({source}, {split})")
            if got["tokens"]:
                done = stats.setdefault(f"extract_{split}", {"tokens": 0, "seconds": 0.0})
                done["tokens"] += got["tokens"]
                done["seconds"] += got["seconds"]
                done["tokens_per_s"] = done["tokens"] / max(done["seconds"], 1e-9)
            count = store.prefix(*limit)
            parts.append((store, count))
            if split == "train":  # --tokens may use only part of a source: the model card says how much
                stats.setdefault("sources", {})[source] = {"sequences": count,
                                                           "tokens": store.tokens_of(count)}
            if budget is not None:
                budget -= store.tokens_of(count) if split == "train" else count
        stores[split] = StoreSet(parts)
    return target, stores


def _responses(cfg: TrainConfig, source: str, root: Path, ident: dict, target_path: Path, tdtype: str,
               device: torch.device) -> dict[bool, list[dict]]:
    """On-policy responses for a "responses:N" source: N for training (held-out False) and
    eval_seqs // 2 to prompts from the held-out modules (held-out True), generated once and cached."""
    key = cache_key(target=ident, seed=cfg.seed, seq_len=cfg.seq_len, dtype=tdtype,
                    response_tokens=cfg.response_tokens)
    counts = {False: int(source.split(":")[1]), True: max(1, cfg.eval_seqs // 2)}
    return {heldout: D.ensure_responses(
        root / "responses" / f"{key}-{'eval' if heldout else 'train'}.jsonl", target_path, count, heldout,
        cfg.seq_len, cfg.response_tokens, cfg.seed, device, cfg.dtype, cfg.gen_batch_size)
        for heldout, count in counts.items()}
