"""Building blocks shared by the target and the draft: linear layers, RMSNorm, RoPE, attention.

`Linear` is the one linear abstraction: every projection goes through it, and each one is marked
column- or row-parallel (or replicated), so tensor parallelism and weight-only quantization can
swap the weight storage and the matmul here without touching model code.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

Parallel = Literal["column", "row", "replicated"]
SMALL_ROWS = 64  # a layout planned for "any other row count" (key 0) serves 2..SMALL_ROWS rows (batches)


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` lists the output widths of checkpoint tensors fused into this one
    (e.g. q, k, v -> qkv); the loader copies each checkpoint tensor into its slice."""

    def __init__(
        self,
        in_features: int,
        out_features: int | list[int],
        bias: bool = False,
        parallel: Parallel = "replicated",
    ) -> None:
        super().__init__()
        self.shards = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        self.in_features = in_features
        self.out_features = sum(self.shards)
        self.parallel = parallel
        # Logically [out, in] like every checkpoint, stored column-major: F.linear then runs x @ W^T as a
        # plain NN GEMM, which MKL does 1.5-3x faster than the NT form for the 2-16 token rows of a
        # verify block or prefill chunk on CPU (decode GEMVs are unaffected).
        self.weight = nn.Parameter(torch.empty(in_features, self.out_features).t())
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None

    @classmethod
    def of(cls, weight: torch.Tensor) -> Linear:
        """A bias-free Linear over an existing [out, in] weight (no copy)."""
        layer = cls(weight.shape[1], weight.shape[0])
        layer.weight = nn.Parameter(weight, requires_grad=False)
        return layer

    def set_layouts(self, plan: dict[int, str] | None, copies: bool = True) -> None:
        """Lay the fp32 CPU weight out for the row counts of `plan` (rows -> layout; key 0: every other count
        from 2 to SMALL_ROWS rows); None or {}: the stored weight for every input. Layouts:
          "nn"     the stored column-major weight, F.linear as an NN GEMM (the default everywhere);
          "nt"     a row-major copy, F.linear as an NT GEMM (MKL streams it like a GEMV on some CPUs);
          "wx"     a row-major copy, computed as W x^T: the weight is the GEMM's big left operand (one row is
                   computed as two: a GEMM where the BLAS's GEMV is slow);
          "packed" an MKL-packed copy for exactly that row count (no re-packing per call).
        Which is fastest depends on the CPU (engine/layout_tuning.py measures it). copies=False takes only
        the layouts that need no copy (a tied LM head: its row-major weight is the embedding itself).
        Costs one row-major copy if any layout needs it, plus one per packed count: pack after the weights
        are final."""
        old = self.__dict__.get("fast") or {}  # copies already made are reused (tuning switches plans often)
        row_major = next((w for kind, w, _ in old.values() if kind != "nn"), None)
        packs = {rows: p for rows, (kind, _, p) in old.items() if kind == "packed"}
        self.fast = {}
        if not plan or self.weight.dtype != torch.float32 or self.weight.device.type != "cpu":
            return
        for rows, layout in sorted(plan.items()):
            if layout not in ("nn", "nt", "wx", "packed"):
                raise ValueError(f"Linear.set_layouts: unknown layout {layout!r} for {rows} rows; "
                                 "use nn, nt, wx or packed.")
            if layout == "packed" and (rows < 2 or not torch.backends.mkl.is_available()):
                layout = "nn"
            if layout != "nn" and row_major is None:
                row_major = self.weight.detach().contiguous()
                if not copies and row_major.data_ptr() != self.weight.data_ptr():
                    self.fast = {}
                    return
            weight = self.weight if layout == "nn" else row_major
            packed = None
            if layout == "packed":
                packed = packs.get(rows)
                packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows) if packed is None else packed
            self.fast[rows] = (layout, weight, packed)

    def shard_slice(self, index: int) -> slice:
        start = sum(self.shards[:index])
        return slice(start, start + self.shards[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self.__dict__.get("fast")
        if fast and not torch.is_grad_enabled():  # the copies are detached: training goes through the weight
            rows = x.numel() // x.shape[-1]
            layout = fast.get(rows, fast.get(0) if 1 < rows <= SMALL_ROWS else None)
            if layout is not None:
                kind, weight, packed = layout
                flat = x.reshape(rows, -1)
                if kind == "wx":
                    # One row goes as two: some BLAS (MKL on AMD) run a 2-column GEMM faster than a GEMV
                    # (torch.cat: ~4 us per call against repeat's ~30, times 120 projections per token).
                    cols = (flat if rows > 1 else torch.cat((flat, flat))).t()
                    out = (torch.mm(weight, cols) if self.bias is None
                           else torch.addmm(self.bias.unsqueeze(1), weight, cols))[:, :rows].t().contiguous()
                elif kind == "packed":
                    out = torch.ops.mkl._mkl_linear(flat, packed, weight, self.bias, rows)
                else:
                    out = F.linear(flat, weight, self.bias)
                return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # None once folded into the next projection (CausalLM.fold_norm_weights)
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


class Rotary(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, scaling: dict | None) -> None:
        super().__init__()
        self.inv_freq_args = (head_dim, theta, scaling)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset(max_positions)

    def reset(self, max_positions: int | None = None) -> None:
        """(Re)build the table; needed after `to_empty`, which leaves buffers uninitialised."""
        n = max_positions or self.cos.shape[0]
        inv_freq = rope_inv_freq(*self.inv_freq_args)
        freqs = torch.outer(torch.arange(n, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1).to("cpu" if self.cos.is_meta else self.cos.device)
        # sin with the rotate-half sign folded in: rotate_half(x) * sin == x.roll(half) * signed_sin
        half = emb.shape[-1] // 2
        self.cos, self.sin = emb.cos(), torch.cat([-emb[:, :half].sin(), emb[:, half:].sin()], dim=-1)

    def ensure(self, max_positions: int) -> None:
        """Positions past the checkpoint's max_position_embeddings are still well defined for RoPE."""
        if self.cos.shape[0] < max_positions:
            self.reset(max_positions)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `positions` [..., n] shaped [..., n, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(-2).to(dtype), self.sin[positions].unsqueeze(-2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Neox rotation of x [..., n, heads, head_dim] with a `Rotary.table` (sin carries the sign)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def fold_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask [b, n, L] (True = visible) as `attention` uses it: additive (0 / -inf) in `dtype`,
    repeated for the `groups` query heads per KV head: [b, 1, groups * n, L]. A model builds it once per
    forward instead of once per layer."""
    b, n, length = mask.shape
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return additive.unsqueeze(1).expand(b, groups, n, length).reshape(b, 1, groups * n, length)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention without repeating K/V.

    q: [b, n, heads, d]; k, v: [b, kv_heads, L, d]; mask: bool [b, n, L] (True = visible), a
    `fold_mask` result, or None. The query heads of one KV group are folded into the sequence axis so
    SDPA sees kv_heads heads. Returns [b, n, heads * d].
    """
    b, n, heads, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    if n == 1 and mask is None:  # decode: the fold is a plain view, no permutes
        out = F.scaled_dot_product_attention(q.reshape(b, kv_heads, groups, d), k, v)
        return out.reshape(b, 1, heads * d)
    q = q.view(b, n, kv_heads, groups, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, groups * n, d)
    if mask is not None and mask.dim() == 3:
        mask = fold_mask(mask, groups, q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.view(b, kv_heads, groups, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, heads * d)
