"""Exact prefix caching: the K/V one request computed, reused by the next that starts with the same tokens.

The engine keeps one KV slab per slot (docs/architecture.md), so the cache is made of slots too, as
llama.cpp's server slots are. A request that finishes hands its slot over as an `Entry`: the token ids
whose K/V its target slab holds (its committed context: never the pending token, nor rows a step wrote
past a stop), how many of them the draft's slab holds, and the target features of the rest, which the
draft was not fed yet (`Sequence.unfed_features`). A request is admitted with the longest prefix it
shares with an entry or with a running request (engine/prefix_reuse.py): it takes the entry's slot over
(no copy), or has the shared rows copied into its own slot, target and draft alike, and prefills only the
rest. So a hit costs neither the target's prefill nor the draft's injection of the shared part. The CPU
kernels being batch- and chunk-invariant (a token's K/V are the same bits whichever prefill chunk or decode
step computed them), a hit holds the very K/V a miss computes, so the output is the same, bit for bit.

Entries hold slots no request holds and count against the KV token budget; whenever a request needs a
slot or budget, they go least recently used first (`evict_lru`), so the cache never makes a request
wait or fail that would have run without it. A running request's rows are its own slot's, which no
eviction touches; a request copying from another reads rows that never change while their owner runs
(committed rows), at once or, behind a request still prefilling the same prefix, step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.engine.slots import SlotPool


@dataclass(eq=False)
class Prefix:
    """What a slot holds: the target K/V of tokens[:ready], the draft's context K/V of
    tokens[:draft_ready], and the target features of positions draft_ready..ready-1 (the draft's
    backlog); a slot filled by plain decoding has no draft context (draft_ready 0, no features)."""

    slot: int
    tokens: list[int]
    ready: int
    draft_ready: int
    features: list[torch.Tensor]

    def usable(self, shared: int, speculative: bool) -> int:
        """How many of `shared` leading tokens a request can take from here: a DFlash request needs the
        draft's context (or its features) for each of them too."""
        if speculative:
            return min(shared, self.ready, self.draft_ready + len(self.features))
        return min(shared, self.ready)


@dataclass(eq=False)
class Entry(Prefix):
    """A finished request's slot, kept (ready == len(tokens))."""

    last_use: int = 0


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of a and b, at most `limit` (64 ids compared at a time)."""
    n = min(len(a), len(b), limit)
    i = 0
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The entries, least recently used first out, and the counters the server exports."""

    def __init__(self, pool: SlotPool, bytes_per_token: int, enabled: bool = True) -> None:
        self.pool, self.bytes_per_token, self.enabled = pool, bytes_per_token, enabled
        self.entries: dict[int, Entry] = {}  # slot -> its entry
        self._clock = 0  # a logical clock: ranks under tensor parallelism evict alike
        self.hit_tokens = 0  # prompt tokens whose K/V came from the cache
        self.miss_tokens = 0  # prompt tokens prefilled (computed)
        self.evictions = 0

    @property
    def tokens(self) -> int:
        return sum(entry.ready for entry in self.entries.values())

    @property
    def nbytes(self) -> int:
        """Memory the entries' rows and features hold."""
        features = sum(f.numel() * f.element_size() for e in self.entries.values() for f in e.features)
        return self.tokens * self.bytes_per_token + features

    @property
    def hit_rate(self) -> float:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0

    def touch(self, entry: Entry) -> None:
        self._clock += 1
        entry.last_use = self._clock

    def insert(self, prefix: Prefix) -> None:
        """Keep a slot's content as an entry. An entry it extends goes (the new one serves every request the
        old one did); if an entry already holds all of it, the slot is freed instead."""
        if prefix.ready == 0:
            self.pool.free(prefix.slot)
            return
        for entry in list(self.entries.values()):
            shared = common_prefix(entry.tokens, prefix.tokens, prefix.ready)
            if shared == prefix.ready and entry.usable(shared, True) >= prefix.usable(shared, True):
                self.touch(entry)
                self.pool.free(prefix.slot)
                return
            if shared == entry.ready and prefix.usable(shared, True) >= entry.usable(shared, True):
                self._drop(entry)
        # The features are views of whole verify passes' outputs: one compact copy keeps only these rows.
        features = list(torch.stack(prefix.features).unbind(0)) if prefix.features else []
        entry = Entry(prefix.slot, prefix.tokens[: prefix.ready], prefix.ready, prefix.draft_ready, features)
        self.entries[entry.slot] = entry
        self.touch(entry)

    def take(self, entry: Entry) -> int:
        """A request takes the entry's slot over (its rows become the request's); returns the slot."""
        del self.entries[entry.slot]
        return entry.slot

    def relocate(self, entry: Entry, slot: int) -> None:
        """The entry's rows moved to `slot` (compaction)."""
        del self.entries[entry.slot]
        entry.slot = slot
        self.entries[slot] = entry

    def evict_lru(self, keep: Entry | None = None) -> bool:
        """Free the least recently used entry's slot (never `keep`'s); False if there is none."""
        candidates = [e for e in self.entries.values() if e is not keep]
        if not candidates:
            return False
        self._drop(min(candidates, key=lambda e: e.last_use))
        self.evictions += 1
        return True

    def trim(self, room: int) -> None:
        """Evict until the entries hold at most `room` tokens (the KV budget the running requests leave)."""
        while self.entries and self.tokens > max(room, 0):
            self.evict_lru()

    def clear(self) -> None:
        for entry in list(self.entries.values()):
            self._drop(entry)

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry.slot]
        self.pool.free(entry.slot)
