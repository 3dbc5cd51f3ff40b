"""The dense fp32 CPU product (kernels/dense_matmul.cpp through layers/dense.py): a row's bits do not depend
on the row count, its place among the rows, the thread count, the instruction-set variant or the weight's
layout, and row-parallel parts summed as a tree of halves give one rank's bits. Every variant this CPU has
is tested (the portable one everywhere), so a kernel that breaks the order shows on every machine kind."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.distributed import _tree_sum
from blockspec.layers.quant import kernels
from blockspec.layers.dense import LEVELS, VARIANTS, available_variants, dense_product, dense_variant
from blockspec.layers.embedding import Embedding, LMHead
from blockspec.layers.linear import Linear

ROW_COUNTS = (2, 3, 4, 5, 7, 9, 16, 17, 33, 64, 65, 80)


def variants():
    return [pytest.param(v, id=VARIANTS[v]) for v in (1, 2, 3)]


def require(variant):
    if variant not in available_variants():
        pytest.skip(f"this CPU has no {VARIANTS[variant]} variant")


def column_major(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("variant", variants())
def test_a_row_is_the_same_bits_whatever_the_row_count(variant, threads):
    """A Linear (column-major, fused parts, a bias, a residual, one part's outputs alone) and a tied LM head
    (the row-major embedding) give a row the same bits alone (a decode step) as inside any 2..80-row input
    (a batch, a verify block, a prefill chunk), wherever it sits."""
    require(variant)
    gen = torch.Generator().manual_seed(0)
    layer = Linear(200, [96, 72], bias=True)
    embedding = Embedding(300, 200)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(168, 200, generator=gen) * 0.2)
        layer.bias.copy_(torch.randn(168, generator=gen))
    embedding.load("weight", torch.randn(300, 200, generator=gen) * 0.2)
    head = LMHead(200, 300, tied_to=embedding)
    x = torch.randn(80, 200, generator=gen)
    residual = torch.randn(80, 168, generator=gen)
    products = {
        "linear": lambda rows: layer(x[rows]),
        "residual": lambda rows: layer(x[rows], residual[rows]),
        "shards": lambda rows: layer.forward_shards(x[rows], 1),
        "head": lambda rows: head(x[rows]),
    }
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode(), dense_variant(variant):
            for name, product in products.items():
                alone = torch.cat([product(slice(i, i + 1)) for i in range(len(x))])
                for rows in ROW_COUNTS:
                    assert torch.equal(product(slice(80 - rows, 80)), alone[80 - rows:]), (name, rows)
    finally:
        torch.set_num_threads(previous)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 70), inputs=st.integers(1, 300),
       outputs=st.integers(1, 300), bias=st.booleans())
def test_every_variant_and_layout_gives_the_same_bits(seed, rows, inputs, outputs, bias):
    """Odd sizes included (masked edges), and close to a float64 product."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inputs, generator=gen)
    w = torch.randn(outputs, inputs, generator=gen)
    b = torch.randn(outputs, generator=gen) if bias else None
    res = torch.randn(rows, outputs, generator=gen)
    ops = kernels()
    expected = ops.dense_matmul(x, w, b, res, 1)
    for variant in available_variants():
        for weight in (w, column_major(w)):
            assert torch.equal(ops.dense_matmul(x, weight, b, res, variant), expected), variant
    exact = x.double() @ w.double().t() + res.double() + (0 if b is None else b.double())
    tolerance = 1e-5 * (x.double().abs() @ w.double().abs().t() + res.double().abs() + 1)
    assert ((expected.double() - exact).abs() <= tolerance).all()


@pytest.mark.parametrize("variant", variants())
@pytest.mark.parametrize("inputs, ranks", [(64, 2), (96, 2), (576, 2), (1536, 4), (200, 4), (136, 8), (8, 8)])
def test_row_parallel_parts_sum_to_one_rank(variant, inputs, ranks):
    """Each rank's K / ranks inputs, summed as the subtree LEVELS - log2(ranks) deep, are one node of one
    rank's tree of halves, so the parts summed the same way (TPGroup.sum_parts) are one rank's sums."""
    require(variant)
    gen = torch.Generator().manual_seed(inputs)
    x = torch.randn(9, inputs, generator=gen)
    w = column_major(torch.randn(40, inputs, generator=gen))
    ops = kernels()
    part, levels = inputs // ranks, LEVELS - (ranks - 1).bit_length()
    parts = [ops.dense_matmul(x[:, r * part:(r + 1) * part].contiguous(), w[:, r * part:(r + 1) * part],
                              None, None, variant, levels) for r in range(ranks)]
    assert torch.equal(_tree_sum(parts), ops.dense_matmul(x, w, None, None, variant))


def test_training_and_other_devices_take_torch_linear():
    """With grad enabled the product is F.linear's (its backward); the kernel only serves inference."""
    layer = Linear(16, 32, bias=True)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(4, 16, requires_grad=True)
    out = layer(x)
    assert out.requires_grad
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    with torch.inference_mode():
        torch.testing.assert_close(dense_product(x.detach(), layer.weight, layer.bias), out.detach())


def test_strided_inputs_give_the_contiguous_bits():
    """Inputs that are a view (every other column, a transposed block) multiply as their contiguous copy."""
    w = column_major(torch.randn(24, 40))
    wide = torch.randn(6, 80)
    with torch.inference_mode():
        assert torch.equal(dense_product(wide[:, ::2], w), dense_product(wide[:, ::2].contiguous(), w))
        block = torch.randn(40, 6).t()
        assert torch.equal(dense_product(block, w), dense_product(block.contiguous(), w))


def test_bad_inputs_are_named():
    ops = kernels()
    with pytest.raises(RuntimeError, match="x has 8 columns"):
        ops.dense_matmul(torch.zeros(2, 8), torch.zeros(4, 9), None, None, 0)
    with pytest.raises(RuntimeError, match="bias must hold 4"):
        ops.dense_matmul(torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(3), None, 0)
    with pytest.raises(RuntimeError, match="variant 7 is not available"):
        ops.dense_matmul(torch.zeros(2, 8), torch.zeros(4, 8), None, None, 7)
    with pytest.raises(RuntimeError, match="levels=4 must be in"):
        ops.dense_matmul(torch.zeros(2, 8), torch.zeros(4, 8), None, None, 0, 4)
    with pytest.raises(ValueError, match="not available here"):
        with dense_variant(9):
            pass
