"""`blockspec bench-serving`: its flags checked before the engine loads, then the benchmark asked for (the
throughput sweep: serving.py; the prefix cache's: prefix.py) and its report (--json, and a summary on
stdout)."""

from __future__ import annotations

import argparse
import json
import sys

from blockspec.config import EngineConfig
from blockspec.errors import BlockspecError
from blockspec.paths import check_output_file
from blockspec.sampling_params import SamplingParams


def run_bench_serving(args: argparse.Namespace) -> None:
    from blockspec.bench.datasets import load_dataset, select_subset
    from blockspec.bench.machine import machine_info
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
    from blockspec.bench.serving import sweep

    rows = sweep(llm, prompts_meta, params, levels)
    finish(args, {
        "dataset": args.dataset, "num_prompts": len(prompts_meta), "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature, "block_size": llm.block_size,
        "max_running_requests": config.max_num_seqs,
        "max_total_tokens": config.max_total_tokens, "rows": rows,
        "machine": machine_info(llm.device, llm.dtype),
    })


def finish(args: argparse.Namespace, report: dict) -> None:
    """Write the report (--json) and print its summary on stdout."""
    from blockspec.bench.machine import now_utc

    report = {**report, "date": now_utc(), "command": " ".join(["blockspec"] + sys.argv[1:])}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "per_conversation"}))
