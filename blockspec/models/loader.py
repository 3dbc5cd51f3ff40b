"""Loading and saving checkpoints: HF target folders and z-lab DFlash draft folders (safetensors).

Headers are read and checked (names, shapes, file sizes) before any weight is copied, so a bad
checkpoint fails with the file and tensor named instead of a crash deep inside torch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from blockspec.config import ModelConfig, read_config_json
from blockspec.errors import ModelLoadError
from blockspec.models.draft import DFlashDraft
from blockspec.models.layers import Linear
from blockspec.models.target import CausalLM
from blockspec.spec.draft_config import DRAFT_VOCAB, resolve_draft_config
from blockspec.spec.draft_tensors import check_draft_tensors, check_draft_vocab

# checkpoint projection name -> (our fused module name, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def read_header(path: Path) -> dict[str, dict]:
    """Tensor entries of one safetensors file, checked against the file's real size."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than file")
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"{path} is not a readable safetensors file ({exc}). It is probably truncated or corrupt: "
            f"re-download or re-convert it."
        ) from exc
    header.pop("__metadata__", None)
    data_end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + header_len + data_end > size:
        raise ModelLoadError(
            f"{path} is truncated: its header needs {8 + header_len + data_end} bytes but the file has {size}. "
            f"Re-download or re-convert it."
        )
    return header


def checkpoint_index(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) over model.safetensors, a sharded index, or all *.safetensors files."""
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"{index_file} lists shard {file.name}, which is missing from {folder}.")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No *.safetensors weights in {folder}. Convert the checkpoint to safetensors first.")
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        for name, entry in read_header(file).items():
            index[name] = (file, tuple(entry["shape"]))
    return index


def expected_tensors(model: nn.Module, prefix: str) -> dict[str, tuple[nn.Parameter, slice | None]]:
    """Checkpoint tensor name -> (our parameter, row slice of it), un-fusing packed projections.
    Tied weights appear once (named_parameters skips the second name of a shared tensor)."""
    out: dict[str, tuple[nn.Parameter, slice | None]] = {}
    for name, param in model.named_parameters():
        module_name, _, leaf_param = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(module, Linear) and len(module.shards) > 1:
            owner, _, fused_name = module_name.rpartition(".")
            for ckpt_name, (fused, i) in PACKED.items():
                if fused == fused_name:
                    out[f"{prefix}{owner}.{ckpt_name}.{leaf_param}"] = (param, module.shard_slice(i))
        else:
            out[prefix + name] = (param, None)
    return out


def load_into(model: nn.Module, folder: Path, names: dict[str, tuple[nn.Parameter, slice | None]], optional=()) -> None:
    index = checkpoint_index(folder)
    for name, (param, rows) in names.items():
        target_shape = tuple(param[rows].shape if rows is not None else param.shape)
        if name not in index:
            if name in optional:
                continue
            raise ModelLoadError(
                f"Tensor {name!r} is missing from the checkpoint in {folder}. The checkpoint does not match its "
                f"config.json (wrong architecture or an incomplete download)."
            )
        file, shape = index[name]
        if shape != target_shape:
            raise ModelLoadError(
                f"Tensor {name!r} in {file} has shape {list(shape)}, but config.json implies {list(target_shape)}. "
                f"The weights and config.json come from different models."
            )
    handles: dict[Path, object] = {}
    with torch.no_grad():
        for name, (param, rows) in names.items():
            if name not in index:
                continue
            file = index[name][0]
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt")
            tensor = handles[file].get_tensor(name)
            (param[rows] if rows is not None else param).copy_(tensor)


def load_target(folder: str | Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.rotary.reset()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    names = expected_tensors(model, "model.")
    names = {("lm_head.weight" if n == "model.lm_head.weight" else n): v for n, v in names.items()}
    load_into(model, folder, names)
    return model.to(device).eval()


def save_module(model: nn.Module, folder: Path, config: dict, dtype: torch.dtype | None = None,
                extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write config.json + model.safetensors with checkpoint (un-fused) tensor names (+ `extra` as is)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in (extra or {}).items()}
    for name, (param, rows) in expected_tensors(model, "").items():
        tensor = (param[rows] if rows is not None else param).detach()
        tensors[name] = (tensor.to(dtype) if dtype is not None else tensor).contiguous().cpu()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_draft(
    folder: str | Path,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    token_to_id=None,
    cli_block_size: int | None = None,
    cli_mask_token: str | None = None,
    cli_mask_token_id: int | None = None,
) -> DFlashDraft:
    """Resolve and validate the draft's config and tensor shapes, then load its weights."""
    folder = Path(folder)
    hint = "Pass --draft-model-path pointing at a DFlash draft (config.json + model.safetensors, z-lab format)."
    config_path, raw = read_config_json(folder, "Draft", hint)
    cfg = resolve_draft_config(
        raw, target=target, source=str(config_path), cli_block_size=cli_block_size,
        cli_mask_token=cli_mask_token, cli_mask_token_id=cli_mask_token_id, token_to_id=token_to_id,
    )
    index = checkpoint_index(folder)
    check_draft_tensors(cfg, {name: shape for name, (_, shape) in index.items()}, str(folder))
    embed_rows = index["embed_tokens.weight"][1][0] if cfg.has_embed_tokens else None
    with torch.device("meta"):
        draft = DFlashDraft(cfg, embed_rows)
    draft = draft.to_empty(device="cpu").to(dtype)
    draft.rotary.reset()
    load_into(draft, folder, expected_tensors(draft, ""))
    if DRAFT_VOCAB in index:
        with safe_open(str(index[DRAFT_VOCAB][0]), framework="pt") as f:
            draft.vocab = check_draft_vocab(f.get_tensor(DRAFT_VOCAB), target.vocab_size, str(folder))
    return draft.to(device).eval()


def save_draft(draft: DFlashDraft, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write a draft in the z-lab checkpoint format (loads in z-lab's reference and SGLang too)."""
    extra = {DRAFT_VOCAB: draft.vocab} if draft.vocab is not None else None
    save_module(draft, Path(folder), draft.config.to_json_dict(), dtype, extra)
