"""The int8-activation block kernel (blockspec/kernels/int8_matmul.cpp): its arithmetic against an exact
reference of the formula (Q4_0, Q4_1, Q8_0), and its invariances, bit for bit, on every type it reads: every
instruction-set variant this CPU has, a row alone or inside 2- to 64-row inputs, any thread count."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from blockspec.layers.quant import QUANT_TYPES, kernels, quantize
from tests.test_gguf_blocks import random_blocks

OPS = kernels()
VARIANTS = list(OPS.int8_variants())  # 1 portable, 2 AVX2, 3 AVX-VNNI, 4 AVX512-VNNI: those this CPU has
TYPES = ["q4_0", "q4_1", "q8_0"]
ALL_TYPES = sorted(name for name, t in QUANT_TYPES.items() if not t.floats)  # F16 / BF16: no int8 form


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def weight(qtype: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(GGUF blocks, the same packed) of a random weight: quantized where gguf quantizes the type, else
    random blocks (any quants and sub-scales, finite scales)."""
    if QUANT_TYPES[qtype].requantizable:
        blocks = quantize(torch.randn(rows, cols, generator=gen(seed)), QUANT_TYPES[qtype])
    else:
        blocks = random_blocks(qtype, rows, cols, seed)
    return blocks, OPS.int8_pack(blocks, QUANT_TYPES[qtype].ggml_id)


def f32(x) -> np.float32:
    return np.float32(x)


def round_f32(value: Fraction) -> np.float32:
    """`value` rounded to the nearest float32, ties to even (no double rounding)."""
    guess = np.float32(float(value))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.int32)) & 1))


def reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> np.ndarray:
    """The kernel's formula, written out: each 32-value activation block quantized with d = amax / 127 and
    q = round-half-even(x * (127 / amax)); per output, block by block, acc = fma(dot, d_w * d_x, acc) (Q4_1:
    then acc = fma(m_w, d_x * sum(q), acc)), every fma rounded once."""
    qt = QUANT_TYPES[qtype]
    raw = blocks.numpy()
    out = np.zeros((x.shape[0], raw.shape[0]), dtype=np.float32)
    nblocks = x.shape[1] // 32
    for r in range(x.shape[0]):
        for o in range(raw.shape[0]):
            acc = f32(0)
            for b in range(nblocks):
                xs = x[r, 32 * b : 32 * b + 32].numpy()
                amax = f32(np.abs(xs).max())
                d = f32(amax / f32(127))
                inv = f32(f32(127) / amax) if amax > 0 else f32(0)
                q = np.clip(np.rint(xs * inv), -127, 127).astype(np.int64)
                block = raw[o, b * qt.block_bytes : (b + 1) * qt.block_bytes]
                dw = f32(block[:2].view(np.float16)[0])
                if qtype == "q8_0":
                    w = block[2:].view(np.int8).astype(np.int64)
                else:
                    nib = block[4:] if qtype == "q4_1" else block[2:]
                    w = np.concatenate([nib & 0xF, nib >> 4]).astype(np.int64) - (8 if qtype == "q4_0" else 0)
                dot = int((w * q).sum())
                acc = round_f32(Fraction(dot) * Fraction(float(f32(dw * d))) + Fraction(float(acc)))
                if qtype == "q4_1":
                    m = f32(block[2:4].view(np.float16)[0])
                    ds = f32(d * f32(int(q.sum())))
                    acc = round_f32(Fraction(float(m)) * Fraction(float(ds)) + Fraction(float(acc)))
            out[r, o] = acc
    return out


