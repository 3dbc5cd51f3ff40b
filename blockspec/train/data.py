"""Training data for DFlash drafts: offline corpora and on-policy target responses, as token sequences.

Sources (`--data`, a comma list):
  stdlib       CPython standard-library .py files (tests and held-out modules excluded)
  pydoc        Debian python3.11-doc reStructuredText sources (skipped with a warning if absent)
  responses:N  N greedy responses of the target itself to prompts built offline (train/prompts.py:
               stdlib code tasks, docstring stubs, writing, role-play, explanations, arithmetic,
               extraction, specific multi-constraint requests), generated with the engine's batched
               `LLM.generate` and cached on disk
  PATH.jsonl   one object per line: {"text": ...} or {"token_ids": [...]}
Each source has a held-out split (stdlib/pydoc: the json and email modules and their docs;
responses: prompts from held-out topics and those modules; jsonl: every 50th line) used only for
the held-out tau estimate. Benchmark prompts (HumanEval, MT-Bench) are never used.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from blockspec.errors import BlockspecError, setting
from blockspec.train.prompts import response_prompts

log = logging.getLogger("blockspec.train")

HELDOUT_MODULES = ("json", "email")
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "_bundled"}
PYDOC_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
MIN_TOKENS = 32  # shorter documents (or window tails) are dropped
JSONL_HELDOUT_EVERY = 50


@dataclass(frozen=True)
class TrainSequence:
    ids: list[int]
    start: int  # first position that may be an anchor (1 for corpora, the response start otherwise)
    on_policy: bool  # labels are the sequence's own next tokens from `start` on (target's greedy output)


@dataclass(frozen=True)
class DataSpec:
    sources: tuple[str, ...]  # normalized: "stdlib", "pydoc", "responses:N", absolute .jsonl paths

    @classmethod
    def parse(cls, text: str) -> "DataSpec":
        out: list[str] = []
        for item in (s.strip() for s in text.split(",")):
            if item in ("stdlib", "pydoc"):
                out.append(item)
            elif item.startswith("responses:"):
                n = item.split(":", 1)[1]
                if not n.isdigit() or int(n) < 1:
                    raise BlockspecError(f"{setting('data')}={item!r}: responses:N needs a positive integer "
                                         f"N, e.g. responses:200.")
                out.append(f"responses:{int(n)}")
            elif item.endswith(".jsonl"):
                path = Path(item).expanduser().resolve()
                if not path.is_file():
                    raise BlockspecError(f"{setting('data')}={item!r}: file {path} does not exist.")
                out.append(str(path))
            else:
                raise BlockspecError(
                    f"{setting('data')}={text!r}: unknown source {item!r}. Use a comma list of: stdlib, "
                    f"pydoc, responses:N, or a path to a .jsonl file of {{\"text\": ...}} lines.")
        if not out:
            raise BlockspecError(f"{setting('data')} is empty; use e.g. stdlib,pydoc,responses:200.")
        return cls(tuple(out))

    @property
    def num_responses(self) -> int:
        return sum(int(s.split(":")[1]) for s in self.sources if s.startswith("responses:"))


def stdlib_files(heldout: bool, root: Path | None = None) -> list[Path]:
    """Non-test stdlib .py files, sorted; `heldout` selects the held-out modules instead of the rest."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]  # prune: never descend into tests or site-packages
        for name in files:
            path = Path(folder) / name
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            module = path.relative_to(root).parts[0].removesuffix(".py")
            if (module in HELDOUT_MODULES) == heldout:
                out.append(path)
    return sorted(out)


def pydoc_files(heldout: bool) -> list[Path]:
    if not PYDOC_ROOT.is_dir():
        log.warning("--data pydoc: %s is missing; skipping it (apt-get install python3.11-doc provides it).",
                    PYDOC_ROOT)
        return []
    out = []
    for path in sorted(PYDOC_ROOT.rglob("*.rst.txt")):
        name = path.name.removesuffix(".rst.txt")
        if any(name == m or name.startswith(m + ".") for m in HELDOUT_MODULES) == heldout:
            out.append(path)
    return out


def windows(ids: list[int], seq_len: int) -> Iterator[TrainSequence]:
    """Split one document into seq_len windows; a tail shorter than MIN_TOKENS is dropped."""
    for i in range(0, len(ids), seq_len):
        chunk = ids[i : i + seq_len]
        if len(chunk) >= MIN_TOKENS:
            yield TrainSequence(chunk, 1, False)


def _text_files(files: list[Path], tokenizer, seq_len: int, seed: int) -> Iterator[TrainSequence]:
    files = list(files)
    random.Random(seed).shuffle(files)
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        yield from windows(tokenizer.encode(text), seq_len)


