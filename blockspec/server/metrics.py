"""Prometheus metrics, rendered by hand in the text exposition format (no client library needed).

Counters and histograms are updated by the engine thread and the HTTP handlers under one lock;
gauges (queue depth, running requests, KV use) are read from the engine's latest snapshot.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from blockspec.engine.stats import RequestStats

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# engine counters published through the snapshot
COUNTER_GAUGES = {"preemptions_total", "prefix_cache_hit_tokens_total", "prefix_cache_miss_tokens_total",
                  "prefix_cache_evictions_total"}
TTFT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float, times: int = 1) -> None:
        self.n += times
        self.total += value * times
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += times

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for bound, count in zip(self.buckets, self.counts):
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {count}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.n}', f"{self.name}_sum {_num(self.total)}",
                  f"{self.name}_count {self.n}"]
        return lines


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class Metrics:
    def __init__(self, block_size: int, info: dict[str, str] | None = None) -> None:
        self._lock = threading.Lock()
        self.info = info or {}  # how the engine runs (weights, activations): one labelled gauge
        self.requests: dict[str, int] = {}  # finish_reason ("stop", "length", "abort", "error") -> count
        self.http_errors: dict[int, int] = {}  # status -> count (rejected before reaching the engine)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.plain_steps = 0
        self.lookup_steps = 0
        self.lookup_tokens = 0
        self.merged_steps = 0
        self.merged_tokens = 0
        self.accept_length = Histogram(
            "blockspec_accept_length", "Tokens committed per verify step (tau, bonus included)",
            tuple(float(i) for i in range(1, max(block_size, 1) + 1)),
        )
        self.step_latency = Histogram("blockspec_step_latency_seconds", "Wall time of one engine step",
                                      STEP_BUCKETS)
        self.ttft = Histogram("blockspec_time_to_first_token_seconds", "Arrival to first token",
                              TTFT_BUCKETS)
        self.itl = Histogram("blockspec_inter_token_latency_seconds",
                             "Time between a request's successive output tokens (tokens committed together "
                             "share the time since the previous ones); one observation per token",
                             ITL_BUCKETS)
        self.e2e = Histogram("blockspec_e2e_request_latency_seconds",
                             "Arrival to the last token, per finished request", E2E_BUCKETS)
        self.gauges: dict[str, float] = {}

    def request_done(self, reason: str, prompt_tokens: int, output_tokens: int, ttft: float | None,
                     stats: RequestStats, latency: float | None = None) -> None:
        with self._lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += output_tokens
            self.plain_steps += stats.plain_steps
            self.lookup_steps += len(stats.lookup_accept_lengths)
            self.lookup_tokens += sum(stats.lookup_accept_lengths)
            self.merged_steps += len(stats.merged_accept_lengths)
            self.merged_tokens += sum(stats.merged_accept_lengths)
            if ttft is not None:
                self.ttft.observe(ttft)
            if latency is not None:
                self.e2e.observe(latency)

    def inter_token(self, seconds: float, tokens: int) -> None:
        """`tokens` output tokens of one request arrived together, `seconds` after its previous ones."""
        with self._lock:
            self.itl.observe(seconds / tokens, tokens)

    def http_error(self, status: int) -> None:
        with self._lock:
            self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def step(self, seconds: float, accept_lengths: list[int]) -> None:
        with self._lock:
            self.step_latency.observe(seconds)
            for a in accept_lengths:
                self.accept_length.observe(a)

    def set_gauges(self, **values: float) -> None:
        with self._lock:
            self.gauges.update(values)

    def render(self) -> str:
        with self._lock:
            labels = ",".join(f'{key}="{value}"' for key, value in self.info.items())
            lines = ["# HELP blockspec_engine_info How the engine holds weights and judges samples",
                     "# TYPE blockspec_engine_info gauge", f"blockspec_engine_info{{{labels}}} 1",
                     "# HELP blockspec_requests_total Finished requests by finish reason",
                     "# TYPE blockspec_requests_total counter"]
            for reason, count in sorted(self.requests.items()):
                lines.append(f'blockspec_requests_total{{finish_reason="{reason}"}} {count}')
            lines += ["# HELP blockspec_http_errors_total Requests rejected with an error status",
                      "# TYPE blockspec_http_errors_total counter"]
            for status, count in sorted(self.http_errors.items()):
                lines.append(f'blockspec_http_errors_total{{status="{status}"}} {count}')
            for name, value, help_ in (
                ("blockspec_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests"),
                ("blockspec_generation_tokens_total", self.generation_tokens,
                 "Output tokens of finished requests"),
                ("blockspec_plain_decode_steps_total", self.plain_steps,
                 "Plain decode steps adaptive speculation took for DFlash requests, finished requests"),
                ("blockspec_lookup_steps_total", self.lookup_steps,
                 "Prompt-lookup verify steps of DFlash requests (not in blockspec_accept_length), "
                 "finished requests"),
                ("blockspec_lookup_tokens_total", self.lookup_tokens,
                 "Tokens committed by prompt-lookup steps (bonus included), finished requests"),
                ("blockspec_merged_steps_total", self.merged_steps,
                 "Verify steps of DFlash requests that checked a copy and the draft's candidates as one tree "
                 "(not in blockspec_accept_length), finished requests"),
                ("blockspec_merged_tokens_total", self.merged_tokens,
                 "Tokens committed by those steps (bonus included), finished requests"),
            ):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
            for name, value in sorted(self.gauges.items()):
                kind = "counter" if name in COUNTER_GAUGES else "gauge"
                lines += [f"# TYPE blockspec_{name} {kind}", f"blockspec_{name} {_num(value)}"]
            for hist in (self.accept_length, self.step_latency, self.ttft, self.itl, self.e2e):
                lines += hist.render()
        return "\n".join(lines) + "\n"
