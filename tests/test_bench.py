"""`blockspec bench`: dataset loaders on the real packages, report fields on tiny random models, and an
honest outputs_match (a corrupted DFlash output must be caught)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from blockspec.bench.datasets import HUMANEVAL_TEMPLATE, load_dataset, select_subset
from blockspec.cli import main
from blockspec.models.config import ModelConfig
from blockspec.errors import BlockspecError
from tests.tiny import write_tiny_draft, write_tiny_target

WORDS = ["<unk>", "<s>", "</s>", "<user>", "<assistant>"] + [f"t{i}" for i in range(5, 97)]
TEMPLATE = ("{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}<assistant> {% endif %}")
CONTRACT_FIELDS = {
    "dataset", "num_prompts", "max_new_tokens", "block_size", "temperature", "mean_accept_length",
    "accept_length_histogram", "baseline", "baseline_tokens_per_s", "dflash_tokens_per_s", "speedup",
    "outputs_match", "per_prompt", "machine",
}


def write_tokenizer(folder: Path) -> None:
    """A 97-word WordLevel tokenizer with a tiny chat template, matching the tiny target's vocab."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(w, special=True) for w in WORDS[:5]])
    backend.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bench")
    target = write_tiny_target(root / "target", "llama")
    write_tokenizer(target)
    draft = write_tiny_draft(root / "draft", ModelConfig.from_folder(target), block_size=4)
    data = root / "prompts.jsonl"
    rows = [{"turns": [" ".join(f"t{5 + (7 * i + j) % 90}" for j in range(6 + i)), "t9 t10 t11"]}
            for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return {"root": root, "target": target, "draft": draft, "data": data}


def bench(tiny: dict[str, Path], *extra: str, draft: bool = True, name: str = "out",
          adaptive: bool = False) -> tuple[int, dict | None]:
    """Runs `blockspec bench`; adaptive speculation off unless asked (its choices depend on timing)."""
    out = tiny["root"] / f"{name}.json"
    out.unlink(missing_ok=True)
    argv = ["bench", "--dataset", str(tiny["data"]), "--max-new-tokens", "10",
            "--model-path", str(tiny["target"]),
            "--device", "cpu", "--dtype", "float32", "--json", str(out), "--no-progress", *extra]
    argv += [] if adaptive else ["--no-adaptive-speculation"]
    if draft:
        argv += ["--draft-model-path", str(tiny["draft"])]
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, json.loads(out.read_text()) if out.is_file() else None


# ---- datasets on the real packages ----------------------------------------------------------------


def test_humaneval_from_package() -> None:
    data = load_dataset("humaneval")
    assert len(data) == 164
    first = data.prompts[0]
    assert first.source_id == "HumanEval/0" and len(first.turns) == 1
    assert (first.turns[0].startswith(HUMANEVAL_TEMPLATE.split("{")[0])
            and "def has_close_elements" in first.turns[0])
    assert first.turns[0].endswith("\n```")


def test_mt_bench_from_package() -> None:
    data = load_dataset("mt-bench")
    assert len(data) == 80
    assert all(len(p.turns) == 2 for p in data.prompts)
    assert data.prompts[0].source_id == "81"


def test_seeded_subset() -> None:
    data = load_dataset("mt-bench")
    a, note = select_subset(data, 10, seed=0)
    assert note is None and len(a) == 10
    assert [p.index for p in a] == sorted(p.index for p in a)
    assert [p.index for p in a] == [p.index for p in select_subset(data, 10, seed=0)[0]]
    assert [p.index for p in a] != [p.index for p in select_subset(data, 10, seed=1)[0]]
    every, note = select_subset(data, 500, seed=0)
    assert len(every) == 80 and "exceeds" in note
    with pytest.raises(BlockspecError, match="num-prompts"):
        select_subset(data, 0, seed=0)


def test_jsonl_loader_errors(tmp_path: Path) -> None:
    with pytest.raises(BlockspecError, match="neither a built-in dataset"):
        load_dataset(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": [\n')
    with pytest.raises(BlockspecError, match="line 2 is not valid JSON"):
        load_dataset(str(bad))
    bad.write_text('{"turns": ["ok"]}\n\n{"prompt": "x"}\n')
    with pytest.raises(BlockspecError, match='line 3: expected "turns"'):
        load_dataset(str(bad))
    bad.write_text("\n")
    with pytest.raises(BlockspecError, match="no prompts"):
        load_dataset(str(bad))


# ---- the bench on tiny random models -------------------------------------------------------------


def test_report_fields_and_plot(tiny, capsys) -> None:
    plot = tiny["root"] / "bench.png"
    code, report = bench(tiny, "--plot", str(plot))
    assert code == 0
    assert CONTRACT_FIELDS <= report.keys()
    assert report["dataset"] == "prompts.jsonl" and report["num_prompts"] == 4 and report["num_samples"] == 4
    assert report["baseline"] == "ar" and report["block_size"] == 4 and report["max_new_tokens"] == 10
    assert report["outputs_match"] == 1.0 and report["mismatches"] == []
    hist = report["accept_length_histogram"]
    assert len(hist) == 4 and sum(hist) == pytest.approx(1.0, abs=1e-3)
    assert 1.0 <= report["mean_accept_length"] <= 4.0
    assert (report["baseline_tokens_per_s"] > 0 and report["dflash_tokens_per_s"] > 0
            and report["speedup"] > 0)
    assert report["speedup_median"] > 0 and report["methods"]["ar"]["tpot_ms_median"] > 0
    assert len(report["per_prompt"]) == 4
    row = report["per_prompt"][0]
    assert row["outputs_match"] is True and row["ar_tpot_ms"] > 0 and row["dflash_tpot_ms"] > 0
    assert all(1 <= a <= 4 for a in row["accept_lengths"])
    assert {"cpu", "threads", "torch", "device"} <= report["machine"].keys()
    assert report["command"] and report["date"] and "decode-only" in report["timing"]
    assert report["adaptive_speculation"] is False and report["num_plain_steps"] == 0
    assert plot.is_file() and plot.stat().st_size > 1000
    table = capsys.readouterr().out
    assert "ar (baseline)" in table and "dflash B=4" in table and "outputs_match 1.000" in table


def test_adaptive_speculation_reports_its_plain_steps(tiny) -> None:
    code, report = bench(tiny, "--max-new-tokens", "40", adaptive=True, name="adaptive")
    assert code == 0 and report["adaptive_speculation"] is True and report["outputs_match"] == 1.0
    assert report["num_verify_steps"] >= 1  # the first step measures DFlash
    steps = report["num_verify_steps"] + report["num_plain_steps"]
    assert report["speculative_step_fraction"] == pytest.approx(report["num_verify_steps"] / steps, abs=1e-4)
    assert sum(r["plain_steps"] for r in report["per_prompt"]) == report["num_plain_steps"]


def test_corrupted_dflash_output_is_caught(tiny, monkeypatch, capsys) -> None:
    from blockspec.llm import LLM

    original = LLM.generate

    def corrupt(self, prompts, params=None, speculative_algorithm=None):
        outs = original(self, prompts, params, speculative_algorithm)
        if speculative_algorithm == "DFLASH" and len(prompts[0]) > 9:  # prompts 2 and 3 of the four
            outs[0].token_ids = [(outs[0].token_ids[0] + 1) % 97] + outs[0].token_ids[1:]
        return outs

    monkeypatch.setattr(LLM, "generate", corrupt)
    code, report = bench(tiny)
    assert code == 1
    assert report["outputs_match"] == pytest.approx(0.5)
    assert [m["index"] for m in report["mismatches"]] == [2, 3] and report["mismatches"][0]["position"] == 0
    err = capsys.readouterr().err
    assert "MISMATCH prompt index 2" in err and "first differ at output position 0" in err
    assert "losslessness bug" in err


def test_without_a_draft_reports_plain_decoding(tiny, capsys) -> None:
    code, report = bench(tiny, draft=False)
    assert code == 0
    assert report["baseline_tokens_per_s"] > 0
    assert (report["dflash_tokens_per_s"] is None and report["speedup"] is None
            and report["outputs_match"] is None)
    assert any("no DFlash draft" in n for n in report["notes"])
    code, _ = bench(tiny, "--baseline", "none", draft=False, name="none")
    assert code == 2 and "--draft-model-path" in capsys.readouterr().err


def test_hf_baseline_row(tiny) -> None:
    code, report = bench(tiny, "--baseline", "hf", "--num-prompts", "2")
    assert code == 0 and report["num_prompts"] == 2
    assert report["baseline"] == "hf" and report["baseline_tokens_per_s"] == report["hf_tokens_per_s"] > 0
    assert (report["ar_tokens_per_s"] > 0 and report["speedup_vs_ar"] > 0
            and report["speedup"] == report["speedup_vs_hf"])
    assert report["ar_speedup_vs_hf"] > 0 and report["ar_speedup_vs_hf_median"] > 0
    assert report["outputs_match"] == 1.0 and report["hf_outputs_match"] is not None
    assert report["per_prompt"][0]["hf_tpot_ms"] > 0


def test_prefill_lengths_time_the_first_token_of_long_prompts(tiny, capsys) -> None:
    code, report = bench(tiny, "--baseline", "hf", "--num-prompts", "1", "--prefill-lengths", "60,30",
                         name="prefill")
    assert code == 0 and report["cpu_activations"] is None and report["draft_quantization"] is None
    assert [row["prompt_tokens"] for row in report["prefill"]] == [30, 60]
    for row in report["prefill"]:
        assert row["median_ttft_s"].keys() == {"ar", "hf", "dflash"} and row["repetitions"] == 3
        assert all(len(times) == 3 and min(times) > 0 for times in row["ttft_s"].values())
        assert row["ar_ttft_ratio_to_hf"] == pytest.approx(row["median_ttft_s"]["ar"] /
                                                          row["median_ttft_s"]["hf"], rel=0.01)
    assert "time to first token" in capsys.readouterr().out
    code, _ = bench(tiny, "--max-model-len", "64", "--prefill-lengths", "64", name="too-long")
    assert code == 2 and "raise --max-model-len" in capsys.readouterr().err


def test_sweep_block_sizes(tiny, capsys) -> None:
    plot = tiny["root"] / "sweep.png"
    code, report = bench(tiny, "--sweep-block-sizes", "2,4,8", "--num-prompts", "2", "--plot", str(plot))
    assert code == 0
    assert [e["block_size"] for e in report["sweep"]] == [2, 4, 8]
    for entry in report["sweep"]:
        assert len(entry["accept_length_histogram"]) == entry["block_size"] and entry["outputs_match"] == 1.0
    assert plot.is_file()
    table = capsys.readouterr().out
    assert all(f"dflash B={b}" in table for b in (2, 4, 8))


def test_sweep_tree_budgets(tiny, capsys) -> None:
    plot = tiny["root"] / "trees.png"
    code, report = bench(tiny, "--sweep-tree-budgets", "0,3,9", "--num-prompts", "2", "--plot", str(plot))
    assert code == 0
    assert [(e["block_size"], e["tree_budget"]) for e in report["sweep"]] == [(4, 0), (4, 3), (4, 9)]
    for entry in report["sweep"]:
        assert entry["outputs_match"] == 1.0
        assert entry["num_tree_steps"] == (entry["num_verify_steps"] if entry["tree_budget"] else 0)
    assert plot.is_file()
    table = capsys.readouterr().out
    assert all(name in table for name in ("dflash B=4 ", "dflash B=4 N=3", "dflash B=4 N=9"))
    code, _ = bench(tiny, "--sweep-tree-budgets", "0,3", "--sweep-block-sizes", "2,4")
    assert code != 0


def test_multi_turn_and_sampling(tiny) -> None:
    code, report = bench(tiny, "--multi-turn", "--num-prompts", "2")
    assert code == 0 and report["num_samples"] == 4 and report["outputs_match"] == 1.0
    assert [r["turn"] for r in report["per_prompt"]] == [1, 2, 1, 2]
    code, report = bench(tiny, "--temperature", "0.8", "--num-prompts", "2", "--seed", "3")
    assert code == 0 and report["outputs_match"] is None and report["temperature"] == 0.8
    assert report["mean_accept_length"] >= 1.0
