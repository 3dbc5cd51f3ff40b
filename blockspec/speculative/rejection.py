"""The "rejection" acceptance rule: speculative sampling with the proposer's distribution q.

At a verified position the target's distribution is p (filtered: temperature, top-k, top-p, penalties).
A proposed token d drawn from q is kept with probability min(1, p(d) / q(d)); on its rejection the token
there is drawn from the residual norm(max(0, p - q)) (p itself if that is all zero), and the step ends.
Then P(token = y) = min(p(y), q(y)) + (1 - sum_x min(p(x), q(x))) * residual(y) = p(y): exact. A row
whose candidates were all kept takes its bonus from p at the position after the last. A deterministic
proposal (a prompt-lookup copy, a greedy row's argmax, a tree's extra branch) has a one-hot q: it is kept
with probability p(d), else the token is drawn from p without d, as under "match".

Trees, by recursive rejection sampling. A node's children are judged one after another against a running
target r (p at first): the sampled child first (a tree holds at most one per node: the sampled chain is
the tree's spine), then the deterministic ones in node order. A child with distribution q_c is kept with
probability min(1, r(t_c) / q_c(t_c)); else r becomes norm(max(0, r - q_c)) and the next child is judged.
If none is kept, the token is drawn from the last r. Why this is exact: each stage outputs its target r
exactly, as for a chain, provided its token is distributed as its q given that the stage is reached.
The sampled child is judged first, so nothing before it depends on its draw: it holds. A deterministic
child's q is one-hot at its token, and one-hot stages are exact for ANY fixed token, whatever it was
chosen from (the siblings of a sampled token are chosen after its draw, distinct from it): the stage keeps
t with probability r(t) and otherwise draws from r without t, which is r again. Skipping a deterministic
stage is exact too, so where a copy's node holds the sampled token it is judged once, as the sampled one.
Below a kept child the same holds one position on: the child's own sampled child was drawn from q given
its ancestors, independently of the tests that kept them.

Randomness: the test of a node's i-th judged child uses the keyed uniform (seed, position, ACCEPT, i), the
residual draw (seed, position, RESIDUAL), a bonus (seed, position, TARGET); a walk visits one node per
depth, so no number is used twice. The output has the target distribution; unlike "match" it is not plain
decoding's token for token (a seed reproduces it for the same sequence of step shapes).
"""

from __future__ import annotations

import torch

from blockspec.engine.sampler import ACCEPT, RESIDUAL, TARGET, draw, uniform
from blockspec.speculative.proposal import Drawn

# One child to judge: its token and, if it was sampled, what it was sampled from (None: one-hot).
Stage = tuple[int, Drawn | None]


def judge(p: torch.Tensor, stages: list[Stage], seed: int, position: int) -> tuple[int | None, int]:
    """p [V]: the target's distribution at `position`; `stages` in the order judged. Returns (the index
    of the kept stage, or None, and the token at the position: the kept one, else a draw from the
    residual; with no stages at all, a draw from p)."""
    r = p.detach().to("cpu", torch.float64)
    if not stages:
        return None, draw(r.unsqueeze(0), seed, position, TARGET)[0]
    for index, (token, dist) in enumerate(stages):
        q = stage_q(r, token, dist)
        if uniform(seed, position, ACCEPT, index) * float(q[token]) < float(r[token]):
            return index, token
        rest = (r - q).clamp_min_(0.0)
        total = float(rest.sum())
        if total > 0:  # all zero only where r <= q everywhere, when the test could not fail but by rounding
            r = rest / total
    return None, draw(r.unsqueeze(0), seed, position, RESIDUAL)[0]


def stage_q(like: torch.Tensor, token: int, dist: Drawn | None) -> torch.Tensor:
    """A stage's proposal distribution over the vocabulary (float64, shaped `like`): its sampled candidates'
    probabilities, or one-hot at its token for a deterministic one."""
    q = torch.zeros_like(like)
    if dist is None:
        q[token] = 1.0
    else:
        q[dist[0]] = dist[1].double()
    return q


def rejection_chain(tokens: list[int], drawn: dict[int, Drawn], probs: torch.Tensor, seed: int,
                    position: int) -> tuple[int, int]:
    """(accepted count, bonus) for a chain of n proposed tokens (token i is node i + 1; `drawn`: those
    sampled) and the target's distributions probs [n + 1, V], row 0 at absolute `position`."""
    for i, token in enumerate(tokens):
        kept, chosen = judge(probs[i], [(token, drawn.get(i + 1))], seed, position + i)
        if kept is None:
            return i, chosen
    return len(tokens), judge(probs[len(tokens)], [], seed, position + len(tokens))[1]


def stages(children: dict[int, int], tokens: tuple[int, ...],
           drawn: dict[int, Drawn]) -> list[tuple[int, Stage]]:
    """A tree node's children (token -> node) in the order they are judged, each with its stage: the
    sampled one first, then the deterministic ones by node."""
    order = sorted(children.values(), key=lambda node: (node not in drawn, node))
    return [(node, (tokens[node - 1], drawn.get(node))) for node in order]
