"""The DFlash2 training objective (the DFlash loss plus the candidate selector's) and its held-out metrics.

At each labelled slot the selector picks among the draft's own unary top-K (the target head over the
draft's hidden state, times output_multiplier, softcapped, over the draft's vocabulary when it has one):
    L_sel = K-way cross-entropy of the lattice row S(p, .) = u[.] + <A[p] * P(h), B[.]>
with label = the slot's label (the target's greedy token), the predecessor p teacher-forced (the block's
anchor at the first slot, else the previous slot's label), and the slot's position-decay weight. The
candidate ids are detached (top-K is not differentiable); when the label is not among them it replaces
the last candidate, for the loss only (inference never sees it). The unary scores and P(h) are not
detached: the selector's loss reaches the draft's backbone through both, as the DFlash loss does.
    loss = L_dflash(unary scores) + alpha * L_sel
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockspec.layers.selector import CandidateSelector, walk
from blockspec.models.dflash2 import unary_candidates, unary_scores
from blockspec.models.dflash2_config import Dflash2Config
from blockspec.models.draft import DFlashDraft
from blockspec.train.objective import IGNORE, Blocks, TrainVocab, dflash_loss


def slot_predecessors(blocks: Blocks) -> torch.Tensor:
    """Teacher-forced predecessor token of every predicted slot [b, count, B-1]: the anchor at slot 1,
    else the previous slot's label (IGNORE where that is unknown; such a slot has no label either)."""
    b, count, steps = blocks.labels.shape
    anchor = blocks.input_ids.view(b, count, steps + 1)[:, :, :1]
    return torch.cat([anchor, blocks.labels[:, :, :-1]], dim=-1)


def selector_loss(selector: CandidateSelector, unary: torch.Tensor, hidden: torch.Tensor,
                  target: torch.Tensor, predecessors: torch.Tensor, weights: torch.Tensor, top_k: int,
                  columns: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """L_sel over M labelled slots: unary scores [M, V'] (V' = the vocabulary's columns), the draft's
    hidden states [M, H], the labels as columns [M], the predecessors as token ids [M], the weights [M];
    `columns` maps a column to its token id (None: the column is the id)."""
    with torch.no_grad():
        top = unary.topk(top_k, dim=-1).indices  # [M, K]
        hit = top == target.unsqueeze(-1)
        recalled = hit.any(dim=-1)
        top[:, -1] = torch.where(recalled, top[:, -1], target)  # the missing label takes the last place
        gold = torch.where(recalled, hit.float().argmax(dim=-1), torch.full_like(target, top_k - 1))
    ids = top if columns is None else columns[top]
    scores = selector.edges(hidden, unary.gather(1, top), ids, predecessors)
    per_slot = F.cross_entropy(scores, gold, reduction="none")
    loss = (per_slot * weights).sum() / weights.sum()
    return loss, {"sel_loss": loss.item(), "recall": recalled.float().mean().item()}


def dflash2_loss(hidden: torch.Tensor, lm_head, blocks: Blocks, weights: torch.Tensor, draft: DFlashDraft,
                 alpha: float, vocab: TrainVocab | None = None, teacher: torch.Tensor | None = None,
                 distill: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The DFlash loss on the draft's unary scores (as inference scores the candidates) + alpha * L_sel.
    The head (restricted to `vocab` when given) runs once, on the labelled slots, for both."""
    d2: Dflash2Config = draft.config.dflash2
    block_size = weights.numel() + 1
    labels = blocks.labels if vocab is None else vocab.labels(blocks.labels)
    rows = labels != IGNORE
    if not rows.any():
        return hidden.sum() * 0.0, {"loss": 0.0, "acc1": 0.0, "sel_loss": 0.0, "recall": 0.0}
    slots = hidden.view(hidden.shape[0], -1, block_size, hidden.shape[-1])[:, :, 1:][rows]  # [M, H]
    unary = unary_scores((lm_head if vocab is None else vocab)(slots), d2)
    loss, info = dflash_loss(hidden, lm_head, blocks, weights, vocab, teacher, distill, logits=unary)
    w = weights.to(hidden.device).expand_as(rows)[rows]
    sel, sel_info = selector_loss(draft.candidate_selector, unary, slots, labels[rows],
                                  slot_predecessors(blocks)[rows], w, d2.selector_top_k,
                                  None if vocab is None else vocab.ids)
    total = loss + alpha * sel
    return total, {**info, "loss": total.item(), "unary_loss": info["loss"], **sel_info}


@torch.no_grad()
def dflash2_metrics(draft: DFlashDraft, lm_head, hidden: torch.Tensor,
                    blocks: Blocks) -> dict[str, torch.Tensor]:
    """Held-out selector metrics, in fp32 as the engine computes them (candidates among `draft.vocab`):
    per labelled slot, `recall_at_k` (the label among the unary top-K) and `selector_acc` (the teacher-forced
    lattice row's argmax is the label); per complete block, `walk_tau` (1 + the leading slots where the greedy
    walk, each step after its own previous choice, equals the labels: the engine's accept length)."""
    with torch.autocast(hidden.device.type, enabled=False):
        b, count, steps = blocks.labels.shape
        slots = hidden.float().view(b, count, steps + 1, -1)[:, :, 1:]
        labels, rows = blocks.labels, blocks.labels != IGNORE
        out = {}
        d2, head_dtype = draft.config.dflash2, lm_head.dtype  # the target's head may be bf16
        unary, candidates = unary_candidates(lm_head, slots[rows].unsqueeze(1).to(head_dtype), d2,
                                             draft.vocab)
        unary, candidates, target = unary[:, 0], candidates[:, 0], labels[rows]
        out["recall_at_k"] = (candidates == target.unsqueeze(-1)).any(-1).float()
        scores = draft.candidate_selector.edges(slots[rows], unary, candidates,
                                                slot_predecessors(blocks)[rows])
        out["selector_acc"] = (candidates.gather(1, scores.argmax(-1, keepdim=True))[:, 0] == target).float()
        complete = blocks.complete
        anchor = blocks.input_ids.view(b, count, steps + 1)[:, :, 0][complete]
        unary, candidates = unary_candidates(lm_head, slots[complete].to(head_dtype), d2, draft.vocab)
        scores = draft.candidate_selector.lattice(slots[complete], unary, candidates, anchor)
        path = walk(scores, candidates).tokens  # as the engine walks, the head in its own dtype
        out["walk_tau"] = 1.0 + (path == labels[complete]).long().cumprod(dim=-1).sum(-1).float()
        return {k: v.cpu() for k, v in out.items()}


def param_groups(draft, lr: float, selector_lr_scale: float | None) -> list[dict]:
    """The optimizer's groups: a DFlash2 draft's selector at --selector-lr-scale times the learning rate
    (it starts near zero on a trained backbone, and Adam moves a weight ~lr per step)."""
    named = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    selector = [p for n, p in named if n.startswith("candidate_selector.")]
    rest = [p for n, p in named if not n.startswith("candidate_selector.")]
    if not selector or selector_lr_scale in (None, 1.0):
        return [{"params": rest + selector}]
    return [{"params": rest}, {"params": selector, "lr": lr * selector_lr_scale}]
