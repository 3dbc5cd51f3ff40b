"""Rotary position embedding (Neox style, with Llama 3 and linear scaling)."""

from __future__ import annotations

import math

import torch
from torch import nn

from blockspec.layers.fused import fused_ops


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return (inv_freq / factor).float()
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        original = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    return inv_freq.float()


Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, signed sin) for some positions, from `Rotary.table`


class Rotary(nn.Module):
    """A precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None) -> None:
        super().__init__()
        self.inv_freq_args = (head_dim, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.ensure(max_positions)

    def ensure(self, max_positions: int) -> None:
        """A table for at least `max_positions` positions (RoPE is well defined past the checkpoint's
        max_position_embeddings)."""
        if self.cos.shape[0] >= max_positions:
            return
        inv_freq = rope_inv_freq(*self.inv_freq_args)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1).to(self.cos.device)
        # sin with the rotate-half sign folded in: rotate_half(x) * sin == x.roll(half) * signed_sin
        half = emb.shape[-1] // 2
        self.cos, self.sin = emb.cos(), torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin for `positions` [..., n] shaped [..., n, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(-2).to(dtype), self.sin[positions].unsqueeze(-2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of x [..., n, heads, head_dim] with a `Rotary.table` (sin carries the sign)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` of x [b, n, heads, head_dim], in place where the fused CPU op applies (x is then
    overwritten and returned), else into a new tensor."""
    ops = fused_ops(x)
    if ops is not None and x.dim() == 4 and cos.shape[:2] == x.shape[:2]:
        ops.rope_(x, cos, signed_sin)
        return x
    return apply_rope(x, cos, signed_sin)
