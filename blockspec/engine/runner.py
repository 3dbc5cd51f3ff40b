"""Model runner: batched prefill chunks, one plain decode step, one DFlash draft+verify step.

Everything per step is batched: one draft forward and one target verify for all running rows,
each row accepting its own number of tokens (ragged acceptance needs no padding: rows keep their
own cache lengths, and the scratch rows past a row's commit point are overwritten before use).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.engine.kv_cache import Batch, SlotPool
from blockspec.engine.sampler import next_token
from blockspec.engine.sequence import Sequence
from blockspec.models.draft import DFlashDraft
from blockspec.models.target import CausalLM
from blockspec.spec.accept import greedy_accept, sampled_accept
from blockspec.spec.draft_config import has_fast_bf16


class ModelRunner:
    def __init__(
        self,
        target: CausalLM,
        draft: DFlashDraft | None,
        block_size: int,
        mask_token_id: int,
        num_slots: int,
        max_len: int,
        prefill_chunk: int = 512,
    ) -> None:
        self.target, self.draft = target, draft
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.max_len, self.prefill_chunk = max_len, prefill_chunk
        self.pool = SlotPool(num_slots)
        self.target_cache = target.new_cache(num_slots, max_len)
        self.draft_cache = draft.new_cache(num_slots, max_len) if draft is not None else None
        self.capture = tuple(draft.config.target_layer_ids) if draft is not None else ()
        self.device = target.embed_tokens.weight.device
        # The draft only proposes (the target verifies in its own dtype), so its LM head may run in bf16
        # where that is fast: over a block's rows it is most of the draft's cost on CPU.
        head = target.lm_head.weight
        fast = draft is not None and head.dtype == torch.float32 and has_fast_bf16(self.device)
        self.draft_head_bf16 = head.to(torch.bfloat16) if fast else None

    def admit(self, seq: Sequence) -> None:
        seq.slot = self.pool.allocate()

    def release(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            self.pool.free(seq.slot)
            seq.slot = -1

    @torch.inference_mode()
    def decode_step(self, seqs: list[Sequence]) -> None:
        """Plain autoregressive step: one token for every sequence."""
        batch = Batch([s.slot for s in seqs], [s.num_cached for s in seqs])
        ids = torch.tensor([[s.pending_token] for s in seqs], device=self.device)
        hidden, _ = self.target(ids, batch, self.target_cache)
        logits = self.target.logits(hidden[:, -1])
        for row, seq in enumerate(seqs):
            seq.num_cached += 1
            seq.emit([next_token(logits[row], seq.params, seq.generator)])
            seq.accept_lengths.append(1)

    def draft_tokens(self, seqs: list[Sequence], block: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The draft's proposals [b, B-1] for blocks [bonus, MASK...]: argmax of the target's LM head."""
        embed = self.draft.embed_tokens if self.draft.embed_tokens is not None else self.target.embed_tokens
        hidden = self.draft(embed(block), batch, self.draft_cache)[:, 1:]
        if self.draft_head_bf16 is not None:
            return F.linear(hidden.to(torch.bfloat16), self.draft_head_bf16).argmax(dim=-1)
        return self.target.lm_head(hidden).argmax(dim=-1)

    @torch.inference_mode()
    def dflash_step(self, seqs: list[Sequence]) -> None:
        """Draft a block per sequence in one pass, verify all blocks in one target pass, commit."""
        size = self.block_size
        batch = Batch([s.slot for s in seqs], [s.num_cached for s in seqs])
        block = torch.full((len(seqs), size), self.mask_token_id, device=self.device)
        block[:, 0] = torch.tensor([s.pending_token for s in seqs], device=self.device)
        drafts = self.draft_tokens(seqs, block, batch)
        candidates = torch.cat([block[:, :1], drafts], dim=1)
        hidden, features = self.target(candidates, batch, self.target_cache, self.capture)
        logits = self.target.logits(hidden)
        # Context K/V for all B rows: rows past a sequence's commit point are overwritten by the next
        # draft block (which starts right after the commit) before anything attends to them.
        self.draft.inject(features, batch, self.draft_cache)
        for row, seq in enumerate(seqs):
            if seq.params.greedy:
                accepted, bonus = greedy_accept(drafts[row], logits[row])
            else:
                accepted, bonus = sampled_accept(drafts[row], logits[row], seq.params, seq.generator)
            seq.num_cached += accepted + 1
            seq.accept_lengths.append(accepted + 1)
            seq.emit(drafts[row, :accepted].tolist() + [bonus])

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
        batch = Batch([s.slot for s in seqs], [s.num_cached for s in seqs])
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
        logits = self.target.logits(hidden)
        for row, seq in enumerate(seqs):
            seq.emit([next_token(logits[row], seq.params, seq.generator)])
