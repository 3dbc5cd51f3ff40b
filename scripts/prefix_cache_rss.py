"""Resident memory with the prefix cache full at the default KV budget (every slot an entry near the
context length), on the embedded default (its GGUF blocks and shipped draft).

Usage: python scripts/prefix_cache_rss.py [--slots 16] [--max-model-len 4096] [--threads 2]
The default budget lets every slot hold a full context, so a full cache is every slot's slab filled: the
requests share one long reference text (prefilled once, then copied into each request's slot) and end
differently, so each leaves its own entry. Prints peak and current RSS (/proc/self/status), the entries,
their tokens and bytes, and what the slabs take per token.
"""

from __future__ import annotations

import argparse
import json
import time

from blockspec import LLM, SamplingParams
from blockspec.bench.prefix import system_prompt


def rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split(f"{field}:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int, default=16,
                        help="--max-running-requests (serve's default: 16)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the LLM's (4096)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=args.slots, max_model_len=args.max_model_len, threads=args.threads)
    loaded = rss_mb("VmRSS")
    room = llm.max_model_len - args.max_new_tokens - 16
    shared = llm.tokenizer.encode(system_prompt(llm, room))[: room]
    prompts = [shared + llm.tokenizer.encode(f" Request {i}.") for i in range(args.slots)]
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_new_tokens))
    seconds = time.perf_counter() - start
    cache = llm.runner.prefix_cache
    print(json.dumps({
        "slots": args.slots, "max_model_len": llm.max_model_len,
        "budget_tokens": llm.scheduler().max_total_tokens,
        "prompt_tokens": [len(p) for p in prompts[:1]], "cached_tokens": [o.cached_tokens for o in outs],
        "seconds": round(seconds, 1), "entries": len(cache.entries), "entry_tokens": cache.tokens,
        "entry_mb": round(cache.nbytes / 2**20, 1), "kv_bytes_per_token": cache.bytes_per_token,
        "rss_after_load_mb": round(loaded), "rss_mb": round(rss_mb("VmRSS")),
        "peak_rss_mb": round(rss_mb("VmHWM")),
    }))


if __name__ == "__main__":
    main()
