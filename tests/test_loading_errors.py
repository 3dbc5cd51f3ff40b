"""Bad checkpoints give a BlockspecError naming the file or tensor and the fix; the CLI exits 2."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockspec.errors import BlockspecError, ModelLoadError
from blockspec.models.loader import load_target
from tests.tiny import write_tiny_target

CPU = torch.device("cpu")


@pytest.fixture()
def tiny(tmp_path):
    return write_tiny_target(tmp_path / "m")


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist.*--model-path"):
        load_target(tmp_path / "nope", torch.float32, CPU)


def test_unsupported_architecture(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*MambaForCausalLM"):
        load_target(tiny, torch.float32, CPU)


def test_truncated_safetensors(tiny):
    path = tiny / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors is truncated"):
        load_target(tiny, torch.float32, CPU)


def test_garbage_safetensors(tiny):
    (tiny / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ModelLoadError, match="not a readable safetensors file"):
        load_target(tiny, torch.float32, CPU)


def test_missing_tensor(tiny):
    tensors = load_file(tiny / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(ModelLoadError, match="model.layers.1.mlp.down_proj.weight.*missing"):
        load_target(tiny, torch.float32, CPU)


def test_shape_mismatch(tiny):
    tensors = load_file(tiny / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, tiny / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"k_proj.weight.*shape \[8, 64\].*\[32, 64\]"):
        load_target(tiny, torch.float32, CPU)


def test_bad_config_value(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    cfg["num_hidden_layers"] = "four"
    (tiny / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="num_hidden_layers='four'"):
        load_target(tiny, torch.float32, CPU)


def test_errors_are_value_errors():
    assert issubclass(ModelLoadError, BlockspecError) and issubclass(BlockspecError, ValueError)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-path", "/nonexistent/model"], "does not exist"),
        (["--device", "cuda"], "CUDA"),
    ],
)
def test_cli_prints_error_and_exits_2(args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = subprocess.run(
        [sys.executable, "-m", "blockspec", "generate", "hi", *args], capture_output=True, text=True,
        timeout=120
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_shipped_draft_is_named_default_from_any_folder(tmp_path, monkeypatch):
    """`--draft-model-path default` (and eval-draft's list, train-draft's --init) is the shipped draft
    whatever the working folder: README's commands work outside the checkout."""
    from blockspec.config import EngineConfig
    from blockspec.paths import SHIPPED_DRAFT, draft_folder
    from blockspec.train.config import TrainConfig

    monkeypatch.chdir(tmp_path)
    assert (SHIPPED_DRAFT / "config.json").is_file()
    assert EngineConfig(draft_model_path="default", device="cpu").draft_model_path == str(SHIPPED_DRAFT)
    assert [draft_folder(p) for p in "my-draft,default".split(",")] == ["my-draft", str(SHIPPED_DRAFT)]
    assert TrainConfig(output=str(tmp_path / "out"), init="default").init == str(SHIPPED_DRAFT)
    with pytest.raises(ModelLoadError, match="or 'default' for the shipped one"):
        EngineConfig(draft_model_path="defualt", device="cpu")
