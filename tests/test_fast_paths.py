"""CPU fast paths that must not change results: the int8 argmax head (exactly the fp32 argmax, ties to
the lowest id) and the heads over some rows of the vocabulary."""

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.layers.dense import dense_product
from blockspec.layers.int8_head import Int8ArgmaxHead


def fp32_argmax(h, weight):
    return dense_product(h, weight).argmax(dim=-1)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 16), vocab=st.integers(2, 3000),
       hidden=st.sampled_from([16, 64, 576]), spread=st.sampled_from([1e-3, 1.0, 30.0]))
def test_equals_fp32_argmax(seed, rows, vocab, hidden, spread):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * torch.rand(vocab, 1, generator=gen) * 0.1
    h = torch.randn(rows, hidden, generator=gen) * spread
    head = Int8ArgmaxHead(weight)
    assert torch.equal(head.argmax(h), fp32_argmax(h, weight))


def test_near_ties_and_exact_ties():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 64, generator=gen) * 0.05
    h = torch.randn(3, 64, generator=gen)
    best = int(fp32_argmax(h[:1], weight))
    weight[7] = weight[best]  # an exact tie: the lower id wins, as with torch.argmax
    weight[400] = weight[best] * (1 - 1e-6)  # a near-tie far below int8 resolution
    head = Int8ArgmaxHead(weight)
    assert torch.equal(head.argmax(h), fp32_argmax(h, weight))
    assert int(head.argmax(h[:1])) == min(7, best)


def test_zero_rows_and_zero_input():
    weight = torch.zeros(10, 16)
    weight[3, 0] = 1.0
    head = Int8ArgmaxHead(weight)
    assert head.argmax(torch.zeros(2, 16)).tolist() == [0, 0]  # all logits 0: first id
    assert head.argmax(torch.ones(1, 16)).tolist() == [3]


def test_unsupported_width_is_refused():
    assert not Int8ArgmaxHead.supports(torch.zeros(10, 8))
    with pytest.raises(ValueError, match="multiple of 16"):
        Int8ArgmaxHead(torch.zeros(10, 8))


def test_a_sub_head_gives_the_full_heads_bits():
    """LMHead.rows (a draft vocabulary's head, a copy of some rows) scores those ids with the same bits as
    the whole head, so its exact logits and greedy choices are the whole head's."""
    from blockspec.layers.embedding import Embedding, LMHead

    embedding = Embedding(300, 64)
    embedding.load("weight", torch.randn(300, 64))
    head = LMHead(64, 300, tied_to=embedding)
    assert head.checkpoint_tensors("lm_head") == {}  # not a tensor of its own
    ids = torch.tensor([3, 17, 18, 200, 299])
    h = torch.randn(6, 64)
    with torch.inference_mode():
        assert torch.equal(head.rows(ids).logits(h), head.logits(h)[:, ids])


def test_lm_head_keeps_the_int8_form_only_where_it_is_faster(tmp_path, monkeypatch):
    """LMHead.choose_greedy_form times the greedy choice with the fp32 head and with the int8 copy and keeps
    the faster (both exact); never on a head the int8 kernel does not support. A runner chooses at start."""
    from blockspec.engine.runner import ModelRunner
    from blockspec.layers import int8_head
    from blockspec.layers.linear import Linear
    from blockspec.models.config import ModelConfig
    from blockspec.models.loader import load_target
    from tests.tiny import write_tiny_target

    write_tiny_target(tmp_path / "t", hidden_size=64)
    target = load_target(tmp_path / "t", torch.float32, torch.device("cpu"))
    assert ModelConfig.from_folder(tmp_path / "t").hidden_size == 64
    slow_argmax = int8_head.Int8ArgmaxHead.argmax

    def slow(self, h):
        time.sleep(0.003)
        return slow_argmax(self, h)

    monkeypatch.setattr(int8_head.Int8ArgmaxHead, "argmax", slow)
    ModelRunner(target, None, num_slots=1, max_len=32)
    assert target.lm_head.int8 is None
    monkeypatch.setattr(int8_head.Int8ArgmaxHead, "argmax", slow_argmax)
    slow_linear = Linear.forward
    monkeypatch.setattr(Linear, "forward", lambda self, x: (time.sleep(0.003), slow_linear(self, x))[1])
    ModelRunner(target, None, num_slots=1, max_len=32)
    monkeypatch.setattr(Linear, "forward", slow_linear)
    assert isinstance(target.lm_head.int8, int8_head.Int8ArgmaxHead)
    h = torch.randn(3, 64)
    weight = target.lm_head.checkpoint_tensors("lm_head")["lm_head.weight"]
    with torch.inference_mode():
        assert torch.equal(target.greedy(h), fp32_argmax(target.norm(h), weight))
