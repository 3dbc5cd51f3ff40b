"""`ModelRunner`: owns the target, the draft and their KV caches, and runs every forward pass for a batch
of sequences: prefill chunks, the target's verify pass (a plain decode step is a verify pass of one
token), the draft's block pass and its context injection. What a step verifies and what it keeps is
decided above it (blockspec/speculative/).

Everything is batched: one pass for all rows, each row at its own cache length (rows need no padding:
the scratch rows past a row's commit point are overwritten before anything attends to them).
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch

from blockspec.engine.prefix_cache import Entry, PrefixCache
from blockspec.engine.sampler import next_token
from blockspec.engine.sequence import Sequence
from blockspec.engine.slots import SlotPool
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache
from blockspec.layers.selector import Walk, walk
from blockspec.models.dflash2 import lattice
from blockspec.models.draft import DFlashDraft
from blockspec.models.target import CausalLM

log = logging.getLogger("blockspec.engine")
T = TypeVar("T")


def slots(seqs: list[Sequence]) -> list[int]:
    return [s.slot for s in seqs]


def guarded(seq: Sequence, work: Callable[[], T]) -> T | None:
    """Run one request's own share of a step (its sampling, its acceptance); a fault there fails that
    request alone (`Sequence.fail`) and returns None, and the batch carries on without it."""
    try:
        return work()
    except Exception as exc:  # noqa: BLE001 - whatever it was, it must not take its neighbours down
        log.exception("request %d failed", seq.seq_id)
        seq.fail(f"{type(exc).__name__}: {exc}")
        return None


class ModelRunner:
    def __init__(self, target: CausalLM, draft: DFlashDraft | None, num_slots: int, max_len: int,
                 prefill_chunk: int = 512, prefix_caching: bool = False) -> None:
        """`prefix_caching`: schedulers keep finished requests' slots as prefix-cache entries
        (engine/prefix_cache.py) unless they say otherwise."""
        self.target, self.draft = target, draft
        self.max_len, self.prefill_chunk = max_len, prefill_chunk
        self.pool = SlotPool(num_slots)
        self.target_cache = KVCache.for_model(target, num_slots, max_len)
        self.draft_cache = KVCache.for_model(draft, num_slots, max_len) if draft is not None else None
        self.capture = tuple(draft.config.target_layer_ids) if draft is not None else ()
        token_bytes = sum(c.token_bytes for c in (self.target_cache, self.draft_cache) if c is not None)
        self.prefix_cache = PrefixCache(self.pool, token_bytes, prefix_caching)
        self.device = target.device
        self.tp = target.tp  # tensor parallelism's group (None: one rank)
        if draft is not None and draft.embed_tokens is None:
            draft.use_target_embedding(target.embed_tokens)
        target.lm_head.choose_greedy_form()

    # ---- slots --------------------------------------------------------------------------------------
    @property
    def slots_available(self) -> int:
        """Slots a request can have: free ones and prefix-cache entries' (evicted for it)."""
        return self.pool.num_free + len(self.prefix_cache.entries)

    def take_slot(self, keep: Entry | None = None) -> int:
        """The lowest free slot, or else the least recently used cache entry's (never `keep`'s)."""
        if not self.pool.num_free:
            self.prefix_cache.evict_lru(keep)
        return self.pool.allocate()

    def admit(self, seq: Sequence) -> None:
        seq.slot = self.take_slot()

    def release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.pool.free(seq.slot)
            seq.slot = -1
        seq.unfed_features.clear()  # its draft cache is gone; a resumed request is prefilled again

    @torch.inference_mode()
    def compact(self, seqs: list[Sequence]) -> None:
        """Move sequences holding a slot >= len(seqs) into the free slots below, so the running slots are
        0..len(seqs)-1 and a slot-ordered batch reads its K/V as a view, not a gather of every row per
        layer per step. Costs one copy of a moved sequence's K/V, once, when a sequence below it leaves."""
        caches = [cache for cache in (self.target_cache, self.draft_cache) if cache is not None]
        for seq in seqs:
            if seq.slot < len(seqs):
                continue
            low = self.pool.lowest_free
            if low is not None and low < len(seqs):
                slot = self.pool.allocate()  # the lowest free slot, below len(seqs)
                for cache in caches:
                    cache.move(seq.slot, slot, seq.num_cached)
                self.pool.free(seq.slot)
                seq.slot = slot
                continue
            # A cache entry holds the slot below: the two trade places (the entry's rows move up).
            entry = min((e for e in self.prefix_cache.entries.values() if e.slot < len(seqs)),
                        key=lambda e: e.slot, default=None)
            if entry is not None:
                for cache in caches:
                    cache.swap(seq.slot, entry.slot, seq.num_cached, entry.ready)
                slot = entry.slot
                self.prefix_cache.relocate(entry, seq.slot)
                seq.slot = slot

    # ---- forward passes -------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], chunks: list[list[int]], capture: bool) -> torch.Tensor:
        """One prompt chunk per sequence in one forward, at positions seq.num_cached onwards; rows are
        right-padded to the longest chunk (the padding writes scratch rows past each sequence's length,
        which its next forward overwrites before anything attends to them, as with a rejected draft tail).
        `capture`: inject the chunk's context into the draft too. Advances num_cached and returns the last
        layer's hidden state at each row's last real token [b, H] (`first_tokens` turns it into a token).
        The caller keeps every row's num_cached + padded width within max_len."""
        width = max(len(c) for c in chunks)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=self.device)
        for row, chunk in enumerate(chunks):
            ids[row, : len(chunk)] = torch.tensor(chunk, device=self.device)
        starts = [s.num_cached for s in seqs]
        hidden, features = self.target_pass(seqs, ids, capture)
        if capture:
            self.inject(seqs, features, starts)
        for seq, chunk in zip(seqs, chunks):
            seq.num_cached += len(chunk)
        last = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        return hidden[torch.arange(len(seqs), device=self.device), last]

    @torch.inference_mode()
    def first_tokens(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """Emit each sequence's first token from the hidden state of its last prompt token [b, H]."""
        for seq, out in zip(seqs, self.target_choices(seqs, hidden)):
            if not seq.needs_logits:  # `out` is already the greedy token id
                seq.emit([int(out)])
                continue
            token = guarded(seq, lambda: next_token(out, seq.params, seq.seed, seq.next_position))
            if token is not None:
                seq.emit([token], logits=out.unsqueeze(0))

    def target_pass(self, seqs: list[Sequence], tokens: torch.Tensor, capture: bool,
                    parents: list[tuple[int, ...]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's causal pass over tokens [b, w] at each row's positions num_cached.., writing their
        K/V: last-layer hidden states [b, w, H] and, with `capture`, the draft's features [b, w, K*H].
        With `parents` a row's tokens are a tree (`ForwardBatch.tree`; a chain is a tree too)."""
        starts, rows = [s.num_cached for s in seqs], slots(seqs)
        batch = (ForwardBatch.in_cache(self.target_cache, rows, starts, tokens) if parents is None
                 else ForwardBatch.tree(self.target_cache, rows, starts, tokens, parents))
        return self.target(batch, self.capture if capture else ())

    def keep_paths(self, seqs: list[Sequence], paths: list[list[int]]) -> None:
        """After a tree's verify pass: move each row's accepted nodes' K/V (nodes `paths[row]`, written at
        rows num_cached + node) to consecutive rows num_cached + 1.., where decoding goes on from."""
        for seq, path in zip(seqs, paths):
            if path != list(range(1, len(path) + 1)):  # a chain's path is already in place
                start = seq.num_cached
                self.target_cache.move_rows(seq.slot, [start + node for node in path], start + 1)

    def target_choices(self, seqs: list[Sequence], hidden: torch.Tensor) -> list[torch.Tensor]:
        """Per row of hidden [b, ..., H] (last layer, before the final norm): the target's greedy token ids
        [...] (on the CPU), or its fp32 logits [..., V] for a request that needs them (`needs_logits`)."""
        greedy = [row for row, s in enumerate(seqs) if not s.needs_logits]
        sampled = [row for row, s in enumerate(seqs) if s.needs_logits]
        out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        if greedy:
            choices = self.target.greedy(hidden[greedy]).cpu()  # one device sync for the batch, not per row
            for i, row in enumerate(greedy):
                out[row] = choices[i]
        if sampled:
            logits = self.target.logits(hidden[sampled])
            for i, row in enumerate(sampled):
                out[row] = logits[i]
        return out

    def draft_proposals(self, seqs: list[Sequence], block: torch.Tensor) -> torch.Tensor:
        """The draft's proposals [b, B-1] for blocks [bonus, MASK...] [b, B] at each row's num_cached: its
        hidden states scored by the target's LM head (over the draft's vocabulary, if it has one); a
        DFlash2 draft's greedy walk through its candidates."""
        if self.draft.config.dflash2 is not None:
            return self.draft_walk(seqs, block).tokens
        hidden = self.draft_hidden(seqs, block)
        best = self.target.lm_head.propose(hidden.reshape(-1, hidden.shape[-1]), self.draft.vocab)
        return best.view(hidden.shape[:2])

    def draft_ranking(self, seqs: list[Sequence], block: torch.Tensor,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As `draft_proposals`, but each position's k best tokens and their log-probabilities under the
        draft: ([b, B-1, k], [b, B-1, k]), best first (a tree's material, tree.py)."""
        hidden = self.draft_hidden(seqs, block)
        logprobs, ids = self.target.lm_head.ranked(hidden.reshape(-1, hidden.shape[-1]), k, self.draft.vocab)
        return logprobs.view(*hidden.shape[:2], k), ids.view(*hidden.shape[:2], k)

    def draft_walk(self, seqs: list[Sequence], block: torch.Tensor, temperatures: torch.Tensor | None = None,
                   uniforms: torch.Tensor | None = None) -> Walk:
        """A DFlash2 draft's walk from each block's pending token through its candidates (models/dflash2.py):
        greedy rows (temperature 0, or None for all), and rows drawn at temperatures [b] with uniforms
        [b, B-1]; tokens [b, B-1], candidates and the proposal distribution q [b, B-1, K]."""
        return walk(*self.draft_lattice(seqs, block), temperatures, uniforms)

    def draft_lattice(self, seqs: list[Sequence], block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A DFlash2 draft's edge scores [b, B-1, K, K] and candidate ids [b, B-1, K] after each block's
        pending token (models/dflash2.py): a walk's or a selector tree's material."""
        return lattice(self.draft, self.target.lm_head, self.draft_hidden(seqs, block), block[:, 0])

    def draft_hidden(self, seqs: list[Sequence], block: torch.Tensor) -> torch.Tensor:
        """The draft's last hidden states at a block's drafted positions [b, B-1, H]."""
        batch = ForwardBatch.in_cache(self.draft_cache, slots(seqs), [s.num_cached for s in seqs], block,
                                      among_new="all")
        return self.draft(batch)[:, 1:]

    def feed_draft(self, seqs: list[Sequence]) -> None:
        """Inject every row's unfed target features into the draft's cache (the draft catches up on what
        plain and lookup steps committed): one pass per distinct backlog length (usually one: a batch takes
        plain steps together)."""
        by_length: dict[int, list[Sequence]] = {}
        for seq in seqs:
            if seq.unfed_features:
                by_length.setdefault(len(seq.unfed_features), []).append(seq)
        for n, group in by_length.items():
            features = torch.stack([torch.stack(s.unfed_features) for s in group])  # [g, n, K*H]
            self.inject(group, features, [s.num_cached - n for s in group])
            for seq in group:
                seq.unfed_features.clear()

    def inject(self, seqs: list[Sequence], features: torch.Tensor, starts: list[int]) -> None:
        """Write the draft's context K/V for target features [b, n, K*H] at positions starts[i].. ."""
        batch = ForwardBatch.in_cache(self.draft_cache, slots(seqs), starts, num_new=features.shape[1])
        self.draft.inject(features, batch)
