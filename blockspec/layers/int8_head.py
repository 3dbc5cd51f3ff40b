"""Exact greedy argmax of the LM head at a quarter of its memory traffic (the CPU greedy form of `LMHead`).

On CPU a decode step is bound by reading weights, and SmolLM2's fp32 LM head is a fifth of them.
Greedy decoding needs only the argmax, so we first score every token with an int8 copy of the head
(bf16 activations, `torch._weight_int8pack_mm`), bound each score's error rigorously, and compute
exact fp32 logits (`dense_product`'s) only for the few tokens whose bound reaches the best lower bound.
The result is the argmax of the fp32 logits (ties to the lowest id, like `torch.argmax`); typically 1-5
rows are recomputed.

Error bound for token v with scale s_v (|q| <= 127 so |w| <= 127.5 s_v), h the fp32 input:
  bf16 rounding of h:        <= 2^-9 * 127.5 s_v * |h|_1   (0.249 s_v |h|_1)
  int8 rounding of w:        <= 0.5 s_v (1 + 2^-9) |h|_1    (0.501)
  fp32 accumulation (both):  <= 2 * H * 2^-24 * 127.5 s_v |h|_1   (0.004 for H = 576)
  bf16 rounding of the score: <= 2^-9 |score|, taken as 2^-8 |score|
so we use (0.76 + accumulation term) * s_v * |h|_1 + 2^-8 |score|.
"""

from __future__ import annotations

import torch

from blockspec.layers.dense import dense_product


class Int8ArgmaxHead:
    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        # torch 2.13's CPU kernel returns garbage (or crashes) for a hidden size that is not a multiple
        # of 16 (measured); every real model's is.
        return weight.dim() == 2 and weight.shape[1] % 16 == 0

    def __init__(self, weight: torch.Tensor) -> None:
        """weight: the fp32 LM head [V, H] (kept by reference for the exact recomputation)."""
        if not self.supports(weight):
            raise ValueError(f"Int8ArgmaxHead needs a hidden size that is a multiple of 16, got "
                             f"{list(weight.shape)}")
        self.weight = weight
        w = weight.detach().float()
        amax = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny * 127)
        scale = (amax / 127).to(torch.bfloat16)
        too_small = scale.float() * 127 < amax  # round the scale up so that |q| <= 127
        scale = torch.where(too_small, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
        self.scale = scale.contiguous()
        self.qweight = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
        hidden = w.shape[1]
        accumulation = 2 * hidden * 2.0**-24 * 127.5
        self.bound_scale = (0.76 + accumulation) * self.scale.float()  # times |h|_1 per row

    def rows(self, ids: torch.Tensor) -> "Int8ArgmaxHead":
        """A head over the token ids `ids` only, for `scores` (a draft vocabulary); no `argmax`."""
        sub = object.__new__(Int8ArgmaxHead)
        sub.weight = None
        sub.qweight, sub.scale, sub.bound_scale = self.qweight[ids], self.scale[ids], self.bound_scale[ids]
        return sub

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Approximate logits [M, V] (bf16) for h [M, H]: good enough to rank draft proposals."""
        return torch.ops.aten._weight_int8pack_mm(h.to(torch.bfloat16), self.qweight, self.scale)

    def argmax(self, h: torch.Tensor) -> torch.Tensor:
        """The exact fp32 argmax of h @ weight.T for h [M, H] (fp32), as token ids [M]."""
        return self.best(h)[1]

    def best(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact fp32 maximum of h @ weight.T per row of h [M, H] (fp32) and its token id."""
        approx = self.scores(h).float()
        bound = h.abs().sum(dim=-1, keepdim=True) * self.bound_scale + approx.abs() * 2.0**-8
        best_low = (approx - bound).amax(dim=-1, keepdim=True)
        # A token outside every row's candidate set scores below that row's best lower bound, so taking
        # the union of all rows' candidates leaves each row's argmax unchanged.
        candidates = (approx + bound >= best_low).any(dim=0).nonzero().squeeze(1)
        exact = dense_product(h, self.weight[candidates])  # the bits the full head gives these rows
        best = exact.argmax(dim=-1)
        return exact.gather(-1, best.unsqueeze(-1)).squeeze(-1), candidates[best]
