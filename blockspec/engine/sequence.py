"""One request's state as it moves through the engine."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from blockspec.engine.stats import RequestStats
from blockspec.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class Sequence:
    """Invariant after prefill: the caches hold prompt + output[:-1]; output[-1] (the bonus) is pending."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    seq_id: int = field(default_factory=lambda: next(_ids))
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    tau_estimate: float | None = None  # moving average of its accept lengths (the governor's)
    # Target features [K*H] of the last positions (num_cached - len .. num_cached - 1) that plain steps
    # captured but did not yet inject into the draft's cache: injected in one pass when it next drafts.
    unfed_features: list[torch.Tensor] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def pending_token(self) -> int:
        return self.output_ids[-1]

    def emit(self, tokens: list[int]) -> int:
        """Append tokens in order until a stop token (kept) or max_tokens; returns how many were taken.
        Stops are found by position in the committed run, never by filtering token values."""
        taken = 0
        for token in tokens:
            self.output_ids.append(token)
            taken += 1
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if token in self.stop_ids and not self.params.ignore_eos or token in self.params.stop_token_ids:
                self.finish("stop")
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self.finish("length")
                break
        return taken

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
