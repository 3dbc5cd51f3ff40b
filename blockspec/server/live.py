"""The engine's live view, `GET /stats` (JSON): what the chat page's engine panel shows.

Counters only grow, from the server's start (a client takes the difference of two reads for a rate, as
with Prometheus counters; `time` is the server's monotonic clock for that); gauges are the latest step's.
- `tokens_total`: committed output tokens by source ("draft", "lookup", "target"; see token_sources.py).
- `steps_total`: decode steps by kind ("dflash", "lookup", "mixed", "merged", "plain"; one batched step
  each).
- `verify_rows_total`, `verify_tokens_total`: a request's DFlash verify steps and the tokens they committed
  (bonus included): their ratio over an interval is the draft's tau there (plain decoding: 1).
- `plan`: the latest decode step's plan, the governor's current choice: its kind, the block size and tree
  budget of drafted rows, and the width every row verified.
- gauges from the engine's snapshot: running and waiting requests, KV tokens in use and the budget.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from blockspec.speculative.plan import StepPlan

SOURCES = ("draft", "lookup", "target")
STEP_KINDS = ("dflash", "lookup", "mixed", "merged", "plain")


class LiveView:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self.tokens = dict.fromkeys(SOURCES, 0)
        self.steps = dict.fromkeys(STEP_KINDS, 0)
        self.verify_rows = 0
        self.verify_tokens = 0
        self._plan: StepPlan | None = None

    # ---- the engine thread -------------------------------------------------------------------------
    def committed(self, origins: Iterable[tuple[str, int]]) -> None:
        """Tokens a request committed since its last delivery ((source, step) each)."""
        with self._lock:
            for source, _ in origins:
                self.tokens[source] += 1

    def step(self, plan: StepPlan | None, accept_lengths: list[int]) -> None:
        """After an engine step: the decoder's latest plan (counted once: a step that only prefilled leaves
        it unchanged) and the accept lengths of the verify steps it committed."""
        with self._lock:
            if plan is not None and plan is not self._plan:
                self._plan = plan
                self.steps[plan.kind] += 1
            self.verify_rows += len(accept_lengths)
            self.verify_tokens += sum(accept_lengths)

    # ---- any thread ----------------------------------------------------------------------------------
    def snapshot(self, gauges: dict[str, float], algorithm: str, adaptive: bool) -> dict:
        with self._lock:
            plan = self._plan
            described = None if plan is None else {
                "kind": plan.kind, "width": plan.width,
                "block_size": plan.shape.block_size if plan.shape else None,
                "tree_budget": plan.shape.tree_budget if plan.shape else None,
            }
            return {
                "time": round(time.monotonic(), 4), "uptime_s": round(time.monotonic() - self._started, 3),
                "speculative_algorithm": algorithm, "adaptive_speculation": adaptive,
                "running_requests": gauges.get("num_running_requests", 0),
                "waiting_requests": gauges.get("num_waiting_requests", 0),
                "kv_tokens_used": gauges.get("kv_tokens_used", 0),
                "kv_tokens_budget": gauges.get("kv_tokens_budget", 0),
                "tokens_total": dict(self.tokens), "steps_total": dict(self.steps),
                "verify_rows_total": self.verify_rows, "verify_tokens_total": self.verify_tokens,
                "plan": described,
            }
