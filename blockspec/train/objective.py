"""The DFlash training objective: random anchors, blocks, the block-sparse training mask, the loss.

For a sequence of T tokens with target features f[0..T) and labels y[0..T) (y[t] = the target's
greedy next token after position t), an anchor a starts the block
    ids       [x[a], MASK, ..., MASK]              (B slots)
    positions  a,    a+1,  ..., a+B-1              (absolute, for RoPE, as at inference)
    labels     -,    y[a], ..., y[a+B-2]           (slot k predicts the token at position a+k)
The block sees the context features at positions < a (at inference the anchor, i.e. the bonus
token, is not yet in the context) and its own B slots bidirectionally; never another block. Many
blocks of one sequence are trained in one pass. Label positions past the sequence end are ignored.

Slot k's label is the greedy continuation only while the real tokens after the anchor follow the
target's own argmax: y[a+k-1] is what the target says after x[..a+k-1], which is its greedy path
only if x[a+j] == y[a+j-1] for j < k. Past the first disagreement (teacher-forced text; never inside
an on-policy response) the slots are ignored, so every label is what greedy verification would
compare the draft's proposal with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockspec.layers.embedding import LMHead
from blockspec.layers.forward_batch import ForwardBatch

IGNORE = -100
PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash paper's position-decay constants per block size


def default_gamma(block_size: int) -> float:
    """The paper's gamma for B in {8, 10, 16}; other sizes get the same ~0.45*B scaling."""
    return PAPER_GAMMA.get(block_size, max(1.0, round(0.45 * block_size, 1)))


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for the predicted slots k = 1..B-1 (float32 [B-1])."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def anchor_bounds(length: int, start: int) -> tuple[int, int]:
    """Inclusive range [lo, hi] of valid anchors: a >= max(1, start) (some context, inside the
    response) and a + 1 <= length - 1 (at least one label). Empty when lo > hi."""
    return max(1, start), length - 2


