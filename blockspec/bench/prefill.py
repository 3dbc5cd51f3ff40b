"""`blockspec bench --prefill-lengths 500,2000`: time to first token on long prompts, every method on the
same prompt token ids, interleaved.

A prompt of N tokens is N tokens of reference text (HumanEval's problems one after another, starting from a
different problem at each repetition, so no run meets a prompt another has seen). Every method generates
one token from it: plain decoding, DFlash (whose first token also waits for the draft's context injection)
and a peer (llama.cpp, transformers) on the same ids. The method order rotates from repetition to
repetition; each length reports every method's median and the ratios of our plain decoding's median to the
peers'.
"""

from __future__ import annotations

import statistics
import sys

from blockspec.bench.datasets import load_humaneval
from blockspec.bench.runner import PEERS, Method
from blockspec.errors import BlockspecError
from blockspec.sampling_params import SamplingParams

REPETITIONS = 3


def prefill_prompts(llm, length: int, repetitions: int) -> list[list[int]]:
    """`repetitions` prompts of exactly `length` token ids, each from its own starting problem."""
    problems = [p.turns[0] for p in load_humaneval().prompts]
    prompts = []
    for rep in range(repetitions):
        start = rep * len(problems) // repetitions
        ids = llm.tokenizer.encode("\n\n".join(problems[start:] + problems[:start]))
        if len(ids) < length:
            raise BlockspecError(f"--prefill-lengths {length}: the reference text holds only {len(ids)} "
                                 f"tokens; ask for {len(ids)} or fewer.")
        prompts.append(ids[:length])
    return prompts


def check_lengths(lengths: list[int], max_model_len: int) -> None:
    too_long = [n for n in lengths if n + 1 > max_model_len]
    if too_long:
        raise BlockspecError(f"--prefill-lengths {too_long[0]}: a prompt and its first token need "
                             f"{too_long[0] + 1} positions, over --max-model-len {max_model_len}; raise "
                             f"--max-model-len or ask for a shorter prompt.")


def run_prefill(llm, methods: list[Method], lengths: list[int], repetitions: int = REPETITIONS,
                progress: bool = True) -> list[dict]:
    """One row per length (each checked first: `check_lengths`): every method's times to first token,
    their medians, and plain decoding's median over each peer's."""
    from tqdm.auto import tqdm

    one_token = SamplingParams(max_tokens=1)
    warm = prefill_prompts(llm, min(lengths), 1)[0]
    for method in methods:  # uncounted: the first long prompt pays for allocation
        method.run(warm, one_token)
    rows = []
    bar = tqdm(total=len(lengths) * repetitions * len(methods), desc="prefill", unit="run", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    try:
        for length in lengths:
            times: dict[str, list[float]] = {m.name: [] for m in methods}
            for rep, ids in enumerate(prefill_prompts(llm, length, repetitions)):
                for method in methods[rep % len(methods):] + methods[:rep % len(methods)]:
                    times[method.name].append(round(method.run(ids, one_token).time_to_first_token_s, 4))
                    bar.update(1)
            medians = {name: round(statistics.median(t), 4) for name, t in times.items()}
            row = {"prompt_tokens": length, "repetitions": repetitions, "median_ttft_s": medians,
                   "ttft_s": times}
            for peer in PEERS:
                if peer in medians and "ar" in medians:
                    row[f"ar_ttft_ratio_to_{peer}"] = round(medians["ar"] / medians[peer], 3)
            rows.append(row)
    finally:
        bar.close()
    return rows


def print_prefill(rows: list[dict], out=None) -> None:
    out = out or sys.stdout
    names = list(rows[0]["median_ttft_s"])
    print("\ntime to first token (median s, prompt of N tokens, one new token):", file=out)
    print(f"{'N':>7}" + "".join(f"{name:>14}" for name in names), file=out)
    for row in rows:
        print(f"{row['prompt_tokens']:>7}" + "".join(f"{row['median_ttft_s'][n]:>14.3f}" for n in names),
              file=out)
