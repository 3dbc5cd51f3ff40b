"""KV cache: one preallocated slab per running sequence, addressed by slot.

Layout per layer: [num_slots, kv_heads, max_len, head_dim]. A sequence owns one slot index, which
addresses both the target cache and the draft cache (as in SGLang, the two share one slot space), so
one admission decision covers both. Appending writes rows in place; rolling back a rejected draft tail
is free: the sequence's length simply does not advance past the committed tokens, and later writes
overwrite the scratch rows. Why slabs and not pages: see docs/architecture.md. The attention layer reads
and writes the per-layer views (`k_layers`, `v_layers`), under torch.inference_mode() / no_grad (the views
go stale in grad mode).
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_slots, kv_heads, max_len, head_dim)
        # On the CPU, torch.empty: pages are only touched (and so only use memory) when a sequence writes
        # them. A GPU allocates the whole slab anyway: zero it once instead of a few rows per slot per step.
        lazy = torch.device(device).type == "cpu"
        self.k = (torch.empty if lazy else torch.zeros)(shape, dtype=dtype, device=device)
        self.v = (torch.empty if lazy else torch.zeros)(shape, dtype=dtype, device=device)
        # Per-layer views (fewer index ops per write). Not unbind(): its views refuse in-place writes in
        # grad mode.
        self.k_layers = [self.k[i] for i in range(num_layers)]
        self.v_layers = [self.v[i] for i in range(num_layers)]
        self.device = self.k.device
        self._clean_upto = [0 if lazy else max_len] * num_slots  # per slot: rows below are zeroed or written

    @classmethod
    def for_model(cls, model, num_slots: int, max_len: int) -> KVCache:
        """A cache for `model` (a target or a draft: its config's layer count and head size, the KV heads its
        layers hold (this rank's, under tensor parallelism), in its dtype on its device)."""
        cfg = model.config
        return cls(cfg.num_hidden_layers, num_slots, max_len, model.layers[0].self_attn.kv_heads,
                   cfg.head_dim, model.dtype, model.device)

    @property
    def token_bytes(self) -> int:
        """Memory one token's row takes, every layer's K and V."""
        layers, _, kv_heads, _, head_dim = self.k.shape
        return 2 * layers * kv_heads * head_dim * self.k.element_size()

    def prepare(self, slots: list[int], length: int) -> None:
        """Zero each row below `length` of these slots that no forward has touched yet. Batched attention
        reads rows past a sequence's own length (masked out), and never-written memory may hold NaN bit
        patterns (0 * NaN = NaN). Zeroing lazily keeps resident memory at the rows actually used."""
        for slot in slots:
            start = self._clean_upto[slot]
            if start < length:
                self.k[:, slot, :, start:length].zero_()
                self.v[:, slot, :, start:length].zero_()
                self._clean_upto[slot] = length

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` rows of slot `src` (every layer) into slot `dst`."""
        self.copy(src, dst, 0, length)

    def copy(self, src: int, dst: int, start: int, end: int) -> None:
        """Copy rows start..end-1 of slot `src` (every layer) into the same rows of slot `dst` (rows of `src`
        no forward has touched yet are not copied: they hold nothing)."""
        self.prepare([dst], start)  # rows below `start` stay initialised under the new ones
        end = min(end, self._clean_upto[src])
        if start < end:
            self.k[:, dst, :, start:end] = self.k[:, src, :, start:end]
            self.v[:, dst, :, start:end] = self.v[:, src, :, start:end]
            self._clean_upto[dst] = max(self._clean_upto[dst], end)

    def swap(self, a: int, b: int, length_a: int, length_b: int) -> None:
        """Exchange the first `length_a` rows of slot a with the first `length_b` rows of slot b."""
        length_a, length_b = min(length_a, self._clean_upto[a]), min(length_b, self._clean_upto[b])
        k, v = self.k[:, a, :, :length_a].clone(), self.v[:, a, :, :length_a].clone()
        self.k[:, a, :, :length_b] = self.k[:, b, :, :length_b]
        self.v[:, a, :, :length_b] = self.v[:, b, :, :length_b]
        self.k[:, b, :, :length_a] = k
        self.v[:, b, :, :length_a] = v
        self._clean_upto[a] = max(self._clean_upto[a], length_b)
        self._clean_upto[b] = max(self._clean_upto[b], length_a)

    def move_rows(self, slot: int, rows: list[int], first: int) -> None:
        """Copy rows `rows` of a slot (every layer), in order, to its rows first, first + 1, ..."""
        src = torch.tensor(rows, device=self.device)
        dst = torch.arange(first, first + len(rows), device=self.device)
        self.k[:, slot, :, dst] = self.k[:, slot, :, src]
        self.v[:, slot, :, dst] = self.v[:, slot, :, src]
