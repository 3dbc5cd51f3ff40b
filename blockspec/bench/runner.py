"""The measurement: every prompt through every method, interleaved prompt by prompt in one process.

Timing is decode-only, as in the DFlash paper's benchmark: per prompt, the time from the first output
token (which ends prefill, including the draft's context injection) to the last one, divided by the
tokens after the first (time per output token, TPOT). Methods run one prompt at a time (batch 1), and
their order rotates from prompt to prompt, so machine drift and cache warmth hit all of them equally.
Prompt 0 of the subset is run once through every method first as a warm-up and not counted.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from blockspec.bench.datasets import BenchPrompt
from blockspec.engine.stats import RequestStats
from blockspec.errors import BlockspecError
from blockspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from blockspec.llm import LLM


PEERS = {"hf": "transformers generate", "llama.cpp": "llama.cpp"}  # other engines `bench` can time


@dataclass
class RunStats:
    """One method on one prompt turn."""

    token_ids: list[int]
    text: str
    time_to_first_token_s: float
    decode_time_s: float
    stats: RequestStats = field(default_factory=RequestStats)  # DFlash runs only

    @property
    def tpot_s(self) -> float | None:
        """Decode time per output token after the first; None when fewer than 2 tokens came out."""
        n = len(self.token_ids) - 1
        return self.decode_time_s / n if n > 0 and self.decode_time_s > 0 else None


@dataclass
class Sample:
    """One timed prompt turn: the same conversation turn through every method."""

    index: int  # dataset index of the prompt
    source_id: str
    turn: int  # 0-based
    num_prompt_tokens: int
    runs: dict[str, RunStats] = field(default_factory=dict)


class Method(Protocol):
    name: str

    def run(self, prompt_ids: list[int], params: SamplingParams) -> RunStats: ...


@dataclass
class EngineMethod:
    """Our engine: plain decoding ("NONE") or DFlash at a given block size and tree budget, on the same
    weights."""

    llm: LLM
    name: str
    algorithm: str  # "NONE" or "DFLASH"
    block_size: int | None = None  # DFlash only: set on the runner before each call (block-size sweep)
    tree_budget: int | None = None  # DFlash only: likewise (tree-budget sweep)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> RunStats:
        if self.block_size is not None:
            self.llm.set_block_size(self.block_size)
        if self.tree_budget is not None:
            self.llm.set_tree_budget(self.tree_budget)
        out = self.llm.generate([prompt_ids], params, speculative_algorithm=self.algorithm)[0]
        stats = out.stats.copy() if self.algorithm == "DFLASH" else RequestStats()
        return RunStats(list(out.token_ids), out.text, out.time_to_first_token_s, out.decode_time_s, stats)


class _TokenClock:
    """A transformers streamer that only records when tokens arrive. `generate` first puts the prompt,
    then each new token; `.tolist()` forces a device sync so the times are real."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.tokens: list[int] = []
        self.end_time: float | None = None

    def put(self, value: torch.Tensor) -> None:
        ids = value.reshape(-1).tolist()
        if self.calls:
            self.tokens.extend(ids)
        self.calls.append(time.perf_counter())

    def end(self) -> None:
        self.end_time = time.perf_counter()


class HFMethod:
    """transformers' own `generate` on the same checkpoint (a peer: what a user would otherwise run).
    Decode-only time is measured with a streamer: from the arrival of the first new token to the end,
    so prefill is excluded exactly as for our engine."""

    name = "hf"

    def __init__(self, llm: LLM) -> None:
        try:
            from transformers import AutoModelForCausalLM, GenerationConfig
        except ImportError as exc:
            raise BlockspecError("--baseline hf needs transformers: pip install transformers.") from exc
        from blockspec.models.default_model import ensure_default_model

        self.llm = llm
        # the embedded model's fp32 weights are converted when first needed (blockspec may run its GGUF)
        folder = llm.model_path if llm.config.model_path else ensure_default_model(weights=True)
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=llm.dtype).to(llm.device).eval()
        self.model.generation_config = GenerationConfig()  # no checkpoint defaults leak into the run
        self.stop_ids = sorted(llm.stop_ids)

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], params: SamplingParams) -> RunStats:
        ids = torch.tensor([prompt_ids], device=self.llm.device)
        clock = _TokenClock()
        kwargs: dict = dict(do_sample=not params.greedy, max_new_tokens=params.max_tokens,
                            eos_token_id=self.stop_ids,
                            pad_token_id=self.stop_ids[0] if self.stop_ids else 0)
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=max(params.top_k, 0))
            if params.seed is not None:
                torch.manual_seed(params.seed)
        start = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=clock, **kwargs)
        first = clock.calls[1] if len(clock.calls) > 1 else clock.end_time
        end = clock.end_time or time.perf_counter()
        text = self.llm.tokenizer.decode(clock.tokens)
        return RunStats(clock.tokens, text, first - start, end - first)


