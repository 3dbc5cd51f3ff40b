"""A scheduler's side of the prefix cache (engine/prefix_cache.py): what an admitted request reuses, and
what a finished one leaves behind.

At admission a request gets the longest prefix of its ids that a cache entry or another running request
of the scheduler holds (`find_match`): it takes an entry's slot over when it keeps at least as much of the
entry as it overwrites (or no other slot is to be had), otherwise the rows are copied into a slot of its
own. Requests with one system prompt that arrive together share it as it is computed: the younger ones
wait for the oldest to prefill it (it goes first in prefill order anyway) and copy its rows step by step
(`pull`), then prefill only their own part. When a request finishes, its slot becomes an entry; one that
failed is not kept (its rows may be half-written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.engine.prefix_cache import Entry, Prefix, common_prefix
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence


@dataclass
class Match:
    source: Prefix | None  # where the reused rows are (None: nothing to reuse)
    length: int  # the request's reusable prefix now (rows 0..length-1)
    wait: bool = False  # a request ahead of it in prefill is computing more of its prefix


@dataclass
class Source:
    """A candidate for `find_match`: a slot's content and the tokens it will hold: for a request
    prefilling ahead of the one matched (`leads`), its whole prefill; otherwise what it holds now."""

    prefix: Prefix
    eventual: int
    leads: bool = False


def find_match(ids: list[int], start: int, sources: list[Source], speculative: bool) -> Match:
    """The longest prefix of `ids` beyond `start` (rows the request already holds) that a source holds
    now, and whether a request prefilling ahead of it, not behind it, will hold more. The last token of
    `ids` is never reused: its forward gives the logits of the request's first token. Ties go to the
    first source."""
    shared = [common_prefix(ids, source.prefix.tokens, len(ids) - 1) for source in sources]
    best, length = None, start
    for source, n in zip(sources, shared):
        if source.prefix.usable(n, speculative) > length:
            best, length = source.prefix, source.prefix.usable(n, speculative)
    wait = any(s.leads and s.prefix.ready >= length and min(n, s.eventual) > length
               for s, n in zip(sources, shared))
    return Match(best, length, wait)


def prefill_order(seq: Sequence) -> tuple[float, int]:
    """The order requests prefill in: oldest first."""
    return seq.arrival_time, seq.seq_id


class PrefixReuse:
    """`enabled` False: nothing is reused or kept (the scheduler still evicts entries when it needs room).
    The running requests and their prefill ids (`prefill_ids`: seq_id -> ids, for those still
    prefilling) are the scheduler's."""

    def __init__(self, runner: ModelRunner, speculative: bool, enabled: bool,
                 prefill_ids: dict[int, list[int]]) -> None:
        self.runner, self.cache = runner, runner.prefix_cache
        self.speculative, self.enabled, self.prefill_ids = speculative, enabled, prefill_ids
        self.awaiting: set[int] = set()  # prefilling requests waiting on one ahead to compute their prefix

    def place(self, seq: Sequence, ids: list[int], running: list[Sequence]) -> None:
        """Give an admitted request a slot and the longest prefix of `ids` there is to reuse."""
        seq.num_cached = seq.cached_tokens = 0
        match = find_match(ids, 0, self.sources(seq, running), self.speculative) if self.enabled else None
        entry = match.source if match is not None and isinstance(match.source, Entry) else None
        others = self.runner.pool.num_free + len(self.cache.entries) - 1
        if entry is not None and (entry.ready - match.length <= match.length or others == 0):
            seq.slot = self.cache.take(entry)
        else:
            seq.slot = self.runner.take_slot(keep=entry)
        if match is not None:
            self.reuse(seq, match)

    def pull(self, seq: Sequence, running: list[Sequence]) -> bool:
        """A request waiting on one ahead of it takes the rows there are now; returns whether it goes on
        waiting (and prefills nothing this step)."""
        if seq.seq_id not in self.awaiting:
            return False
        match = find_match(self.prefill_ids[seq.seq_id], seq.num_cached, self.sources(seq, running),
                           self.speculative)
        self.reuse(seq, match)
        return match.wait

    def reuse(self, seq: Sequence, match: Match) -> None:
        if match.source is not None:
            if isinstance(match.source, Entry):
                self.cache.touch(match.source)
            self.copy(seq, match.source, match.length)
        if match.wait:
            self.awaiting.add(seq.seq_id)
        else:
            self.awaiting.discard(seq.seq_id)

    def leave(self, seq: Sequence) -> None:
        """A finished request's slot: kept as a cache entry, or freed."""
        self.awaiting.discard(seq.seq_id)
        if self.enabled and seq.finish_reason != "error" and seq.slot >= 0:
            self.cache.insert(self.held(seq))
            seq.slot = -1
            seq.unfed_features.clear()
        else:
            self.runner.release(seq)

    @torch.inference_mode()
    def copy(self, seq: Sequence, source: Prefix, end: int) -> None:
        """Give a request rows seq.num_cached..end-1 of `source`: copied into its slot (unless it holds the
        source's slot), the target's and, for DFlash, the draft's; the draft context the source lacks comes
        as a backlog of features, fed at once (the request's prefill goes on injecting from `end`)."""
        runner, start = self.runner, seq.num_cached
        if source.slot != seq.slot:
            runner.target_cache.copy(source.slot, seq.slot, start, end)
            if self.speculative and start < min(end, source.draft_ready):
                runner.draft_cache.copy(source.slot, seq.slot, start, min(end, source.draft_ready))
        seq.num_cached = end
        seq.cached_tokens += end - start
        self.cache.hit_tokens += end - start
        if self.speculative and end > source.draft_ready:
            first = max(start, source.draft_ready) - source.draft_ready
            seq.unfed_features += source.features[first : end - source.draft_ready]
            runner.feed_draft([seq])  # the backlog ends at num_cached

    def sources(self, seq: Sequence, running: list[Sequence]) -> list[Source]:
        """What a request may reuse: cache entries (first: taking one over copies nothing), then the other
        running requests' slots; one prefilling ahead of it also as far as it will compute."""
        sources = [Source(entry, entry.ready) for entry in self.cache.entries.values()]
        for other in running:
            if other is not seq and not other.finished and other.slot >= 0:
                held, ids = self.held(other), self.prefill_ids.get(other.seq_id)
                leads = ids is not None and prefill_order(other) < prefill_order(seq)
                sources.append(Source(held, len(ids) if leads else held.ready, leads))
        return sources

    def held(self, seq: Sequence) -> Prefix:
        """What a request's slot holds: its context's K/V as far as computed (rows a step wrote past a stop
        are not its context) and, with DFlash, the draft's context but for its backlog of features."""
        ids = self.prefill_ids.get(seq.seq_id)
        context = ids if ids is not None else seq.prompt_ids + seq.output_ids[:-1]
        ready = min(seq.num_cached, len(context))
        if not self.speculative:
            return Prefix(seq.slot, context, ready, 0, [])
        fed = seq.num_cached - len(seq.unfed_features)
        return Prefix(seq.slot, context, ready, min(fed, ready), seq.unfed_features[: max(0, ready - fed)])
