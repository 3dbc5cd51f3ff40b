"""The token embedding and the LM head (its own weight, or the embedding's when tied), dense or as blocks."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.layers.int8_head import Int8ArgmaxHead
from blockspec.layers.linear import Linear
from blockspec.layers.quant import Blocks, QuantType, QuantWeight


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.quant: QuantWeight | None = None  # the table as GGUF blocks instead (use_blocks)

    def use_blocks(self, qtype: QuantType) -> None:
        """Hold the table as `qtype` blocks from now on (before loading it); lookups dequantize the rows."""
        self.quant = QuantWeight(*self.weight.shape, qtype)
        self.weight = None

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        weight = self.weight if self.quant is None else torch.empty(self.quant.shape, device="meta")
        return {f"{path}.weight": weight}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor | Blocks) -> None:
        if self.quant is not None:
            self.quant.load_rows(slice(None), tensor)
        else:
            self.weight.copy_(tensor.dequantize() if isinstance(tensor, Blocks) else tensor)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.quant is not None else self.weight.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.quant is not None else self.weight.device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.quant is None else self.quant.lookup(ids)


class LMHead(Linear):
    """Vocabulary scores for final-normed hidden states: exact logits, exact greedy choices (on CPU
    possibly through an int8 copy, `Int8ArgmaxHead`), and cheaper approximate scores that rank a draft's
    proposals, over the whole vocabulary or some rows of it."""

    def __init__(self, hidden_size: int, vocab_size: int, tied_to: Embedding | None = None) -> None:
        super().__init__(hidden_size, vocab_size)
        self.tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight  # the embedding owns it; it is not a checkpoint tensor of ours
            object.__setattr__(self, "tied_to", tied_to)  # not a submodule: the model holds it already
        self.int8: Int8ArgmaxHead | None = None  # the greedy form (choose_greedy_form)
        self.plan: dict[int, str] | None = None
        self._subsets: tuple | None = None  # (int8 form, vocab) it was built for, and the sub-head

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        return {} if self.tied else super().checkpoint_tensors(path)

    def use_blocks(self, qtype: QuantType) -> None:
        """As `Linear.use_blocks`; a tied head shares the embedding's blocks (switch the embedding first)."""
        if not self.tied:
            return super().use_blocks(qtype)
        if self.tied_to.quant is None:
            raise ValueError("LMHead.use_blocks: a tied head takes its embedding's blocks: switch the "
                             "embedding first.")
        self.quant, self.weight, self.layout = self.tied_to.quant, None, None
        self._subsets = None

    def set_layouts(self, plan: dict[int, str] | None, copies: bool = False) -> None:
        """As `Linear.set_layouts`, but a 100 MB head is never copied: it takes only the forms its stored
        weight allows (all of them for a tied head, whose weight is the row-major embedding)."""
        self.plan = plan
        self._subsets = None
        super().set_layouts(plan, copies)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self(h).float()

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The exact argmax token ids [...] for h [..., H] (ties to the lowest id)."""
        if self.int8 is None:
            return self(h).argmax(dim=-1)
        return self.int8.argmax(h.reshape(-1, h.shape[-1])).view(h.shape[:-1])

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Scores [M, V] good enough to rank proposals (the int8 copy's where there is one)."""
        return self(h) if self.int8 is None else self.int8.scores(h)

    def propose(self, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The best token per row of h [M, H] by `scores`, over the sorted ids `vocab` only when given."""
        if vocab is None:
            return self.scores(h).argmax(dim=-1)
        return vocab[self.over(vocab).scores(h).argmax(dim=-1)]

    def ranked(self, h: torch.Tensor, k: int, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
        """The k best tokens per row of h [M, H] by `scores` (over `vocab` only when given) and their
        log-probabilities under a softmax of those scores: ([M, k], [M, k]), best first."""
        head = self if vocab is None else self.over(vocab)
        logprobs, best = head.scores(h).float().log_softmax(dim=-1).topk(k, dim=-1)
        return logprobs, best if vocab is None else vocab[best]

    def over(self, vocab: torch.Tensor) -> LMHead:
        """The head over the sorted ids `vocab` only, built once per form and vocabulary."""
        built = self._subsets
        if built is None or built[0] is not self.int8 or built[1] is not vocab:
            self._subsets = built = (self.int8, vocab, self.rows(vocab))
        return built[2]

    def rows(self, ids: torch.Tensor) -> LMHead:
        """A head over the token ids `ids` only (a copy of those rows, in this head's forms)."""
        sub = LMHead(self.in_features, ids.numel())
        if self.quant is not None:
            sub.quant, sub.weight = self.quant.rows(ids), None
            return sub
        sub.weight = nn.Parameter(self.weight.detach()[ids].contiguous(), requires_grad=False)
        sub.set_layouts(self.plan)
        sub.int8 = None if self.int8 is None else self.int8.rows(ids)
        return sub

    @torch.inference_mode()
    def choose_greedy_form(self, reps: int = 5) -> None:
        """Keep an int8 copy of a fp32 CPU head for greedy choices where it makes them faster, timed here:
        exact either way, at a quarter of the head's memory traffic (it won on a Xeon with bf16 units and on
        an AMD EPYC without them: 7.3 vs 11.9 ms for SmolLM2). It then also scores draft proposals."""
        self.int8 = None
        self._subsets = None
        weight = self.weight
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32 \
                or not Int8ArgmaxHead.supports(weight):
            return  # held as blocks, or not a fp32 CPU head
        h = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
        costs = []
        for candidate in (None, Int8ArgmaxHead(weight)):
            self.int8 = candidate
            self.greedy(h)  # warm-up
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                self.greedy(h)
                times.append(time.perf_counter() - start)
            costs.append(min(times))
        self.int8 = candidate if costs[1] < costs[0] else None
