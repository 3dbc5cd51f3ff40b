"""`RequestStats`: what decoding did for one request, the one record every report reads (the API's
`RequestOutput`, the server's `blockspec` field and metrics, `generate --json`, `bench`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class RequestStats:
    # Tokens committed per DFlash verify step, the bonus included (1..block size); plain decoding: 1 a step.
    accept_lengths: list[int] = field(default_factory=list)
    # Tokens committed per prompt-lookup step (a copy from the context verified instead of a draft block):
    # kept apart so that tau stays the draft's own.
    lookup_accept_lengths: list[int] = field(default_factory=list)
    # Tokens committed per merged step (a copy and the draft's candidates verified as one tree): neither the
    # draft's tau nor the copies' alone, so kept apart from both (each token's source says which branch won).
    merged_accept_lengths: list[int] = field(default_factory=list)
    plain_steps: int = 0  # plain steps a DFlash request took where speculating did not pay (adaptive)
    tree_steps: int = 0  # DFlash verify steps that verified a tree of candidates (in accept_lengths too)

    @classmethod
    def pooled(cls, many: Iterable[RequestStats]) -> RequestStats:
        out = cls()
        for stats in many:
            out.accept_lengths += stats.accept_lengths
            out.lookup_accept_lengths += stats.lookup_accept_lengths
            out.merged_accept_lengths += stats.merged_accept_lengths
            out.plain_steps += stats.plain_steps
            out.tree_steps += stats.tree_steps
        return out

    def copy(self) -> RequestStats:
        return RequestStats(list(self.accept_lengths), list(self.lookup_accept_lengths),
                            list(self.merged_accept_lengths), self.plain_steps, self.tree_steps)

    @property
    def mean_accept_length(self) -> float | None:
        """tau: mean tokens per DFlash verify step; None without one (no draft steps: not 0), as the lookup
        and merged taus."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None

    @property
    def lookup_mean_accept_length(self) -> float | None:
        lookups = self.lookup_accept_lengths
        return sum(lookups) / len(lookups) if lookups else None

    @property
    def merged_mean_accept_length(self) -> float | None:
        merged = self.merged_accept_lengths
        return sum(merged) / len(merged) if merged else None

    @property
    def num_steps(self) -> int:
        return (len(self.accept_lengths) + len(self.lookup_accept_lengths) + len(self.merged_accept_lengths)
                + self.plain_steps)

    @property
    def tokens_per_step(self) -> float | None:
        """Committed tokens over every step (DFlash, prompt lookup, merged and plain)."""
        committed = (sum(self.accept_lengths) + sum(self.lookup_accept_lengths)
                     + sum(self.merged_accept_lengths) + self.plain_steps)
        return committed / self.num_steps if self.num_steps else None

    def summary(self) -> dict:
        """The JSON fields every report shares."""
        tau, lookup_tau, merged_tau = (self.mean_accept_length, self.lookup_mean_accept_length,
                                       self.merged_mean_accept_length)
        return {"accept_lengths": list(self.accept_lengths),
                "mean_accept_length": None if tau is None else round(tau, 4),
                "num_verify_steps": len(self.accept_lengths), "num_tree_steps": self.tree_steps,
                "num_plain_steps": self.plain_steps,
                "lookup_accept_lengths": list(self.lookup_accept_lengths),
                "num_lookup_steps": len(self.lookup_accept_lengths),
                "lookup_mean_accept_length": None if lookup_tau is None else round(lookup_tau, 4),
                "merged_accept_lengths": list(self.merged_accept_lengths),
                "num_merged_steps": len(self.merged_accept_lengths),
                "merged_mean_accept_length": None if merged_tau is None else round(merged_tau, 4)}
