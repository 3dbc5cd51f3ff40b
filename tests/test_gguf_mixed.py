"""GGUF files that mix block types, as llama.cpp's recipes make them (Q4_K_M: Q4_K, Q6_K for v and down on
some layers, Q8_0 / Q6_K heads, F32 norms): every tensor loads in its own type, fused q/k/v of several types
included (through the one-op layer stack too), and greedy DFlash equals plain decoding on them, with fp32 and
with int8 activations. The files are
written here from random blocks (any byte pattern is a block), at widths the K-quants' 256 divide."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from blockspec.engine.sequence import Sequence
from blockspec.layers.quant import QUANT_TYPES
from blockspec.layers.quant_parts import QuantParts
from blockspec.models.config import ModelConfig
from blockspec.models.loader import load_draft, load_target
from blockspec.sampling_params import SamplingParams
from tests.test_gguf_blocks import random_blocks
from tests.tiny import TinyEngine, tiny_hf_config, write_tiny_draft

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 4, 2, 97
# Per recipe: the type of each tensor role (layer 1 takes the "more bits" types, as llama.cpp's
# use_more_bits picks some layers), None for F32.
RECIPES = {
    "q4_k_m": {"token_embd": "q4_k", "output": "q6_k", "attn_q": "q4_k", "attn_k": "q4_k",
               "attn_v": ("q4_k", "q6_k"), "attn_output": "q4_k", "ffn_gate": "q4_k", "ffn_up": "q4_k",
               "ffn_down": ("q4_k", "q6_k")},
    "q5_k_m": {"token_embd": "q5_k", "output": "q6_k", "attn_q": "q5_k", "attn_k": "q5_k",
               "attn_v": ("q5_k", "q6_k"), "attn_output": "q5_k", "ffn_gate": "q5_k", "ffn_up": "q5_k",
               "ffn_down": ("q5_k", "q6_k")},
    # F16 and BF16 files: every weight as stored, converted in the kernel (fp32 activations only)
    "f16": {role: "f16" for role in ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
                                     "ffn_gate", "ffn_up", "ffn_down")},
    "bf16": {role: "bf16" for role in ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output",
                                      "ffn_gate", "ffn_up", "ffn_down")},
    # an F16 v beside Q8_0 q and k on some layers: parts in two activation forms under int8 activations
    "f16_v": {"token_embd": "q8_0", "output": "f16", "attn_q": "q8_0", "attn_k": "q8_0",
              "attn_v": ("q8_0", "f16"), "attn_output": "q8_0", "ffn_gate": "q8_0", "ffn_up": "q8_0",
              "ffn_down": "q8_0"},
    # SmolLM2-like fallbacks (rows not a multiple of 256 in the real file): Q5_0 / Q5_1 / Q8_0 mixed
    "legacy": {"token_embd": "q8_0", "output": "q8_0", "attn_q": "q5_0", "attn_k": "q5_1",
               "attn_v": ("q5_0", "q8_0"), "attn_output": "q4_0", "ffn_gate": "q5_0", "ffn_up": "q4_1",
               "ffn_down": ("q5_1", "q8_0")},
}
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN)}


def type_of(recipe: dict, role: str, layer: int = 0) -> str:
    kind = recipe[role]
    return kind[layer % 2] if isinstance(kind, tuple) else kind


def centered(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks whose weights average zero (a min of -d times the middle quant; the K-quants: each
    sub-block's min index equal to its scale's), so that no row's offset decides every token."""
    qt = QUANT_TYPES[kind]
    data = random_blocks(kind, rows, cols, seed).numpy().reshape(rows, -1, qt.block_bytes).copy()
    d = data[..., 0:2].copy().view(np.float16).astype(np.float32)
    if kind in ("q4_1", "q5_1"):
        data[..., 2:4] = (-d * (7.5 if kind == "q4_1" else 15.5)).astype(np.float16).view(np.uint8)
    if kind in ("q4_k", "q5_k"):
        scales = data[..., 4:16]
        scales[..., 4:8] = scales[..., 0:4]
        scales[..., 8:12] = (scales[..., 8:12] & 0xF) * 0x11
        data[..., 2:4] = (d * (7.5 if kind == "q4_k" else 15.5)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def write_gguf(folder, recipe: dict, seed: int = 0):
    """config.json and model.gguf: a tiny Llama whose tensors are random blocks of the recipe's types."""
    import gguf

    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_hf_config("llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    path = folder / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.attention.head_count", HEADS)
    writer.add_uint32("llama.attention.head_count_kv", KV_HEADS)
    count = iter(range(1000))

    def blocks(name: str, kind: str, rows: int, cols: int) -> None:
        data = centered(kind, rows, cols, seed=seed * 1000 + next(count))
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(QUANT_TYPES[kind].ggml_id))

    def ones(name: str) -> None:
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))

    blocks("token_embd.weight", recipe["token_embd"], VOCAB, HIDDEN)
    blocks("output.weight", recipe["output"], VOCAB, HIDDEN)
    ones("output_norm.weight")
    for i in range(LAYERS):
        ones(f"blk.{i}.attn_norm.weight")
        ones(f"blk.{i}.ffn_norm.weight")
        for role, (rows, cols) in SHAPES.items():
            blocks(f"blk.{i}.{role}.weight", type_of(recipe, role, i), rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=sorted(RECIPES))