@pytest.mark.parametrize("qtype", TYPES)
def test_every_variant_computes_the_formula_exactly(qtype):
    blocks, packed = weight(qtype, 11, 96)
    x = torch.randn(3, 96, generator=gen(1)) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(32)
    x[1, 32:64] = 0.0  # an all-zero block: d = 0
    want = reference(x, blocks, qtype)
    for variant in VARIANTS:
        got = OPS.int8_matmul(x, packed, QUANT_TYPES[qtype].ggml_id, 11, None, variant)
        assert np.array_equal(got.numpy(), want), variant


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_a_row_is_the_same_bits_alone_in_any_batch_thread_count_and_variant(qtype):
    """Rows of 1, 2, 5, 9, 17 and 64-row inputs against each row alone, on SmolLM2's shapes (576 -> 1536 and
    1536 -> 576), at 1 and 2 threads, with every variant."""
    threads = torch.get_num_threads()
    ggml_id = QUANT_TYPES[qtype].ggml_id
    try:
        for n, k in ((1536, 576), (576, 1536)) if QUANT_TYPES[qtype].block_elems == 32 else ((576, 1536),):
            _, packed = weight(qtype, n, k, seed=n)
            x = torch.randn(64, k, generator=gen(2)) * 4
            alone = torch.cat([OPS.int8_matmul(x[i : i + 1], packed, ggml_id, n, None, 1) for i in range(64)])
            for count in threads, 1:
                torch.set_num_threads(count)
                for variant in VARIANTS:
                    for rows in (1, 2, 5, 9, 17, 64):
                        start = (rows * 7) % (64 - rows + 1)
                        got = OPS.int8_matmul(x[start : start + rows], packed, ggml_id, n, None, variant)
                        assert torch.equal(got, alone[start : start + rows]), (n, count, variant, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_packing_round_trips_and_lookups_dequantize(qtype):
    ggml_id = QUANT_TYPES[qtype].ggml_id
    blocks, packed = weight(qtype, 21, max(64, QUANT_TYPES[qtype].block_elems))  # the last group holds 5
    assert packed.shape[0] == 3
    assert torch.equal(OPS.int8_unpack(packed, ggml_id, 21), blocks)
    ids = torch.tensor([20, 0, 7, 8, 7])
    assert torch.equal(OPS.int8_rows(packed, ids, ggml_id), OPS.quant_rows(blocks, ids, ggml_id))


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_residual_a_ragged_last_group_and_every_variant_the_same_bits(qtype):
    ggml_id, cols = QUANT_TYPES[qtype].ggml_id, max(64, QUANT_TYPES[qtype].block_elems)
    blocks, packed = weight(qtype, 45, cols)  # 45: 16-output pairs, a lone group, a ragged one
    x, res = torch.randn(6, cols, generator=gen(3)), torch.randn(6, 45, generator=gen(4))
    x[2, :32] = 0.0  # an all-zero activation block
    portable = OPS.int8_matmul(x, packed, ggml_id, 45, None, 1)
    dense = x @ OPS.quant_rows(blocks, torch.arange(45), ggml_id).t()
    torch.testing.assert_close(portable, dense, rtol=0.05, atol=0.03 * dense.abs().max().item())
    for variant in VARIANTS:
        plain = OPS.int8_matmul(x, packed, ggml_id, 45, None, variant)
        assert torch.equal(plain, portable), variant
        assert torch.equal(OPS.int8_matmul(x, packed, ggml_id, 45, res, variant), plain + res)


def test_extreme_q8_weights_and_activations():
    """A Q8_0 weight of -128 (the format allows it) meets activations of +-127: no int16 saturation."""
    blocks, _ = weight("q8_0", 8, 32)
    blocks[:, 2:] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
    blocks[:, :2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    packed = OPS.int8_pack(blocks, 8)
    x = torch.full((2, 32), -1.0)
    x[1] = 1.0
    for variant in VARIANTS:
        got = OPS.int8_matmul(x, packed, 8, 8, None, variant)
        assert torch.equal(got, torch.tensor([[4096.0] * 8, [-4096.0] * 8])), variant


def test_extreme_q6_k_scales_weights_and_activations():
    """Q6_K at its extremes: int8 sub-scales of -128, quants of -32, activations of +-127 (the largest
    integer dot, 2 x 16 x 128 x 32 x 127, fits int32 and float32 exactly)."""
    blocks = torch.zeros(8, 210, dtype=torch.uint8)  # quants 0: each weight's q - 32 is -32
    blocks[:, 192:208] = torch.tensor(-128, dtype=torch.int8).view(torch.uint8)
    blocks[:, 208:] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    packed = OPS.int8_pack(blocks, 14)
    x = torch.full((2, 256), -1.0)
    x[1] = 1.0
    for variant in VARIANTS:
        got = OPS.int8_matmul(x, packed, 14, 8, None, variant)
        assert torch.equal(got, torch.tensor([[-1048576.0] * 8, [1048576.0] * 8])), variant


def test_bad_shapes_are_refused():
    _, packed = weight("q4_1", 16, 64)
    with pytest.raises(RuntimeError, match="columns"):
        OPS.int8_matmul(torch.randn(2, 96), packed, 3, 16, None, 0)
    with pytest.raises(RuntimeError, match="not available"):
        OPS.int8_matmul(torch.randn(2, 64), packed, 3, 16, None, 9)
