"""The server's periodic progress line while it is busy, as SGLang's and vLLM's servers log one:

    INFO blockspec.server: 3 running, 0 waiting | 48.2 tok/s over 5.0 s busy | tau 2.31 | KV 1234/10240 (12%)
        | prefix cache hit 87%

Nothing is logged while idle; counts cover the interval since the previous line (the prefix cache's hit
rate: of the prompt tokens admitted in it, when there were any), and tokens/s the time the engine spent
stepping in it: a request after a minute's idle reports its own speed, not one averaged over the wait.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("blockspec.server")


def prefix_totals(snapshot: dict[str, float]) -> tuple[float, float]:
    """The prefix cache's hit and miss token totals in an engine snapshot."""
    return (snapshot.get("prefix_cache_hit_tokens_total", 0.0),
            snapshot.get("prefix_cache_miss_tokens_total", 0.0))


class ThroughputLog:
    def __init__(self, interval: float, speculative: bool, snapshot: dict[str, float] | None = None) -> None:
        """`interval`: seconds between lines (0: never); `speculative`: whether the engine verifies drafts
        (then the line reports tau, the mean tokens per verify step); `snapshot`: the engine's gauges now
        (the prefix cache may have counted tokens before the server started: they are not the first
        interval's)."""
        self.interval, self.speculative = interval, speculative
        self._since = time.perf_counter()
        self._tokens = 0
        self._busy = 0.0  # seconds spent in engine steps since the previous line
        self._accepts: list[int] = []
        self._prefix = prefix_totals(snapshot or {})  # the totals at the previous line

    def step(self, tokens: int, accepts: list[int], snapshot: dict[str, float], seconds: float) -> None:
        """After an engine step: the output tokens it delivered, its verify steps' accept lengths, the
        engine's gauges (`AsyncEngine.snapshot`) and the seconds it took."""
        if not self.interval:
            return
        self._tokens += tokens
        self._busy += seconds
        self._accepts += accepts
        now = time.perf_counter()
        if now - self._since < self.interval:
            return
        if self._tokens or snapshot.get("num_running_requests"):
            log.info("%s", self.line(self._busy, snapshot))
        self._since, self._tokens, self._busy, self._accepts = now, 0, 0.0, []
        self._prefix = prefix_totals(snapshot)

    def line(self, busy: float, snapshot: dict[str, float]) -> str:
        """The line for an interval in which the engine spent `busy` seconds stepping."""
        used, budget = int(snapshot.get("kv_tokens_used", 0)), int(snapshot.get("kv_tokens_budget", 0))
        share = f" ({100 * used / budget:.0f}%)" if budget else ""
        tau = ""
        if self.speculative and self._accepts:
            tau = f" | tau {sum(self._accepts) / len(self._accepts):.2f}"
        hit_total, miss_total = prefix_totals(snapshot)
        hits, misses = hit_total - self._prefix[0], miss_total - self._prefix[1]
        prefix = f" | prefix cache hit {100 * hits / (hits + misses):.0f}%" if hits + misses > 0 else ""
        return (f"{int(snapshot.get('num_running_requests', 0))} running, "
                f"{int(snapshot.get('num_waiting_requests', 0))} waiting | "
                f"{self._tokens / busy if busy > 0 else 0.0:.1f} tok/s over {busy:.1f} s busy{tau} | "
                f"KV {used}/{budget}{share}"
                f"{prefix}")
