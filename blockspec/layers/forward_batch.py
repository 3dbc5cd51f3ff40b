"""`ForwardBatch`: everything one forward pass needs besides the weights.

Per row of the batch: the new tokens, their positions (for RoPE), the KV rows they write, and the keys
each may attend to. Keys are the row's context (every cache row below its first new token, or, in a
forward without a cache, context K/V passed along with it) plus the new tokens themselves, among which
the attention structure decides: a causal chain (the target), one non-causal block (the DFlash draft), or
any boolean matrix (many blocks at once in training; a tree's ancestors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.layers.kv_cache import KVCache

Structure = str | torch.Tensor  # "causal", "all", or bool [b or 1, n, n] (query i sees new token j)


@dataclass(eq=False)
class ForwardBatch:
    input_ids: torch.Tensor | None  # [b, n]; None when the caller feeds hidden states
    positions: torch.Tensor  # [b, n] absolute positions
    among_new: Structure = "causal"
    cache: KVCache | None = None
    slots: list[int] = field(default_factory=list)  # cache forwards: the KV slot of each row
    starts: list[int] = field(default_factory=list)  # cache forwards: the KV row of each first new token
    context_positions: torch.Tensor | None = None  # no cache: [b, T] positions of the context K/V given
    context_visible: torch.Tensor | None = None  # no cache: bool [b, n, T]
    _memo: dict = field(default_factory=dict, repr=False)

    @classmethod
    def in_cache(cls, cache: KVCache, slots: list[int], starts: list[int],
                 input_ids: torch.Tensor | None = None, num_new: int | None = None,
                 among_new: Structure = "causal", positions: torch.Tensor | None = None) -> ForwardBatch:
        """New tokens (input_ids [b, n], or num_new of them fed as hidden states) written to KV rows
        starts[i].. of each row's slot (rows past a sequence's commit point are scratch: the next forward
        overwrites them before anything attends to them), at positions starts[i].. unless `positions`
        [b, n] says otherwise (a tree's nodes sit at their depth). The cache readies the rows the forward
        touches."""
        n = input_ids.shape[1] if input_ids is not None else num_new
        device = cache.device
        if positions is None:
            positions = torch.tensor(starts, device=device).view(-1, 1) + torch.arange(n, device=device)
        batch = cls(input_ids, positions, among_new, cache, list(slots), list(starts))
        cache.prepare(batch.slots, batch.kv_length)
        return batch

    @classmethod
    def tree(cls, cache: KVCache, slots: list[int], starts: list[int], input_ids: torch.Tensor,
             parents: list[tuple[int, ...]]) -> ForwardBatch:
        """Trees of tokens in the cache: row i's token 0 is its root, written at row starts[i], and token
        j > 0 hangs under token parents[i][j - 1] < j. A token sees the context and its ancestors only, at
        position starts[i] + its depth. Tokens past a row's tree are scratch (they see themselves)."""
        b, width = input_ids.shape
        seen = torch.eye(width, dtype=torch.bool).repeat(b, 1, 1)
        depth = torch.ones(b, width, dtype=torch.long)  # scratch tokens at depth 1: any position does
        for row, links in enumerate(parents):
            depth[row, 0] = 0
            for node, parent in enumerate(links, start=1):
                seen[row, node] |= seen[row, parent]
                depth[row, node] = depth[row, parent] + 1
        positions = torch.tensor(starts).view(-1, 1) + depth
        return cls.in_cache(cache, slots, starts, input_ids, among_new=seen.to(cache.device),
                            positions=positions.to(cache.device))

    @classmethod
    def standalone(cls, input_ids: torch.Tensor | None, positions: torch.Tensor,
                   among_new: Structure = "causal", context_positions: torch.Tensor | None = None,
                   context_visible: torch.Tensor | None = None) -> ForwardBatch:
        """A forward with no KV cache: the new tokens attend to each other (by `among_new`) and to the
        context K/V the caller passes to each layer (positions [b, T], visibility bool [b, n, T])."""
        return cls(input_ids, positions, among_new, context_positions=context_positions,
                   context_visible=context_visible)

    @property
    def size(self) -> int:
        return self.positions.shape[0]

    @property
    def num_new(self) -> int:
        return self.positions.shape[1]

    @property
    def kv_length(self) -> int:
        """Cache rows a cache forward reads per slot: up to the furthest row it writes."""
        return max(self.starts) + self.num_new

    @property
    def contiguous(self) -> bool:
        """Slots lo, lo+1, ... in order: the cache reads them as a view."""
        first = self.slots[0] if self.slots else 0
        return bool(self.slots) and self.slots == list(range(first, first + len(self.slots)))

    def block_offsets(self) -> torch.Tensor:
        """Each new token's place in its block, long [b or 1, n]: how many earlier new tokens it sees. A
        draft's block sees itself whole, so this counts from its first token, in inference (one block per
        row) as in training (many blocks per row, each seeing only itself)."""
        if "offsets" not in self._memo:
            n, device = self.num_new, self.positions.device
            if isinstance(self.among_new, torch.Tensor):
                offsets = self.among_new.tril(-1).sum(dim=-1)
            else:
                offsets = torch.arange(n, device=device).view(1, n)
            self._memo["offsets"] = offsets
        return self._memo["offsets"]

    def slot_tensor(self) -> torch.Tensor:
        if "slots" not in self._memo:
            self._memo["slots"] = torch.tensor(self.slots, device=self.positions.device)
        return self._memo["slots"]

    def write_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, row) indices [b, 1, 1] and [b, 1, n] of the KV rows the new tokens write."""
        if "write" not in self._memo:
            rows = torch.tensor(self.starts, device=self.positions.device).view(-1, 1) + torch.arange(
                self.num_new, device=self.positions.device).view(1, -1)
            self._memo["write"] = (self.slot_tensor().view(-1, 1, 1), rows.unsqueeze(1))
        return self._memo["write"]

    def attention_mask(self, groups: int, dtype: torch.dtype,
                       window: int | None = None) -> torch.Tensor | None:
        """The additive mask `attention` takes (0 / -inf, [b, 1, groups * n, L], query heads of a KV group
        folded into the query axis), or None where every query sees every key. `window`: a sliding-window
        layer also hides context keys more than window - 1 positions before the query. Built once per
        forward and kind of layer."""
        key = (groups, dtype, window)
        if key not in self._memo:
            visible = self.visible(window)
            self._memo[key] = None if visible is None else fold_mask(visible, groups, dtype)
        return self._memo[key]

    def visible(self, window: int | None = None) -> torch.Tensor | None:
        """bool [b, n, L] (True = visible) over the keys [context; new tokens] (a cache forward: cache rows
        0..kv_length), or None when nothing is hidden. Built once per forward and window."""
        key = ("visible", window)
        if key not in self._memo:
            self._memo[key] = self._visible(window)
        return self._memo[key]

    def _visible(self, window: int | None) -> torch.Tensor | None:
        b, n = self.positions.shape
        device = self.positions.device
        if self.cache is None:
            return self._visible_standalone(window)
        structure = "matrix" if isinstance(self.among_new, torch.Tensor) else self.among_new
        if b == 1 and window is None and (structure == "all" or (structure == "causal" and n == 1)):
            return None  # the keys end with the new tokens, and each sees all of them
        keys = torch.arange(self.kv_length, device=device).view(1, 1, -1)
        starts = torch.tensor(self.starts, device=device).view(-1, 1, 1)
        if structure == "matrix":
            offset = (keys - starts).clamp(0, n - 1).expand(b, n, -1)
            new = (keys >= starts) & (keys < starts + n) & self.among_new.expand(b, n, n).gather(2, offset)
            visible = (keys < starts) | new
        elif structure == "causal":  # a query sees the rows up to its own
            visible = keys <= starts + torch.arange(n, device=device).view(1, -1, 1)
        else:
            visible = (keys < starts + n).expand(b, n, -1)
        if window is not None:
            visible = visible & ((keys >= starts) | (keys >= self.positions.unsqueeze(-1) - (window - 1)))
        return visible

    def _visible_standalone(self, window: int | None) -> torch.Tensor:
        b, n = self.positions.shape
        device = self.positions.device
        if isinstance(self.among_new, torch.Tensor):
            new = self.among_new
        elif self.among_new == "causal":
            new = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        else:
            new = torch.ones(n, n, dtype=torch.bool, device=device)
        new = new.expand(b, n, n)
        if self.context_positions is None:
            return new
        context = self.context_visible
        if window is not None:
            near = self.context_positions.unsqueeze(1) >= self.positions.unsqueeze(2) - (window - 1)
            context = context & near
        return torch.cat([context, new], dim=-1)


def fold_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask [b, n, L] (True = visible) as `attention` uses it: additive (0 / -inf) in `dtype`,
    repeated for the `groups` query heads per KV head: [b, 1, groups * n, L]."""
    b, n, length = mask.shape
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return additive.unsqueeze(1).expand(b, groups, n, length).reshape(b, 1, groups * n, length)