def _jsonl(path: Path, heldout: bool, tokenizer, seq_len: int) -> Iterator[TrainSequence]:
    with path.open(encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip() or ((index % JSONL_HELDOUT_EVERY) == JSONL_HELDOUT_EVERY - 1) != heldout:
                continue
            try:
                row = json.loads(line)
                if "token_ids" not in row and tokenizer is None:
                    raise BlockspecError(f"{path}:{index + 1}: a \"text\" line needs the target's "
                                         f"tokenizer.json, which is missing; use \"token_ids\" lines "
                                         f"instead.")
                ids = row["token_ids"] if "token_ids" in row else tokenizer.encode(row["text"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise BlockspecError(f"{path}:{index + 1}: expected an object with \"text\" (a string) or "
                                     f"\"token_ids\" (a list of ints): {exc}") from exc
            yield from windows([int(t) for t in ids], seq_len)


def ensure_responses(
    cache: Path, target_path: Path, count: int, heldout: bool, seq_len: int, response_tokens: int,
    seed: int, device: str | torch.device, dtype: str, batch_size: int,
) -> list[dict]:
    """Generate (or load from `cache`, a .jsonl file appended chunk by chunk, so an interrupted run
    resumes) `count` greedy target responses: [{"prompt_ids": [...], "output_ids": [...]}, ...]."""
    done = _read_rows(cache)
    if len(done) >= count:
        return done[:count]
    from blockspec.llm import LLM
    from blockspec.sampling_params import SamplingParams

    llm = LLM(model_path=str(target_path), speculative_algorithm="NONE", device=device, dtype=dtype,
              max_num_seqs=batch_size, max_model_len=seq_len)
    budget = seq_len - response_tokens
    answered = {tuple(row["prompt_ids"]) for row in done}  # a larger count draws a different prompt list
    texts = iter(response_prompts(count * 2, heldout, seed, stdlib_files(heldout), pydoc_files(heldout)))

    def next_prompts(want: int) -> list[list[int]]:
        """Encoded lazily, chunk by chunk, so generation starts at once however many are asked for."""
        out: list[list[int]] = []
        for text in texts:
            ids = llm.tokenizer.encode(
                llm.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
            if len(ids) <= budget and tuple(ids) not in answered:  # some get dropped for length
                answered.add(tuple(ids))
                out.append(ids)
                if len(out) == want:
                    break
        return out

    params = SamplingParams(max_tokens=response_tokens, temperature=0.0)
    cache.parent.mkdir(parents=True, exist_ok=True)
    split = "held-out" if heldout else "train"
    chunk_size = batch_size * 4
    with tqdm(total=count, initial=len(done), desc=f"on-policy responses ({split})", unit="resp") as bar, \
            cache.open("a") as f:
        while len(done) < count:
            chunk = next_prompts(min(count - len(done), chunk_size))
            if not chunk:
                raise BlockspecError(f"Only {len(done)} of {count} response prompts fit "
                                     f"--seq-len {seq_len} with --response-tokens {response_tokens}; "
                                     f"raise --seq-len or lower --response-tokens.")
            for out in llm.generate(chunk, params, speculative_algorithm="NONE"):
                row = {"prompt_ids": out.prompt_token_ids, "output_ids": out.token_ids}
                f.write(json.dumps(row) + "\n")
                done.append(row)
            f.flush()
            bar.update(len(chunk))
    return done[:count]


def _read_rows(cache: Path) -> list[dict]:
    """The cached responses. A run killed mid-write leaves a partial last line: it is cut off (and
    generated again), so the cache stays appendable."""
    if not cache.is_file():
        return []
    text = cache.read_text()
    lines = text.splitlines()
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise BlockspecError(f"{cache} line {i + 1} is not JSON: delete the file to generate "
                                     f"the responses again.") from None
            log.warning("%s: dropping a partial last line (an interrupted run)", cache)
            with cache.open("r+") as f:
                f.truncate(len("".join(line + "\n" for line in lines[:i]).encode()))
    return rows


def _responses(rows: list[dict]) -> Iterator[TrainSequence]:
    for row in rows:
        ids = row["prompt_ids"] + row["output_ids"]
        if len(row["output_ids"]) >= 2:
            yield TrainSequence(ids, len(row["prompt_ids"]), True)


def source_sequences(
    source: str, tokenizer, seq_len: int, seed: int, heldout: bool, responses: dict[str, list[dict]],
) -> Iterator[TrainSequence]:
    """The sequences of one source (a DataSpec entry) for one split, in a fixed order. `responses` maps
    each "responses:N" source to its generated rows (see `ensure_responses`)."""
    if source in ("stdlib", "pydoc"):
        files = stdlib_files(heldout) if source == "stdlib" else pydoc_files(heldout)
        return _text_files(files, tokenizer, seq_len, seed)
    if source.startswith("responses:"):
        return _responses(responses[source])
    return _jsonl(Path(source), heldout, tokenizer, seq_len)
