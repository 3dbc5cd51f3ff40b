"""Where a DFlash step's time goes on the real SmolLM2 + shipped draft, batch 1, at a fixed position (300),
each part timed alone and repeated (medians), next to a plain step's parts; plus what capturing the
target's features and injecting k positions into the draft's cache cost (lazy draft feeding).

    PYTHONPATH=. python scripts/step_breakdown.py [--block-size 2] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from blockspec import LLM
from blockspec.engine.sequence import Sequence
from blockspec.layers.forward_batch import ForwardBatch
from blockspec.sampling_params import SamplingParams

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--block-size", type=int, default=2)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--reps", type=int, default=100)
args = parser.parse_args()
torch.set_num_threads(args.threads)
llm = LLM(max_num_seqs=1, max_model_len=1024, block_size=args.block_size, adaptive_speculation=False)
runner, size, proposer = llm.runner, args.block_size, llm.decoders["DFLASH"].draft
prompt = list(range(1000, 1300))
seq = Sequence(prompt, SamplingParams(max_tokens=8), frozenset())
runner.admit(seq)
times: dict[str, list[float]] = {}


def timed(name, fn):
    start = time.perf_counter()
    out = fn()
    times.setdefault(name, []).append(time.perf_counter() - start)
    return out


with torch.inference_mode():
    runner.first_tokens([seq], runner.prefill([seq], [prompt], capture=True))
    start = seq.num_cached  # every pass below writes the same scratch rows
    block = torch.full((1, size), proposer.mask_token_id)
    block[:, 0] = seq.pending_token
    draft_batch = ForwardBatch.in_cache(runner.draft_cache, [seq.slot], [start], block, among_new="all")
    head, vocab = runner.target.lm_head, runner.draft.vocab
    hidden_size, features_width = runner.draft.config.hidden_size, runner.draft.fc.in_features
    for _ in range(args.reps):
        drafts = timed("DFlash: draft (forward + ranking)", lambda: proposer.propose([seq], size))
        drafted = timed("  of which the draft's layers", lambda: runner.draft(draft_batch))
        hidden_draft = drafted[:, 1:].reshape(-1, hidden_size)
        timed("  of which ranking proposals", lambda: head.propose(hidden_draft, vocab))
        candidates = torch.cat([block[:, :1], drafts], dim=1)
        hidden, features = timed(f"DFlash: target pass, {size} rows",
                                 lambda: runner.target_pass([seq], candidates, capture=True))
        timed("DFlash: target's token choices", lambda: runner.target_choices([seq], hidden))
        timed("DFlash: draft context injection", lambda: runner.inject([seq], features, [start]))
        hidden1, _ = timed("plain: target pass, 1 row",
                           lambda: runner.target_pass([seq], candidates[:, :1], False))
        timed("plain: target pass, 1 row, capturing features",
              lambda: runner.target_pass([seq], candidates[:, :1], capture=True))
        timed("plain: target's token choice", lambda: runner.target_choices([seq], hidden1))
        for rows in (1, 4, 16):
            backlog = torch.randn(1, rows, features_width)
            timed(f"inject {rows} positions", lambda: runner.inject([seq], backlog, [start]))
skip = args.reps // 10
for name, values in times.items():
    print(f"{name:48} {statistics.median(values[skip:]) * 1e3:7.3f} ms")
