"""Loading and saving checkpoints: HF target folders and z-lab DFlash draft folders (safetensors).

Headers are read and checked (names, shapes, file sizes) before any weight is copied, so a bad
checkpoint fails with the file and tensor named instead of a crash deep inside torch. Each layer then
loads its own tensors (`load`), so a layer that stores its weight differently decides how.
"""

from __future__ import annotations

import contextlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from blockspec.distributed import TPGroup
from blockspec.errors import ModelLoadError
from blockspec.layers.embedding import Embedding
from blockspec.layers.linear import Linear
from blockspec.layers.quant import QuantType, quant_type
from blockspec.models.config import ModelConfig, read_config_json
from blockspec.models.draft import DFlashDraft
from blockspec.models.draft_config import DRAFT_VOCAB, resolve_draft_config
from blockspec.models.draft_tensors import check_draft_tensors, check_draft_vocab
from blockspec.models.gguf_checkpoint import GGUFCheckpoint
from blockspec.models.parallel import shard_target
from blockspec.models.target import CausalLM

@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build a model's weights in `dtype` directly (its layers allocate them uninitialised)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


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
            f"{path} is truncated: its header needs {8 + header_len + data_end} bytes but the file has "
            f"{size}. Re-download or re-convert it."
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
                raise ModelLoadError(f"{index_file} lists shard {file.name}, which is missing from "
                                     f"{folder}.")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"No *.safetensors weights in {folder}. Convert the checkpoint to safetensors "
                             f"first.")
    index: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        for name, entry in read_header(file).items():
            index[name] = (file, tuple(entry["shape"]))
    return index


