"""What a training run reads of its prepared data: which sequences a step takes (a function of (seed, step)
alone, so a resumed run continues exactly as an uninterrupted one would), those sequences as padded CPU
tensors, and the labels' token counts (`--train-vocab`)."""

from __future__ import annotations

import numpy as np
import torch


class Batches:
    def __init__(self, stores: dict, batch_size: int, seed: int, online: bool) -> None:
        """`stores`: the "train" and "eval" sequence stores (prepare.py); `online`: no features on disk."""
        self.stores, self.batch_size, self.seed, self.online = stores, batch_size, seed, online
        self._perms: dict[int, torch.Tensor] = {}

    def get(self, split: str, indices: list[int]) -> tuple:
        """(ids, labels, fp16 features or None when online) as CPU tensors padded to the longest row,
        lengths, starts. Reading the memory-mapped features is disk-bound once the stores outgrow the page
        cache, so the trainer loads the next step's batch in a background thread while this step computes."""
        rows = [self.stores[split].get(i) for i in indices]
        lengths, starts = [len(r[0]) for r in rows], [r[3] for r in rows]
        t = max(lengths)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        labels = torch.zeros(len(rows), t, dtype=torch.long)
        feats = None if self.online else torch.zeros(len(rows), t, rows[0][2].shape[1], dtype=torch.float16)
        for i, (x, y, f, _) in enumerate(rows):  # copies out of the read-only memory maps
            ids[i, : len(x)] = torch.from_numpy(x.astype(np.int64))
            labels[i, : len(x)] = torch.from_numpy(y.astype(np.int64))
            if feats is not None:
                feats[i, : len(x)] = torch.from_numpy(np.array(f))
        return ids, labels, feats, lengths, starts

    def indices(self, step: int) -> list[int]:
        """Sequences of `step`: consecutive slices of per-epoch permutations seeded by (seed, epoch)."""
        n, out = len(self.stores["train"]), []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch = i // n
            if epoch not in self._perms:
                self._perms = {epoch: torch.randperm(n, generator=torch.Generator().manual_seed(
                    self.seed * 7919 + epoch))}
            out.append(int(self._perms[epoch][i % n]))
        return out


def label_counts(store, vocab_size: int) -> torch.Tensor:
    """How often each token is a label in the store's trained positions (online, a label the target decides
    is counted as the text's next token)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in range(len(store)):
        ids, labels, _, start = store.get(i)
        labels = np.where(labels >= 0, labels, np.append(ids[1:], ids[-1]))
        counts += np.bincount(labels[start:].astype(np.int64), minlength=vocab_size)
    return torch.from_numpy(counts)
