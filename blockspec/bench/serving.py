"""Output tokens/s against concurrency, DFlash and plain decoding on the same engine (`blockspec
bench-serving`; serving_command.py runs it).

A closed loop per (method, concurrency): `concurrency` requests are kept in the continuous-batching
scheduler at all times (a finished request is replaced by the next prompt at once) until every
prompt is done; throughput = all output tokens / wall time, prefill included. The engine runs in
process (no HTTP), so the figures are the engine's, not the network's. Prompts are the first turns
of a real prompt set through the target's chat template.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque

from blockspec.engine.stats import RequestStats
from blockspec.sampling_params import SamplingParams


def closed_loop(llm, prompts: list[list[int]], params: SamplingParams, concurrency: int,
                algorithm: str, prefix_caching: bool | None = None) -> tuple[dict, list[list[int]]]:
    """`prefix_caching` False: a scheduler that neither reuses nor keeps computed prefixes."""
    scheduler = llm.scheduler(algorithm, prefix_caching)
    todo, seqs, in_flight, steps = deque(prompts), [], 0, 0
    start = time.perf_counter()
    while todo or scheduler.has_work:
        while todo and in_flight < concurrency:
            seq = llm.sequence(todo.popleft(), params)
            scheduler.add(seq)
            seqs.append(seq)
            in_flight += 1
        in_flight -= sum(1 for s in scheduler.step() if s.finished)
        steps += 1
    elapsed = time.perf_counter() - start
    tokens = sum(len(s.output_ids) for s in seqs)
    stats = RequestStats.pooled(s.stats for s in seqs)
    lookup_tau = stats.lookup_mean_accept_length
    ttfts = [s.first_token_time - s.arrival_time for s in seqs]
    prompt_tokens = sum(len(s.prompt_ids) for s in seqs)
    cached = sum(min(s.cached_tokens, len(s.prompt_ids)) for s in seqs)
    row = {
        "method": algorithm, "concurrency": concurrency, "num_requests": len(seqs),
        "output_tokens": tokens, "wall_s": round(elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 2),
        "mean_accept_length": (round(stats.mean_accept_length, 3)
                               if algorithm == "DFLASH" and stats.accept_lengths else None),
        "plain_steps": stats.plain_steps,  # adaptive speculation's (row-)steps without a draft
        # prompt-lookup (row-)steps, not in mean_accept_length
        "lookup_steps": len(stats.lookup_accept_lengths),
        "lookup_mean_accept_length": round(lookup_tau, 3) if lookup_tau is not None else None,
        "merged_steps": len(stats.merged_accept_lengths),  # copy + draft candidates as one tree, apart too
        "mean_ttft_s": round(statistics.fmean(ttfts), 3), "median_ttft_s": round(statistics.median(ttfts), 3),
        "mean_latency_s": round(sum(s.finish_time - s.arrival_time for s in seqs) / len(seqs), 3),
        "steps": steps, "preemptions": scheduler.num_preemptions,
        # prompt tokens whose K/V the prefix cache held (not prefilled), and their share
        "prompt_tokens": prompt_tokens, "cached_tokens": cached, "hit_rate": round(cached / prompt_tokens, 4),
    }
    return row, [s.output_ids for s in seqs]


def sweep(llm, prompts_meta: list, params: SamplingParams, levels: list[int]) -> list[dict]:
    """Every method at every concurrency level, interleaved level by level; a row each (and a table on
    stderr)."""
    chat = llm.tokenizer.chat_template is not None
    prompts = [llm.tokenizer.encode(
                   llm.tokenizer.apply_chat_template([{"role": "user", "content": p.turns[0]}])
                   if chat else p.turns[0])
               for p in prompts_meta]
    methods = ["NONE"] + (["DFLASH"] if llm.draft is not None else [])
    for algorithm in methods:  # warm-up: first calls pay for allocation and kernel selection
        closed_loop(llm, prompts[:1], SamplingParams(max_tokens=4), 1, algorithm)
    rows = []
    print(f"{'method':<8}{'conc':>5}{'tok/s':>10}{'tau':>7}{'TTFT s':>9}{'latency s':>11}{'match':>7}",
          file=sys.stderr)
    for level in levels:
        outputs = {}
        for algorithm in methods:
            llm.clear_prefix_cache()  # each run starts cold: the other method's prefixes are not handed on
            row, outputs[algorithm] = closed_loop(llm, prompts, params, level, algorithm)
            if algorithm == "DFLASH" and params.greedy:
                row["outputs_match"] = (sum(a == b for a, b in zip(outputs["DFLASH"], outputs["NONE"]))
                                        / len(prompts))
            rows.append(row)
            tau = f"{row['mean_accept_length']:.2f}" if row["mean_accept_length"] else "-"
            match = f"{row['outputs_match']:.2f}" if "outputs_match" in row else "-"
            print(f"{row['method']:<8}{level:>5}{row['output_tokens_per_s']:>10.1f}{tau:>7}"
                  f"{row['mean_ttft_s']:>9.2f}{row['mean_latency_s']:>11.2f}{match:>7}",
                  file=sys.stderr, flush=True)
    return rows


