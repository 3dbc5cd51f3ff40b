"""A fused weight whose parts a GGUF file stores in different block types.

llama.cpp's Q4_K_M (and every mixed recipe) picks a type per tensor: a layer's q and k in Q4_K (Q5_0 where a
row is not a multiple of 256) and its v in Q6_K (Q8_0) on some layers. Blocks are kept as stored, so a
fused q/k/v holds one `QuantWeight` per part, each in its own type, and multiplies them side by side: each
output is computed by its part's kernel exactly as it would be alone (a row's result still depends on that
row alone). The one-op layer stack (kernels/layer_stack.cpp) takes the parts as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blockspec.layers.quant import Blocks, QuantType, QuantWeight


class QuantParts:
    """Parts [rows_i, cols] of types `qtypes`, stacked along the output: the weight [sum rows_i, cols]."""

    def __init__(self, parts: Sequence[QuantWeight]) -> None:
        self.parts = list(parts)
        self.cols = self.parts[0].cols
        self.starts = [0]
        for part in self.parts:
            self.starts.append(self.starts[-1] + part.num_rows)
        self.num_rows = self.starts[-1]

    @classmethod
    def build(cls, rows: Sequence[int], cols: int, qtypes: Sequence[QuantType]) -> QuantParts:
        return cls([QuantWeight(n, cols, qtype) for n, qtype in zip(rows, qtypes)])

    @property
    def qtype(self) -> None:
        return None  # no one type: callers that need one (the layer stack) take single-type weights only

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.cols

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def activations(self) -> str:
        """The parts' form ("mixed" where F16 / BF16 parts, which take fp32 activations, meet int8 ones)."""
        forms = {part.activations for part in self.parts}
        return forms.pop() if len(forms) == 1 else "mixed"

    @property
    def packed(self) -> bool:
        return all(part.packed for part in self.parts)

    def use_int8(self) -> None:
        for part in self.parts:
            part.use_int8()

    def load_rows(self, rows: slice, tensor: torch.Tensor | Blocks) -> None:
        """Fill one whole part (`rows` are its rows) with its checkpoint tensor."""
        start, stop = rows.start or 0, self.num_rows if rows.stop is None else rows.stop
        if start not in self.starts[:-1] or stop != self.starts[self.starts.index(start) + 1]:
            raise ValueError(f"QuantParts.load_rows: rows {rows} are not one part (parts start at "
                             f"{self.starts})")
        self.parts[self.starts.index(start)].load_rows(slice(None), tensor)

    def matmul(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.cat([part.matmul(x) for part in self.parts], dim=-1)
        return out if residual is None else out + residual

    def row_range(self, start: int) -> QuantWeight | QuantParts:
        """The weight's rows start.. (start: a part's first row)."""
        if start not in self.starts[:-1]:
            raise ValueError(f"QuantParts.row_range: {start} is not where a part starts ({self.starts})")
        rest = self.parts[self.starts.index(start) :]
        return rest[0] if len(rest) == 1 else QuantParts(rest)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])
