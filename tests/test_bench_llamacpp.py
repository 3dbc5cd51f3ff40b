"""`blockspec bench --baseline llama.cpp`: llama.cpp (an optional extra) timed beside our methods on the
embedded model's GGUF; a clear error when the extra is absent."""

import importlib.util
import json

import pytest

from blockspec.cli import main

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None
ARGS = ["bench", "--baseline", "llama.cpp", "--dataset", "humaneval", "--num-prompts", "2",
        "--max-new-tokens", "8", "--no-progress", "--threads", "1"]


@pytest.mark.skipif(HAVE_LLAMA_CPP, reason="llama-cpp-python is installed")
def test_the_missing_extra_is_named(smollm2_dir, capsys):
    assert main(ARGS) == 2
    assert "pip install llama-cpp-python==0.3.36" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python (the llamacpp extra) is not installed")
def test_llama_cpp_is_timed_beside_our_methods(smollm2_dir, tmp_path):
    out = tmp_path / "report.json"
    assert main([*ARGS, "--json", str(out), "--prefill-lengths", "64"]) == 0
    report = json.loads(out.read_text())
    assert report["cpu_activations"] == "int8" and report["prefill"][0]["ar_ttft_ratio_to_llama.cpp"] > 0
    assert report["baseline"] == "llama.cpp" and report["llama.cpp_tokens_per_s"] > 0
    assert report["speedup"] == report["speedup_vs_llama.cpp"] and report["outputs_match"] == 1.0
    assert report["methods"]["llama.cpp"]["end_to_end_tokens_per_s"] > 0
