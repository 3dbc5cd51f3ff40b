"""Tensor parallelism on this machine: decode tokens/s at --tp-size 1 and N, plain decoding and DFlash (the
default set-up: the embedded SmolLM2's GGUF blocks and its shipped draft, adaptive speculation and prompt
lookup on), and the collectives rank 0 issues per engine step (calls and bytes, by kind).

Usage: python scripts/tp_bench.py [--tp-size 2] [--num-prompts 3] [--max-new-tokens 64] [--threads 1]
Each rank runs --threads intra-op threads (TP=1 runs the same count, and again with N x that many).
Prompts: the first turns of HumanEval problems, in the target's chat template, one request at a time.
Each row says whether its tokens equal the first set-up's plain decoding (greedy: they must).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from blockspec import LLM, SamplingParams
from blockspec.bench.datasets import load_dataset, select_subset


def run(llm: LLM, prompts: list[str], algorithm: str, max_new_tokens: int) -> tuple[dict, list]:
    params = SamplingParams(max_tokens=max_new_tokens)
    llm.generate(prompts[0], SamplingParams(max_tokens=4), algorithm)  # warm-up
    before = llm.tp.stats.snapshot() if llm.tp is not None else None
    tokens, seconds, steps, outputs = 0, 0.0, 0, []
    for prompt in prompts:
        out = llm.generate(prompt, params, algorithm)[0]
        outputs.append(out.token_ids)
        tokens, seconds = tokens + len(out.token_ids) - 1, seconds + out.decode_time_s
        stats = out.stats
        steps += len(stats.accept_lengths) + stats.plain_steps + len(stats.lookup_accept_lengths) + 1
    row = {"tp_size": llm.config.tp_size, "threads_per_rank": torch.get_num_threads(), "method": algorithm,
           "decode_tokens_per_s": round(tokens / seconds, 2), "tokens": tokens, "engine_steps": steps}
    if before is not None:
        after = llm.tp.stats.snapshot()
        for key in ("calls", "bytes"):  # per engine step (prefill's one step included)
            row[f"{key}_per_step"] = {kind: round((after[key][kind] - before[key].get(kind, 0)) / steps, 1)
                                      for kind in after[key]}
    return row, outputs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    rows, first = [], {}
    for tp, threads in ((1, args.threads), (1, args.threads * args.tp_size), (args.tp_size, args.threads)):
        llm = LLM(tp_size=tp, threads=threads, max_num_seqs=1)
        subset, _ = select_subset(load_dataset("humaneval"), args.num_prompts, seed=0)
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": item.turns[0]}],
                                                     add_generation_prompt=True)
                   for item in subset]
        for algorithm in ("NONE", "DFLASH"):
            row, outputs = run(llm, prompts, algorithm, args.max_new_tokens)
            row["outputs_equal_tp1_plain"] = outputs == first.setdefault("NONE", outputs)
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
        llm.close()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
