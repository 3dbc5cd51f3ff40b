"""`blockspec eval-draft`: a draft's offline acceptance per block size, fp32 and block-held side by side on
the same answers (tiny random target + draft)."""

from __future__ import annotations

import json

from blockspec.cli import main
from blockspec.models.config import ModelConfig
from tests.test_bench import write_tokenizer
from tests.tiny import write_tiny_draft, write_tiny_target


def test_fp32_and_block_held_drafts_are_scored_on_the_same_answers(tmp_path, capsys):
    target = write_tiny_target(tmp_path / "target", "llama")
    write_tokenizer(target)
    draft = write_tiny_draft(tmp_path / "draft", ModelConfig.from_folder(target), block_size=4)
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"turns": [f"t{5 + i} t{9 + i} t{13 + i}"]}) for i in range(3)))
    out = tmp_path / "eval.json"
    argv = ["eval-draft", "--model-path", str(target), "--draft-model-path", str(draft), "--dataset",
            str(data), "--block-sizes", "2,4", "--max-new-tokens", "12", "--device", "cpu",
            "--draft-quantization", "none,q8_0", "--json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]["prompts.jsonl"]
    assert set(results) == {f"{draft} (none)", f"{draft} (q8_0)"}
    for row in results.values():
        assert set(row) == {"2", "4"} and all(1.0 <= r["tau"] <= int(b) for b, r in row.items())
        assert row["2"]["blocks"] == results[f"{draft} (none)"]["2"]["blocks"] > 0  # the same anchors
    assert main([*argv[:-4], "--draft-quantization", "q5_0"]) == 2
    assert "each form must be one of none, q8_0" in capsys.readouterr().err
