"""CPU fast paths that must not change results: the int8 argmax head (exactly the fp32 argmax, ties to
the lowest id) and the Linear weight layouts (and their tuning)."""

import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockspec.layers.int8_head import Int8ArgmaxHead


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


@pytest.mark.parametrize("layout", ["nn", "nt", "wx", "packed"])
@torch.no_grad()  # layouts are for inference (with grad enabled the stored weight multiplies)
def test_linear_layouts_match_and_fall_back(layout):
    """Linear.set_layouts: each layout computes the same product for its row counts (key 0: any other count
    of 2..SMALL_ROWS rows); one row (unless planned), and counts above SMALL_ROWS, use F.linear on the stored
    weight."""
    from blockspec.layers.layout import SMALL_ROWS, stored_product
    from blockspec.layers.linear import Linear

    if layout == "packed" and not torch.backends.mkl.is_available():
        pytest.skip("no MKL")
    torch.manual_seed(0)
    layer = Linear(64, [48, 16], bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    inputs = {rows: torch.randn(1, rows, 64) for rows in (1, 2, 3, 4, 7, SMALL_ROWS + 1)}
    expected = {rows: torch.nn.functional.linear(x, layer.weight, layer.bias) for rows, x in inputs.items()}
    layer.set_layouts({4: layout, 2: layout, 0: "wx" if layout == "packed" else layout})
    assert set(layer.layout.forms) == {0, 2, 4}
    for rows, x in inputs.items():
        torch.testing.assert_close(layer(x), expected[rows], rtol=1e-5, atol=1e-5)
    layer.set_layouts({1: "wx"})  # one row computed as two
    torch.testing.assert_close(layer(inputs[1]), expected[1], rtol=1e-5, atol=1e-5)
    layer.set_layouts({4: layout, 2: layout, 0: "wx" if layout == "packed" else layout})
    for rows, x in inputs.items():
        torch.testing.assert_close(layer(x), expected[rows], rtol=1e-5, atol=1e-5)
    for rows in (1, SMALL_ROWS + 1):  # the stored form: one row as two, many rows as F.linear
        assert torch.equal(layer(inputs[rows]), stored_product(inputs[rows], layer.weight, layer.bias))
    assert torch.equal(layer(inputs[SMALL_ROWS + 1]), expected[SMALL_ROWS + 1])
    layer.set_layouts(None)
    assert layer.layout is None
    with pytest.raises(ValueError, match="unknown layout 'tn'"):
        layer.set_layouts({2: "tn"})


@pytest.mark.parametrize("plan", [None, {1: "nn", 0: "nn"}, {1: "wx", 4: "nt", 0: "nt"},
                                  {1: "wx", 4: "wx", 0: "wx"}, {1: "nn", 4: "packed", 0: "nt"}])
def test_a_row_is_the_same_bits_whatever_the_row_count(plan):
    """A dense fp32 Linear (column-major, with a bias) and a tied LM head (the row-major embedding) give a
    row the same bits alone (a decode step), inside any 2..80-row input (a batch, a verify block, a prefill
    chunk), wherever it sits, under any plan: forms that round otherwise on this CPU are dropped. (MKL
    multiplies one row as a GEMV whose sums round otherwise than its GEMM's, and its NT form rounds by row
    count: a request batched beside others sampled other tokens than alone.)"""
    from blockspec.layers.embedding import Embedding, LMHead
    from blockspec.layers.linear import Linear

    if plan and "packed" in plan.values() and not torch.backends.mkl.is_available():
        pytest.skip("no MKL")
    gen = torch.Generator().manual_seed(0)
    layer = Linear(64, [96, 96], bias=True)
    embedding = Embedding(97, 64)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(192, 64, generator=gen) * 0.2)
        layer.bias.copy_(torch.randn(192, generator=gen))
    embedding.load("weight", torch.randn(97, 64, generator=gen) * 0.2)
    head = LMHead(64, 97, tied_to=embedding)
    x = torch.randn(80, 64, generator=gen)
    with torch.inference_mode():
        for module in (layer, head):
            module.set_layouts(plan)
            alone = torch.cat([module(x[i : i + 1]) for i in range(len(x))])
            for rows in (2, 3, 4, 5, 7, 16, 17, 64, 65, 80):
                assert torch.equal(module(x[80 - rows :]), alone[80 - rows :]), (type(module), rows)


