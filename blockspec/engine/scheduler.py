"""Continuous batching: a request queue, admission, one batched step for everyone, preemption, abort.

Policy (one step = `Scheduler.step`):

1. Retire: finished or aborted requests give their slot back at once (with prefix caching, as a cache
   entry that keeps its K/V: engine/prefix_cache.py).
2. Make room: the KV budget is counted in tokens, one token = one row in the target cache *and* one
   in the draft cache (they share the slot space), so one budget covers both. A running request
   holds `num_cached + width` tokens, where width is the rows its next step may write (the decoder's
   step width: the block size B or the prompt-lookup width for DFlash, 1 for plain decoding); a request
   still prefilling holds its whole prefill length + width from the moment it is admitted. Holdings
   grow as requests decode; when their sum exceeds
   the budget, the youngest running request (latest arrival) is preempted: its slot is freed and it
   goes back to the *front* of the queue. It keeps every token it has generated; when readmitted it
   recomputes the KV of prompt + output[:-1] (`ModelRunner.prefill`) and resumes from its pending token,
   so nothing is lost, re-sampled or emitted twice. The oldest request is never preempted for a
   younger one, so every request finishes (no livelock). Prefix-cache entries count against the budget
   too and go first (least recently used), before any request is preempted.
3. Admit: first come, first served, while a slot is free (`--max-running-requests` slots) and the
   head of the queue fits in the budget; a request that does not fit blocks those behind it
   (no overtaking, so long prompts are not starved). A cache entry's slot counts as free (it is
   evicted for the request), so the cache never holds a request back. An admitted request reuses the
   longest prefix of its ids an entry or a running request holds (engine/prefix_reuse.py) and
   prefills only the rest.
4. Prefill: up to `prefill_tokens_per_step` prompt tokens per step, split into chunks across the
   requests being prefilled (oldest first); rows of similar chunk length share one padded forward.
   A long prompt thus takes several steps while the others keep decoding. Fairly: while requests
   decode, a step's token budget is shared, and its prefill takes at most `prefill_decode_ratio`
   times the rows its decode verifies, fewer deep into a long prompt, where each token also attends
   over its context (at least MIN_PREFILL_CHUNK), so a long prompt's arrival delays the running streams
   by about two decode steps per step, not by a whole prompt's compute.
   (Padding rows are scratch inside the slab, like a rejected draft tail, and are not counted against
   the budget.) A request whose prefix an older request is prefilling waits for it and copies its rows
   as they come, so requests with one system prompt compute it once.
5. Compact: requests that finished at prefill leave, and running requests above a freed slot move
   down into it (`ModelRunner.compact`, one copy of their K/V; a cache entry in the way trades places
   with them), so the decode batch, in slot order,
   is a contiguous slot range whose K/V every layer reads as a view instead of a gather.
6. Decode: one step of the decoder (blockspec/speculative/decoder.py: a batched draft forward and one
   batched target verify, or a plain decode forward) for every request past prefill, including those
   whose prefill ended this step; each row accepts its own number of tokens, stops on its own stop
   tokens and max_tokens.

The scheduler is not thread-safe: one thread (the engine thread) calls add/abort/step.
Memory: the budget bounds the KV rows in use. Slab rows are zeroed lazily, the first time a forward
reaches them (`KVCache.prepare`), so resident memory follows the longest length each slot has reached,
not num_slots x slab length.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

from blockspec.engine.mirror import Mirror
from blockspec.engine.prefill_chunks import prefill_groups, prefill_share
from blockspec.engine.prefix_reuse import PrefixReuse, prefill_order
from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence
from blockspec.errors import RequestError, setting

DEFAULT_PREFILL_DECODE_RATIO = 2.0


class StepDecoder(Protocol):
    """What decodes a batch one step (blockspec.speculative.decoder.Decoder)."""

    speculative: bool  # its requests' prefill also feeds the draft
    step_width: int  # the most rows one step writes past a sequence's cache length

    def decode(self, seqs: list[Sequence]) -> None: ...


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        decoder: StepDecoder,
        max_total_tokens: int | None = None,
        prefill_tokens_per_step: int | None = None,
        prefill_decode_ratio: float | None = None,
        mirror: tuple[Mirror, int] | None = None,
        prefix_caching: bool | None = None,
    ) -> None:
        """`prefill_decode_ratio`: while requests decode, prefill tokens per step per decoded row (None:
        DEFAULT_PREFILL_DECODE_RATIO; 0: no sharing, every step prefills prefill_tokens_per_step).
        `mirror`: on tensor-parallel rank 0, the channel its adds, aborts and steps go through to the other
        ranks' copies of this scheduler, and this scheduler's number there (engine/mirror.py).
        `prefix_caching`: reuse computed prefixes and keep finished requests' (engine/prefix_cache.py);
        None: the runner's setting."""
        self.runner, self.decoder = runner, decoder
        self.mirror = mirror
        self.width = decoder.step_width
        capacity = runner.pool.num_slots * runner.max_len
        if max_total_tokens is not None and (
            isinstance(max_total_tokens, bool) or not isinstance(max_total_tokens, int)
            or max_total_tokens < 1
        ):
            raise RequestError(f"max_total_tokens={max_total_tokens!r} must be a positive integer.")
        self.max_total_tokens = min(max_total_tokens or capacity, capacity)
        self.prefill_tokens_per_step = prefill_tokens_per_step or runner.prefill_chunk
        ratio = DEFAULT_PREFILL_DECODE_RATIO if prefill_decode_ratio is None else prefill_decode_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < float("inf"):
            raise RequestError(f"prefill_decode_ratio={prefill_decode_ratio!r} must be a number >= 0.")
        self.prefill_decode_ratio = float(ratio)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # prefilling seq_id -> the ids to prefill (progress: its num_cached)
        self._prefill_ids: dict[int, list[int]] = {}
        self.num_preemptions = 0
        self.cache = runner.prefix_cache
        enabled = self.cache.enabled if prefix_caching is None else bool(prefix_caching)
        self.reuse = PrefixReuse(runner, decoder.speculative, enabled, self._prefill_ids)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def tokens_in_use(self) -> int:
        return sum(self._holding(s) for s in self.running)

    def _holding(self, seq: Sequence) -> int:
        ids = self._prefill_ids.get(seq.seq_id)
        return (len(ids) if ids is not None else seq.num_cached) + self.width

    def max_need(self, seq: Sequence) -> int:
        """The most tokens this request can ever hold: its whole context plus one step's scratch rows."""
        return len(seq.prompt_ids) + seq.params.max_tokens - 1 + self.width

    def check(self, seq: Sequence) -> None:
        """Raise RequestError if the request could never run (reads only constants: any thread may
        call it)."""
        need = self.max_need(seq)
        limit = min(self.max_total_tokens, self.runner.max_len)
        if need > limit:
            most = setting("max_tokens")
            raise RequestError(
                f"The prompt has {len(seq.prompt_ids)} tokens and {most}={seq.params.max_tokens}: with "
                f"{self.width} scratch rows per step the request needs {need} KV tokens, more than this "
                f"engine can hold for one request ({limit}). Shorten the prompt, lower {most}, or raise the "
                f"KV budget ({setting('max_total_tokens')}) / {setting('max_model_len')}."
            )

    # ---- requests in and out ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)
        if self.mirror is not None:
            self.mirror[0].record("add", self.mirror[1], seq)

    def abort(self, seq_id: int, reason: str = "abort") -> Sequence | None:
        """Stop a request now (between steps) and free its slot; returns it, or None if unknown/finished."""
        if self.mirror is not None:
            self.mirror[0].record("abort", self.mirror[1], seq_id, reason)
        for i, seq in enumerate(self.waiting):
            if seq.seq_id == seq_id:
                del self.waiting[i]
                seq.finish(reason)
                return seq
        for seq in self.running:
            if seq.seq_id == seq_id:
                if not seq.finished:
                    seq.finish(reason)
                self._retire()
                return seq
        return None

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Admit, prefill, decode once; returns the sequences that ran this step (finished ones included)."""
        if self.mirror is None:
            return self._step()
        self.mirror[0].publish("step", self.mirror[1])
        try:
            return self._step()
        except BaseException as exc:  # the other ranks are mid-step: stop them rather than hang (mirror.py)
            self.mirror[0].fail(exc)
            raise

    def _step(self) -> list[Sequence]:
        self._retire()
        self._make_room()
        self._admit()
        prefilled = self._prefill()
        self._retire()  # requests done at prefill (max_tokens=1, a stop token) leave before the compaction
        self.runner.compact(self.running)
        decoding = [s for s in self.running if s.seq_id not in self._prefill_ids and not s.finished]
        decoding.sort(key=lambda s: s.slot)  # a contiguous slot range in order: the KV reads are views
        if decoding:
            self.decoder.decode(decoding)
        seen = {s.seq_id for s in prefilled}
        ran = prefilled + [s for s in decoding if s.seq_id not in seen]
        self._retire()
        return ran

    def _retire(self) -> None:
        for seq in self.running:
            if seq.finished:
                self.reuse.leave(seq)  # kept as a prefix-cache entry, or freed
                self._prefill_ids.pop(seq.seq_id, None)
        self.running = [s for s in self.running if not s.finished]

    def _make_room(self) -> None:
        total = self.tokens_in_use
        self.cache.trim(self.max_total_tokens - total)  # cache entries go before any request is preempted
        while total > self.max_total_tokens and len(self.running) > 1:
            victim = max(self.running, key=lambda s: (s.arrival_time, s.seq_id))
            total -= self._holding(victim)
            self._preempt(victim)

    def _preempt(self, seq: Sequence) -> None:
        self.runner.release(seq)
        self.running = [s for s in self.running if s.seq_id != seq.seq_id]
        self._prefill_ids.pop(seq.seq_id, None)
        self.reuse.awaiting.discard(seq.seq_id)
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admit(self) -> None:
        in_use = self.tokens_in_use
        while self.waiting and self.runner.slots_available:
            seq = self.waiting[0]
            # A resumed request recomputes prompt + output[:-1]; its pending token output[-1] is kept.
            ids = seq.prompt_ids + seq.output_ids[:-1]
            need = len(ids) + self.width
            if in_use + need > self.max_total_tokens:
                break
            self.waiting.popleft()
            self._prefill_ids[seq.seq_id] = ids
            self.running.append(seq)  # first: should placing it fail, the step's failure handling sees it
            self.reuse.place(seq, ids, self.running)
            in_use += need
            self.cache.trim(self.max_total_tokens - in_use)

    def _prefill(self) -> list[Sequence]:
        """Run this step's share of prefill; sequences whose prefill ends get their first token. A request
        waiting on an older one that prefills its prefix copies the rows as they come; once it has them
        it prefills the rest with what the step's share has left, in a second pass of the same step."""
        left = self.prefill_allowance()
        ran: list[Sequence] = []
        pending = sorted((s for s in self.running if s.seq_id in self._prefill_ids), key=prefill_order)
        while pending:
            rows: list[tuple[Sequence, list[int]]] = []
            waiting = []
            for seq in pending:
                if self.reuse.pull(seq, self.running):
                    waiting.append(seq)
                elif left > 0:
                    ids = self._prefill_ids[seq.seq_id]
                    chunk = ids[seq.num_cached : seq.num_cached + left]
                    rows.append((seq, chunk))
                    left -= len(chunk)
            self._run_prefill(rows)
            ran += [s for s, _ in rows]
            pending = waiting if rows and left > 0 else []
        return ran

    def _run_prefill(self, rows: list[tuple[Sequence, list[int]]]) -> None:
        for group in prefill_groups(rows, self.runner.max_len):
            seqs, chunks = [s for s, _ in group], [c for _, c in group]
            hidden = self.runner.prefill(seqs, chunks, capture=self.decoder.speculative)
            self.cache.miss_tokens += sum(len(c) for c in chunks)
            done = [i for i, s in enumerate(seqs) if s.num_cached == len(self._prefill_ids[s.seq_id])]
            fresh = [i for i in done if not seqs[i].output_ids]
            if fresh:
                self.runner.first_tokens([seqs[i] for i in fresh], hidden[fresh])
            for i in done:
                del self._prefill_ids[seqs[i].seq_id]

    def prefill_allowance(self) -> int:
        """Prompt tokens this step may prefill: its share of the step's budget beside the decoding rows."""
        decoding = sum(1 for s in self.running if s.seq_id not in self._prefill_ids and not s.finished)
        if not decoding or not self.prefill_decode_ratio:
            return self.prefill_tokens_per_step
        context = max((s.num_cached for s in self.running if s.seq_id in self._prefill_ids), default=0)
        share = prefill_share(self.prefill_decode_ratio, decoding * self.width, context)
        return min(self.prefill_tokens_per_step, share)


def run_to_completion(scheduler: Scheduler, seqs: list[Sequence],
                      on_step: Callable[[list[Sequence]], None] | None = None) -> Scheduler:
    """The offline loop: a fixed list of sequences, each joining as soon as a slot (and KV budget) frees up
    and leaving the moment it finishes. `on_step` sees the sequences that ran after every step, finished
    ones included (for streaming). Returns the scheduler (for its statistics)."""
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work:
        ran = scheduler.step()
        if on_step is not None:
            on_step(ran)
    return scheduler