def first_difference(a: list[int], b: list[int]) -> tuple[int, int | None, int | None]:
    """(position, a's token, b's token) of the first difference; None where a list has ended."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n, a[n] if n < len(a) else None, b[n] if n < len(b) else None


def report_mismatch(sample: Sample, dflash: str, reference: str, write: Callable[[str], None]) -> bool:
    """True (and a message on stderr) if a DFlash run's tokens differ from the reference's."""
    a, b = sample.runs[dflash].token_ids, sample.runs[reference].token_ids
    if a == b:
        return False
    pos, x, y = first_difference(a, b)
    write(f"MISMATCH prompt index {sample.index} ({sample.source_id}), turn {sample.turn + 1}: {dflash} and "
          f"{reference} outputs first differ at output position {pos}: "
          f"{dflash} token {x} vs {reference} token {y}")
    return True


def _params(base: SamplingParams, prompt: BenchPrompt, turn: int) -> SamplingParams:
    """Per prompt turn: the same seed for every method (sampled runs are reproducible, not identical)."""
    seed = None if base.greedy else (base.seed or 0) * 100003 + prompt.index * 10 + turn
    return SamplingParams(max_tokens=base.max_tokens, temperature=base.temperature, top_p=base.top_p,
                          top_k=base.top_k, seed=seed)


def _run_conversation(llm: LLM, prompt: BenchPrompt, methods: list[Method], params: SamplingParams,
                      turns: int | None, rotate: int) -> list[Sample]:
    """Each method holds its own conversation: turn k+1 follows that method's own answer to turn k."""
    order = methods[rotate % len(methods):] + methods[: rotate % len(methods)]
    history: dict[str, list[dict]] = {m.name: [] for m in methods}
    samples = []
    for turn, text in enumerate(prompt.turns[:turns]):
        sample = Sample(prompt.index, prompt.source_id, turn, 0)
        for method in order:
            messages = history[method.name] + [{"role": "user", "content": text}]
            ids = llm.tokenizer.encode(
                llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            if method is methods[0]:
                sample.num_prompt_tokens = len(ids)
            stats = method.run(ids, _params(params, prompt, turn))
            sample.runs[method.name] = stats
            history[method.name] = messages + [{"role": "assistant", "content": stats.text}]
        samples.append(sample)
    return samples


def run_bench(
    llm: LLM,
    prompts: list[BenchPrompt],
    methods: list[Method],
    params: SamplingParams,
    multi_turn: bool = False,
    checks: list[tuple[str, str]] | tuple = (),
    progress: bool = True,
) -> list[Sample]:
    """Warm up on prompts[0], then time every prompt turn through every method. `checks` lists
    (dflash method, reference method) pairs whose greedy outputs must be identical; a difference is
    printed to stderr at once."""
    from tqdm.auto import tqdm

    if not prompts:
        raise BlockspecError("No prompts to benchmark.")
    turns = None if multi_turn else 1  # None: every turn
    _run_conversation(llm, prompts[0], methods, params, 1, 0)  # warm-up, not counted
    total = sum(len(p.turns[:turns]) for p in prompts)
    bar = tqdm(total=total, desc="bench", unit="turn", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    samples: list[Sample] = []
    try:
        for i, prompt in enumerate(prompts):
            for sample in _run_conversation(llm, prompt, methods, params, turns, i):
                if params.greedy:
                    for dflash, reference in checks:
                        report_mismatch(sample, dflash, reference, lambda m: tqdm.write(m, file=sys.stderr))
                samples.append(sample)
                bar.set_postfix_str(_postfix(samples, methods))
                bar.update(1)
    finally:
        bar.close()
    return samples


def _postfix(samples: list[Sample], methods: list[Method]) -> str:
    parts = []
    for m in methods:
        tpots = [t for s in samples if (t := s.runs[m.name].tpot_s)]
        if tpots:
            parts.append(f"{m.name} {len(tpots) / sum(tpots):.1f} tok/s")
        steps = [a for s in samples for a in s.runs[m.name].stats.accept_lengths]
        if steps:
            parts.append(f"{m.name} tau {sum(steps) / len(steps):.2f}")
    return ", ".join(parts)
