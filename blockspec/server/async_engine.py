"""The bridge between asyncio request handlers and the one thread that runs the model.

Handlers call `submit` (returns an asyncio.Queue of `Output`s) and `abort`; both only post a message
to the engine thread's inbox. The engine thread drains its inbox between steps (so an abort frees
the request's KV before the next step), runs `Scheduler.step`, turns each request's new tokens into
text (StreamDecoder), applies stop strings (the text is cut before the stop string and the request
finishes at once), and posts the pieces to the request's queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field

from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence
from blockspec.engine.stats import RequestStats
from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import StreamDecoder, Tokenizer
from blockspec.server.live import LiveView
from blockspec.server.metrics import Metrics
from blockspec.server.token_sources import Piece, PieceStream

log = logging.getLogger("blockspec.server")


@dataclass
class Output:
    """One update of a request: text since the previous update; finish_reason set on the last one."""

    text: str
    num_output_tokens: int
    finish_reason: str | None = None
    stats: RequestStats = field(default_factory=RequestStats)  # on the last update only
    error: str | None = None
    shutdown: bool = False  # the error is the server stopping, not a fault
    pieces: list[Piece] | None = None  # the text's tokens and their sources, when the request asked


@dataclass
class _Tracked:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    decoder: StreamDecoder
    stop: list[str]
    sent_tokens: int = 0
    sent_accepts: int = 0
    held: str = ""  # decoded text held back because it may be the start of a stop string
    pieces: PieceStream | None = None  # set when the request asked for its tokens' sources


def find_stop(text: str, stops: list[str]) -> tuple[int | None, int]:
    """(index where the earliest stop string starts or None, length of the longest suffix of text
    that is a proper prefix of some stop string: text that must be held back for now)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return min(hits), 0
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return None, hold