def mixed(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    path = write_gguf(folder / "target", RECIPES[request.param])
    target = load_target(folder / "target", torch.float32, torch.device("cpu"), "stored", gguf=path)
    cfg = ModelConfig.from_folder(folder / "target")
    write_tiny_draft(folder / "draft", cfg, block_size=4)
    draft = load_draft(folder / "draft", cfg, torch.float32, torch.device("cpu"), cli_block_size=4)
    return RECIPES[request.param], target, TinyEngine(target, draft, 4, num_slots=2, max_len=96)


def test_every_tensor_keeps_its_own_type(mixed):
    recipe, target, _ = mixed
    assert target.embed_tokens.quant.qtype.name == recipe["token_embd"]
    assert target.lm_head.quant.qtype.name == recipe["output"]
    for i, layer in enumerate(target.layers):
        qkv = layer.self_attn.qkv_proj.quant
        want = [type_of(recipe, role, i) for role in ("attn_q", "attn_k", "attn_v")]
        got = [p.qtype.name for p in qkv.parts] if isinstance(qkv, QuantParts) else [qkv.qtype.name] * 3
        assert got == want, i
        assert layer.mlp.down_proj.quant.qtype.name == type_of(recipe, "ffn_down", i)
        assert layer.self_attn.o_proj.quant.qtype.name == type_of(recipe, "attn_output", i)


@pytest.mark.parametrize("activations", ["fp32", "int8"])
def test_greedy_dflash_equals_plain_on_mixed_files(mixed, activations):
    recipe, target, engine = mixed
    if activations == "int8":
        target.use_int8_activations()
    floats = QUANT_TYPES[type_of(recipe, "ffn_down", 1)].floats  # F16 / BF16 weights take fp32 activations
    assert target.layers[1].mlp.down_proj.quant.activations == ("fp32" if floats else activations)
    # the one-op layer stack runs the mixed layers too, unless F16 parts (fp32 activations) meet int8 ones
    mixed_forms = activations == "int8" and recipe is RECIPES["f16_v"]
    assert (target.block_stack() is None) == mixed_forms
    prompts = [[1, 2, 3], [5, 9, 11, 40, 7, 3, 3, 8]]
    params = SamplingParams(max_tokens=24)
    plain = engine.run([Sequence(p, params, frozenset()) for p in prompts], False)
    spec = engine.run([Sequence(p, params, frozenset()) for p in prompts], True)
    for p, s in zip(plain, spec):
        assert len(p.output_ids) == 24 and len(set(p.output_ids)) > 4  # a varied text, not one token
        assert s.output_ids == p.output_ids
