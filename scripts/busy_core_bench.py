"""Decode speed on a quiet machine and with one core kept busy, blockspec and llama.cpp in the same run.

    python scripts/busy_core_bench.py --reps 3 --max-new-tokens 128 [--variants default,threads2,threads1]
        [--busy-cores 1] [--no-llama-cpp] [--json OUT.json]

Every measurement is a fresh process (OpenMP reads its settings when torch loads), the conditions and the
methods alternating within each repetition; a busy core is a spinning Python process the scheduler may
place anywhere (--busy-cores of them). Prints each method's median decode tokens/s quiet and busy and the
slowdown (quiet / busy).
Methods: blockspec's plain decoding and its default (DFlash) set-up, each with the environment of a
variant, and llama.cpp (llama-cpp-python, the `llamacpp` extra) on the same GGUF and prompt.
Variants: default (the CPUs other processes leave free, blockspec/cpu_load.py), threads2 / threads1 (a
fixed --threads 2 / 1), passive (OMP_WAIT_POLICY=PASSIVE: OpenMP workers sleep instead of spinning while
they wait), spin10k (GOMP_SPINCOUNT=10000: they spin less before sleeping).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a Python function that checks whether a number is prime."
VARIANTS = {"default": ({}, []), "threads2": ({}, ["--threads", "2"]),
            "threads1": ({}, ["--threads", "1"]),
            "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--threads", "2"]),
            "spin10k": ({"GOMP_SPINCOUNT": "10000"}, ["--threads", "2"])}


def blockspec_run(algorithm: str, variant: str, tokens: int) -> float:
    env, flags = VARIANTS[variant]
    algo = ["--speculative-algorithm", "NONE"] if algorithm == "plain" else []
    out = subprocess.run([sys.executable, "-m", "blockspec", "generate", "--json", "--max-new-tokens",
                          str(tokens), *algo, *flags, PROMPT], capture_output=True, text=True,
                         env={**os.environ, **env}, check=True)
    return json.loads(out.stdout)["decode_tokens_per_s"]


def llama_cpp_run(tokens: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--llama-cpp-worker", "--max-new-tokens",
                          str(tokens)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def llama_cpp_worker(tokens: int) -> None:
    """One llama.cpp decode of the chat-templated prompt: prints decode tokens/s (first token to last)."""
    from llama_cpp import Llama

    from blockspec.device import allowed_cpus
    from blockspec.models.default_model import ensure_default_model, gguf_path
    from blockspec.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(ensure_default_model(weights=False))
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]))
    threads = allowed_cpus()
    model = Llama(model_path=str(gguf_path()), n_ctx=1024, n_threads=threads, n_threads_batch=threads,
                  seed=0, verbose=False)
    count, first = 0, None
    for token in model.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        first = first or time.perf_counter()
        count += 1
        if count >= tokens or token in tokenizer.eos_token_ids:
            break
    print((count - 1) / (time.perf_counter() - first))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--variants", default="default,threads2,threads1")
    parser.add_argument("--busy-cores", type=int, default=1)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--llama-cpp-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_cpp_worker:
        return llama_cpp_worker(args.max_new_tokens)
    methods = {f"blockspec {algo} ({variant})":
               (lambda a=algo, v=variant: blockspec_run(a, v, args.max_new_tokens))
               for variant in args.variants.split(",") for algo in ("plain", "dflash")}
    if not args.no_llama_cpp:
        methods["llama.cpp"] = lambda: llama_cpp_run(args.max_new_tokens)
    results: dict[str, dict[str, list[float]]] = {m: {"quiet": [], "busy": []} for m in methods}
    for rep in range(args.reps):
        for load in ("quiet", "busy") if rep % 2 == 0 else ("busy", "quiet"):
            spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                        for _ in range(args.busy_cores if load == "busy" else 0)]
            try:
                time.sleep(0.5)
                order = list(methods) if rep % 2 == 0 else list(reversed(methods))
                for name in order:
                    results[name][load].append(methods[name]())
                    print(f"rep {rep} {load:5} {name:32} {results[name][load][-1]:7.1f} tok/s",
                          file=sys.stderr)
            finally:
                for spinner in spinners:
                    spinner.kill()
                    spinner.wait()
    print(f"{'method':34} {'quiet tok/s':>12} {'busy tok/s':>11} {'slowdown':>9}")
    rows = []
    for name, runs in results.items():
        quiet, busy = statistics.median(runs["quiet"]), statistics.median(runs["busy"])
        rows.append({"method": name, "quiet_tokens_per_s": round(quiet, 2),
                     "busy_tokens_per_s": round(busy, 2), "slowdown": round(quiet / busy, 3), "runs": runs})
        print(f"{name:34} {quiet:12.1f} {busy:11.1f} {quiet / busy:8.2f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"max_new_tokens": args.max_new_tokens, "reps": args.reps,
                       "busy_cores": args.busy_cores, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
