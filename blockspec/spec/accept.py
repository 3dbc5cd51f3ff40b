"""Verification: how many drafted tokens the target accepts, and the bonus token that follows.

Both rules are lossless. Candidates are [bonus, d1 .. d_{B-1}]; target row i scores position i+1.
"""

from __future__ import annotations

import torch

from blockspec.engine.sampler import draw_device, filtered_probs, sample
from blockspec.sampling_params import SamplingParams


def greedy_accept(drafts: torch.Tensor, choice: torch.Tensor) -> tuple[int, int]:
    """drafts [B-1], choice [B] (the target's argmax per position): the longest prefix where
    draft == choice, and the target's choice at the first mismatch (or after the last draft) as the bonus."""
    accepted = int((drafts == choice[:-1]).int().cumprod(0).sum())
    return accepted, int(choice[accepted])


def sampled_accept(
    drafts: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, int]:
    """Speculative sampling with a deterministic (argmax) draft: accept d_i with probability p_i(d_i);
    at the first rejection draw the bonus from p_i with d_i removed and renormalised; if all are
    accepted draw it from the last position. The output then has exactly the target distribution."""
    probs = filtered_probs(target_logits, params)
    uniforms = torch.rand(drafts.shape[0], generator=generator, device=draw_device(probs, generator))
    p_draft = probs[:-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1).to(uniforms.device)
    rejected = (uniforms >= p_draft).nonzero()
    if rejected.numel() == 0:
        return drafts.shape[0], int(sample(probs[-1:], generator)[0])
    i = int(rejected[0])
    residual = probs[i].clone()
    residual[drafts[i]] = 0.0
    return i, int(sample((residual / residual.sum()).unsqueeze(0), generator)[0])
