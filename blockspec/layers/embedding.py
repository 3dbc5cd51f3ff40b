"""The token embedding and the LM head (its own weight, or the embedding's when tied), dense or as blocks."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.distributed import TPGroup, best_rank_choice, shard_range
from blockspec.layers.int8_head import Int8ArgmaxHead
from blockspec.layers.linear import Linear, Source
from blockspec.layers.quant import Blocks, QuantType, QuantWeight


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        # Column-major, as a Linear stores its weight: a tied LM head then streams it as the dense kernel
        # reads best (a lookup gathers a token's row from strided memory: once per token, cheap).
        self.weight = nn.Parameter(torch.empty(hidden_size, vocab_size).t())
        self.quant: QuantWeight | None = None  # the table as GGUF blocks instead (use_blocks)
        self.vocab_size = vocab_size
        # vocabulary-parallel (shard_vocab): this rank holds rows [start, stop) = vocab_range
        self.tp: TPGroup | None = None
        self.vocab_range = (0, vocab_size)

    def shard_vocab(self, group: TPGroup) -> None:
        """Vocabulary-parallel, before loading: hold only this rank's rows (`shard_range`); a lookup is then
        each rank's rows (zeros for ids it does not hold) summed across ranks."""
        self.tp, self.vocab_range = group, shard_range(self.vocab_size, group)
        start, stop = self.vocab_range
        hidden, dtype = self.weight.shape[1], self.weight.dtype
        self.weight = nn.Parameter(torch.empty(hidden, stop - start, dtype=dtype).t())

    def source(self, name: str) -> Source | None:
        start, stop = self.vocab_range
        return None if self.tp is None else (0, start, stop - start, self.vocab_size)

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
        if self.tp is None:
            return self._lookup(ids)
        start, stop = self.vocab_range
        local = ids - start
        outside = (local < 0) | (local >= stop - start)
        rows = self._lookup(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(rows)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
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
        # (int8 form, vocab) it was built for, this rank's ids of that vocab and their sub-head
        self._subsets: tuple | None = None
        self._vocab_head: tuple | None = None  # (vocab, its rows' head): logits_over
        self.vocab_size, self.vocab_start = vocab_size, 0  # this rank's logits are ids vocab_start..

    def shard_vocab(self, group: TPGroup) -> None:
        """Vocabulary-parallel, before loading (after the embedding, for a tied head): this rank scores its
        own rows; greedy choices and proposals go through `best_rank_choice`, logits are gathered."""
        start, stop = shard_range(self.vocab_size, group)
        self.vocab_start = start
        if not self.tied:
            return self.shard_columns(group, [(start, stop - start)])
        self.tp, self.parallel = group, "column"
        self.shards, self.out_features, self.weight = [stop - start], stop - start, self.tied_to.weight

    def checkpoint_tensors(self, path: str) -> dict[str, torch.Tensor]:
        return {} if self.tied else super().checkpoint_tensors(path)

    def use_blocks(self, qtype: QuantType) -> None:
        """As `Linear.use_blocks`; a tied head shares the embedding's blocks (switch the embedding first)."""
        if not self.tied:
            return super().use_blocks(qtype)
        if self.tied_to.quant is None:
            raise ValueError("LMHead.use_blocks: a tied head takes its embedding's blocks: switch the "
                             "embedding first.")
        self.quant, self.weight = self.tied_to.quant, None
        self._subsets = self._vocab_head = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits [..., V] over the whole vocabulary (gathered from every rank under TP)."""
        out = self(h).float()
        if self.tp is None:
            return out
        per = -(-self.vocab_size // self.tp.size)
        if out.shape[-1] < per:  # the last rank's shard of a vocabulary the ranks do not divide
            out = F.pad(out, (0, per - out.shape[-1]), value=-float("inf"))
        gathered = self.tp.all_gather(out)  # [ranks, ..., per]
        return gathered.movedim(0, -2).reshape(*out.shape[:-1], -1)[..., : self.vocab_size]

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """The exact argmax token ids [...] for h [..., H] (ties to the lowest id)."""
        if self.tp is None and self.int8 is None:
            return self(h).argmax(dim=-1)
        values, ids = self.local_best(h.reshape(-1, h.shape[-1]))
        if self.tp is not None:
            ids = best_rank_choice(self.tp, values, ids + self.vocab_start)
        return ids.view(h.shape[:-1])

    def local_best(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best logit and its id among this rank's rows, per row of h [M, H] (first best on ties)."""
        if self.int8 is not None:
            return self.int8.best(h)
        logits = self(h)
        ids = logits.argmax(dim=-1)
        return logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1), ids

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Scores [M, V] good enough to rank proposals (the int8 copy's where there is one)."""
        return self(h) if self.int8 is None else self.int8.scores(h)

    def propose(self, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The best token per row of h [M, H] by `scores`, over the sorted ids `vocab` only when given
        (under TP: each rank's best among its rows, then the best rank's, like `greedy`)."""
        scores, ids = self.shard_scores(h, vocab)
        if self.tp is None:
            best = scores.argmax(dim=-1)
            return best if ids is None else ids[best]
        if scores is None:  # none of the draft's vocabulary is among this rank's rows
            values = torch.full((h.shape[0],), -float("inf"), device=h.device)
            chosen = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
        else:
            best = scores.argmax(dim=-1)
            values = scores.gather(-1, best.unsqueeze(-1)).squeeze(-1)
            chosen = best + self.vocab_start if ids is None else ids[best]
        return best_rank_choice(self.tp, values, chosen)

    def ranked(self, h: torch.Tensor, k: int, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
        """The k best tokens per row of h [M, H] by `scores` (over `vocab` only when given) and their
        log-probabilities under a softmax of those scores: ([M, k], [M, k]), best first. Under TP each rank
        sends its k best and its log-sum-exp (one all-gather); the k best of all, ties to the lower rank."""
        scores, ids = self.shard_scores(h, vocab)
        if self.tp is None:
            logprobs, best = scores.float().log_softmax(dim=-1).topk(k, dim=-1)
            return logprobs, best if ids is None else ids[best]
        rows = h.shape[0]
        values = torch.full((rows, k), -float("inf"), dtype=torch.float64, device=h.device)
        chosen = torch.zeros((rows, k), dtype=torch.float64, device=h.device)
        total = torch.full((rows, 1), -float("inf"), dtype=torch.float64, device=h.device)
        if scores is not None:
            local = scores.double()
            top, best = local.topk(min(k, local.shape[-1]), dim=-1)
            values[:, : top.shape[1]] = top
            chosen[:, : top.shape[1]] = (best + self.vocab_start if ids is None else ids[best]).double()
            total = local.logsumexp(dim=-1, keepdim=True)
        gathered = self.tp.all_gather(torch.cat([values, chosen, total], dim=-1))  # [ranks, M, 2k + 1]
        every = gathered.permute(1, 0, 2)  # [M, ranks, 2k + 1]
        value, token = every[..., :k].reshape(rows, -1), every[..., k : 2 * k].reshape(rows, -1)
        order = value.argsort(dim=-1, descending=True, stable=True)[:, :k]
        logprobs = value.gather(-1, order) - every[..., -1].logsumexp(dim=-1, keepdim=True)
        return logprobs.float(), token.gather(-1, order).long()

    def logits_over(self, h: torch.Tensor, vocab: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                 torch.Tensor | None]:
        """Exact fp32 logits for h [M, H] over the sorted token ids `vocab` (all, when None) and their
        columns' ids (None: all, in order). A head of those rows alone is built once per vocabulary (under
        TP: the gathered logits' columns)."""
        if vocab is None:
            return self.logits(h), None
        if self.tp is not None:
            return self.logits(h)[:, vocab], vocab
        built = self._vocab_head
        if built is None or built[0] is not vocab:
            built = self._vocab_head = (vocab, self.rows(vocab))
        return built[1].logits(h), vocab

    def shard_scores(self, h: torch.Tensor, vocab: torch.Tensor | None) -> tuple[torch.Tensor | None,
                                                                                  torch.Tensor | None]:
        """This rank's `scores` for h [M, H] and their columns' token ids (None: its rows in order, from
        vocab_start): over the sorted ids `vocab` among its rows only, when given (scores None if none
        are). The sub-head is built once per form and vocabulary."""
        if vocab is None:
            return self.scores(h), None
        built = self._subsets
        if built is None or built[0] is not self.int8 or built[1] is not vocab:
            ids = vocab
            if self.tp is not None:
                ids = vocab[(vocab >= self.vocab_start) & (vocab < self.vocab_start + self.out_features)]
            sub = self.rows(ids - self.vocab_start) if ids.numel() else None
            self._subsets = built = (self.int8, vocab, ids, sub)
        ids, sub = built[2], built[3]
        return (sub.scores(h) if sub is not None else None), ids

    def rows(self, ids: torch.Tensor) -> LMHead:
        """A head over the token ids `ids` only (a copy of those rows: the same logits, bit for bit)."""
        sub = LMHead(self.in_features, ids.numel())
        if self.quant is not None:
            sub.quant, sub.weight = self.quant.rows(ids), None
            return sub
        sub.weight = nn.Parameter(self.weight.detach()[ids].t().contiguous().t(), requires_grad=False)
        sub.int8 = None if self.int8 is None else self.int8.rows(ids)
        return sub

    @torch.inference_mode()
    def choose_greedy_form(self, reps: int = 5) -> None:
        """Keep an int8 copy of a fp32 CPU head for greedy choices where it makes them faster, timed here:
        exact either way, at a quarter of the head's memory traffic (it won on a Xeon with bf16 units and on
        an AMD EPYC without them: 7.3 vs 11.9 ms for SmolLM2). It then also scores draft proposals."""
        self.int8 = None
        self._subsets = self._vocab_head = None
        weight = self.weight
        if weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32 \
                or not Int8ArgmaxHead.supports(weight):
            return  # held as blocks, or not a fp32 CPU head
        h = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(0), dtype=weight.dtype)
        costs = []
        for candidate in (None, Int8ArgmaxHead(weight)):
            self.int8 = candidate
            self.local_best(h)  # warm-up (this rank's rows only: no collective in the timing)
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                self.local_best(h)
                times.append(time.perf_counter() - start)
            costs.append(min(times))
        self.int8 = candidate if costs[1] < costs[0] else None
