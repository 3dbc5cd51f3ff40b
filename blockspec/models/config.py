"""Target model configuration: parsed from a Hugging Face `config.json`, validated at the boundary."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from blockspec.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """The fields our target runtime needs; everything else in config.json is ignored."""

    family: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs!r}. blockspec runs targets of these "
                f"architectures: {sorted(SUPPORTED_ARCHITECTURES)}. Use a Llama-family or Qwen3 checkpoint."
            )

        def need_int(name: str, minimum: int = 1) -> int:
            value = raw.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ModelLoadError(
                    f"{source}: field {name}={value!r} must be an integer >= {minimum}. "
                    f"Fix the checkpoint's config.json."
                )
            return value

        hidden = need_int("hidden_size")
        heads = need_int("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or hidden // heads
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}."
            )
        # transformers >= 5 writes `rope_parameters` (theta inside); older checkpoints use rope_scaling +
        # rope_theta.
        rope_parameters = raw.get("rope_parameters") or {}
        rope_theta = float(rope_parameters.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_scaling = raw.get("rope_scaling") or (
            rope_parameters if rope_parameters.get("rope_type") not in (None, "default") else None)
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("llama3", "default", "linear"):
                raise ModelLoadError(
                    f"{source}: rope_scaling type {kind!r} is not supported "
                    f"(supported: llama3, linear, default)."
                )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"{source}: hidden_act={act!r} is not supported; only silu (SwiGLU) is.")
        return cls(
            family=family,
            vocab_size=need_int("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=need_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=need_int("intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        hint = (
            "Pass --model-path pointing at a Hugging Face checkpoint folder (config.json + *.safetensors), "
            "or omit it to use the embedded SmolLM2."
        )
        path, raw = read_config_json(folder, "Model", hint)
        return cls.from_dict(raw, source=str(path))


def read_config_json(folder: str | Path, kind: str, hint: str) -> tuple[Path, dict]:
    """The parsed config.json of a checkpoint folder, with errors that say which folder and what to pass."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise ModelLoadError(f"{kind} folder {str(folder)!r} does not exist. {hint}")
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: a {kind.lower()} folder needs its config.json. {hint}")
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON ({exc}). Re-download or rewrite it.") from exc
