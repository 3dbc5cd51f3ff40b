"""Model runner: batched prefill chunks, one plain decode step, one DFlash draft+verify step, one
prompt-lookup verify step.

Everything per step is batched: one draft forward and one target verify for all running rows,
each row accepting its own number of tokens (ragged acceptance needs no padding: rows keep their
own cache lengths, and the scratch rows past a row's commit point are overwritten before use).
"""

from __future__ import annotations

import time

import torch

from blockspec.engine.kv_cache import Batch, SlotPool
from blockspec.engine.sampler import next_token
from blockspec.engine.sequence import Sequence
from blockspec.models.argmax_head import Int8ArgmaxHead
from blockspec.models.draft import DFlashDraft
from blockspec.models.layers import Linear
from blockspec.models.target import CausalLM
from blockspec.spec.accept import greedy_accept, sampled_accept
from blockspec.spec.governor import SpecGovernor
from blockspec.spec.lookup import lookup
from blockspec.engine.layout_tuning import DEFAULT_PROBE_ROWS, tune_layouts


def batch_of(seqs: list[Sequence]) -> Batch:
    """The rows' slots and cache lengths: where a forward over them writes and what it attends to."""
    return Batch([s.slot for s in seqs], [s.num_cached for s in seqs])


class ModelRunner:
    # A plain step of a DFlash request only keeps the new position's target features; the draft catches
    # up right before it drafts again (`feed_draft_backlog`): injecting k positions costs about what
    # injecting one does (the draft's weights are read once), and a request that finishes while decoding
    # plainly never pays for its backlog. At most this many positions wait.
    MAX_UNFED = 64

    def __init__(
        self,
        target: CausalLM,
        draft: DFlashDraft | None,
        block_size: int,
        mask_token_id: int,
        num_slots: int,
        max_len: int,
        prefill_chunk: int = 512,
        governor: SpecGovernor | None = None,
        lookup_ngram: int = 0,
        lookup_width: int = 0,
    ) -> None:
        self.target, self.draft = target, draft
        self.governor = governor  # None: every decode step of a DFlash request speculates
        # Prompt lookup (spec/lookup.py) for DFlash requests: a step where every row's context has a match of
        # at least lookup_ngram tokens verifies the copied continuation, lookup_width rows, without drafting.
        self.lookup_ngram, self.lookup_width = (lookup_ngram, lookup_width) if draft is not None else (0, 0)
        self.mask_token_id = mask_token_id
        self.max_len, self.prefill_chunk = max_len, prefill_chunk
        self.pool = SlotPool(num_slots)
        self.target_cache = target.new_cache(num_slots, max_len)
        self.draft_cache = draft.new_cache(num_slots, max_len) if draft is not None else None
        self.capture = tuple(draft.config.target_layer_ids) if draft is not None else ()
        self.device = target.embed_tokens.weight.device
        self.argmax_head: Int8ArgmaxHead | None = None
        self._draft_head: tuple | None = None  # (argmax_head, draft vocab) it was built for, and its rows
        self.layout_plan: dict[int, str] = {}  # rows -> Linear layout (layout_tuning.py); {}: stored everywhere
        self.set_block_size(block_size)
        self.argmax_head = self.pick_argmax_head()

    @property
    def step_width(self) -> int:
        """The most rows one decode step of a DFlash request writes past its cache length."""
        return max(self.block_size, self.lookup_width if self.lookup_ngram else 0)

    def set_block_size(self, block_size: int) -> None:
        self.block_size = block_size
        self.tune_layouts()

    def tune_layouts(self) -> None:
        """Time and set the fp32 CPU weight layouts for the row counts decode steps run (layout_tuning.py):
        batch-1 verify passes of B (and lookup-width) rows, draft passes of B rows, and batches of either."""
        if self.device.type != "cpu" or self.target.embed_tokens.weight.dtype != torch.float32:
            return
        counts = (self.block_size, self.lookup_width) if self.draft is not None else ()
        position = min(256, self.max_len - max((DEFAULT_PROBE_ROWS, *counts)))  # a typical context length
        if self.pool.num_free == 0 or position < 0:
            return  # no free scratch slot to time in (set_block_size mid-generation): keep the last plan
        slot = self.pool.allocate()

        @torch.inference_mode()
        def run(rows: int) -> None:
            ids = torch.randint(0, self.target.embed_tokens.weight.shape[0], (1, rows), device=self.device)
            hidden, _ = self.target(ids, Batch([slot], [position]), self.target_cache, self.capture)
            self.greedy_tokens(hidden)

        linears = [m for model in (self.target, self.draft) if model is not None
                   for m in model.modules() if isinstance(m, Linear) and m is not self.target.lm_head]
        try:  # the weight copies are made outside inference mode: a grad-mode forward may use them too
            self.layout_plan = tune_layouts(linears, [self.target.lm_head], run, counts)
            self._draft_head = None  # rebuilt in the new layouts when next drafted
        finally:
            self.pool.free(slot)

    @torch.inference_mode()
    def pick_argmax_head(self, reps: int = 5) -> Int8ArgmaxHead | None:
        """An int8 copy of the fp32 CPU LM head (argmax_head.py: exact greedy choices at a quarter of the head's
        memory traffic) where it makes a decode step's choice faster than the fp32 head, timed here (it won
        on the Xeon with bf16 units, and on the AMD EPYC without them: 7.3 vs 11.9 ms for SmolLM2). It then
        also ranks the draft's proposals, which need not be exact."""
        head = self.target.lm_head.weight
        if self.device.type != "cpu" or head.dtype != torch.float32 or not Int8ArgmaxHead.supports(head):
            return None
        hidden = torch.randn(1, head.shape[1], generator=torch.Generator().manual_seed(0), dtype=head.dtype)
        costs = []
        for candidate in (None, Int8ArgmaxHead(head)):
            self.argmax_head = candidate
            self.greedy_tokens(hidden)  # warm-up
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                self.greedy_tokens(hidden)
                times.append(time.perf_counter() - start)
            costs.append(min(times))
        return candidate if costs[1] < costs[0] else None

    def admit(self, seq: Sequence) -> None:
        seq.slot = self.pool.allocate()

    def release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.pool.free(seq.slot)
            seq.slot = -1
        seq.unfed_features.clear()  # its draft cache is gone; a resumed request is prefilled again

    @torch.inference_mode()
    def compact(self, seqs: list[Sequence]) -> None:
        """Move sequences holding a slot >= len(seqs) into the free slots below, so the running slots are
        0..len(seqs)-1 and a slot-ordered batch reads its K/V as a view, not a gather of every row per
        layer per step. Costs one copy of a moved sequence's K/V, once, when a sequence below it leaves."""
        for seq in seqs:
            if seq.slot >= len(seqs):
                slot = self.pool.allocate()  # the lowest free slot, below len(seqs)
                for cache in (self.target_cache, self.draft_cache):
                    if cache is not None:
                        cache.move(seq.slot, slot, seq.num_cached)
                self.pool.free(seq.slot)
                seq.slot = slot

    def target_outputs(self, seqs: list[Sequence], hidden: torch.Tensor) -> list[torch.Tensor]:
        """Per row of hidden [b, ..., H] (last layer, before the final norm): the target's greedy
        token ids [...] (on the CPU) for a greedy request, its fp32 logits [..., V] for a sampled one."""
        greedy = [row for row, s in enumerate(seqs) if s.params.greedy]
        sampled = [row for row, s in enumerate(seqs) if not s.params.greedy]
        out: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        if greedy:
            choices = self.greedy_tokens(hidden[greedy]).cpu()  # one device sync for the batch, not one per row
            for i, row in enumerate(greedy):
                out[row] = choices[i]
        if sampled:
            logits = self.target.logits(hidden[sampled])
            for i, row in enumerate(sampled):
                out[row] = logits[i]
        return out

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's greedy token ids [...] for hidden states [..., H] (last layer, before the final norm)."""
        normed = self.target.norm(hidden)
        if self.argmax_head is None:
            return self.target.lm_head(normed).argmax(dim=-1)
        return self.argmax_head.argmax(normed.reshape(-1, normed.shape[-1])).view(normed.shape[:-1])

    def emit_next(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """Emit one token per sequence from the hidden state [b, H] of its last position."""
        for seq, out in zip(seqs, self.target_outputs(seqs, hidden)):
            seq.emit([int(out) if seq.params.greedy else next_token(out, seq.params, seq.generator)])

    def decode(self, seqs: list[Sequence], use_draft: bool) -> None:
        """One decode step for every sequence: plain, a DFlash step, or a prompt-lookup step. A row whose
        context has a match (spec/lookup.py) verifies the copy instead of a draft block: it accepts far more
        there. When every row has one the step needs no draft pass (`lookup_step`); when only some do, the
        others draft as usual in a `dflash_step` at the lookup width if the governor expects that wider step
        to commit tokens faster; otherwise the governor picks a DFlash or a plain step."""
        copies = self.lookups(seqs) if use_draft and self.lookup_ngram else []
        copied = [bool(c) for c in copies]
        start = time.perf_counter()
        if any(copied) and (all(copied) or self.governor is None
                            or self.governor.mix(seqs, copied, self.block_size, self.lookup_width)):
            if all(copied):
                self.lookup_step(seqs, torch.tensor(copies, device=self.device))
            else:
                self.dflash_step(seqs, copies)
            if self.governor is not None:
                self.governor.record_lookup(seqs, copied, self.block_size, self.lookup_width,
                                            time.perf_counter() - start)
            return
        speculate = use_draft and (self.governor is None or self.governor.speculate(seqs, self.block_size))
        if speculate:
            self.dflash_step(seqs)
        else:
            self.decode_step(seqs, feed_draft=use_draft)
        if use_draft and self.governor is not None:  # both steps end in a host sync (tokens emitted)
            self.governor.record(seqs, self.block_size, speculate, time.perf_counter() - start)

    def lookups(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each row's prompt-lookup proposals (lookup_width - 1 tokens), or [] where its context has no match."""
        return [lookup(s.prompt_ids + s.output_ids, self.lookup_ngram, self.lookup_width - 1) for s in seqs]

    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence], feed_draft: bool = False) -> None:
        """Plain autoregressive step: one token for every sequence. `feed_draft` also keeps the new
        position's target features for the draft (`feed_draft_backlog`), so a DFlash request can
        speculate again at any later step."""
        batch = batch_of(seqs)
        ids = torch.tensor([[s.pending_token] for s in seqs], device=self.device)
        hidden, features = self.target(ids, batch, self.target_cache, self.capture if feed_draft else ())
        for row, seq in enumerate(seqs):
            seq.num_cached += 1
            if feed_draft:
                seq.plain_steps += 1
                seq.unfed_features.append(features[row, 0])
            else:
                seq.accept_lengths.append(1)
        if feed_draft and max(len(s.unfed_features) for s in seqs) >= self.MAX_UNFED:
            self.feed_draft_backlog(seqs)
        self.emit_next(seqs, hidden[:, -1])

    @torch.inference_mode()
    def feed_draft_backlog(self, seqs: list[Sequence]) -> None:
        """Inject every sequence's unfed target features into the draft's cache: one pass per distinct
        backlog length (usually one: a batch takes plain steps together)."""
        by_length: dict[int, list[Sequence]] = {}
        for seq in seqs:
            if seq.unfed_features:
                by_length.setdefault(len(seq.unfed_features), []).append(seq)
        for n, group in by_length.items():
            features = torch.stack([torch.stack(s.unfed_features) for s in group])  # [g, n, K*H]
            self.draft.inject(features, Batch([s.slot for s in group], [s.num_cached - n for s in group]),
                              self.draft_cache)
            for seq in group:
                seq.unfed_features.clear()

    def draft_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Scores [M, V] of the target's LM head for draft hidden states [M, H] (the int8 copy where there is
        one), over the draft's vocabulary only if it has one (the rows of the head it was trained to use)."""
        head, vocab = self.argmax_head, self.draft.vocab
        built = self._draft_head
        if built is None or built[0] is not head or built[1] is not vocab:  # built once per head and vocab
            if head is None:  # a Linear over the head's rows, to run in the tuned layout
                rows = self.target.lm_head.weight if vocab is None else self.target.lm_head.weight[vocab]
                rows = Linear.of(rows.detach().contiguous())
                rows.set_layouts(self.layout_plan, copies=False)
            else:
                rows = head if vocab is None else head.rows(vocab)
            self._draft_head = built = (head, vocab, rows)
        return built[2](hidden) if head is None else built[2].scores(hidden)

    def draft_tokens(self, seqs: list[Sequence], block: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The draft's proposals [b, B-1] for blocks [bonus, MASK...]: argmax of the target's LM head."""
        embed = self.draft.embed_tokens if self.draft.embed_tokens is not None else self.target.embed_tokens
        hidden = self.draft(embed(block), batch, self.draft_cache)[:, 1:]
        best = self.draft_scores(hidden.reshape(-1, hidden.shape[-1])).argmax(dim=-1).view(hidden.shape[:2])
        return best if self.draft.vocab is None else self.draft.vocab[best]

    @torch.inference_mode()
    def dflash_step(self, seqs: list[Sequence], copies: list[list[int]] | None = None) -> None:
        """Draft a block per sequence in one pass, verify all blocks in one target pass, commit. With `copies`
        (some rows' prompt-lookup proposals) those rows verify their copy instead and the pass is step_width
        rows wide; the drafting rows still propose B-1 tokens (their accept lengths stay 1..B)."""
        self.feed_draft_backlog(seqs)
        copied = [bool(c) for c in copies] if copies else [False] * len(seqs)
        drafting = [row for row, c in enumerate(copied) if not c]
        rows = [seqs[row] for row in drafting]
        block = torch.full((len(rows), self.block_size), self.mask_token_id, device=self.device)
        block[:, 0] = torch.tensor([s.pending_token for s in rows], device=self.device)
        proposals = self.draft_tokens(rows, block, batch_of(rows))
        if any(copied):  # widen to the lookup width; drafted rows' extra positions are never judged
            wide = torch.full((len(seqs), self.step_width - 1), self.mask_token_id, device=self.device)
            wide[drafting, : self.block_size - 1] = proposals
            for row, copy in enumerate(copies):
                if copy:
                    wide[row, : len(copy)] = torch.tensor(copy, device=self.device)
            proposals = wide
        self.verify(seqs, proposals, batch_of(seqs), copied, inject=True)

    @torch.inference_mode()
    def lookup_step(self, seqs: list[Sequence], proposals: torch.Tensor) -> None:
        """Verify each row's prompt-lookup proposals [b, W-1]; the draft is not run (it catches up on the
        committed positions' features before it next drafts, as after a plain step)."""
        batch = batch_of(seqs)
        self.verify(seqs, proposals, batch, [True] * len(seqs), inject=False)
        if max(len(s.unfed_features) for s in seqs) >= self.MAX_UNFED:
            self.feed_draft_backlog(seqs)

    def verify(self, seqs: list[Sequence], proposals: torch.Tensor, batch: Batch, copied: list[bool],
               inject: bool) -> None:
        """One causal target pass over [pending, proposals...] per row, acceptance, commit. A copied row
        judges its first W-1 proposals and records a lookup step; a drafted row its first B-1 and a DFlash step.
        inject: write the draft's context K/V for every row now (its backlog was fed), else copied rows keep
        the committed positions' features for later."""
        pending = torch.tensor([[s.pending_token] for s in seqs], device=self.device)
        hidden, features = self.target(torch.cat([pending, proposals], dim=1), batch, self.target_cache, self.capture)
        outputs = self.target_outputs(seqs, hidden)
        host_proposals = proposals.cpu()
        if inject:
            # Context K/V for all rows: rows past a sequence's commit point are overwritten by the next
            # draft block (which starts right after the commit) before anything attends to them.
            self.draft.inject(features, batch, self.draft_cache)
        for row, seq in enumerate(seqs):
            n = (self.lookup_width if copied[row] else self.block_size) - 1
            if seq.params.greedy:
                accepted, bonus = greedy_accept(host_proposals[row, :n], outputs[row][: n + 1])
            else:
                accepted, bonus = sampled_accept(proposals[row, :n], outputs[row][: n + 1], seq.params, seq.generator)
            seq.num_cached += accepted + 1
            if copied[row]:
                seq.lookup_accept_lengths.append(accepted + 1)
                if not inject:
                    seq.unfed_features.extend(features[row, : accepted + 1].unbind(0))
            else:
                seq.accept_lengths.append(accepted + 1)
            seq.emit(host_proposals[row, :accepted].tolist() + [bonus])

    @torch.inference_mode()
    def prefill_batch(self, seqs: list[Sequence], chunks: list[list[int]], use_draft: bool) -> torch.Tensor:
        """One prompt chunk per sequence in one forward, at positions seq.num_cached onwards; rows are
        right-padded to the longest chunk (the padding writes scratch rows past each sequence's length,
        which the sequence's next forward overwrites before anything attends to them, as with a rejected
        draft tail). Injects the draft context, advances num_cached, and returns the last layer's hidden
        state at each row's last real token [b, H]; `sample_first` turns it into a first token.
        The caller keeps every row's num_cached + padded width within max_len."""
        width = max(len(c) for c in chunks)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=self.device)
        for row, chunk in enumerate(chunks):
            ids[row, : len(chunk)] = torch.tensor(chunk, device=self.device)
        batch = batch_of(seqs)
        capture = self.capture if use_draft else ()
        hidden, features = self.target(ids, batch, self.target_cache, capture)
        if use_draft:
            self.draft.inject(features, batch, self.draft_cache)
        for seq, chunk in zip(seqs, chunks):
            seq.num_cached += len(chunk)
        last = torch.tensor([len(c) - 1 for c in chunks], device=self.device)
        return hidden[torch.arange(len(seqs), device=self.device), last]

    @torch.inference_mode()
    def sample_first(self, seqs: list[Sequence], hidden: torch.Tensor) -> None:
        """Emit each sequence's first token from the hidden state of its last prompt token [b, H]."""
        self.emit_next(seqs, hidden)
