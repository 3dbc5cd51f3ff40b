"""Per-request sampling parameters, validated when constructed."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

from blockspec.errors import RequestError, setting

MAX_LOGPROBS = 20  # most alternatives per position (OpenAI's top_logprobs limit)
MAX_STOPS = 16


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no top-k
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's end tokens
    ignore_eos: bool = False
    # Stop strings: the output ends where one first appears in its text (the text is cut before it).
    stop: list[str] = field(default_factory=list)
    # OpenAI's penalties on tokens already in the output: logit - frequency * count - presence * (count > 0),
    # applied position by position (also inside a verified block), before temperature, top-k and top-p.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Log-probabilities of each output token under the target (its raw logits' log-softmax) and of this many
    # most likely alternatives; None: none recorded.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"{setting('max_tokens')}={self.max_tokens!r:.80} must be an integer >= 1.")
        if not _number(self.temperature) or not 0.0 <= self.temperature < float("inf"):
            raise RequestError(f"{setting('temperature')}={self.temperature!r:.80} must be a number >= 0 "
                               f"(0 means greedy).")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"{setting('top_p')}={self.top_p!r:.80} must be in (0, 1].")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"{setting('top_k')}={self.top_k!r:.80} must be an integer >= 1, or 0 / -1 to "
                               f"disable top-k.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise RequestError(f"{setting('seed')}={self.seed!r:.80} must be an integer in [-2**63, 2**64) "
                               f"or None.")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise RequestError(f"stop_token_ids={self.stop_token_ids!r:.80} must be a list of token ids.")
        bad = [t for t in self.stop_token_ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise RequestError(f"stop_token_ids contains invalid ids {bad!r:.80}; they must be non-negative "
                               f"integers.")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if (not isinstance(self.stop, (list, tuple)) or len(self.stop) > MAX_STOPS
                or not all(isinstance(s, str) and s for s in self.stop)):
            raise RequestError(f"{setting('stop')}={self.stop!r:.80} must be a non-empty string or a list of "
                               f"up to {MAX_STOPS} non-empty strings.")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise RequestError(f"{setting(name)}={value!r:.80} must be a number in [-2, 2] (0: off).")
            setattr(self, name, float(value))
        top = self.logprobs
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_LOGPROBS):
            raise RequestError(f"{setting('logprobs')}={top!r:.80} must be an integer in [0, {MAX_LOGPROBS}] "
                               f"(alternatives per token beside the chosen one), or None.")
        self.stop = list(self.stop)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_logits(self) -> bool:
        """Whether the target's full logits are needed at each position (sampling, penalties, logprobs), not
        only its greedy choice."""
        return not self.greedy or self.penalized or self.logprobs is not None


def add_sampling_args(p: argparse.ArgumentParser, max_tokens_flag: str = "--max-new-tokens",
                      max_tokens: int = 128, extras: bool = False) -> None:
    """Command-line flags for a run's SamplingParams (`sampling_from_args`); `extras`: the penalties and
    stop strings too."""
    g = p.add_argument_group("sampling")
    g.add_argument(max_tokens_flag, dest="max_new_tokens", type=int, default=max_tokens, metavar="N",
                   help="most tokens to generate per answer")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 picks the most likely token (greedy)")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample only from the most likely tokens holding this much probability (1: all)")
    g.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample only from the K most likely tokens (0: no limit)")
    if not extras:
        return
    g.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X from the logit of every token already in the answer, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract X times its count from the logit of every token in the answer, in [-2, 2]")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end the answer where TEXT first appears (cut before it); repeatable "
                        "(default: none)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    extra = {}
    if hasattr(args, "presence_penalty"):
        extra = dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                     stop=args.stop or [])
    return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, **extra)
