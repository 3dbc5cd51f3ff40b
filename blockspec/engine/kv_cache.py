"""KV cache: one preallocated slab per running sequence, drawn from a shared pool.

Layout per layer: [num_slots, kv_heads, max_len, head_dim]. A sequence owns one slot index, which
addresses both the target cache and the draft cache (as in SGLang, the two share one slot space),
so one admission decision covers both. Appending writes rows in place; rolling back a rejected
draft tail is O(1): the sequence's length simply does not advance past the committed tokens, and
later writes overwrite the garbage rows. Why slabs and not pages: see docs/architecture.md.
Writes happen under torch.inference_mode() / no_grad (the per-layer views go stale in grad mode).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from blockspec.errors import RequestError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (num_layers, num_slots, kv_heads, max_len, head_dim)
        # On the CPU, torch.empty: pages are only touched (and so only use memory) when a sequence writes
        # them. A GPU allocates the whole slab anyway: zero it once instead of a few rows per slot per step.
        lazy = torch.device(device).type == "cpu"
        self.k = (torch.empty if lazy else torch.zeros)(shape, dtype=dtype, device=device)
        self.v = (torch.empty if lazy else torch.zeros)(shape, dtype=dtype, device=device)
        # Per-layer views (fewer index ops per write). Not unbind(): its views refuse in-place writes in grad mode.
        self.k_layers = [self.k[i] for i in range(num_layers)]
        self.v_layers = [self.v[i] for i in range(num_layers)]
        self.max_len = max_len
        self._clean_upto = [0 if lazy else max_len] * num_slots  # rows below this are zeroed or written, per slot

    def prepare(self, batch: "Batch", length: int) -> None:
        """Zero each row the coming forward may touch that no forward has touched yet (up to `length`).
        Batched attention reads rows past a sequence's own length (masked out), and never-written
        memory may hold NaN bit patterns (0 * NaN = NaN). Zeroing lazily keeps resident memory at the
        rows actually used, not whole slabs."""
        for slot in batch.slots:
            start = self._clean_upto[slot]
            if start < length:
                self.k[:, slot, :, start:length].zero_()
                self.v[:, slot, :, start:length].zero_()
                self._clean_upto[slot] = length

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` rows of slot `src` (every layer) into slot `dst`."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        self._clean_upto[dst] = max(self._clean_upto[dst], length)

    def write(self, layer: int, batch: "Batch", k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [b, n, kv_heads, d] for positions batch.starts[i] .. + n."""
        n = k.shape[1]
        if batch.size == 1:
            slot, start = batch.slots[0], batch.starts[0]
            self.k_layers[layer][slot].narrow(1, start, n).copy_(k[0].transpose(0, 1))
            self.v_layers[layer][slot].narrow(1, start, n).copy_(v[0].transpose(0, 1))
            return
        slot_idx, pos_idx = batch.write_index(n, k.device)
        heads = torch.arange(k.shape[2], device=k.device).view(1, -1, 1)
        self.k_layers[layer].index_put_((slot_idx, heads, pos_idx), k.transpose(1, 2))
        self.v_layers[layer].index_put_((slot_idx, heads, pos_idx), v.transpose(1, 2))

    def read(self, layer: int, batch: "Batch", length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the first `length` positions of every sequence in the batch: [b, kv_heads, length, d]."""
        k, v = self.k_layers[layer], self.v_layers[layer]
        if batch.size == 1:
            slot = batch.slots[0]
            return k[slot : slot + 1, :, :length], v[slot : slot + 1, :, :length]
        if batch.contiguous:  # a view: no copy of every row's K/V per layer
            lo = batch.slots[0]
            return k[lo : lo + batch.size, :, :length], v[lo : lo + batch.size, :, :length]
        index = batch.slot_tensor(self.k.device)
        return k[index, :, :length], v[index, :, :length]


@dataclass
class Batch:
    """Where each row of a forward pass lives in the cache: its slot and the position of its first new token."""

    slots: list[int]
    starts: list[int]

    def __post_init__(self) -> None:
        self._slot_tensor: torch.Tensor | None = None
        self._write_index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by n: built once, used per layer
        # slots lo, lo+1, ... in order: `KVCache.read` returns views (see ModelRunner.compact)
        first = self.slots[0] if self.slots else 0
        self.contiguous = bool(self.slots) and self.slots == list(range(first, first + len(self.slots)))

    @property
    def size(self) -> int:
        return len(self.slots)

    def slot_tensor(self, device: torch.device) -> torch.Tensor:
        if self._slot_tensor is None:
            self._slot_tensor = torch.tensor(self.slots, device=device)
        return self._slot_tensor

    def write_index(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if n not in self._write_index:
            self._write_index[n] = (self.slot_tensor(device).view(-1, 1, 1), self.positions(n, device).unsqueeze(1))
        return self._write_index[n]

    def positions(self, n: int, device: torch.device) -> torch.Tensor:
        """Absolute positions [b, n] of the n new tokens of each row."""
        return torch.tensor(self.starts, device=device).view(-1, 1) + torch.arange(n, device=device).view(1, n)


class SlotPool:
    """Hands out slot indices, lowest free first: the running slots then stay a contiguous range most
    of the time, and `KVCache.read` of a slot-ordered batch is a view. The memory budget is
    num_slots x max_len tokens per cache."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RequestError(
                f"All {self.num_slots} KV cache slots are in use. Send fewer prompts at once or raise "
                f"max_num_seqs (--max-running-requests)."
            )
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} freed twice or out of range")
        heapq.heappush(self._free, slot)
