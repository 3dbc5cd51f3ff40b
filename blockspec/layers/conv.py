"""The grouped dynamic causal convolution of a DFlash2 draft layer.

Around a sublayer (attention or MLP, after its pre-norm): `prepare` convolves the sublayer's input and
`finish` its output, each with kernel base[side, t, c] + delta[i, side, t, c // group_size] over taps
t < k (token i sees tokens i, i-1, .., i-k+1 of its own block only, never across a block's start). One
projection of the sublayer's input predicts both sides' delta, so the output side's kernel comes from the
input. Identity weights (base[:, 0] = 1, base[:, 1:] = 0, projection 0) pass values through unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.linear import Linear


class DynamicConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [side, tap, channel]
        self.kernel_projection = Linear(hidden_size, 2 * kernel_size * self.groups)

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        return {f"{path}.base_kernel": self.base_kernel}  # the projection names its own

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        self.base_kernel.copy_(tensor)

    @torch.no_grad()
    def set_identity(self) -> None:
        """Weights that pass values through: a DFlash2 layer then computes what its DFlash layer does."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        projection = self.kernel_projection
        projection.load("kernel_projection.weight", torch.zeros(projection.out_features,
                                                                projection.in_features))

    def prepare(self, x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input x [b, n, H] convolved, and the output side's predicted kernel [b, n, k, G].
        offsets [b or 1, n]: each token's place in its block (`ForwardBatch.block_offsets`)."""
        delta = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self.convolve(x, delta[..., 0, :, :], 0, offsets), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, kernel: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [b, n, H] convolved with the kernel `prepare` predicted."""
        return self.convolve(y, kernel, 1, offsets)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int,
                 offsets: torch.Tensor) -> torch.Tensor:
        b, n, hidden = x.shape
        values = x.view(b, n, self.groups, self.group_size)
        base = self.base_kernel[side].to(x.dtype).view(self.kernel_size, self.groups, self.group_size)
        out = values * (base[0] + delta[:, :, 0].unsqueeze(-1))
        for t in range(1, self.kernel_size):
            shifted = F.pad(values[:, : n - t], (0, 0, 0, 0, t, 0)) if t < n else torch.zeros_like(values)
            inside = (offsets >= t).view(offsets.shape[0], n, 1, 1)  # token i - t is in i's block
            shifted = torch.where(inside, shifted, torch.zeros((), dtype=x.dtype, device=x.device))
            out = out + shifted * (base[t] + delta[:, :, t].unsqueeze(-1))
        return out.view(b, n, hidden)