def test_lm_head_layouts_never_copy_the_head():
    """A tied LM head (the row-major embedding) takes every layout as itself; a head of its own
    (column-major) keeps the stored layout rather than copy 100 MB."""
    from blockspec.layers.embedding import Embedding, LMHead

    embedding = Embedding(32, 16)
    embedding.load("weight", torch.randn(32, 16))
    tied = LMHead(16, 32, tied_to=embedding)
    tied.set_layouts({0: "wx"})
    assert tied.layout.forms[0][1].data_ptr() == embedding.weight.data_ptr()  # no copy
    assert tied.checkpoint_tensors("lm_head") == {}  # not a tensor of its own
    own = LMHead(16, 32)
    own.set_layouts({0: "wx"})
    assert own.layout is None


def test_tuned_plan_is_measured_once_per_machine(tmp_path, monkeypatch):
    """tune_layouts times each candidate with run(rows), keeps the fastest, saves it under $BLOCKSPEC_HOME
    and reuses it (in this process and the next) without timing again; a corrupt file is measured again."""
    from blockspec.layers import layout_tuning
    from blockspec.layers.linear import Linear

    monkeypatch.setenv("BLOCKSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(layout_tuning, "SAVE_AFTER_S", 0.0)  # this toy measurement is quick: save it anyway
    monkeypatch.setattr(layout_tuning, "_measured", {})
    layers = [Linear(16, 32), Linear(32, 16)]
    with torch.no_grad():  # real weights (not torch.empty's): a form is kept only where it rounds alike
        for layer in layers:
            layer.weight.normal_()
    current = {}

    def run(rows):  # "wx" is the fast one at every count
        forms = layers[0].layout.forms if layers[0].layout is not None else {}
        current.setdefault(rows, []).append(forms.get(rows, forms.get(0, ("nn",)))[0])
        if current[rows][-1] != "wx":
            time.sleep(0.002)

    plan = layout_tuning.tune_layouts(layers, run, (2, 4))
    assert plan == {1: "wx", 2: "wx", 4: "wx", 0: "wx"}
    assert layers[1].layout.forms[2][0] == "wx" and layers[1].layout.forms[0][0] == "wx"
    calls = sum(map(len, current.values()))
    assert layout_tuning.tune_layouts(layers, run, (2, 4)) == plan
    layout_tuning._measured.clear()  # as in a new process: from the file
    assert layout_tuning.tune_layouts(layers, run, (2, 4)) == plan
    assert sum(map(len, current.values())) == calls  # not timed again
    saved = json.loads((tmp_path / layout_tuning.PLANS_FILE).read_text())
    (tmp_path / layout_tuning.PLANS_FILE).write_text(json.dumps({**saved, "v1|old cpu": {"2": "nt"}}))
    # stale: dropped
    assert "v1|old cpu" not in layout_tuning.read_plans(tmp_path / layout_tuning.PLANS_FILE)
    (tmp_path / layout_tuning.PLANS_FILE).write_text("{not json")
    layout_tuning._measured.clear()  # as in a new process
    assert layout_tuning.tune_layouts(layers, run, (2, 4)) == plan
    assert sum(map(len, current.values())) > calls


@pytest.mark.parametrize("layout", ["nt", "wx", "packed"])
def test_layouts_are_inference_only(layout):
    """With grad enabled a Linear ignores its layout copies (detached, and MKL's packed op has no backward):
    the gradient is the stored weight's, exactly as without a plan."""
    from blockspec.layers.linear import Linear

    if layout == "packed" and not torch.backends.mkl.is_available():
        pytest.skip("no MKL")
    layer = Linear(16, 32)
    with torch.no_grad():
        layer.weight.normal_()
    x = torch.randn(4, 16)
    layer(x).square().sum().backward()
    expected, layer.weight.grad = layer.weight.grad.clone(), None
    layer.set_layouts({1: "wx" if layout == "packed" else layout, 4: layout})
    layer(x).square().sum().backward()
    assert torch.equal(layer.weight.grad, expected)
    with torch.no_grad():
        assert layer.layout and torch.allclose(layer(x), x @ layer.weight.t(), atol=1e-5)


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
        assert torch.equal(target.greedy(h), (target.norm(h) @ weight.t()).argmax(-1))
