"""`blockspec bench-serving`: output tokens/s against concurrency, DFlash and plain decoding on the same
engine.

A closed loop per (method, concurrency): `concurrency` requests are kept in the continuous-batching
scheduler at all times (a finished request is replaced by the next prompt at once) until every
prompt is done; throughput = all output tokens / wall time, prefill included. The engine runs in
process (no HTTP), so the figures are the engine's, not the network's. Prompts are the first turns
of a real prompt set through the target's chat template.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque

from blockspec.config import EngineConfig
from blockspec.engine.stats import RequestStats
from blockspec.errors import BlockspecError
from blockspec.paths import check_output_file
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


def run_bench_serving(args: argparse.Namespace) -> None:
    from blockspec.bench.datasets import load_dataset, select_subset
    from blockspec.bench.report import machine_info
    from blockspec.llm import LLM

    try:
        levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError as exc:
        raise BlockspecError(f"--concurrency={args.concurrency!r} must be a comma-separated list of "
                             f"integers.") from exc
    if not levels or levels[0] < 1:
        raise BlockspecError(f"--concurrency={args.concurrency!r} must list integers >= 1.")
    if args.multi_turn and args.shared_prefix:
        raise BlockspecError("--multi-turn and --shared-prefix are two benchmarks: run one at a time.")
    if args.shared_prefix is not None and args.shared_prefix < 1:
        raise BlockspecError(f"--shared-prefix={args.shared_prefix} must be a number of tokens >= 1.")
    # multi-turn: a slot for turn 2 without the cache while turn 1's entry waits in another
    slots = max(2, args.max_num_seqs or 2) if args.multi_turn else args.max_num_seqs or levels[-1]
    config = EngineConfig.from_args(args, max_num_seqs=slots)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    if args.json:
        check_output_file(args.json, "json")
    dataset = load_dataset(args.dataset)
    prompts_meta, note = select_subset(dataset, args.num_prompts, seed=0)
    if note:
        print(note, file=sys.stderr)
    llm = LLM(config)
    if args.multi_turn or args.shared_prefix:
        from blockspec.bench.prefix import run_multi_turn, run_shared_prefix

        algorithm = llm.speculative_algorithm
        report = (run_multi_turn(llm, prompts_meta, params, algorithm) if args.multi_turn else
                  run_shared_prefix(llm, list(dataset.prompts), args.num_prompts, args.shared_prefix, params,
                                    levels, algorithm))
        return finish(args, {"dataset": args.dataset, "speculative_algorithm": algorithm,
                             "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                             "block_size": llm.block_size, "max_running_requests": config.max_num_seqs,
                             "max_total_tokens": config.max_total_tokens, **report,
                             "machine": machine_info(llm.device, llm.dtype)})
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
    finish(args, {
        "dataset": args.dataset, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "block_size": llm.block_size,
        "max_running_requests": config.max_num_seqs,
        "max_total_tokens": config.max_total_tokens, "rows": rows,
        "machine": machine_info(llm.device, llm.dtype),
    })


def finish(args: argparse.Namespace, report: dict) -> None:
    """Write the report (--json) and print its summary on stdout."""
    from blockspec.bench.report import now_utc

    report = {**report, "date": now_utc(), "command": " ".join(["blockspec"] + sys.argv[1:])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "per_conversation"}))
