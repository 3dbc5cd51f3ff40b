"""Turning logits into tokens: temperature, joint top-k/top-p filtering, and keyed draws.

A sampled token is drawn by inverse CDF with one uniform that depends only on the request's seed and the
token's absolute position (`uniform`). Whatever path reaches a position (a plain step, a DFlash block,
a prompt-lookup copy, a recomputation after preemption) and whatever the batch, the block size, the
thread count or the device, the draw there is the same: a seed reproduces its tokens up to the logits'
rounding, and DFlash's sampled output under the "match" rule equals plain sampled decoding token for token
(accept.py). The "rejection" rule (rejection.py) draws more than one number at a position: each draw has
its own stream (`PROPOSAL`, `ACCEPT`, `RESIDUAL`), keyed by (seed, position, stream, index) alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.errors import RequestError
from blockspec.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Independent streams of keyed uniforms at one position: the target's own draw (plain decoding's, and the
# bonus), a sampled proposal, a candidate's accept test (index: its place among its siblings), and the draw
# from the residual after a rejection.
TARGET, PROPOSAL, ACCEPT, RESIDUAL = 0, 1, 2, 3


class SamplingError(RequestError):
    """The target's distribution for a request could not be sampled (non-finite logits)."""


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's log-probability under the target and its `top` most likely alternatives there (id,
    log-probability), best first: from the log-softmax of the target's raw logits (before penalties,
    temperature, top-k and top-p, as OpenAI-compatible servers report them)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit integers whose outputs look independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: int = TARGET, index: int = 0) -> float:
    """A uniform number in [0, 1) keyed by (seed, position, stream, index) alone: counter-based, no
    generator state. The target stream's first number is the one plain decoding draws."""
    x = _mix64(_mix64(seed & _MASK64) ^ (position & _MASK64))
    if stream or index:
        x = _mix64(x ^ ((stream << 32) | index))
    return (x >> 11) * 2.0**-53


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution a request samples from, for logits [n, V] (float32).

    The logits are shifted by their maximum before the temperature divides them: the top token then
    scores exactly 0 and the others <= 0, so any temperature > 0, however small, gives a finite
    distribution (one-hot in the limit) instead of inf / inf = NaN. The divisor is kept at or above the
    float's smallest normal number, below which every logit gap would round to -inf anyway.

    top-k and top-p are applied jointly on the original (temperature-scaled) distribution: a token
    stays if it is among the k most likely and the mass strictly before it is < top_p. Renormalising
    after top-k and then cutting by top-p would be a different distribution.
    """
    logits = logits.float()
    shifted = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(shifted / max(params.temperature, torch.finfo(torch.float32).tiny), dim=-1)
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


def draw(probs: torch.Tensor, seed: int, first_position: int, stream: int = TARGET) -> list[int]:
    """One token per row of probs [n, V], row i drawn at absolute position first_position + i with that
    position's keyed uniform (of `stream`), by inverse CDF in float64 on the CPU (so every device draws
    alike). A token of probability 0 is never drawn. Raises SamplingError for a row that is not a
    distribution."""
    cdf = probs.detach().to("cpu", torch.float64).cumsum(dim=-1)
    total = cdf[:, -1]
    if not bool(torch.isfinite(total).all()) or bool((total <= 0).any()):
        raise SamplingError("The target's next-token distribution is not finite (the model produced NaN or "
                            "infinite logits); the request cannot be sampled.")
    u = torch.tensor([uniform(seed, first_position + i, stream) for i in range(cdf.shape[0])],
                     dtype=torch.float64)
    tokens = torch.searchsorted(cdf, (u * total).unsqueeze(-1), right=True).squeeze(-1)
    # u * total may round up to total: then the last token of non-zero probability (where cdf reaches it)
    last = torch.searchsorted(cdf, total.unsqueeze(-1).contiguous()).squeeze(-1)
    return torch.minimum(tokens, last).tolist()


def next_token(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """The token at absolute `position` from logits [V] of one request."""
    if params.greedy:
        return int(logits.argmax())
    return draw(filtered_probs(logits.unsqueeze(0), params), seed, position)[0]


def penalized(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
              candidates: list[int]) -> torch.Tensor:
    """logits [n, V] of n consecutive positions after `output_ids`, row i following output_ids +
    candidates[:i], with presence and frequency penalties applied as plain decoding applies them there:
    row i sees the counts of the tokens generated before its position. A candidate's row matters only if
    every candidate before it is accepted, so each row is exactly what a plain step at that position sees."""
    if not params.penalized:
        return logits
    rows, vocab = logits.shape
    history = torch.tensor(output_ids + candidates[: rows - 1], dtype=torch.long)
    counts = torch.zeros(rows, vocab, dtype=torch.float32)
    base = torch.bincount(history[: len(output_ids)], minlength=vocab)[:vocab].float()
    counts[:] = base
    for i in range(1, rows):  # row i also counts candidates[:i]
        counts[i:, int(history[len(output_ids) + i - 1])] += 1
    counts = counts.to(logits.device)
    penalty = params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits.float() - penalty


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under its row of raw logits [n, V] and the row's `top` best."""
    if not tokens:
        return []
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1).cpu()
    chosen = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    best_values, best_ids = logprobs.topk(top, dim=-1) if top else (None, None)
    out = []
    for i, token in enumerate(tokens):
        alternatives = () if not top else tuple(zip(best_ids[i].tolist(), best_values[i].tolist()))
        out.append(TokenLogprob(token, chosen[i], alternatives))
    return out
