"""`Proposal`: a proposer's tokens and, where it sampled them, the distributions it sampled them from.

Under the "rejection" acceptance rule (rejection.py) a sampled request's draft does not propose its argmax:
it samples each token from its own proposal distribution q at the request's temperature, and the verifier
needs q to judge it (min(1, p/q)). A proposer returns exactly what it sampled from: per proposed token,
K candidate ids and their probabilities given the row's earlier proposed tokens. Greedy rows (and every
row under "match") propose deterministically: their q is one-hot at the proposed token.

A proposer is a function of (per-row temperatures, uniforms [b, γ]) -> Proposal; the uniforms are keyed
by (seed, absolute position, PROPOSAL) (`proposal_uniforms`), so a seed's proposals do not depend on the
batch. `sample_ranked` is the DFlash draft's: its K best tokens per position by the target head, q =
softmax(their scores / T), positions independent of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from blockspec.engine.sampler import PROPOSAL, uniform
from blockspec.engine.sequence import Sequence

AcceptRule = Literal["match", "rejection"]
PROPOSAL_TOPK = 16  # the candidates a sampled DFlash proposal is drawn among, per position
# One proposed token's distribution: candidate ids [K] and their probabilities [K] (CPU; None: one-hot).
Drawn = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Proposal:
    """tokens [b, γ] (on the device); candidates [b, γ, K] (long) and q [b, γ, K] (float32), on the CPU:
    q[r, i, k] is the probability that token i of row r was candidates[r, i, k], given the row's tokens
    before it. Both None where every row proposed deterministically (q one-hot at each token)."""

    tokens: torch.Tensor
    candidates: torch.Tensor | None = None
    q: torch.Tensor | None = None

    def drawn(self, row: int) -> dict[int, Drawn]:
        """Row `row`'s sampled tokens by node (token i is node i + 1 of its chain); empty if deterministic."""
        if self.q is None:
            return {}
        return {i + 1: (self.candidates[row, i], self.q[row, i]) for i in range(self.q.shape[1])}


def temperatures(seqs: list[Sequence], rule: AcceptRule) -> list[float]:
    """Each row's proposal temperature: its own under "rejection" when it samples, else 0 (its argmax)."""
    return [0.0 if rule == "match" or s.params.greedy else s.params.temperature for s in seqs]


def proposal_uniforms(seqs: list[Sequence], width: int) -> torch.Tensor:
    """[b, width] float64: the keyed uniforms of each row's proposed tokens (token i at the row's
    next_position + i, the position it would take)."""
    keys = [[uniform(s.seed, s.next_position + i, PROPOSAL) for i in range(width)] for s in seqs]
    return torch.tensor(keys, dtype=torch.float64).view(len(seqs), width)


def sample_ranked(logprobs: torch.Tensor, ids: torch.Tensor, temps: list[float], uniforms: torch.Tensor,
                  device: torch.device) -> Proposal:
    """From each position's K best tokens (ids [b, γ, K], best first) and their log-probabilities: per
    row, q = softmax(logprobs / T) over the K (one-hot at the best where T is 0), and a token drawn from q
    by inverse CDF with that position's uniform. The draw reads q as stored (float32), so q is exactly the
    distribution sampled from."""
    logprobs, ids = logprobs.detach().to("cpu", torch.float64), ids.detach().cpu()
    temp = torch.tensor(temps, dtype=torch.float64).clamp_min(torch.finfo(torch.float32).tiny).view(-1, 1, 1)
    q = torch.softmax((logprobs - logprobs.amax(dim=-1, keepdim=True)) / temp, dim=-1).float()
    greedy = torch.tensor([t == 0 for t in temps])
    q[greedy] = torch.nn.functional.one_hot(torch.zeros_like(ids[greedy][..., 0]), ids.shape[-1]).float()
    cdf = q.double().cumsum(dim=-1)
    total = cdf[..., -1:]
    chosen = torch.searchsorted(cdf, (uniforms.unsqueeze(-1) * total).contiguous(), right=True)
    chosen = torch.minimum(chosen, torch.searchsorted(cdf, total.contiguous()))  # u * total rounded up
    tokens = ids.gather(-1, chosen).squeeze(-1)
    return Proposal(tokens.to(device), ids, q)