def model_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Checkpoint tensor name (relative to the model) -> (the layer that owns it, the name it knows it by,
    its current tensor), over every layer that holds checkpoint tensors."""
    out = {}
    for path, module in model.named_modules():
        tensors = getattr(module, "checkpoint_tensors", None)
        if tensors is not None and module is not model:
            out.update({name: (module, name, tensor) for name, tensor in tensors(path).items()})
    return out


def copy_layer(dst: nn.Module, src: nn.Module, scale: float | torch.Tensor = 1.0) -> None:
    """Load layer `dst` with the checkpoint tensors of `src`, a layer of the same kind and shape (times
    `scale`); tensors `dst` has no place for (a bias it lacks) are skipped."""
    wanted = dst.checkpoint_tensors("layer")
    for name, tensor in src.checkpoint_tensors("layer").items():
        if name in wanted:
            dst.load(name, tensor * scale)


class SafetensorsCheckpoint:
    """The tensors of a checkpoint folder's safetensors files, read when asked for."""

    def __init__(self, folder: Path) -> None:
        self.source, self.index = folder, checkpoint_index(folder)
        self._handles: dict[Path, object] = {}

    def shape(self, name: str) -> tuple[int, ...] | None:
        return self.index[name][1] if name in self.index else None

    def stored_type(self, name: str) -> QuantType | None:
        return None  # dense

    def get(self, name: str, source: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """The tensor, or only its part `source` (dim, start, length, full): read from the file as a slice,
        so a tensor-parallel rank never holds the whole tensor."""
        file = self.index[name][0]
        if file not in self._handles:
            self._handles[file] = safe_open(str(file), framework="pt")
        if source is None:
            return self._handles[file].get_tensor(name)
        dim, start, length, _ = source
        part = self._handles[file].get_slice(name)
        return part[start : start + length] if dim == 0 else part[:, start : start + length]


def load_into(model: nn.Module, checkpoint, names: dict[str, tuple[nn.Module, str, torch.Tensor]]) -> None:
    """Check every expected tensor's presence and shape in the checkpoint, then let each layer load its
    own (only its slice of it, under tensor parallelism)."""
    sources = {}
    for name, (layer, own_name, tensor) in names.items():
        source = getattr(layer, "source", lambda _: None)(own_name)
        expected = list(tensor.shape)
        if source is not None:
            expected[source[0]] = source[3]
            sources[name] = source
        shape = checkpoint.shape(name)
        if shape is None:
            raise ModelLoadError(
                f"Tensor {name!r} is missing from the checkpoint in {checkpoint.source}. The checkpoint "
                f"does not match its config.json (wrong architecture or an incomplete download)."
            )
        if shape != tuple(expected):
            raise ModelLoadError(
                f"Tensor {name!r} in {checkpoint.source} has shape {list(shape)}, but config.json implies "
                f"{expected}. The weights and config.json come from different models."
            )
    for name, (layer, own_name, _) in names.items():
        source = sources.get(name)
        layer.load(own_name, checkpoint.get(name) if source is None else checkpoint.get(name, source))


def hold_as_blocks(names: dict[str, tuple[nn.Module, str, torch.Tensor]], checkpoint,
                   quantization: str) -> None:
    """Switch the embedding and every Linear to block storage before loading: of the type `quantization`
    names, or with "stored", of the type the checkpoint stores each in (float tensors stay dense)."""
    owned: dict[nn.Module, list[str]] = {}
    for name, (layer, _, _) in names.items():
        if isinstance(layer, (Linear, Embedding)) and name.endswith(".weight"):
            owned.setdefault(layer, []).append(name)
    for layer, weights in owned.items():
        if quantization != "stored":
            layer.use_blocks(quant_type(quantization))
            continue
        stored = [checkpoint.stored_type(name) for name in weights]
        if len(set(stored)) == 1:
            if stored[0] is not None:
                layer.use_blocks(stored[0])
            continue
        if None in stored or not isinstance(layer, Linear) or layer.shard_names is None:
            kinds = ", ".join(f"{n}: {t.name if t else 'float'}" for n, t in zip(weights, stored))
            raise ModelLoadError(f"{checkpoint.source}: the parts of one fused layer are stored as blocks "
                                 f"and as floats ({kinds}); pass --quantization q8_0 (or none) to load "
                                 f"them in one.")
        # each fused part in its own type, in the layer's part order
        by_part = {name.rsplit(".", 2)[-2]: qtype for name, qtype in zip(weights, stored)}
        layer.use_blocks([by_part[part] for part in layer.shard_names])


def load_target(folder: str | Path, dtype: torch.dtype, device: torch.device,
                quantization: str | None = None, gguf: Path | None = None,
                tp: TPGroup | None = None) -> CausalLM:
    """The target of a checkpoint folder (config.json, and its weights unless `gguf` gives them).
    quantization: None for dense weights in `dtype`; a block type (q8_0, q4_0, q4_1) to hold every Linear and
    the embedding in it (CPU, fp32 activations); "stored" to keep a GGUF's own blocks. `tp`: this rank's
    shard only (models/parallel.py)."""
    folder = Path(folder)
    cfg = ModelConfig.from_folder(folder)
    with default_dtype(dtype):
        model = CausalLM(cfg)
        if tp is not None:
            shard_target(model, tp)
    checkpoint = GGUFCheckpoint(gguf) if gguf is not None else SafetensorsCheckpoint(folder)
    # HF names: the decoder under "model.", the head beside it
    names = {(n if n.startswith("lm_head.") else f"model.{n}"): v for n, v in model_tensors(model).items()}
    if quantization is not None:
        hold_as_blocks(names, checkpoint, quantization)
        if model.lm_head.tied and model.embed_tokens.quant is not None:
            model.lm_head.use_blocks(model.embed_tokens.quant.qtype)
    load_into(model, checkpoint, names)
    return model.to(device).eval()


def save_module(model: nn.Module, folder: Path, config: dict, dtype: torch.dtype | None = None,
                extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write config.json + model.safetensors with checkpoint (un-fused) tensor names (+ `extra` as is)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in (extra or {}).items()}
    for name, (_, _, tensor) in model_tensors(model).items():
        tensor = tensor.detach()
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
    quantization: str | None = None,
) -> DFlashDraft:
    """Resolve and validate the draft's config and tensor shapes, then load its weights: dense in `dtype`, or
    with `quantization` (a block type) every linear layer held as blocks of it (CPU inference)."""
    folder = Path(folder)
    hint = ("Pass --draft-model-path pointing at a DFlash draft (config.json + model.safetensors, z-lab "
            "format).")
    config_path, raw = read_config_json(folder, "Draft", hint)
    cfg = resolve_draft_config(
        raw, target=target, source=str(config_path), cli_block_size=cli_block_size,
        cli_mask_token=cli_mask_token, cli_mask_token_id=cli_mask_token_id, token_to_id=token_to_id,
    )
    checkpoint = SafetensorsCheckpoint(folder)
    index = checkpoint.index
    check_draft_tensors(cfg, {name: shape for name, (_, shape) in index.items()}, str(folder))
    vocab = None
    if DRAFT_VOCAB in index:  # a few ids, checked before the weights are read
        with safe_open(str(index[DRAFT_VOCAB][0]), framework="pt") as f:
            vocab = check_draft_vocab(f.get_tensor(DRAFT_VOCAB), target.vocab_size, str(folder))
    embed_rows = index["embed_tokens.weight"][1][0] if cfg.has_embed_tokens else None
    with default_dtype(dtype):
        draft = DFlashDraft(cfg, embed_rows)
    names = model_tensors(draft)
    if quantization is not None:
        hold_as_blocks(names, checkpoint, quantization)
    load_into(draft, checkpoint, names)
    draft.vocab = vocab
    return draft.to(device).eval()


def save_draft(draft: DFlashDraft, folder: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write a draft in the z-lab checkpoint format (loads in z-lab's reference and SGLang too)."""
    extra = {DRAFT_VOCAB: draft.vocab} if draft.vocab is not None else None
    save_module(draft, Path(folder), draft.config.to_json_dict(), dtype, extra)
