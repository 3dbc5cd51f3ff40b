"""Every command checks its flags, paths and files before it loads, extracts or trains, and a mistake ends in
exit status 2 and one line on stderr, never a traceback. Fuzzed with hypothesis over every value-taking flag
of every subcommand; the slow work is replaced by a tripwire, so a bad value that gets past the checks
fails the test instead of loading a model."""

from __future__ import annotations

import argparse
import math
import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.cli import build_parser, main
from blockspec.models.config import ModelConfig
from tests.tiny import TINY_SPECIALS, write_tiny_draft, write_tiny_target, write_tiny_tokenizer


class SlowWorkReached(Exception):
    """A bad value got past the checks: the command went on to load, extract or train."""


def tripwire(*args, **kwargs):
    raise SlowWorkReached("a bad value reached the slow work")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-errors")
    target = write_tiny_tokenizer(write_tiny_target(root / "target"))
    draft = write_tiny_draft(root / "draft", ModelConfig.from_folder(target), block_size=4)
    (root / "data.jsonl").write_text('{"turns": ["hello"]}\n')
    (root / "a-file").write_text("not a folder")
    (root / "model.gguf").write_bytes(b"GGUF")
    (root / "a-dir").mkdir()
    return {"target": str(target), "draft": str(draft), "jsonl": str(root / "data.jsonl"),
            "file": str(root / "a-file"), "gguf": str(root / "model.gguf"), "missing": str(root / "nowhere"),
            "under-file": str(root / "a-file" / "out"), "dir": str(root / "a-dir"), "out": str(root / "out")}


@pytest.fixture(autouse=True)
def no_slow_work(monkeypatch):
    import blockspec.llm
    import blockspec.train.eval_draft
    import blockspec.train.trainer

    monkeypatch.setattr(blockspec.llm, "load_target", tripwire)  # after the checks and the draft's config
    monkeypatch.setattr(blockspec.train.trainer.Trainer, "run", tripwire)
    monkeypatch.setattr(blockspec.train.eval_draft, "run_eval_draft", tripwire)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)  # chat checks for a terminal after the flags


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def base(command: str, p: dict) -> list[str]:
    """A valid command line (up to the tripwire) to which one bad flag is added."""
    model = ["--model-path", p["target"], "--draft-model-path", p["draft"], "--device", "cpu"]
    return {
        "generate": ["generate", "hi", *model],
        "chat": ["chat", *model],
        "bench": ["bench", "--dataset", p["jsonl"], *model],
        "bench-serving": ["bench-serving", "--dataset", p["jsonl"], "--num-prompts", "1", *model],
        "serve": ["serve", "--port", free_port(), *model],
        "train-draft": ["train-draft", "--target", p["target"], "--output", p["out"], "--data", p["jsonl"],
                        "--block-size", "4", "--target-layer-ids", "0,2", "--mask-token-id", "5",
                        "--device", "cpu"],
        "eval-draft": ["eval-draft", "--model-path", p["target"], "--draft-model-path", p["draft"],
                       "--dataset", p["jsonl"], "--device", "cpu"],
    }[command]


NOT_INT = st.sampled_from(["x", "1.5", "", "1e3", "0x10", "--", "nan", "3 4"])
NOT_NUMBER = st.sampled_from(["x", "", "1,5", "--", "one"])


def ints(low: int | None = None, high: int | None = None) -> st.SearchStrategy[str]:
    """Integers outside [low, high], and text that is no integer."""
    outside = []
    if low is not None:
        outside.append(st.integers(max_value=low - 1, min_value=low - 10**20).map(str))
    if high is not None:
        outside.append(st.integers(min_value=high + 1, max_value=high + 10**20).map(str))
    return st.one_of(NOT_INT, *outside)


def floats(low: float, high: float, low_open: bool = False,
           high_open: bool = False) -> st.SearchStrategy[str]:
    """Numbers outside the range (open ends included), NaN, infinities, and text that is no number."""
    outside = [st.floats(max_value=low, exclude_max=not low_open, allow_nan=False,
                         allow_infinity=False).map(repr)]
    if math.isfinite(high):
        outside.append(st.floats(min_value=high, exclude_min=not high_open, allow_nan=False,
                                 allow_infinity=False).map(repr))
    return st.one_of(NOT_NUMBER, st.sampled_from(["nan", "inf", "-inf"]), *outside)


def words(*valid: str) -> st.SearchStrategy[str]:
    return st.text(min_size=1, max_size=12).filter(lambda t: t not in valid and t.upper() not in valid
                                                   and not t.startswith("-"))


FOLDER = ["missing", "file", "gguf"]  # what a folder flag must refuse
# The tiny tokenizer has one token per character and six special ones.
NOT_A_TOKEN = st.text(min_size=2, max_size=10).filter(lambda t: t not in TINY_SPECIALS
                                                     and not t.startswith("-"))
