"""Block-quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) held as GGUF stores them: the kernel against gguf's
own dequantization and an fp64 matmul, its batch invariance (bitwise), and layers that hold blocks."""

import numpy as np
import pytest
import torch

from blockspec.errors import ModelLoadError
from blockspec.layers.linear import Linear
from blockspec.layers.quant import QUANT_TYPES, Blocks, QuantWeight, kernels, quantize

ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 33, 64)
# The types gguf quantizes (the K-quants, which it only dequantizes, are tested from random blocks in
# test_gguf_blocks.py).
QUANTIZED = sorted(name for name, t in QUANT_TYPES.items() if t.requantizable)


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> Blocks:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen)
    return Blocks(QUANT_TYPES[qtype], quantize(weight, QUANT_TYPES[qtype]), cols)


def gguf_dequantize(blocks: Blocks) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(blocks.data.numpy(), gguf.GGMLQuantizationType(blocks.qtype.ggml_id))


@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("shape", [(37, 64), (131, 160), (96, 576)])
def test_kernel_matches_gguf_dequantize_and_fp64(qtype, shape):
    blocks = random_blocks(qtype, *shape)
    reference = gguf_dequantize(blocks)
    assert np.array_equal(blocks.dequantize().numpy(), reference)  # the weights dequantize exactly
    x = torch.randn(max(ROWS), shape[1], generator=torch.Generator().manual_seed(1))
    want = x.double() @ torch.from_numpy(reference).double().t()
    for rows in ROWS:
        got = kernels().quant_matmul(x[:rows], blocks.data, blocks.qtype.ggml_id)
        scale = (x[:rows].abs().double() @ torch.from_numpy(np.abs(reference)).double().t()).max()
        assert (got.double() - want[:rows]).abs().max() <= 5e-6 * scale, (qtype, rows)  # fp32 sums


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_batch_invariance_is_bitwise(qtype):
    """A row's outputs are the same bits alone and inside 2-, 5- and 16-row inputs, wherever it sits, with
    one thread or two, and on the portable path."""
    blocks = random_blocks(qtype, 75, 192, seed=2)
    x = torch.randn(16, 192, generator=torch.Generator().manual_seed(3))
    op, qid = kernels().quant_matmul, blocks.qtype.ggml_id
    alone = torch.cat([op(x[r : r + 1], blocks.data, qid) for r in range(16)])
    for rows in (2, 5, 16):
        for start in range(0, 16 - rows + 1, max(1, rows // 2)):
            assert torch.equal(op(x[start : start + rows], blocks.data, qid), alone[start : start + rows])
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            assert torch.equal(op(x, blocks.data, qid), alone)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(op(x, blocks.data, qid, portable=True), alone)


def test_rows_lookup_dequantizes_exactly():
    blocks = random_blocks("q8_0", 50, 96)
    ids = torch.tensor([[3, 0], [49, 3]])
    weight = QuantWeight(50, 96, QUANT_TYPES["q8_0"])
    weight.load_rows(slice(None), blocks)
    assert torch.equal(weight.lookup(ids), torch.from_numpy(gguf_dequantize(blocks))[ids])
    with pytest.raises(RuntimeError, match="outside"):
        weight.lookup(torch.tensor([50]))


def test_a_linear_holding_blocks_loads_fused_parts_and_requantizes():
    """Fused q/k/v rows fill from each part's blocks; a dense tensor (or blocks of another type) is quantized
    as gguf quantizes it; the result matches F.linear over the dequantized weight."""
    layer = Linear(64, [32, 16, 16], shard_names=("q_proj", "k_proj", "v_proj"))
    layer.use_blocks(QUANT_TYPES["q4_1"])
    parts = {"q_proj": random_blocks("q4_1", 32, 64, 4), "k_proj": random_blocks("q8_0", 16, 64, 5)}
    dense_v = torch.randn(16, 64)
    layer.load("self_attn.q_proj.weight", parts["q_proj"])
    layer.load("self_attn.k_proj.weight", parts["k_proj"])
    layer.load("self_attn.v_proj.weight", dense_v)
    assert torch.equal(layer.quant.data[:32], parts["q_proj"].data)
    weight = layer.quant.dequantize()
    requant_k = quantize(parts["k_proj"].dequantize(), QUANT_TYPES["q4_1"])
    assert torch.equal(layer.quant.data[32:48], requant_k)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    assert (layer.checkpoint_tensors("layers.0.self_attn.qkv_proj")["layers.0.self_attn.k_proj.weight"].shape
            == (16, 64))
    assert not layer.foldable
    torch.testing.assert_close(layer.forward_shards(x, 1), layer(x)[:, 32:])


def test_bad_shapes_are_refused():
    with pytest.raises(ModelLoadError, match="multiple of 32 columns"):
        QuantWeight(4, 40, QUANT_TYPES["q8_0"])
    with pytest.raises(RuntimeError, match="unsupported GGML type id 16"):
        kernels().quant_matmul(torch.zeros(1, 32), torch.zeros(1, 34, dtype=torch.uint8), 16)
    with pytest.raises(RuntimeError, match="64 columns but the weight rows hold 34 bytes"):
        kernels().quant_matmul(torch.zeros(1, 64), torch.zeros(1, 34, dtype=torch.uint8), 8)


def test_real_gguf_tensors_match_gguf_dequantize(smollm2_dir):
    """SmolLM2's own Q4_1 and Q8_0 tensors, read as GGUF blocks (q rows put back in HF order)."""
    from safetensors import safe_open

    from blockspec.models.default_model import gguf_path
    from blockspec.models.gguf_checkpoint import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(gguf_path())
    gen = torch.Generator().manual_seed(0)
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as converted:
        for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.mlp.down_proj.weight",
                     "model.embed_tokens.weight"):
            blocks = checkpoint.get(name)
            dense = converted.get_tensor(name)  # gguf's dequantization, written by the converter
            assert torch.equal(blocks.dequantize(), dense), name
            x = torch.randn(4, dense.shape[1], generator=gen)
            got = kernels().quant_matmul(x, blocks.data, blocks.qtype.ggml_id)
            want = x.double() @ dense.double().t()
            assert (got.double() - want).abs().max() < 1e-4, name
