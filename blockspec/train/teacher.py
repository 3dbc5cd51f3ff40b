"""The frozen target in training: what of it a run keeps (`freeze`), and what it computes beside the draft:
with `--features online` a batch's tapped features and greedy labels (`target_pass`), and the distillation
teacher, the target's own hidden state where each block slot predicts (`teacher_hidden`). Both in the
target's own dtype, outside autocast."""

from __future__ import annotations

import torch

from blockspec.layers.forward_batch import ForwardBatch
from blockspec.models.target import CausalLM
from blockspec.train.features import causal_batch, greedy_labels


def freeze(target: CausalLM, online: bool, distill: bool, layer_ids: tuple[int, ...]) -> None:
    """With features on disk training needs only the frozen embedding and LM head, plus, with --distill,
    the layers above the deepest tapped one (the teacher's distribution); online, the whole target."""
    target.requires_grad_(False)
    if online:
        return
    keep = ("embed_tokens", "lm_head") + (("layers", "norm", "rotary") if distill else ())
    for name in [n for n, _ in target.named_children() if n not in keep]:
        delattr(target, name)
    if distill:
        for i in range(max(layer_ids) + 1):
            target.layers[i] = torch.nn.Identity()


@torch.no_grad()
@torch.autocast("cpu", enabled=False)
@torch.autocast("cuda", enabled=False)
def target_pass(target: CausalLM, ids: torch.Tensor, labels: torch.Tensor,
                layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One causal target forward over the batch -> (the tapped features as float32, the labels with each -1
    replaced by the target's argmax, the final-normed hidden states (the distillation teacher)). Right
    padding never reaches real positions."""
    hidden, feats = target(causal_batch(ids), layer_ids)
    rows = (labels < 0).any(dim=1).nonzero().squeeze(1)  # teacher-forced text (responses carry theirs)
    if rows.numel():
        labels = labels.clone()
        labels[rows] = torch.where(labels[rows] < 0, greedy_labels(target, hidden[rows]), labels[rows])
    return feats.float(), labels, target.norm(hidden)


@torch.no_grad()
@torch.autocast("cpu", enabled=False)
@torch.autocast("cuda", enabled=False)
def teacher_hidden(target: CausalLM, feats: torch.Tensor, blocks, layer_ids: tuple[int, ...],
                   final: torch.Tensor | None = None) -> torch.Tensor:
    """The target's final-normed hidden state at the position each block slot predicts from
    ([b, count, B-1, H]): `final` when the target just ran (online), else the deepest tapped layer's
    cached features (`feats`, columns in `layer_ids` order) run through the target's remaining layers
    (causal; right padding cannot reach real positions)."""
    b, t, _ = feats.shape
    size = blocks.labels.shape[-1] + 1  # the block size
    hidden_size, last = target.config.hidden_size, target.config.num_hidden_layers - 1
    deepest = max(layer_ids)
    column = layer_ids.index(deepest) * hidden_size
    if final is not None:
        x = final
    else:  # a capture of the last layer is already final-normed (HF hidden_states[L])
        x = feats[..., column : column + hidden_size].to(target.dtype)
    if final is None and deepest < last:
        positions = torch.arange(t, device=x.device).expand(b, t)
        x, _ = target.run_layers(x, ForwardBatch.standalone(None, positions), deepest + 1)
        x = target.norm(x)
    # slot k predicts from a+k-1
    from_pos = blocks.positions.view(b, -1, size)[:, :, :-1].clamp(max=t - 1)
    gathered = x.gather(1, from_pos.reshape(b, -1, 1).expand(-1, -1, hidden_size))
    return gathered.view(b, -1, size - 1, hidden_size)
