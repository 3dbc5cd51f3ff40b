"""`Linear`: the one linear layer. It owns its weight, dense or as GGUF blocks (`use_blocks`): it loads it
from checkpoint tensors (one per fused part), scales its inputs when a norm folds into it, and multiplies
in the CPU form a tuning pass chose."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from blockspec.distributed import TPGroup
from blockspec.errors import ModelLoadError
from blockspec.layers.dense import LEVELS, dense_product
from blockspec.layers.quant import Blocks, QuantType, QuantWeight
from blockspec.layers.quant_parts import QuantParts

# A checkpoint tensor's part this rank loads: (dim, start, length, the tensor's full size along dim).
Source = tuple[int, int, int, int]


class Linear(nn.Module):
    """y = x W^T (+ b). `out_features` lists the widths of checkpoint tensors fused into this one along the
    output (q, k, v -> qkv), and `shard_names` their checkpoint names (siblings of this module's path)."""

    def __init__(self, in_features: int, out_features: int | Sequence[int], bias: bool = False,
                 shard_names: Sequence[str] | None = None) -> None:
        super().__init__()
        self.shards = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        if shard_names is not None and len(shard_names) != len(self.shards):
            raise ValueError(f"Linear: {len(self.shards)} fused parts need as many shard_names, got "
                             f"{shard_names}")
        self.shard_names = tuple(shard_names) if shard_names is not None else None
        self.in_features = in_features
        self.out_features = sum(self.shards)
        # Logically [out, in] like every checkpoint, stored column-major: the dense kernel then reads each
        # input's weights for a slab of outputs as one contiguous run (and a BLAS runs an NN GEMM).
        self.weight = nn.Parameter(torch.empty(in_features, self.out_features).t())
        self.bias = nn.Parameter(torch.zeros(self.out_features)) if bias else None
        self.quant: QuantWeight | QuantParts | None = None  # the weight as GGUF blocks instead (use_blocks)
        # Tensor parallelism (shard_columns / shard_rows): this rank's group, and the part of each fused
        # checkpoint tensor it holds.
        self.tp: TPGroup | None = None
        self.parallel: str | None = None  # "column" (outputs split) or "row" (inputs split, all-reduced)
        self.sources: list[Source] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.quant is not None else self.weight.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.quant is not None else self.weight.device

    def use_blocks(self, qtype: QuantType | Sequence[QuantType]) -> None:
        """Hold the weight as `qtype` blocks from now on (before loading it): a CPU inference form. A list:
        one type per fused part (as a GGUF file stores each)."""
        qtypes = list(qtype) if isinstance(qtype, (list, tuple)) else [qtype] * len(self.shards)
        if self.parallel == "row":
            _, start, length, full = self.sources[0]
            block = max(t.block_elems for t in qtypes)
            if start % block or length % block:
                raise ModelLoadError(
                    f"Tensor parallelism splits a {qtypes[0].name} weight's {full} inputs on {block}-weight "
                    f"block boundaries, but rank {self.tp.rank} of {self.tp.size} would hold inputs "
                    f"[{start}, {start + length}). Use a --tp-size whose parts are multiples of {block}, or "
                    f"--quantization none.")
        if len(set(qtypes)) == 1:
            self.quant = QuantWeight(self.out_features, self.in_features, qtypes[0])
        else:
            self.quant = QuantParts.build(self.shards, self.in_features, qtypes)
        self.weight = None

    # ---- tensor parallelism (before loading) ---------------------------------------------------------
    def shard_columns(self, group: TPGroup, parts: Sequence[tuple[int, int]]) -> None:
        """Column-parallel: hold only the output rows parts[i] = (start, length) of each fused part i (its
        checkpoint tensor's rows); outputs stay split (the next layer takes them as they are)."""
        self.sources = [(0, start, length, full) for (start, length), full in zip(parts, self.shards)]
        self.shards = [length for _, length in parts]
        self._reshape(group, "column", self.in_features, sum(self.shards))

    def shard_rows(self, group: TPGroup, start: int, length: int) -> None:
        """Row-parallel: hold only input columns [start, start + length); each rank's partial product is
        summed across ranks (then the bias and residual are added, as one rank adds them to its sum)."""
        self.sources = [(1, start, length, self.in_features)] * len(self.shards)
        self._reshape(group, "row", length, self.out_features)

    def _reshape(self, group: TPGroup, parallel: str, in_features: int, out_features: int) -> None:
        if self.quant is not None:
            raise ValueError("Linear: shard a layer before choosing its storage or loading it.")
        self.tp, self.parallel = group, parallel
        self.in_features, self.out_features = in_features, out_features
        dtype = self.weight.dtype
        self.weight = nn.Parameter(torch.empty(in_features, out_features, dtype=dtype).t())
        if self.bias is not None and parallel == "column":
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype))

    def source(self, name: str) -> Source | None:
        """The part of checkpoint tensor `name` (from `checkpoint_tensors`) this rank loads; None: all."""
        if self.sources is None or (self.parallel == "row" and name.endswith(".bias")):
            return None
        owner = name.rsplit(".", 2)[-2]
        return self.sources[0 if self.shard_names is None else self.shard_names.index(owner)]

    # ---- weights ----------------------------------------------------------------------------------
    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        """This layer's tensors under their checkpoint names (views; shape-only for a block-held weight),
        `path` being its module path."""
        weight = self.weight if self.quant is None else torch.empty(self.quant.shape, device="meta")
        leaves = {"weight": weight} if self.bias is None else {"weight": weight, "bias": self.bias}
        if self.shard_names is None:
            return {f"{path}.{leaf}": t for leaf, t in leaves.items()}
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        return {f"{prefix}{name}.{leaf}": t[self.shard_slice(i)]
                for i, name in enumerate(self.shard_names) for leaf, t in leaves.items()}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor | Blocks) -> None:
        """Copy one checkpoint tensor (a name from `checkpoint_tensors`; dense, or GGUF blocks) into its
        part of this layer."""
        owner, leaf = name.rsplit(".", 2)[-2:]
        rows = slice(None) if self.shard_names is None else self.shard_slice(self.shard_names.index(owner))
        if leaf == "bias":
            self.bias[rows].copy_(tensor.dequantize() if isinstance(tensor, Blocks) else tensor)
        elif self.quant is not None:
            self.quant.load_rows(rows, tensor)
        else:
            self.weight[rows].copy_(tensor.dequantize() if isinstance(tensor, Blocks) else tensor)

    def shard_slice(self, index: int) -> slice:
        start = sum(self.shards[:index])
        return slice(start, start + self.shards[index])

    @property
    def foldable(self) -> bool:
        """Whether a norm's weight can be folded into this layer's inputs (not into blocks: not exact)."""
        return self.quant is None

    @torch.no_grad()
    def scale_inputs(self, scale: torch.Tensor) -> None:
        """W <- W diag(scale): the layer now computes what it did on inputs multiplied by `scale`."""
        self.weight.mul_(scale)  # [out, in] * [in]: scales input columns

    # ---- compute ----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T (+ b), plus `residual` if given (a residual stream's add, inside the kernel). Row-parallel:
        the sum of every rank's part, then the bias and the residual."""
        if self.parallel != "row":
            return self._product(x, self.bias, residual)
        out = self.tp.sum_parts(self._product(x, None, None, LEVELS - (self.tp.size - 1).bit_length()))
        out = out if self.bias is None else out + self.bias
        return out if residual is None else residual + out

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                 levels: int = LEVELS) -> torch.Tensor:
        if self.quant is None:
            return dense_product(x, self.weight, bias, residual, max(levels, 0))
        if bias is None:
            return self.quant.matmul(x, residual)
        out = self.quant.matmul(x) + bias
        return out if residual is None else residual + out

    def forward_shards(self, x: torch.Tensor, first: int) -> torch.Tensor:
        """Only the outputs of fused parts `first`.. (e.g. k and v of a fused qkv), in the stored form."""
        start = sum(self.shards[:first])
        bias = None if self.bias is None else self.bias[start:]
        if self.quant is None:
            return dense_product(x, self.weight[start:], bias)
        out = self.quant.row_range(start).matmul(x)
        return out if bias is None else out + bias
