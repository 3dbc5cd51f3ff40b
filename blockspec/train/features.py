"""Target features and labels: precomputed and cached on disk (`--features disk`), or computed by the
trainer per batch from sequences held in memory (`--features online`, `SequenceStore`).

One forward of the frozen target over a sequence yields both the draft's conditioning (the hidden
states after the `target_layer_ids` layers, concatenated; float16 on disk) and the labels (the
target's argmax next token at every position). A store is a folder of append-only shards
(`shard_NNNNN.{ids,labels,features,offsets,starts}.npy`, memory-mapped when read) plus meta.json,
keyed by target identity + layer ids + data source + sequence length + extraction dtype (one store
per source, so a new mix of sources reuses the ones already extracted; `responses:N` for any N shares
one store, its rows being a prefix of one growing cache), so a larger `--tokens`, a larger N or an
interrupted extraction continues where the last one stopped.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np
import torch
from tqdm import tqdm

from blockspec.layers.forward_batch import ForwardBatch
from blockspec.models.default_model import file_sha256
from blockspec.models.target import CausalLM
from blockspec.train.data import TrainSequence

FORMAT_VERSION = 1
T = TypeVar("T")
PARTS = ("ids", "labels", "features", "offsets", "starts")


def target_identity(target_path: Path) -> dict:
    """What makes two targets the same for feature and response caching: config.json and the weight
    files' contents (hashed: ~1.5 s for SmolLM2's 540 MB, once per run). Not mtimes: a re-made but
    identical checkpoint (e.g. the embedded model converted again) must keep its hours-long caches."""
    files = sorted(target_path.glob("*.safetensors"))
    return {"path": str(target_path.resolve()),
            "config": hashlib.sha256((target_path / "config.json").read_bytes()).hexdigest(),
            "weights": [(f.name, file_sha256(f)) for f in files]}


def cache_key(**fields) -> str:
    blob = json.dumps({"version": FORMAT_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@torch.inference_mode()
def target_features(
    target: CausalLM, seqs: list[TrainSequence], capture: tuple[int, ...], logit_rows: int = 128,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One batched causal forward (right padding never affects earlier positions) ->
    per sequence (features float16 [T, K*H], labels int32 [T]).

    Labels are the target's argmax at every position. On teacher-forced text that is the greedy
    continuation only while the text follows the target's own choices (the objective ignores block
    slots past the first disagreement); on on-policy responses (the target's own greedy output) the
    labels are the response's next tokens, which is exact."""
    longest = max(len(s.ids) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s.ids)] = torch.tensor(s.ids)
    hidden, feats = target(causal_batch(ids.to(target.device)), capture)
    argmax = greedy_labels(target, hidden, logit_rows)
    out = []
    for row, s in enumerate(seqs):
        n = len(s.ids)
        labels = argmax[row, :n].to(torch.int32).cpu().numpy()
        if s.on_policy:  # the response is the target's greedy output: its next tokens are the labels
            labels[s.start : n - 1] = np.asarray(s.ids[s.start + 1 :], dtype=np.int32)
        fp16 = feats[row, :n].clamp(-65504, 65504).to(torch.float16)  # rare massive activations: no inf
        out.append((fp16.cpu().numpy(), labels))
    return out


def causal_batch(ids: torch.Tensor) -> ForwardBatch:
    """A cache-free causal forward over whole sequences ids [b, t] from position 0 (right padding never
    reaches earlier positions)."""
    return ForwardBatch.standalone(
        ids, torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1))


def greedy_labels(target: CausalLM, hidden: torch.Tensor, logit_rows: int = 128) -> torch.Tensor:
    """The target's argmax next token at every position of hidden [b, t, H], `logit_rows` positions at a
    time (the full [b, t, vocab] logits of a batch would not fit)."""
    return torch.cat([target.logits(hidden[:, i : i + logit_rows]).argmax(-1)
                      for i in range(0, hidden.shape[1], logit_rows)], dim=1)


def leading(items: Iterable[T], length: Callable[[T], int], max_tokens: int | None,
            max_sequences: int | None) -> Iterator[T]:
    """The leading sequences a run capped at max_tokens / max_sequences uses (`length`: a sequence's tokens):
    each source stops at the sequence that reaches its share."""
    count, total = 0, 0
    for item in items:
        if ((max_sequences is not None and count >= max_sequences)
                or (max_tokens is not None and total >= max_tokens)):
            return
        count, total = count + 1, total + length(item)
        yield item


