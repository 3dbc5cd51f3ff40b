"""The bridge between asyncio request handlers and the one thread that runs the model.

Handlers call `submit` (returns an asyncio.Queue of `Output`s; several requests, the choices of one HTTP
request, may share one, each `Output` naming its choice's index) and `abort`; both only post a message
to the engine thread's inbox. The engine thread drains its inbox between steps (so an abort frees
the request's KV before the next step), runs `Scheduler.step`, turns each request's new tokens into
text (`TextStream`, token by token with each token's source for requests that ask), applies stop strings
(the text is cut before the stop string, the tokens after the one that completed it are dropped, and the
request finishes at once), and posts the pieces to the request's queue with `call_soon_threadsafe`. It
counts each step into the live view (`GET /stats`, live.py) and, while busy, logs a throughput line every
few seconds (throughput.py).
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

from blockspec.engine.sampler import TokenLogprob
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence
from blockspec.engine.stats import RequestStats
from blockspec.engine.text_stream import Piece, TextStream, follow_text
from blockspec.errors import BlockspecError
from blockspec.models.tokenizer import Tokenizer
from blockspec.server.live import LiveView
from blockspec.server.metrics import Metrics
from blockspec.server.throughput import ThroughputLog

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
    index: int = 0  # the choice it belongs to (submit's `index`)
    token_ids: list[int] = field(default_factory=list)  # the tokens since the previous update
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when the request asked for them
    pieces: list[Piece] | None = None  # the text token by token with their sources, when the request asked


@dataclass
class _Tracked:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    text: TextStream
    index: int = 0
    sent_tokens: int = 0
    sent_accepts: int = 0
    last_delivery: float | None = None  # when its previous tokens were posted (inter-token latency)
    pieces: bool = False  # the request asked for its tokens' sources


class AsyncEngine:
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, metrics: Metrics,
                 log_interval: float = 0.0) -> None:
        """`log_interval`: seconds between throughput lines while busy (0: none)."""
        self.scheduler, self.tokenizer, self.metrics = scheduler, tokenizer, metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._tracked: dict[int, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._step_tokens = 0  # output tokens delivered in the current step
        self.draining = False  # set once the server stops admitting (shutdown.py); handlers then refuse
        self.snapshot: dict[str, float] = {}
        self.live = LiveView()
        self._publish()
        self.throughput = ThroughputLog(log_interval, scheduler.decoder.speculative, self.snapshot)

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

    def submit(self, seq: Sequence, stop: list[str] | None = None, outputs: asyncio.Queue | None = None,
               index: int = 0, token_sources: bool = False) -> asyncio.Queue:
        """Queue a validated sequence; its `Output`s, marked `index`, arrive on `outputs` (a new queue if
        None), which is returned. `stop`: its stop strings (default: its SamplingParams');
        `token_sources`: the Outputs carry their text token by token with each token's source (a token's
        text then never splits over two Outputs)."""
        stops = seq.params.stop if stop is None else stop
        tracked = _Tracked(seq, asyncio.get_running_loop(), outputs or asyncio.Queue(),
                           TextStream(self.tokenizer, stops, whole_tokens=token_sources), index,
                           pieces=token_sources)
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
            self._step_tokens = 0
            for seq in ran:
                accepts += self._deliver(seq)
            accepts = accepts if self.scheduler.decoder.speculative else []
            self.metrics.step(time.perf_counter() - start, accepts)
            self.live.step(getattr(self.scheduler.decoder, "last_plan", None), accepts)
            self._publish()
            self.throughput.step(self._step_tokens, accepts, self.snapshot, time.perf_counter() - start)
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
        accepts = seq.stats.accept_lengths[tracked.sent_accepts :]
        tracked.sent_accepts = len(seq.stats.accept_lengths)
        # a stop string ends it (and trims its tokens) here
        pieces = follow_text(self.scheduler, seq, tracked.text)
        text = "".join(piece.text for piece in pieces)
        new = slice(tracked.sent_tokens, len(seq.output_ids))
        tracked.sent_tokens = len(seq.output_ids)
        self.live.committed(seq.token_sources[new])
        reason = seq.finish_reason
        if new.stop > new.start:
            self._time_tokens(tracked, new.stop - new.start)
            self._step_tokens += new.stop - new.start
        if text or reason is not None or new.stop > new.start:
            final = reason is not None
            error = f"the request failed: {seq.error}" if reason == "error" else None
            self._post(tracked, Output(text, len(seq.output_ids), reason,
                                       seq.stats.copy() if final else RequestStats(), error,
                                       index=tracked.index, token_ids=seq.output_ids[new],
                                       logprobs=seq.logprobs[new], pieces=pieces if tracked.pieces else None))
        if reason is not None:
            self._tracked.pop(seq.seq_id, None)
            self._done(seq, reason)
        return accepts

    def _time_tokens(self, tracked: _Tracked, count: int) -> None:
        """Inter-token latency: the time since the request's previous tokens, shared by the ones that came
        together (a verify step commits several at once)."""
        now = time.perf_counter()
        if tracked.last_delivery is not None:
            self.metrics.inter_token(now - tracked.last_delivery, count)
        tracked.last_delivery = now

    def _done(self, seq: Sequence, reason: str) -> None:
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
        latency = (seq.finish_time or time.perf_counter()) - seq.arrival_time
        self.metrics.request_done(reason, len(seq.prompt_ids), len(seq.output_ids), ttft, seq.stats, latency)

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