def sample_anchors(
    lengths: list[int], starts: list[int], count: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` distinct random anchors per sequence, sorted: (anchors [b, count] long, valid [b, count]).
    Sequences with fewer valid positions get all of them; the rest of their row is padding (valid False)."""
    anchors = torch.zeros(len(lengths), count, dtype=torch.long)
    valid = torch.zeros(len(lengths), count, dtype=torch.bool)
    for row, (length, start) in enumerate(zip(lengths, starts)):
        lo, hi = anchor_bounds(length, start)
        span = hi - lo + 1
        if span <= 0:
            continue
        pick = torch.randperm(span, generator=generator)[:count].sort().values + lo
        anchors[row, : len(pick)] = pick
        valid[row, : len(pick)] = True
    return anchors, valid


@dataclass
class Blocks:
    """Many blocks per sequence, flattened to n = count * B rows per sequence."""

    input_ids: torch.Tensor  # [b, n] anchor token then MASKs, per block
    positions: torch.Tensor  # [b, n] absolute positions a..a+B-1
    labels: torch.Tensor  # [b, count, B-1] target tokens for slots 1..B-1, IGNORE where absent
    context_visible: torch.Tensor  # bool [b, n, T]: the context positions each row sees
    own_block: torch.Tensor  # bool [1, n, n]: row i sees row j of the blocks (its own block's)
    valid: torch.Tensor  # bool [b, count] real (non-padding) blocks
    # bool [b, count] real blocks whose B-1 label positions are all inside the sequence
    complete: torch.Tensor

    def forward_batch(self) -> ForwardBatch:
        """The draft's training forward over every block at once, the context (target features at
        positions 0..T-1) given with it instead of a cache."""
        b, t = self.context_visible.shape[0], self.context_visible.shape[2]
        context_positions = torch.arange(t, device=self.positions.device).expand(b, t)
        return ForwardBatch.standalone(self.input_ids, self.positions, self.own_block, context_positions,
                                       self.context_visible)


def training_mask(anchors: torch.Tensor, block_size: int, ctx_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bool [b, count*B, ctx_len], bool [1, count*B, count*B]): the rows of block j see context positions
    < a_j and the B rows of block j; nothing else. Padding blocks (any anchor) see the same pattern, so no
    row is ever fully masked."""
    b, count = anchors.shape
    n = count * block_size
    row_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, n]
    ctx = torch.arange(ctx_len, device=anchors.device).view(1, 1, -1) < row_anchor.unsqueeze(-1)
    block_of = torch.arange(n, device=anchors.device) // block_size
    return ctx, (block_of.view(-1, 1) == block_of.view(1, -1)).unsqueeze(0)


def build_blocks(
    ids: torch.Tensor,
    labels: torch.Tensor,
    lengths: list[int],
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
) -> Blocks:
    """ids, labels: [b, T] (right-padded); anchors/valid from `sample_anchors`."""
    b, count = anchors.shape
    offsets = torch.arange(block_size, device=ids.device)
    positions = anchors.unsqueeze(-1) + offsets  # [b, count, B]
    input_ids = torch.full((b, count, block_size), mask_token_id, dtype=ids.dtype, device=ids.device)
    input_ids[:, :, 0] = ids.gather(1, anchors)
    label_pos = positions[:, :, 1:]  # slot k predicts the token at position a+k, i.e. labels[a+k-1]
    length = torch.tensor(lengths, device=ids.device).view(-1, 1, 1)
    inside = (label_pos <= length - 1) & valid.unsqueeze(-1)
    # agree[t]: the real token at t+1 is the target's greedy choice after t; slot k needs agree[a..a+k-2]
    agree = torch.zeros_like(ids, dtype=torch.bool)
    agree[:, :-1] = ids[:, 1:] == labels[:, :-1]
    agree_pos = (positions[:, :, 1:-1] - 1).clamp(max=ids.shape[1] - 1)  # a .. a+B-3
    follows = agree.gather(1, agree_pos.reshape(b, count * (block_size - 2))).view(b, count, block_size - 2)
    on_path = torch.ones_like(inside)
    on_path[:, :, 1:] = follows.cumprod(dim=-1).bool()
    present = inside & on_path
    gathered = labels.gather(
        1, (label_pos - 1).clamp(max=labels.shape[1] - 1).view(b, -1)).view_as(label_pos)
    block_labels = torch.where(present, gathered, torch.full_like(gathered, IGNORE))
    context_visible, own_block = training_mask(anchors, block_size, ids.shape[1])
    return Blocks(
        input_ids=input_ids.view(b, -1),
        positions=positions.view(b, -1),
        labels=block_labels,
        context_visible=context_visible,
        own_block=own_block,
        valid=valid,
        complete=inside.all(-1),
    )


def block_logits(hidden: torch.Tensor, lm_head: torch.nn.Module, block_size: int,
                 rows: torch.Tensor) -> torch.Tensor:
    """Logits for the selected predicted slots: hidden [b, count*B, H] -> [rows.sum(), V] in the
    autocast dtype (under bf16 autocast, cross_entropy still runs in fp32)."""
    b = hidden.shape[0]
    predicted = hidden.view(b, -1, block_size, hidden.shape[-1])[:, :, 1:]  # [b, count, B-1, H]
    return lm_head(predicted[rows])


class TrainVocab:
    """The `size` most frequent label tokens. The training softmax over the full vocabulary is most of
    a CPU step (SmolLM2: 49k logits per predicted slot, ~2/3 of the step); restricted to the tokens the
    target actually emits (SmolLM2: the top 16k covered 100% of its response labels) a step took 2.2x
    less time, like EAGLE-3's draft vocabulary. Labels outside are skipped. The exported draft carries
    the ids, and inference and the held-out tau rank its proposals over them only."""

    def __init__(self, lm_head: LMHead, counts: torch.Tensor, size: int) -> None:
        ids = counts.topk(min(size, counts.numel())).indices.sort().values
        self.coverage = (counts[ids].sum() / counts.sum().clamp(min=1)).item()
        ids, device = ids.to(lm_head.device), lm_head.device
        self.ids = ids  # sorted; exported as the draft's vocabulary (checkpoint tensor draft_vocab)
        self.head = lm_head.rows(ids)  # [size, H]
        self.remap = torch.full((counts.numel(),), IGNORE, dtype=torch.long, device=device)
        self.remap[ids] = torch.arange(ids.numel(), device=device)

    @property
    def size(self) -> int:
        return self.ids.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)

    def labels(self, labels: torch.Tensor) -> torch.Tensor:
        return torch.where(labels == IGNORE, labels, self.remap[labels.clamp(min=0)])


def dflash_loss(
    hidden: torch.Tensor, lm_head, blocks: Blocks, weights: torch.Tensor, vocab: TrainVocab | None = None,
    teacher: torch.Tensor | None = None, distill: float = 0.0, logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Position-decayed cross-entropy over the predicted slots; the LM head (or the restricted `vocab`)
    runs on labelled rows only. With `teacher` (the target's final-normed hidden state at the position
    each slot predicts from, [b, count, B-1, H]) and distill > 0 the per-slot loss is
    (1 - distill) * CE(label) + distill * KL(target || draft) over the same head: the target's whole
    next-token distribution, not only its argmax (soft labels, as in knowledge distillation). `logits`:
    the draft's scores at the labelled slots when the caller has them (a DFlash2 draft's unary scores)."""
    block_size = weights.numel() + 1
    labels = blocks.labels if vocab is None else vocab.labels(blocks.labels)
    rows = labels != IGNORE  # [b, count, B-1]
    if not rows.any():
        return hidden.sum() * 0.0, {"loss": 0.0, "acc1": 0.0}
    head = lm_head if vocab is None else vocab
    logits = block_logits(hidden, head, block_size, rows) if logits is None else logits
    target = labels[rows]
    w = weights.to(hidden.device).expand_as(rows)[rows]
    per_slot = F.cross_entropy(logits, target, reduction="none")
    info = {}
    if teacher is not None and distill > 0:
        with torch.no_grad():
            log_p = F.log_softmax(head(teacher[rows].to(logits.dtype)).float(), dim=-1)
        kl = (log_p.exp() * (log_p - F.log_softmax(logits.float(), dim=-1))).sum(-1)
        per_slot = (1.0 - distill) * per_slot + distill * kl
        info["kl"] = ((kl.detach() * w).sum() / w.sum()).item()
    loss = (per_slot * w).sum() / w.sum()
    with torch.no_grad():  # top-1 accuracy of the first predicted slot (the one verified first)
        first = torch.arange(block_size - 1, device=rows.device).expand_as(rows)[rows] == 0
        hits = logits[first].argmax(-1) == target[first]
        acc1 = hits.float().mean().item() if hits.numel() else 0.0
    return loss, {"loss": loss.item(), "acc1": acc1, **info}


def greedy_accept_lengths(
    hidden: torch.Tensor, lm_head: torch.nn.Module, blocks: Blocks, vocab: TrainVocab | None = None,
) -> torch.Tensor:
    """Accepted length per complete block under greedy verification against the labels:
    1 (the anchor / bonus) + the number of leading slots where draft argmax == label (the argmax over
    `vocab` when given, as the engine ranks the proposals of a draft that carries its vocabulary).
    Blocks that run past the sequence end are skipped; a run that reaches a slot whose label is unknown
    (the text left the target's greedy path there) stops, so on teacher-forced text this is a lower bound.
    Returns float [num_complete]."""
    complete = blocks.complete
    if not complete.any():
        return torch.zeros(0)
    block_size = blocks.labels.shape[-1] + 1
    rows = complete.unsqueeze(-1).expand_as(blocks.labels)
    predicted = block_logits(hidden, lm_head if vocab is None else vocab, block_size, rows).argmax(-1)
    predicted = (predicted if vocab is None else vocab.ids[predicted]).view(-1, block_size - 1)
    hits = (predicted == blocks.labels[complete]).long()
    return 1.0 + hits.cumprod(dim=-1).sum(-1).float()


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warm-up to 1 over `warmup` steps, then cosine decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def steps_in_budget(done: int, elapsed: float, eval_seconds: float, evals: int, eval_every: int,
                    budget: float, first_step: float = 0.0) -> int:
    """How many steps in all fit a time budget, from `done` steps having taken `elapsed` seconds, of which
    `eval_seconds` went to `evals` evaluations: the steps to come, their periodic evaluations and a final
    one. `first_step`: the first step's seconds, when given, are left out of the rate (on a GPU it carries
    the one-off kernel and allocator warm-up)."""
    eval_cost = eval_seconds / max(1, evals)
    timed_steps, timed_seconds = ((done - 1, elapsed - first_step) if first_step and done > 1
                                  else (done, elapsed))
    per_step = (timed_seconds - eval_seconds) / timed_steps + eval_cost / eval_every
    return done + max(0, int((budget - elapsed - eval_cost) / per_step))
