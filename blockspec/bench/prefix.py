"""`blockspec bench-serving --multi-turn` and `--shared-prefix N`: what the prefix cache saves, measured
against no cache in the same run, on the same engine.

--multi-turn: two-turn conversations (MT-Bench's 80, or a PATH.jsonl's with two turns or more), one at a
time. Turn 1 runs; turn 2 is sent with turn 1's real answer (through the chat template), once through a
scheduler that reuses computed prefixes and once through one that does not, which of the two goes first
alternating conversation by conversation. Reported: turn 2's time to first token both ways (median and
per conversation) and their ratio, the prompt tokens the cache held, tau both ways, and whether turn 2's
tokens are the same both ways on every conversation.

--shared-prefix N: every request is one system prompt of N tokens (reference text: HumanEval's problems)
and one question (the dataset's --num-prompts shortest first turns). At each concurrency a closed loop
(`serving.closed_loop`) runs with the cache, cold (emptied first), and one without, the order
alternating level by level. Reported per run: throughput, median TTFT, hit rate (prompt tokens the cache
held / prompt tokens) and, greedy, whether the outputs match.
"""

from __future__ import annotations

import statistics
import sys

from blockspec.bench.datasets import BenchPrompt, load_humaneval
from blockspec.bench.serving import closed_loop
from blockspec.engine.prefix_cache import common_prefix
from blockspec.engine.scheduler import run_to_completion
from blockspec.engine.sequence import Sequence
from blockspec.engine.stats import RequestStats
from blockspec.errors import BlockspecError
from blockspec.sampling_params import SamplingParams

SYSTEM_PREAMBLE = ("You are a Python tutor. Answer the user's question briefly. Reference material from "
                   "the course follows.\n\n")


def one_request(llm, ids: list[int], params: SamplingParams, algorithm: str, cache: bool) -> Sequence:
    seq = llm.sequence(ids, params)
    run_to_completion(llm.scheduler(algorithm, prefix_caching=cache), [seq])
    if seq.finish_reason == "error":
        raise BlockspecError(f"a benchmark request failed: {seq.error}")
    return seq


def chat_ids(llm, messages: list[dict]) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def ttft(seq: Sequence) -> float:
    return seq.first_token_time - seq.arrival_time


def run_multi_turn(llm, conversations: list[BenchPrompt], params: SamplingParams, algorithm: str) -> dict:
    short = [c.source_id for c in conversations if len(c.turns) < 2]
    if short:
        raise BlockspecError(f"--multi-turn needs conversations of two turns or more; {len(short)} have one "
                             f"(first: {short[0]}). Use --dataset mt-bench or a PATH.jsonl with two turns.")
    warm = chat_ids(llm, [{"role": "user", "content": conversations[0].turns[0]}])
    for cache in (True, False):  # uncounted: first calls pay for allocation and kernel selection
        one_request(llm, warm, SamplingParams(max_tokens=4), algorithm, cache)
    llm.clear_prefix_cache()
    rows, stats = [], {True: [], False: []}
    for i, conversation in enumerate(conversations):
        messages = [{"role": "user", "content": conversation.turns[0]}]
        first = one_request(llm, chat_ids(llm, messages), params, algorithm, True)
        messages += [{"role": "assistant", "content": llm.tokenizer.decode(first.output_ids)},
                     {"role": "user", "content": conversation.turns[1]}]
        ids = chat_ids(llm, messages)
        runs = {cache: one_request(llm, ids, params, algorithm, cache)
                for cache in ((True, False) if i % 2 == 0 else (False, True))}
        for cache, seq in runs.items():
            stats[cache].append(seq.stats)
        rows.append({"index": conversation.index, "id": conversation.source_id,
                     "turn2_prompt_tokens": len(ids), "cached_tokens": runs[True].cached_tokens,
                     "ttft_cached_s": round(ttft(runs[True]), 4),
                     "ttft_uncached_s": round(ttft(runs[False]), 4),
                     "outputs_match": runs[True].output_ids == runs[False].output_ids})
        print(f"  {i + 1}/{len(conversations)} {conversation.source_id}: turn 2 {len(ids)} tokens, "
              f"{runs[True].cached_tokens} cached, TTFT {ttft(runs[True]):.3f} s vs "
              f"{ttft(runs[False]):.3f} s", file=sys.stderr, flush=True)
    cached, uncached = (statistics.median(r[key] for r in rows)
                        for key in ("ttft_cached_s", "ttft_uncached_s"))
    taus = {cache: RequestStats.pooled(stats[cache]).mean_accept_length for cache in (True, False)}
    return {
        "mode": "multi-turn", "num_conversations": len(rows),
        "turn2_median_ttft_cached_s": round(cached, 4), "turn2_median_ttft_uncached_s": round(uncached, 4),
        "turn2_ttft_ratio": round(uncached / cached, 2) if cached else None,
        "turn2_mean_prompt_tokens": round(statistics.fmean(r["turn2_prompt_tokens"] for r in rows), 1),
        "turn2_mean_cached_tokens": round(statistics.fmean(r["cached_tokens"] for r in rows), 1),
        "turn2_tau_cached": round(taus[True], 3) if taus[True] is not None else None,
        "turn2_tau_uncached": round(taus[False], 3) if taus[False] is not None else None,
        "outputs_match": sum(r["outputs_match"] for r in rows) / len(rows),
        "per_conversation": rows,
    }