MODEL = {
    "--model-path": FOLDER, "--draft-model-path": FOLDER,
    "--speculative-algorithm": words("DFLASH", "NONE"), "--block-size": ints(2, 64),
    "--mask-token-id": ints(0, 96), "--device": words("cpu", "cuda", "auto"),
    "--dtype": words("float32", "bfloat16", "float16", "auto"), "--seed": ints(-(2**63), 2**64 - 1),
    "--quantization": words("auto", "none", "q8_0", "q4_0", "q4_1"),
    "--cpu-activations": words("auto", "int8", "fp32"), "--prompt-lookup-ngram": ints(0, 64),
    "--draft-quantization": words("auto", "none", "q8_0", "q4_0", "q4_1"),
    "--prompt-lookup-block-size": ints(2, 64), "--prompt-lookup-merge": words("auto", "always", "never"),
    "--speculative-tree-budget": ints(0, 64),
    "--speculative-tree-topk": ints(1, 64), "--speculative-tree-rule": words("best-first", "spine-first"),
    "--speculative-accept": words("match", "rejection"),
    "--max-model-len": ints(1, 512), "--threads": ints(1, 1024), "--tp-size": ints(1, 2),
    "--tp-backend": words("auto", "gloo", "nccl"), "--speculative-dflash-mask-token": NOT_A_TOKEN,
}
SAMPLING = {"--max-new-tokens": ints(1), "--temperature": floats(0, math.inf, high_open=True),
            "--top-p": floats(0, 1, low_open=True), "--top-k": ints(-1)}
EXTRAS = {"--presence-penalty": floats(-2, 2), "--frequency-penalty": floats(-2, 2), "--stop": st.just("")}
ENGINE = {"--max-running-requests": ints(1, 4096), "--max-total-tokens": ints(1),
          "--prefill-tokens-per-step": ints(1), "--prefill-decode-ratio": floats(0, 1e6)}
TRAIN_POSITIVE = ["--num-draft-layers", "--num-target-features", "--tokens", "--steps", "--batch-size",
                  "--anchors-per-seq", "--train-vocab", "--save-every", "--eval-every", "--eval-seqs",
                  "--eval-anchors", "--response-tokens", "--gen-batch-size", "--extract-batch-size",
                  "--stop-after-steps", "--selector-rank", "--selector-top-k"]
BAD = {
    "generate": {**MODEL, **SAMPLING, **EXTRAS},
    "chat": {**MODEL, **SAMPLING, **EXTRAS},
    "bench": {**MODEL, **SAMPLING, "--dataset": ["missing", "file"], "--num-prompts": ints(1),
              "--baseline": words("ar", "hf", "llama.cpp", "none"), "--json": ["dir", "under-file"],
              "--plot": ["dir", "under-file"], "--sweep-block-sizes": st.sampled_from(["1", "x", "", "2,-4"]),
              "--sweep-tree-budgets": st.sampled_from(["-1", "x", ""]),
              "--prefill-lengths": st.sampled_from(["0", "x", "", "500,-1", "1.5"])},
    "bench-serving": {**MODEL, **ENGINE, "--max-running-requests": ints(0, 4096),
                      "--dataset": ["missing", "file"], "--num-prompts": ints(1),
                      "--max-new-tokens": ints(1), "--temperature": floats(0, math.inf, high_open=True),
                      "--concurrency": st.sampled_from(["0", "x", "", "4,-1", "1.5"]),
                      "--shared-prefix": ints(1),
                      "--json": ["dir", "under-file"]},
    "serve": {**MODEL, **ENGINE, "--port": ints(1, 65535), "--max-request-bytes": ints(1024),
              "--shutdown-grace-seconds": floats(0, 3600), "--log-interval": floats(0, 86400),
              "--log-level": words("critical", "error", "warning", "info", "debug"),
              "--api-key": st.sampled_from(["", "two words", "naïve"]),
              "--api-key-file": ["missing", "dir"]},
    "train-draft": {**{flag: ints(1) for flag in TRAIN_POSITIVE},
                    "--target": FOLDER, "--output": ["file", "under-file"], "--block-size": ints(2),
                    "--target-layer-ids": st.sampled_from(["x", "0,99", "-7", "1.5"]),
                    "--mask-token-id": ints(0, 96), "--mask-token": st.one_of(st.just(""), NOT_A_TOKEN),
                    "--data": st.sampled_from(["", "responses:0", "nope", "missing.jsonl", "responses:x"]),
                    "--epochs": floats(0, math.inf, low_open=True, high_open=True),
                    "--lr": floats(0, 1, low_open=True, high_open=True),
                    "--warmup-ratio": floats(0, 1, high_open=True),
                    "--weight-decay": floats(0, 1, high_open=True),
                    "--grad-clip": floats(0, math.inf, low_open=True, high_open=True),
                    "--seq-len": ints(32), "--loss-gamma": floats(0, math.inf, low_open=True, high_open=True),
                    "--distill": floats(0, 1), "--init": ["missing", "file", "dir"],
                    "--train-dtype": words("auto", "float32", "bfloat16"),
                    "--device": words("cpu", "cuda", "auto"),
                    "--dtype": words("float32", "bfloat16", "float16", "auto"),
                    "--save-dtype": words("float32", "float16", "bfloat16"), "--seed": ints(0, 2**63 - 1),
                    "--cache-dir": ["file", "under-file"], "--features": words("auto", "disk", "online"),
                    "--time-budget": floats(0, math.inf, low_open=True, high_open=True),
                    "--architecture": words("dflash", "dflash2"),
                    "--selector-alpha": floats(0, math.inf, high_open=True),
                    "--selector-lr-scale": floats(0, math.inf, low_open=True, high_open=True),
                    "--threads": ints(1, 1024)},
    "eval-draft": {"--model-path": FOLDER, "--draft-model-path": FOLDER, "--dataset": ["missing", "file"],
                   "--block-sizes": st.sampled_from(["1", "x", "", "2,999"]), "--num-prompts": ints(1),
                   "--draft-quantization": st.sampled_from(["", "auto", "q5_0", "none,x", ","]),
                   "--max-new-tokens": ints(1), "--seed": ints(0, 2**63 - 1),
                   "--device": words("cpu", "cuda", "auto"), "--threads": ints(1, 1024),
                   "--json": ["dir", "under-file"]},
}
# Flags that take any text (a name, an address, a message): nothing to refuse.
FREE_TEXT = {"--system", "--host", "--served-model-name", "--cors-allow-origins"}


