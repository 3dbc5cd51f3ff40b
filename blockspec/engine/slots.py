"""KV slots: one per running request, shared by the target's and the draft's caches."""

from __future__ import annotations

import heapq

from blockspec.errors import RequestError


class SlotPool:
    """Hands out slot indices, lowest free first: the running slots then stay a contiguous range most
    of the time, and a slot-ordered batch reads its K/V as a view. The memory budget is
    num_slots x max_len tokens per cache."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def lowest_free(self) -> int | None:
        return self._free[0] if self._free else None

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
