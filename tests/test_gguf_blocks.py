"""Every GGUF block type blockspec reads (kernels/gguf_blocks.cpp), as the file stores it: dequantization
equal to gguf-py's bit for bit on random blocks (any byte pattern is a block), the int8 kernels' repacked form
holding every stored bit, the fp32-activation kernel against a matmul on gguf-py's weights, and a clear
refusal of the types it does not read."""

import numpy as np
import pytest
import torch

from blockspec.errors import ModelLoadError
from blockspec.layers.quant import QUANT_TYPES, Blocks, kernels

OPS = kernels()
TYPES = sorted(QUANT_TYPES)
BLOCK_TYPES = [name for name in TYPES if not QUANT_TYPES[name].floats]  # those with an int8 form
ROWS = (1, 2, 5, 9, 17, 33, 64)


def random_bytes(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Rows of blocks of arbitrary bytes (fp16 scales included: NaN, inf and subnormals too)."""
    qt = QUANT_TYPES[qtype]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, cols // qt.block_elems * qt.block_bytes), dtype=torch.uint8,
                         generator=gen)


# Where each type keeps its fp16 scales (d, and m or dmin), by byte offset within a block.
SCALE_AT = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2),
            "q5_k": (0, 2), "q6_k": (208,), "f16": (), "bf16": ()}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Arbitrary quants and sub-scales with finite fp16 scales of varied size (for matmuls to compare);
    F16 / BF16: normal values."""
    qt = QUANT_TYPES[qtype]
    gen = torch.Generator().manual_seed(seed + 1)
    if qt.floats:
        values = torch.randn(rows, cols, generator=gen) * 0.05
        return values.to(torch.float16 if qtype == "f16" else torch.bfloat16).view(torch.uint8).contiguous()
    data = random_bytes(qtype, rows, cols, seed).view(rows, -1, qt.block_bytes)
    for at in SCALE_AT[qtype]:
        scale = (torch.rand(rows, data.shape[1], generator=gen) * 0.02 + 1e-4).half()
        data[:, :, at : at + 2] = scale.view(torch.uint8).view(rows, data.shape[1], 2)
    return data.reshape(rows, -1).contiguous()


def gguf_dequantize(qtype: str, data: torch.Tensor) -> np.ndarray:
    import gguf

    with np.errstate(invalid="ignore", over="ignore"):  # random fp16 scales: inf and NaN among them
        return gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType(QUANT_TYPES[qtype].ggml_id))


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bit patterns (so -0 is not 0), NaN wherever the other is NaN (its payload may differ)."""
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantization_is_gguf_py_bit_for_bit_on_any_bytes(qtype):
    cols = 2 * QUANT_TYPES[qtype].block_elems
    for seed in range(3):
        data = random_bytes(qtype, 24, cols, seed)
        assert_same_bits(Blocks(QUANT_TYPES[qtype], data, cols).dequantize().numpy(),
                         gguf_dequantize(qtype, data))


@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_the_repacked_form_holds_every_stored_bit(qtype):
    """Packing for int8 activations and back gives the file's bytes; lookups from it dequantize as stored."""
    qt = QUANT_TYPES[qtype]
    data = random_bytes(qtype, 21, 2 * qt.block_elems, seed=4)  # 21 rows: the last group of 8 holds 5
    packed = OPS.int8_pack(data, qt.ggml_id)
    assert packed.shape[0] == 3
    assert torch.equal(OPS.int8_unpack(packed, qt.ggml_id, 21), data)
    ids = torch.tensor([20, 0, 7, 8, 7])
    assert_same_bits(OPS.int8_rows(packed, ids, qt.ggml_id).numpy(),
                     OPS.quant_rows(data, ids, qt.ggml_id).numpy())


@pytest.mark.parametrize("qtype", TYPES)
def test_fp32_activations_equal_a_matmul_on_gguf_weights_within_fp32_rounding(qtype):
    qt = QUANT_TYPES[qtype]
    cols = 3 * max(qt.block_elems, 64)
    data = random_blocks(qtype, 37, cols, seed=5)
    weight = torch.from_numpy(gguf_dequantize(qtype, data)).double()
    x = torch.randn(max(ROWS), cols, generator=torch.Generator().manual_seed(6))
    want = x.double() @ weight.t()
    bound = 5e-6 * (x.abs().double() @ weight.abs().t()).max()
    alone = torch.cat([OPS.quant_matmul(x[r : r + 1], data, qt.ggml_id) for r in range(max(ROWS))])
    assert (alone.double() - want).abs().max() <= bound
    for rows in ROWS:
        start = (rows * 7) % (max(ROWS) - rows + 1)
        for portable in (False, True):
            got = OPS.quant_matmul(x[start : start + rows], data, qt.ggml_id, portable)
            assert torch.equal(got, alone[start : start + rows]), (rows, portable)


def test_types_blockspec_does_not_read_are_refused_by_name(tmp_path):
    import gguf

    from blockspec.models.gguf_checkpoint import GGUFCheckpoint

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", 1)
    iq = gguf.GGMLQuantizationType.IQ4_NL
    writer.add_tensor("blk.0.ffn_down.weight", np.zeros((4, 2 * 18), dtype=np.uint8), raw_dtype=iq)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    checkpoint = GGUFCheckpoint(path)
    assert checkpoint.stored_type("model.layers.0.mlp.up_proj.weight") is None
    with pytest.raises(ModelLoadError) as caught:
        checkpoint.stored_type("model.layers.0.mlp.down_proj.weight")
    message = str(caught.value)
    for part in ("blk.0.ffn_down.weight", "IQ4_NL", "Q4_K, Q5_K, Q6_K", "BF16", "F32", "llama-quantize",
                 "Q4_K_M"):
        assert part in message, part
    # --quantization none still runs it, dequantized by gguf-py
    assert checkpoint.get("model.layers.0.mlp.down_proj.weight").shape == (4, 64)


def test_float_weights_are_held_as_stored_and_take_fp32_activations():
    from blockspec.layers.quant import QuantWeight

    for name in ("f16", "bf16"):
        data = random_blocks(name, 9, 64, seed=7)
        weight = QuantWeight(9, 64, QUANT_TYPES[name])
        weight.load_rows(slice(None), Blocks(QUANT_TYPES[name], data, 64).dequantize())  # as a file arrives
        assert torch.equal(weight.data, data)  # converted back exactly
        weight.use_int8()
        assert weight.activations == "fp32" and torch.equal(weight.data, data)
        with pytest.raises(RuntimeError, match="no int8 form"):
            OPS.int8_pack(data, QUANT_TYPES[name].ggml_id)


def test_bad_type_ids_and_shapes_are_refused():
    with pytest.raises(RuntimeError, match="unsupported GGML type id 16"):
        OPS.quant_matmul(torch.zeros(1, 256), torch.zeros(1, 66, dtype=torch.uint8), 16)
    with pytest.raises(RuntimeError, match="512 columns but the weight rows hold 144 bytes"):
        OPS.quant_matmul(torch.zeros(1, 256 * 2), torch.zeros(1, 144, dtype=torch.uint8), 12)
    with pytest.raises(ModelLoadError, match="multiple of 256 columns"):
        from blockspec.layers.quant import QuantWeight

        QuantWeight(4, 576, QUANT_TYPES["q6_k"])
