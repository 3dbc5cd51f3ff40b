"""What merging a copy into the draft's candidates buys and costs: over the same steps, the tokens a merged
tree commits against what the draft's candidates alone and the copy alone would have (`MergedTree.alone`),
and where the time of a merged step and of a copy-alone step goes.

Usage: PYTHONPATH=. python scripts/merged_steps.py [BLOCK_SIZE=2] [TREE_BUDGET=0] [DATASET=humaneval]
    [NUM_PROMPTS=20]
The embedded SmolLM2 and its shipped draft, prompts in the chat template, 128 new tokens, greedy, every step
speculating (no adaptive plain steps), 2 threads: once with every copy merged (--prompt-lookup-merge
always), once with copies alone (never). Step parts are wall-clock ms per step of that kind; they nest (the
target's choices are inside acceptance in a merged step).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import Counter, defaultdict

from blockspec import LLM, SamplingParams
from blockspec.bench.datasets import load_dataset, select_subset
from blockspec.engine.runner import ModelRunner
from blockspec.speculative import decoder

PARTS = [(ModelRunner, "feed_draft", "draft catch-up"), (decoder.Decoder, "propose", "proposals"),
         (ModelRunner, "target_pass", "verify pass"), (ModelRunner, "target_choices", "target choices"),
         (decoder, "accept_trees", "tree acceptance"), (ModelRunner, "keep_paths", "K/V moved"),
         (ModelRunner, "inject", "draft injection")]


def run(merge: str, block: int, budget: int, prompts) -> tuple[dict, Counter, list]:
    llm = LLM(threads=2, max_num_seqs=1, block_size=block, speculative_tree_budget=budget,
              adaptive_speculation=False, prompt_lookup_merge=merge, prefix_caching=False)
    spent, steps, merged_rows, kind = defaultdict(float), Counter(), [], [None]

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if kind[0] is not None:  # prefill passes are not a step's
                    spent[(kind[0], label)] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS]
    for owner, name, label in PARTS:
        timed(owner, name, label)
    step = llm.decoders["DFLASH"].run

    def counted(seqs, plan):
        kind[0] = plan.kind
        steps[plan.kind] += 1
        start = time.perf_counter()
        alone = step(seqs, plan)
        spent[(plan.kind, "step")] += time.perf_counter() - start
        kind[0] = None
        merged_rows.extend((seqs[row].stats.merged_accept_lengths[-1], *both) for row, both in alone.items())
        return alone

    llm.decoders["DFLASH"].run = counted
    try:
        for prompt in prompts:
            llm.chat([{"role": "user", "content": prompt.turns[0]}], SamplingParams(max_tokens=128))
    finally:
        for owner, name, inner in originals:
            setattr(owner, name, inner)
    return spent, steps, merged_rows


def main() -> None:
    block, budget = int(sys.argv[1]) if len(sys.argv) > 1 else 2, int(sys.argv[2]) if len(sys.argv) > 2 else 0
    dataset = sys.argv[3] if len(sys.argv) > 3 else "humaneval"
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    prompts, _ = select_subset(load_dataset(dataset), count, 0)
    print(f"{dataset}, {len(prompts)} prompts, B={block}, tree budget {budget}, every step speculating")
    for merge in ("always", "never"):
        spent, steps, rows = run(merge, block, budget, prompts)
        for kind in ("merged", "lookup", "dflash"):
            if steps[kind]:
                parts = ", ".join(f"{label} {1000 * spent[(kind, label)] / steps[kind]:.2f}"
                                  for label in ["step"] + [label for *_, label in PARTS]
                                  if spent[(kind, label)])
                print(f"  {merge:>6}: {steps[kind]:4d} {kind} steps, ms per step: {parts}")
        if rows:
            merged, drafted, copied = (statistics.fmean(column) for column in zip(*rows))
            print(f"  {merge:>6}: tokens per merged step {merged:.3f}; on the same steps the draft's "
                  f"candidates alone {drafted:.3f}, the copy alone {copied:.3f}; the draft beat the copy on "
                  f"{sum(d > c for _, d, c in rows) / len(rows):.0%} of them, the copy the draft on "
                  f"{sum(c > d for _, d, c in rows) / len(rows):.0%}")


if __name__ == "__main__":
    main()
