"""Acceptance: how many candidate tokens the target keeps, and its own token that follows (the bonus).

Both rules are lossless. A row verified [pending, d1 .. d_n]; target output i scores position i+1.

Sampled requests use "sample, then match": at each verified position the target's own token is drawn
from its (temperature / top-k / top-p) distribution with that position's keyed uniform
(sampler.draw); a candidate is kept while it equals the drawn token, and the first drawn token that
differs (or the one after the last candidate) is the bonus. Every committed token is thus exactly
the token plain sampled decoding draws at that position with the same seed, so the output has the
target distribution for any proposer, and a candidate is kept with probability p(candidate), as in
classic speculative sampling with a deterministic draft.
"""

from __future__ import annotations

import torch

from blockspec.engine.sampler import draw, filtered_probs
from blockspec.engine.sequence import Sequence
from blockspec.sampling_params import SamplingParams


def accept(seq: Sequence, candidates: torch.Tensor, host_candidates: torch.Tensor,
           target: torch.Tensor) -> tuple[int, int]:
    """(accepted count, bonus) for one row's n candidates (on the device and on the CPU) and the target's
    n + 1 outputs there (greedy token ids for a greedy request, fp32 logits for a sampled one)."""
    if seq.params.greedy:
        return greedy_accept(host_candidates, target)
    return sampled_accept(host_candidates, target, seq.params, seq.seed, seq.next_position)


def greedy_accept(drafts: torch.Tensor, choice: torch.Tensor) -> tuple[int, int]:
    """drafts [B-1], choice [B] (the target's argmax per position): the longest prefix where
    draft == choice, and the target's choice at the first mismatch (or after the last draft) as the bonus."""
    if drafts.numel() == 0:  # a plain step
        return 0, int(choice[0])
    accepted = int((drafts == choice[:-1]).int().cumprod(0).sum())
    return accepted, int(choice[accepted])


def sampled_accept(drafts: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams, seed: int,
                   position: int) -> tuple[int, int]:
    """drafts [n] (CPU), target_logits [n + 1, V]; `position`: the absolute position of the token that
    target output 0 scores. Sample, then match (see the module docstring)."""
    drawn = draw(filtered_probs(target_logits, params), seed, position)
    accepted = 0
    for proposed, token in zip(drafts.tolist(), drawn):
        if proposed != token:
            break
        accepted += 1
    return accepted, drawn[accepted]