class AsyncEngine:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, metrics: Metrics) -> None:
        self.scheduler, self.tokenizer, self.metrics = scheduler, tokenizer, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._tracked: dict[int, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.draining = False  # set once the server stops admitting (shutdown.py); handlers then refuse
        self.snapshot: dict[str, float] = {}
        self.live = LiveView()
        self._publish()

    # ---- called from the event loop --------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="blockspec-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, seq: Sequence, stop: list[str], token_sources: bool = False) -> asyncio.Queue:
        """Queue a validated sequence; its `Output`s arrive on the returned queue (with their tokens'
        sources if `token_sources`)."""
        tracked = _Tracked(seq, asyncio.get_running_loop(), asyncio.Queue(), StreamDecoder(self.tokenizer),
                           stop, pieces=PieceStream() if token_sources else None)
        self._inbox.put(("add", tracked))
        self._wake.set()
        return tracked.queue

    def abort(self, seq_id: int) -> None:
        self._inbox.put(("abort", seq_id))
        self._wake.set()

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet answered in full (read from any thread)."""
        return len(self._tracked) + self._inbox.qsize()

    def stop_admission(self) -> None:
        self.draining = True

    def end_remaining(self, message: str) -> None:
        """Finish every request still running with an error (the grace period is over)."""
        self._inbox.put(("end", message))
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            self._drain()
            if not self.scheduler.has_work:
                self._publish()
                self._wake.wait(timeout=0.5)
                continue
            start = time.perf_counter()
            try:
                ran = self.scheduler.step()
            except Exception as exc:  # a bug or out-of-memory must not take the server down
                if self.scheduler.runner.tp is not None:  # a rank failed: the ranks cannot step together
                    self._stop_server(exc)
                    return
                # A fault in one request's own work fails it alone (runner.guarded); what reaches here
                # is the batch's (a forward pass): its requests fail, the queued ones carry on.
                log.exception("engine step failed; failing the requests in it")
                self._fail_running(f"internal engine error: {type(exc).__name__}: {exc}")
                continue
            accepts: list[int] = []
            for seq in ran:
                accepts += self._deliver(seq)
            accepts = accepts if self.scheduler.decoder.speculative else []
            self.metrics.step(time.perf_counter() - start, accepts)
            self.live.step(getattr(self.scheduler.decoder, "last_plan", None), accepts)
            self._publish()
        self._fail_all("the server is shutting down", shutdown=True)

    def _stop_server(self, exc: Exception) -> None:
        """Under tensor parallelism a failed step means a rank is gone or broken, and the ranks can no
        longer run in lock-step: every request ends with an error now, and the server stops (SIGTERM: the
        graceful shutdown, with nothing left to wait for) instead of hanging on the lost rank."""
        log.error("tensor-parallel engine step failed (%s: %s); stopping the server", type(exc).__name__,
                  exc)
        self._fail_all(f"the tensor-parallel engine failed ({type(exc).__name__}: {exc}); the server is "
                       f"stopping", shutdown=True)
        self.draining = True
        os.kill(os.getpid(), signal.SIGTERM)

    def _drain(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "end":
                self._fail_all(item, shutdown=True)
            elif kind == "add":
                try:
                    self.scheduler.add(item.seq)
                except BlockspecError as exc:  # handlers check first; this is a safety net
                    self._post(item, Output("", 0, "error", error=str(exc)))
                    continue
                self._tracked[item.seq.seq_id] = item
            else:
                tracked = self._tracked.pop(item, None)
                seq = self.scheduler.abort(item)
                if tracked is not None and seq is not None:
                    self._done(seq, "abort")

    def _deliver(self, seq: Sequence) -> list[int]:
        """Post the request's new text; returns the accept lengths of its new verify steps (for metrics)."""
        tracked = self._tracked.get(seq.seq_id)
        if tracked is None:
            return []
        start = tracked.sent_tokens
        new, origins = seq.output_ids[start:], seq.token_sources[start:]
        accepts = seq.stats.accept_lengths[tracked.sent_accepts :]
        tracked.sent_tokens, tracked.sent_accepts = len(seq.output_ids), len(seq.stats.accept_lengths)
        self.live.committed(origins)
        texts = [tracked.decoder.push(t) for t in new]
        tail = tracked.decoder.flush() if seq.finished else ""
        text = tracked.held + "".join(texts) + tail
        reason = seq.finish_reason
        tracked.held, keep, cut = "", None, False  # keep: characters of `text` that go out now (None: all)
        if tracked.stop:
            at, hold = find_stop(text, tracked.stop)
            if at is not None:
                keep, cut, reason = at, True, "stop"
                if not seq.finished:
                    self.scheduler.abort(seq.seq_id, reason="stop")  # frees its KV now
            elif reason is None and hold:
                keep = len(text) - hold
        pieces = None
        if tracked.pieces is not None:  # held back a token at a time, so no token's text is split
            pieces, text, tracked.held = tracked.pieces.take(texts, tail, origins, keep, cut)
        elif keep is not None:
            text, tracked.held = text[:keep], "" if cut else text[keep:]
        if text or pieces or reason is not None:
            final = reason is not None
            error = f"the request failed: {seq.error}" if reason == "error" else None
            self._post(tracked, Output(text, len(seq.output_ids), reason,
                                       seq.stats.copy() if final else RequestStats(), error,
                                       pieces=pieces))
        if reason is not None:
            self._tracked.pop(seq.seq_id, None)
            self._done(seq, reason)
        return accepts

    def _done(self, seq: Sequence, reason: str) -> None:
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
        self.metrics.request_done(reason, len(seq.prompt_ids), len(seq.output_ids), ttft, seq.stats)

    def _post(self, tracked: _Tracked, output: Output) -> None:
        try:
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, output)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _fail_running(self, message: str) -> None:
        for seq in list(self.scheduler.running):
            self.scheduler.abort(seq.seq_id, reason="error")
            tracked = self._tracked.pop(seq.seq_id, None)
            if tracked is not None:
                self._post(tracked, Output("", len(seq.output_ids), "error", error=message))
                self._done(seq, "error")
        self._publish()

    def _fail_all(self, message: str, shutdown: bool = False) -> None:
        for seq_id, tracked in list(self._tracked.items()):
            self.scheduler.abort(seq_id, reason="error")
            self._post(tracked, Output("", len(tracked.seq.output_ids), "error", error=message,
                                       shutdown=shutdown))
            self._done(tracked.seq, "error")
        self._tracked.clear()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):  # untracked leftovers
            self.scheduler.abort(seq.seq_id, reason="error")
        self._publish()

    def _publish(self) -> None:
        s = self.scheduler
        runner, cache = s.runner, s.runner.prefix_cache
        self.snapshot = {
            "num_running_requests": len(s.running), "num_waiting_requests": len(s.waiting),
            "kv_tokens_used": s.tokens_in_use, "kv_tokens_budget": s.max_total_tokens,
            # free for a request: unused slots and prefix-cache entries' (evicted for it)
            "kv_slots_free": runner.slots_available, "kv_slots_total": runner.pool.num_slots,
            "preemptions_total": s.num_preemptions,
            "prefix_cache_hit_tokens_total": cache.hit_tokens,
            "prefix_cache_miss_tokens_total": cache.miss_tokens,
            "prefix_cache_hit_rate": round(cache.hit_rate, 6),
            "prefix_cache_evictions_total": cache.evictions,
            "prefix_cache_entries": len(cache.entries), "prefix_cache_tokens": cache.tokens,
            "prefix_cache_bytes": cache.nbytes,
        }
        self.metrics.set_gauges(**self.snapshot)
