"""RMSNorm, which can fold its weight into the projection it feeds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.fused import fused_ops
from blockspec.layers.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight: nn.Parameter | None = nn.Parameter(torch.ones(dim))

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        return {} if self.weight is None else {f"{path}.weight": self.weight}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        self.weight.copy_(tensor)

    @property
    def folded(self) -> bool:
        return self.weight is None

    def fold_into(self, projection: Linear) -> None:
        """Move the weight into the projection this norm feeds (W (g * x) == (W diag g) x): a vector
        multiply less per call. Output changes by rounding only; the layers no longer match their
        checkpoint. A projection held as blocks keeps its weight exact: the norm keeps its own."""
        if self.weight is not None and projection.foldable:
            projection.scale_inputs(self.weight)
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (ops := fused_ops(x)) is not None:
            return ops.rms_norm(x, weight, self.eps)
        if x.dtype != torch.float32:  # F.rms_norm accumulates low-precision inputs in fp32
            return F.rms_norm(x, (x.shape[-1],), None if weight is None else weight.to(x.dtype), self.eps)
        # F.rms_norm's math in fewer kernels (equal up to fp32 rounding). On the decode path (one row, 61
        # norms per token) its internal casts and reductions cost ~0.5 ms per token more on CPU, and a 1x1
        # addmm (eps + x.x/H in one kernel) ~1 ms less than a reduction chain.
        if x.numel() == x.shape[-1]:
            flat = x.reshape(1, -1)
            mean_square = torch.addmm(self._eps_like(x), flat, flat.t(), alpha=1.0 / flat.shape[1])
            scale = mean_square.rsqrt_().view(*x.shape[:-1], 1)
        else:
            scale = torch.linalg.vecdot(x, x).unsqueeze(-1).div_(x.shape[-1]).add_(self.eps).rsqrt_()
        return torch.mul(x, scale) if weight is None else torch.mul(x, scale).mul_(weight)

    def _eps_like(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.__dict__.get("_eps")
        if eps is None or eps.device != x.device or eps.dtype != x.dtype:
            eps = self.__dict__["_eps"] = torch.full((1, 1), self.eps, dtype=x.dtype, device=x.device)
        return eps
