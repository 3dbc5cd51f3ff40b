"""Turning logits into tokens: temperature, joint top-k/top-p filtering, seeded sampling."""

from __future__ import annotations

import torch

from blockspec.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution a request samples from, for logits [n, V] (float32).

    top-k and top-p are applied jointly on the original (temperature-scaled) distribution: a token
    stays if it is among the k most likely and the mass strictly before it is < top_p. Renormalising
    after top-k and then cutting by top-p would be a different distribution.
    """
    probs = torch.softmax(logits / params.temperature, dim=-1)
    use_k = params.top_k > 0 and params.top_k < probs.shape[-1]
    if not use_k and params.top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = (sorted_probs.cumsum(dim=-1) - sorted_probs) < params.top_p
    if use_k:
        keep[..., params.top_k :] = False
    keep[..., 0] = True
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
    return filtered / filtered.sum(dim=-1, keepdim=True)


def draw_device(probs: torch.Tensor, generator: torch.Generator | None) -> torch.device:
    """Where random draws happen: on the request's generator (a CPU one, so a seed gives the same stream on
    every device; CUDA refuses a CPU generator for its own tensors), else on the probabilities' device."""
    return probs.device if generator is None else generator.device


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [n, V], on the draw device."""
    return torch.multinomial(probs.to(draw_device(probs, generator)), 1, generator=generator).squeeze(-1)


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token from logits [V] of one request."""
    if params.greedy:
        return int(logits.argmax())
    return int(sample(filtered_probs(logits.unsqueeze(0), params), generator)[0])