def strategy(bad, p: dict) -> st.SearchStrategy[str]:
    return st.sampled_from([p[name] for name in bad]) if isinstance(bad, list) else bad


def run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


def test_every_value_flag_is_fuzzed():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, sub in subs.choices.items():
        flags = {a.option_strings[0] for a in sub._actions if a.option_strings and a.nargs != 0}
        assert flags - set(BAD[command]) - FREE_TEXT == set(), command


TRIED: list[tuple[str, str, str]] = []
CASES = [(command, flag) for command, table in BAD.items() for flag in table]


@pytest.mark.parametrize("command,flag", CASES)
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_bad_value_is_one_line_and_exit_2(paths, capsys, data, command, flag):
    value = data.draw(strategy(BAD[command][flag], paths), label=flag)
    code, err = run([*base(command, paths), f"{flag}={value}"], capsys)
    TRIED.append((command, flag, value))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, (command, flag, value, err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (flag, value, err)


def test_the_fuzz_covered_every_flag():
    """Run after the fuzz (file order): it tried every flag of the table."""
    seen = {(c, f) for c, f, _ in TRIED}
    assert seen == set(CASES), set(CASES) - seen
    print(f"\nCLI fuzz: {len(TRIED)} bad values tried ({len(set(TRIED))} distinct) over {len(CASES)} "
          f"(command, flag) pairs")


@pytest.mark.parametrize("command", ["generate", "train-draft", "serve"])
def test_a_gguf_file_given_as_a_model_says_what_to_do(paths, capsys, command):
    flag = "--target" if command == "train-draft" else "--model-path"
    code, err = run([*base(command, paths), flag, paths["gguf"]], capsys)
    assert code == 2 and "is a GGUF file, not a folder" in err and "original Hugging Face folder" in err


def test_train_draft_mistakes_are_caught_up_front(paths, capsys, tmp_path):
    argv = base("train-draft", paths)
    code, err = run([*argv, "--output", paths["file"]], capsys)
    assert code == 2 and "--output=" in err and "is a file" in err
    code, err = run([*argv, "--output", str(tmp_path / "fresh"), "--resume"], capsys)
    assert code == 2 and "--resume" in err and "holds no training checkpoint" in err
    broken = tmp_path / "broken-draft"
    broken.mkdir()
    (broken / "config.json").write_text('{"architectures": ["DFlashDraftModel"], "hidden_size": 3}')
    code, err = run([*argv, "--output", str(tmp_path / "fresh2"), "--init", str(broken)], capsys)
    assert code == 2 and "DFLASH" in err and "broken-draft" in err and "invalid num_hidden_layers" in err


def test_messages_name_flags_on_the_command_line_and_fields_in_the_api(paths, capsys):
    from blockspec import SamplingParams
    from blockspec.errors import RequestError

    code, err = run([*base("generate", paths), "--max-new-tokens", "0"], capsys)
    assert code == 2 and "--max-new-tokens=0" in err and "max_tokens" not in err
    with pytest.raises(RequestError, match=r"^max_tokens=0 must be"):
        SamplingParams(max_tokens=0)
    code, err = run([*base("serve", paths), "--max-running-requests", "0"], capsys)
    assert "--max-running-requests=0" in err and "max_num_seqs" not in err
