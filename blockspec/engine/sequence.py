"""One request's state as it moves through the engine."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from blockspec.engine.sampler import TokenLogprob, token_logprobs
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
    # Parallel to output_ids: where each token came from ("draft" or "lookup": proposed and accepted by the
    # target; "target": the target's own token after a step's accepted run, or a plain step's) and the
    # decode step that committed it (0: the prefill's first token; then stats.num_steps).
    token_sources: list[tuple[str, int]] = field(default_factory=list)
    # With params.logprobs: per output token, its log-probabilities under the target.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    # Moving averages of its accept lengths per kind of drafted step (the governor's: chain, tree, merged)
    tau_estimates: dict = field(default_factory=dict)
    # Target features [K*H] of the last positions (num_cached - len .. num_cached - 1) that plain steps
    # captured but did not yet inject into the draft's cache: injected in one pass when it next drafts.
    unfed_features: list[torch.Tensor] = field(default_factory=list)
    num_cached: int = 0
    # Tokens of its current admission's prefill whose K/V came from the prefix cache (engine/prefix_cache.py)
    cached_tokens: int = 0
    finish_reason: str | None = None
    # The key of the request's draws (sampler.draw): its seed, or one drawn from torch's global generator
    # (reproducible under --seed) when it has none.
    seed: int = 0
    error: str | None = None  # why it failed, with finish_reason "error"
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.seed = self.params.seed
        elif not self.params.greedy:
            self.seed = int(torch.randint(-(2**63), 2**63 - 1, ()))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def needs_logits(self) -> bool:
        """Whether its steps need the target's logits, not only its greedy choices (SamplingParams)."""
        return self.params.needs_logits

    @property
    def pending_token(self) -> int:
        return self.output_ids[-1]

    @property
    def next_position(self) -> int:
        """The absolute position of the next token to be committed (the key of its draw)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def emit(self, tokens: list[int], proposer: str | list[str] = "target",
             logits: torch.Tensor | None = None) -> int:
        """Append tokens in order until a stop token (kept) or max_tokens; returns how many were taken.
        Stops are found by position in the committed run, never by filtering token values. tokens[:-1]
        were proposed by `proposer` ("draft" or "lookup", or one of them per token) and accepted; the last is
        the target's own. `logits` [len(tokens), V]: the target's raw logits that chose each (for
        params.logprobs)."""
        taken, step, last = 0, self.stats.num_steps, len(tokens) - 1
        for i, token in enumerate(tokens):
            self.output_ids.append(token)
            source = "target" if i == last else proposer if isinstance(proposer, str) else proposer[i]
            self.token_sources.append((source, step))
            taken += 1
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
            if token in self.stop_ids and not self.params.ignore_eos or token in self.params.stop_token_ids:
                self.finish("stop")
                break
            if len(self.output_ids) >= self.params.max_tokens:
                self.finish("length")
                break
        if self.params.logprobs is not None and logits is not None:
            self.logprobs += token_logprobs(logits[:taken], tokens[:taken], self.params.logprobs)
        return taken

    def truncate(self, length: int) -> None:
        """Keep only the first `length` output tokens (a stop string ended the output there)."""
        del self.output_ids[length:], self.token_sources[length:], self.logprobs[length:]

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

    def fail(self, error: str) -> None:
        """A fault in this request alone (its sampling, say): it finishes with "error"; others carry on."""
        self.error = error
        self.finish("error")