def system_prompt(llm, tokens: int) -> str:
    """About `tokens` tokens of real reference text (HumanEval's problems) after a short preamble."""
    text = SYSTEM_PREAMBLE + "\n\n".join(p.turns[0] for p in load_humaneval().prompts)
    ids = llm.tokenizer.encode(text)
    if tokens > len(ids):
        raise BlockspecError(f"--shared-prefix {tokens}: the reference text holds {len(ids)} tokens; ask for "
                             f"fewer.")
    return llm.tokenizer.decode(ids[:tokens])


def run_shared_prefix(llm, questions: list[BenchPrompt], count: int, tokens: int, params: SamplingParams,
                      levels: list[int], algorithm: str) -> dict:
    """`count` questions: the shortest first turns of `questions`."""
    system = system_prompt(llm, tokens)
    shortest = sorted(questions, key=lambda q: (len(q.turns[0]), q.index))[:count]
    prompts = [chat_ids(llm, [{"role": "system", "content": system},
                              {"role": "user", "content": q.turns[0]}]) for q in shortest]
    shared = min(common_prefix(prompts[0], p, len(p)) for p in prompts)
    for cache in (True, False):  # uncounted warm-up
        closed_loop(llm, prompts[:1], SamplingParams(max_tokens=4), 1, algorithm, cache)
    rows = []
    print(f"{'cache':<7}{'conc':>5}{'tok/s':>10}{'TTFT p50 s':>12}{'hit rate':>10}{'match':>7}",
          file=sys.stderr)
    for n, level in enumerate(levels):
        outputs = {}
        for cache in ((True, False) if n % 2 == 0 else (False, True)):
            llm.clear_prefix_cache()  # cold: only what this run computes is reused
            row, outputs[cache] = closed_loop(llm, prompts, params, level, algorithm, cache)
            rows.append({"prefix_caching": cache, **row})
        for row in rows[-2:]:
            if params.greedy:
                same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
                row["outputs_match"] = same / len(prompts)
            match = f"{row['outputs_match']:.2f}" if "outputs_match" in row else "-"
            print(f"{'on' if row['prefix_caching'] else 'off':<7}{level:>5}"
                  f"{row['output_tokens_per_s']:>10.1f}{row['median_ttft_s']:>12.3f}{row['hit_rate']:>10.2f}"
                  f"{match:>7}", file=sys.stderr, flush=True)
    return {"mode": "shared-prefix", "system_prompt_tokens": tokens, "shared_prompt_tokens": shared,
            "num_questions": len(prompts), "rows": rows}