class FeatureStore:
    """Append-only, memory-mapped shards of (token ids, labels, features, anchor starts) per sequence."""

    def __init__(self, folder: Path, key_fields: dict) -> None:
        self.folder = folder
        self.meta_path = folder / "meta.json"
        if self.meta_path.is_file():
            self.meta = json.loads(self.meta_path.read_text())
        else:
            self.meta = {"key": key_fields, "shards": [], "exhausted": False}
        self._shards: list[dict[str, np.ndarray]] = []
        self._index: list[tuple[int, int]] = []  # sequence -> (shard, row)
        self._lengths: list[int] = []
        for i, _ in enumerate(self.meta["shards"]):
            self._open(i)

    @property
    def num_sequences(self) -> int:
        return len(self._index)

    @property
    def num_tokens(self) -> int:
        return sum(s["tokens"] for s in self.meta["shards"])

    @property
    def exhausted(self) -> bool:
        return bool(self.meta["exhausted"])

    def _path(self, shard: int, part: str) -> Path:
        return self.folder / f"shard_{shard:05d}.{part}.npy"

    def _open(self, shard: int) -> None:
        arrays = {p: np.load(self._path(shard, p), mmap_mode="r") for p in PARTS}
        self._shards.append(arrays)
        self._index.extend((shard, row) for row in range(len(arrays["starts"])))
        self._lengths.extend(np.diff(arrays["offsets"]).tolist())

    def _write_meta(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)  # a source with no held-out lines is exhausted empty
        tmp = self.meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.meta, indent=1))
        os.replace(tmp, self.meta_path)

    def append(self, items: list[tuple[TrainSequence, np.ndarray, np.ndarray]]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        shard = len(self.meta["shards"])
        lengths = [len(s.ids) for s, _, _ in items]
        arrays = {
            "ids": np.concatenate([np.asarray(s.ids, dtype=np.int32) for s, _, _ in items]),
            "labels": np.concatenate([labels for _, _, labels in items]),
            "features": np.concatenate([feats for _, feats, _ in items]),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "starts": np.asarray([s.start for s, _, _ in items], dtype=np.int32),
        }
        for part, array in arrays.items():
            np.save(self._path(shard, part), array)
        self.meta["shards"].append({"sequences": len(items), "tokens": int(sum(lengths))})
        self._write_meta()
        self._open(shard)

    def mark_exhausted(self) -> None:
        self.meta["exhausted"] = True
        self._write_meta()

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(ids int32 [T], labels int32 [T], features float16 [T, K*H] (memory-mapped), start)."""
        shard, row = self._index[index]
        a = self._shards[shard]
        lo, hi = int(a["offsets"][row]), int(a["offsets"][row + 1])
        return a["ids"][lo:hi], a["labels"][lo:hi], a["features"][lo:hi], int(a["starts"][row])

    def tokens_of(self, count: int) -> int:
        """Tokens in the first `count` sequences."""
        return int(sum(self._lengths[:count]))

    def prefix(self, max_tokens: int | None, max_sequences: int | None) -> int:
        """How many leading sequences a run capped at max_tokens / max_sequences uses."""
        return sum(1 for _ in leading(self._lengths, int, max_tokens, max_sequences))


class SequenceStore:
    """`--features online`: a source's leading token sequences held in memory, read like a FeatureStore
    but with no features; the trainer runs the target on each batch instead. Labels known without the
    target (an on-policy response's own next tokens) are filled in; the others are -1, meaning the
    target's argmax, which the trainer computes with the features."""

    def __init__(self, sequences: Iterator[TrainSequence], max_tokens: int | None,
                 max_sequences: int | None) -> None:
        self.sequences = list(leading(sequences, lambda seq: len(seq.ids), max_tokens, max_sequences))
        self._lengths = [len(seq.ids) for seq in self.sequences]

    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    def tokens_of(self, count: int) -> int:
        return int(sum(self._lengths[:count]))

    def prefix(self, max_tokens: int | None, max_sequences: int | None) -> int:
        return sum(1 for _ in leading(self._lengths, int, max_tokens, max_sequences))

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray, None, int]:
        """(ids int32 [T], labels int32 [T] with -1 where the target decides, None, start)."""
        seq = self.sequences[index]
        ids = np.asarray(seq.ids, dtype=np.int32)
        if seq.on_policy:  # its own next tokens (those before `start` and the last are never used)
            return ids, np.append(ids[1:], ids[-1]), None, seq.start
        return ids, np.full(len(ids), -1, dtype=np.int32), None, seq.start


def extract(
    store: FeatureStore, sequences: Iterator[TrainSequence], target: CausalLM, capture: tuple[int, ...],
    max_tokens: int | None, max_sequences: int | None, batch_size: int, desc: str, shard_sequences: int = 64,
) -> dict:
    """Extend `store` until it holds max_tokens tokens / max_sequences sequences or the data runs out.
    Returns {"tokens": newly extracted, "seconds": ..., "tokens_per_s": ...}."""
    sequences = itertools.islice(sequences, store.num_sequences, None)  # already stored: skip
    done_tokens, start_time = 0, time.perf_counter()

    def wanted() -> bool:
        return not store.exhausted and (max_tokens is None or store.num_tokens < max_tokens) and \
            (max_sequences is None or store.num_sequences < max_sequences)

    with tqdm(total=max_tokens, initial=store.num_tokens, desc=desc,
              unit="tok", unit_scale=True, disable=not wanted()) as bar:
        while wanted():
            room = shard_sequences if max_sequences is None else min(shard_sequences,
                                                                     max_sequences - store.num_sequences)
            chunk, tokens = [], store.num_tokens
            for seq in sequences:
                chunk.append(seq)
                tokens += len(seq.ids)
                if len(chunk) >= room or (max_tokens is not None and tokens >= max_tokens):
                    break
            if not chunk:
                store.mark_exhausted()
                break
            items = []
            for i in range(0, len(chunk), batch_size):
                part = chunk[i : i + batch_size]
                for seq, (feats, labels) in zip(part, target_features(target, part, capture)):
                    items.append((seq, feats, labels))
                bar.update(sum(len(s.ids) for s in part))
            store.append(items)
            done_tokens += sum(len(s.ids) for s in chunk)
    seconds = time.perf_counter() - start_time
    return {"tokens": done_tokens, "seconds": seconds,
            "tokens_per_s": done_tokens / seconds if seconds else 0.0}


class StoreSet:
    """The leading sequences of several stores (one per data source) as one indexable collection."""

    def __init__(self, parts: list[tuple[FeatureStore | SequenceStore, int]]) -> None:
        self.parts = parts
        self._index = [(p, row) for p, (_, count) in enumerate(parts) for row in range(count)]
        self.num_tokens = sum(store.tokens_of(count) for store, count in parts)

    def __len__(self) -> int:
        return len(self._index)

    def get(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int]:
        part, row = self._index[index]
        return self.parts[part][0].get(row)
