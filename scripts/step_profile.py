"""Where a DFlash step's time goes, for the chain and for candidate trees of several budgets: the draft pass,
its ranking, tree building, the tree mask, the target's verify pass, the target's choices, acceptance and
the commit (the accepted nodes' K/V moved into place, the draft's context injection).

Usage: PYTHONPATH=. python scripts/step_profile.py [BUDGETS=0,4,8,16,32] [NUM_PROMPTS=5] [DRAFT]
The embedded SmolLM2 and its shipped draft (or DRAFT, e.g. a DFlash2 one) at B=4, HumanEval prompts in
the chat template, 128 new tokens, greedy, every step a DFlash step, no prompt lookup, 2 threads. Times
are wall-clock sums per step; the parts nest (the mask is inside the verify pass).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from blockspec import LLM, SamplingParams
from blockspec.bench.datasets import load_dataset
from blockspec.engine.runner import ModelRunner
from blockspec.layers.embedding import LMHead
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.speculative import decoder

PARTS = [(ModelRunner, "draft_hidden", "draft pass"), (LMHead, "ranked", "ranking (top-k)"),
         (LMHead, "propose", "ranking (argmax)"),
         (LMHead, "logits_over", "DFlash2 candidates (LM head)"),
         (ModelRunner, "draft_lattice", "DFlash2 lattice (draft pass incl.)"),
         (decoder, "build_tree", "tree building"),
         (ForwardBatch, "tree", "tree mask"), (ModelRunner, "target_pass", "verify pass (with the mask)"),
         (ModelRunner, "target_choices", "target choices (LM head)"), (decoder, "accept_trees", "acceptance"),
         (ModelRunner, "keep_paths", "commit: K/V moved"), (ModelRunner, "inject", "commit: injection"),
         (decoder.Decoder, "run", "step")]


def timed(seconds: dict, owner, name: str, part: str) -> None:
    inner = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[part] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    budgets = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "0,4,8,16,32").split(",")]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    draft = {"draft_model_path": sys.argv[3]} if len(sys.argv) > 3 else {}
    prompts = [[{"role": "user", "content": p.turns[0]}] for p in load_dataset("humaneval").prompts[:count]]
    llm = LLM(max_num_seqs=1, max_model_len=2048, adaptive_speculation=False, prompt_lookup_ngram=0,
              block_size=4, speculative_tree_budget=max(budgets), threads=2, **draft)
    seconds: dict[str, float] = defaultdict(float)
    for owner, name, part in PARTS:
        timed(seconds, owner, name, part)
    params = SamplingParams(max_tokens=128)
    llm.chat(prompts[0], params)  # warm-up
    for budget in budgets:
        llm.set_tree_budget(budget)
        seconds.clear()
        steps = tokens = 0
        for prompt in prompts:
            out = llm.chat(prompt, params)[0]
            steps, tokens = steps + len(out.accept_lengths), tokens + sum(out.accept_lengths)
        step = seconds.pop("step")
        print(f"N={budget}: {steps} steps, tau {tokens / steps:.2f}, {1e3 * step / steps:.1f} ms per step, "
              f"{1e3 * step / tokens:.1f} ms per token")
        for part, total in sorted(seconds.items(), key=lambda kv: -kv[1]):
            print(f"  {part:<30}{1e3 * total / steps:7.2f} ms per step")
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += len(llm.chat(prompt, params, speculative_algorithm="NONE")[0].token_ids)
    elapsed = time.perf_counter() - start
    print(f"plain decoding: {1e3 * elapsed / tokens:.1f} ms per token (prefill included)")


if __name__ == "__main__":
    main()
