"""The candidate selector of a DFlash2 draft: a lattice over each drafted position's K candidates, and the
walk that picks a path through it.

Position i of a block (0 = the first drafted token) has K candidates c with unary scores u_i[c] (the
target head's top-K over the draft's output). Each edge from a predecessor p (the anchor, i.e. the
block's pending token, at i = 0; else a candidate of position i-1) scores
    S_i(p, c) = u_i[c] + sum_r A[p, r] * P(h_i)[r] * B[c, r]
with the codebooks A (predecessor) and B (successor) [V, r] and the projection P (H -> r) of the draft's
hidden state h_i. The walk goes left to right from the anchor: greedy (argmax of the chosen
predecessor's row) or, at temperature T > 0, drawn from softmax(S_i(prev, .) / T) by inverse CDF.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.linear import Linear


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, rank: int, vocab_size: int) -> None:
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = Linear(hidden_size, rank)

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        # bare names, no `.weight`: the format stores the codebooks so (the projection names its own)
        return {f"{path}.predecessor_codebook": self.predecessor_codebook,
                f"{path}.successor_codebook": self.successor_codebook}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        getattr(self, name.rpartition(".")[2]).copy_(tensor)

    @torch.no_grad()
    def init_random(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Fresh weights ~ N(0, std) (drawn on the CPU from `generator`, so a seed gives the same draft)."""
        projection = self.hidden_projection
        for name, shape in (("predecessor_codebook", self.predecessor_codebook.shape),
                            ("successor_codebook", self.successor_codebook.shape),
                            ("hidden_projection.weight", (projection.out_features, projection.in_features))):
            values = torch.randn(shape, generator=generator) * std
            (projection if name.startswith("hidden") else self).load(name, values)

    def lattice(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                anchor: torch.Tensor) -> torch.Tensor:
        """Edge scores fp32 [b, γ, K, K] (predecessor row, candidate column) for the draft's hidden states
        at the drafted positions [b, γ, H], their candidates' unary scores [b, γ, K] and ids [b, γ, K],
        and the anchors [b]. Position 0's rows all hold the anchor's edges."""
        b, _, k = candidates.shape
        predecessors = torch.cat([anchor.view(b, 1, 1).expand(b, 1, k), candidates[:, :-1]], dim=1)
        return self.scores(hidden, unary, candidates, predecessors)

    def edges(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
              predecessors: torch.Tensor) -> torch.Tensor:
        """One lattice row per position: the scores fp32 [N, K] of candidates [N, K] (unary [N, K]) after
        a given predecessor [N] each, for hidden states [N, H] (training's teacher-forced rows)."""
        return self.scores(hidden, unary, candidates, predecessors.unsqueeze(-1)).squeeze(-2)

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
               predecessors: torch.Tensor) -> torch.Tensor:
        """S(p, c) fp32 [..., P, K] from predecessors [..., P] to candidates [..., K] (unary [..., K]) at
        positions with hidden states [..., H]: the projection runs once per position."""
        projected = self.hidden_projection(hidden).float().unsqueeze(-2)  # [..., 1, r]
        left = F.embedding(predecessors, self.predecessor_codebook).float() * projected  # [..., P, r]
        right = F.embedding(candidates, self.successor_codebook).float()  # [..., K, r]
        return unary.float().unsqueeze(-2) + left @ right.transpose(-1, -2)


@dataclass
class Walk:
    """A walked path: its tokens [b, γ], every position's candidates [b, γ, K] and the proposal
    distribution q [b, γ, K] (fp32) over them given the predecessor the walk chose (one-hot when greedy)."""

    tokens: torch.Tensor
    candidates: torch.Tensor
    q: torch.Tensor


def walk(scores: torch.Tensor, candidates: torch.Tensor, temperatures: torch.Tensor | None = None,
         uniforms: torch.Tensor | None = None) -> Walk:
    """The left-to-right walk over a lattice fp32 [b, γ, K, K] (`CandidateSelector.lattice`). temperatures
    [b] (None, or a row's 0: greedy, ties to the better-ranked candidate); a row at T > 0 draws position i
    with uniforms[row, i] in [0, 1): the first candidate whose cumulative probability exceeds u * total
    (float64), never one of probability 0."""
    b, steps, k = candidates.shape
    device = scores.device
    rows = torch.arange(b, device=device)
    sampled = None
    if temperatures is not None and bool((temperatures > 0).any()):
        if uniforms is None:
            raise ValueError("walk: rows with temperature > 0 need uniforms [b, γ].")
        sampled = (temperatures > 0).to(device).view(b, 1)
        divisor = temperatures.to(device, torch.float32).clamp_min(torch.finfo(torch.float32).tiny).view(b, 1)
        uniforms = uniforms.to(device, torch.float64)
    chosen = torch.zeros(b, dtype=torch.long, device=device)  # position 0: every row is the anchor's
    picks, qs = [], []
    for i in range(steps):
        row = scores[rows, i, chosen]  # [b, K]: the chosen predecessor's edges
        best = row.argmax(dim=-1)
        q = F.one_hot(best, k).float()
        if sampled is not None:
            probs = torch.softmax((row - row.max(dim=-1, keepdim=True).values) / divisor, dim=-1)
            cdf = probs.double().cumsum(dim=-1)
            total = cdf[:, -1:].contiguous()
            drawn = torch.searchsorted(cdf, (uniforms[:, i : i + 1] * total).contiguous(), right=True)
            last = torch.searchsorted(cdf, total)  # where u * total rounds up to the total
            drawn = torch.minimum(drawn, last).squeeze(-1)
            best = torch.where(sampled.view(b), drawn, best)
            q = torch.where(sampled, probs, q)
        chosen = best
        picks.append(best)
        qs.append(q)
    index = torch.stack(picks, dim=1)  # [b, γ]
    return Walk(candidates.gather(-1, index.unsqueeze(-1)).squeeze(-1), candidates, torch.stack(qs, dim=1))
