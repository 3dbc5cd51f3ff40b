"""The int8 argmax head returns exactly the fp32 argmax (ties to the lowest id), for any inputs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.models.argmax_head import Int8ArgmaxHead


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 16), vocab=st.integers(2, 3000),
       hidden=st.sampled_from([16, 64, 576]), spread=st.sampled_from([1e-3, 1.0, 30.0]))
def test_equals_fp32_argmax(seed, rows, vocab, hidden, spread):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen) * torch.rand(vocab, 1, generator=gen) * 0.1
    h = torch.randn(rows, hidden, generator=gen) * spread
    head = Int8ArgmaxHead(weight)
    assert torch.equal(head.argmax(h), (h @ weight.t()).argmax(dim=-1))


def test_near_ties_and_exact_ties():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 64, generator=gen) * 0.05
    h = torch.randn(3, 64, generator=gen)
    best = int((h[0] @ weight.t()).argmax())
    weight[7] = weight[best]  # an exact tie: the lower id wins, as with torch.argmax
    weight[400] = weight[best] * (1 - 1e-6)  # a near-tie far below int8 resolution
    head = Int8ArgmaxHead(weight)
    assert torch.equal(head.argmax(h), (h @ weight.t()).argmax(dim=-1))
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
