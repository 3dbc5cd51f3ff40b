"""Acceptance: how many candidate tokens the target keeps, and its own token that follows (the bonus).

Both rules are lossless. A row verified [pending, d1 .. d_n]; target output i scores position i+1.
Candidates are deterministic tokens (the draft's argmax, a prompt-lookup copy), which is what the
sampled rule assumes.
"""

from __future__ import annotations

import torch

from blockspec.engine.sampler import draw_device, filtered_probs, sample
from blockspec.engine.sequence import Sequence
from blockspec.sampling_params import SamplingParams


def accept(seq: Sequence, candidates: torch.Tensor, host_candidates: torch.Tensor,
           target: torch.Tensor) -> tuple[int, int]:
    """(accepted count, bonus) for one row's n candidates (on the device and on the CPU) and the target's
    n + 1 outputs there (greedy token ids for a greedy request, fp32 logits for a sampled one)."""
    if seq.params.greedy:
        return greedy_accept(host_candidates, target)
    return sampled_accept(candidates, target, seq.params, seq.generator)


def greedy_accept(drafts: torch.Tensor, choice: torch.Tensor) -> tuple[int, int]:
    """drafts [B-1], choice [B] (the target's argmax per position): the longest prefix where
    draft == choice, and the target's choice at the first mismatch (or after the last draft) as the bonus."""
    if drafts.numel() == 0:  # a plain step
        return 0, int(choice[0])
    accepted = int((drafts == choice[:-1]).int().cumprod(0).sum())
    return accepted, int(choice[accepted])


def sampled_accept(
    drafts: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams,
    generator: torch.Generator | None,
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
