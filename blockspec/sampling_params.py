"""Per-request sampling parameters, validated when constructed."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from blockspec.errors import RequestError


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = no top-k
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's end tokens
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens={self.max_tokens!r} must be an integer >= 1.")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
            0.0 <= self.temperature < float("inf")
        ):
            raise RequestError(f"temperature={self.temperature!r} must be a number >= 0 (0 means greedy).")
        top_p = self.top_p
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
            raise RequestError(f"top_p={self.top_p!r} must be in (0, 1].")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise RequestError(f"top_k={self.top_k!r} must be an integer >= 1, or 0 / -1 to disable top-k.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -(2**63) <= self.seed < 2**64):
            raise RequestError(f"seed={self.seed!r:.80} must be an integer in [-2**63, 2**64) or None.")
        bad = [t for t in self.stop_token_ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise RequestError(f"stop_token_ids contains invalid ids {bad!r}; they must be non-negative "
                               f"integers.")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def add_sampling_args(p: argparse.ArgumentParser, max_tokens_flag: str = "--max-new-tokens") -> None:
    """Command-line flags for a run's SamplingParams (`sampling_from_args`)."""
    p.add_argument(max_tokens_flag, dest="max_new_tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)
