"""train-draft --architecture dflash2: the selector loss against a loop of its formula, a converted DFlash
draft starting where it was, training that lowers the selector loss and resumes exactly, the trained draft
decoding losslessly in the engine, and the flag combinations that are refused."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from blockspec.cli import main
from blockspec.errors import BlockspecError
from blockspec.layers.embedding import LMHead
from blockspec.layers.selector import CandidateSelector
from blockspec.models.config import ModelConfig
from blockspec.models.dflash2_config import Dflash2Config
from blockspec.models.loader import load_draft, load_target
from blockspec.sampling_params import SamplingParams
from blockspec.train.objective import IGNORE, build_blocks, loss_weights
from blockspec.train.selector_loss import dflash2_loss
from blockspec.train.trainer import train
from tests.test_train import _cfg, tiny, write_motif_text  # noqa: F401 (the module's fixture)
from tests.tiny import TinyEngine

CPU = torch.device("cpu")


def reference_selector_loss(unary, hidden, labels, anchors, selector, top_k, weights):
    """Slot by slot: the top-K of the unary scores (the label swapped into the last place when missing),
    the predecessor teacher-forced, S = u[c] + sum_r A[p, r] P(h)[r] B[c, r], weighted cross-entropy."""
    a, b_book = selector.predecessor_codebook, selector.successor_codebook
    proj = selector.hidden_projection.weight
    total = norm = 0.0
    for j in range(labels.shape[0]):
        for k in range(labels.shape[1]):
            y = int(labels[j, k])
            if y == IGNORE:
                continue
            u = unary[j, k]
            top = [int(i) for i in torch.argsort(u, descending=True)[:top_k]]
            if y not in top:
                top[-1] = y
            p = int(anchors[j]) if k == 0 else int(labels[j, k - 1])
            ph = proj @ hidden[j, k]
            s = torch.stack([u[c] + sum(a[p, r] * ph[r] * b_book[c, r] for r in range(ph.numel()))
                             for c in top])
            total = total + weights[k] * -torch.log_softmax(s, 0)[top.index(y)]
            norm += float(weights[k])
    return total / norm


def test_selector_loss_equals_its_formula():
    torch.manual_seed(0)
    vocab, width, size, top_k, rank = 12, 8, 4, 3, 2
    d2 = Dflash2Config(2, 4, rank, top_k, vocab, output_multiplier=0.5, final_logit_softcapping=3.0)
    selector = CandidateSelector(width, rank, vocab)
    selector.init_random(torch.Generator().manual_seed(1), 0.7)
    head = LMHead(width, vocab)
    head.load("lm_head.weight", torch.randn(vocab, width) * 2)
    draft = SimpleNamespace(config=SimpleNamespace(dflash2=d2), candidate_selector=selector)
    ids = torch.tensor([[3, 7, 1, 9, 4, 4, 2, 8, 11, 6, 5, 0]])
    # block 2 leaves the greedy path at its slot 2
    labels = torch.tensor([[7, 1, 9, 4, 0, 2, 8, 11, 6, 5, 0, 3]])
    anchors = torch.tensor([[1, 4, 7]])
    blocks = build_blocks(ids, labels, [12], anchors, torch.ones(1, 3, dtype=torch.bool), size, 10)
    hidden = torch.randn(1, 3 * size, width, requires_grad=True)
    weights = loss_weights(size, gamma=1.5)
    alpha = 0.7
    loss, info = dflash2_loss(hidden, head, blocks, weights, draft, alpha)
    slots = hidden.view(3, size, width)[:, 1:]
    unary = torch.tanh(head(slots) * 0.5 / 3.0) * 3.0  # multiplier, then softcap: as inference scores them
    block_labels = blocks.labels[0]
    w = weights.expand_as(block_labels) * (block_labels != IGNORE)  # slot 2 of block 2 left the path
    unary_ce = F.cross_entropy(unary.reshape(-1, vocab), block_labels.reshape(-1), reduction="none")
    expected_unary = (unary_ce * w.reshape(-1)).sum() / w.sum()
    anchor_ids = ids[0, anchors[0]]
    expected_sel = reference_selector_loss(unary, slots, block_labels, anchor_ids, selector, top_k, weights)
    assert torch.allclose(loss, expected_unary + alpha * expected_sel, atol=1e-5)
    assert info["recall"] < 1.0  # some label was missing from the top-K: the swap was exercised
    loss.backward()  # the selector's loss reaches the backbone
    assert hidden.grad.abs().sum() > 0 and selector.successor_codebook.grad is not None


def test_a_converted_dflash_draft_starts_where_it_was(tiny):
    first = tiny / "d2-base"
    train(_cfg(tiny, first, steps=8, train_dtype="float32"))
    runs = {}
    for arch in ("dflash", "dflash2"):
        runs[arch] = train(_cfg(tiny, tiny / f"d2-from-{arch}", steps=1, lr=1e-9, init=str(first),
                                train_dtype="float32", architecture=arch))
    # one step at lr 1e-9: the converted draft's unary argmax is the DFlash draft's, block for block
    assert runs["dflash2"]["heldout_tau"] == runs["dflash"]["heldout_tau"]
    history = torch.load(tiny / "d2-from-dflash2" / "checkpoint" / "state.pt", weights_only=False)["history"]
    assert {"heldout_walk_tau", "heldout_recall_at_k", "heldout_selector_acc", "sel_loss"} <= set(history[-1])
    cfg = ModelConfig.from_folder(tiny / "target")
    draft = load_draft(tiny / "d2-from-dflash2", cfg, torch.float32, CPU)
    assert draft.config.dflash2.selector_rank == 64 and draft.config.dflash2.selector_top_k == 16
    base = load_draft(first, cfg, torch.float32, CPU).state_dict()
    for name, tensor in base.items():
        assert torch.allclose(draft.state_dict()[name], tensor, atol=1e-6), name
    assert torch.equal(draft.layers[0].mlp_conv.base_kernel[:, 0], torch.ones(2, cfg.hidden_size))


def test_training_lowers_the_selector_loss_resumes_and_decodes_losslessly(tiny):
    out = tiny / "d2-scratch"
    summary = train(_cfg(tiny, out, steps=40, lr=1e-2, architecture="dflash2", selector_rank=8,
                         selector_top_k=4, train_vocab=60, train_dtype="bfloat16", dtype="bfloat16",
                         selector_lr_scale=3.0))
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=False)
    assert [g["initial_lr"] for g in state["optimizer"]["param_groups"]] == [1e-2, 3e-2]
    sel = [r["sel_loss"] for r in state["history"]]
    assert all(math.isfinite(x) for x in sel) and sum(sel[-8:]) / 8 < sum(sel[:8]) / 8 - 0.1
    assert summary["step"] == 40 and 1.0 <= state["history"][-1]["heldout_walk_tau"] <= 4.0
    card = (out / "MODEL_CARD.md").read_text()
    assert card.startswith("# DFlash2 draft") and "| step | selector loss | walk tau |" in card
    straight, split = tiny / "d2-straight", tiny / "d2-split"
    kw = dict(steps=6, eval_every=3, architecture="dflash2", selector_rank=8, selector_top_k=4)
    train(_cfg(tiny, straight, **kw))
    train(_cfg(tiny, split, stop_after_steps=3, **kw))
    train(_cfg(tiny, split, resume=True, **kw))
    a, b = (torch.load(f / "checkpoint" / "state.pt", weights_only=False) for f in (straight, split))
    assert all(torch.equal(t, b["draft"][n]) for n, t in a["draft"].items()) and a["history"] == b["history"]
    # the trained draft (convolutions and selector moved, a draft vocabulary) decodes as plain decoding does
    cfg = ModelConfig.from_folder(tiny / "target")
    draft = load_draft(out, cfg, torch.float32, CPU)
    assert draft.vocab.numel() == 60
    assert draft.layers[0].attention_conv.kernel_projection.weight.abs().sum() > 0
    engine = TinyEngine(load_target(tiny / "target", torch.float32, CPU), draft, 4, num_slots=2, max_len=128)
    from blockspec.engine.sequence import Sequence

    prompts = [[10, 11, 12, 10, 11, 12, 10], [40, 41, 40, 41, 40]]
    for size in (2, 4):
        engine.set_block_size(size)
        params = SamplingParams(max_tokens=30)
        plain = engine.run([Sequence(p, params, frozenset()) for p in prompts], use_draft=False)
        spec = engine.run([Sequence(p, params, frozenset()) for p in prompts], use_draft=True)
        assert [s.output_ids for s in spec] == [p.output_ids for p in plain]


def test_bad_combinations_are_refused(tiny, capsys):
    with pytest.raises(BlockspecError, match="selector_rank applies to DFlash2 drafts only"):
        _cfg(tiny, tiny / "bad-a", selector_rank=8)
    with pytest.raises(BlockspecError, match="selector_alpha=-1"):
        _cfg(tiny, tiny / "bad-b", architecture="dflash2", selector_alpha=-1.0)
    with pytest.raises(BlockspecError, match="selector_lr_scale=0.0 must be a number > 0"):
        _cfg(tiny, tiny / "bad-b2", architecture="dflash2", selector_lr_scale=0.0)
    with pytest.raises(BlockspecError, match="architecture='dflash3'"):
        _cfg(tiny, tiny / "bad-c", architecture="dflash3")
    d2 = tiny / "d2-for-errors"
    train(_cfg(tiny, d2, steps=1, architecture="dflash2", selector_rank=8, selector_top_k=4))
    with pytest.raises(BlockspecError, match="is a DFlash2 draft; pass architecture dflash2"):
        train(_cfg(tiny, tiny / "bad-d", steps=1, init=str(d2)))
    with pytest.raises(BlockspecError, match="selector_rank=16, but init .* has selector_rank=8"):
        train(_cfg(tiny, tiny / "bad-e", steps=1, init=str(d2), architecture="dflash2", selector_rank=16))
    with pytest.raises(BlockspecError, match="selector_top_k=16 is more than the 8 tokens"):
        train(_cfg(tiny, tiny / "bad-f", steps=1, architecture="dflash2", train_vocab=8))
    argv = ["train-draft", "--target", str(tiny / "target"), "--output", str(tiny / "bad-g"), "--data",
            str(tiny / "data.jsonl"), "--block-size", "4", "--target-layer-ids", "0,2",
            "--mask-token-id", "5", "--device", "cpu", "--cache-dir", str(tiny / "cache"), "--steps", "1"]
    assert main(argv + ["--selector-top-k", "4"]) == 2
    err = capsys.readouterr().err
    assert "--selector-top-k applies to DFlash2 drafts only; pass --architecture dflash2" in err
    assert "Traceback" not in err
    # continuing a DFlash2 draft takes its selector's shape without the flags
    assert main(argv + ["--architecture", "dflash2", "--init", str(d2)]) == 0
