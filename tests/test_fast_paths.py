"""CPU fast paths that must not change results: the int8 argmax head (exactly the fp32 argmax, ties to
the lowest id) and the MKL-packed Linear."""

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


@pytest.mark.parametrize("rows", [2, 4])
def test_packed_linear_matches_and_falls_back(rows):
    """Linear.pack_for: weight copies laid out for exactly the given row counts (row-major for 2, MKL-packed
    for more); other row counts use F.linear on the stored weight."""
    from blockspec.models.layers import Linear

    if rows > 2 and not torch.backends.mkl.is_available():
        pytest.skip("no MKL")
    torch.manual_seed(0)
    layer = Linear(64, [48, 16], bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(1, rows, 64)
    plain = layer(x)
    layer.pack_for((rows, 3))  # several row counts: a DFlash block and a prompt-lookup block
    assert set(layer.fast) == {rows, 3}
    torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-5)
    x3 = torch.randn(1, 3, 64)
    torch.testing.assert_close(layer(x3), torch.nn.functional.linear(x3, layer.weight, layer.bias), rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(layer(x[:, :1]), torch.nn.functional.linear(x[:, :1], layer.weight, layer.bias))
    layer.pack_for(None)
    assert layer.fast == {}
