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
from blockspec.engine.kv_cache import Batch
from blockspec.engine.sequence import Sequence
from blockspec.sampling_params import SamplingParams

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--block-size", type=int, default=2)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--reps", type=int, default=100)
args = parser.parse_args()
torch.set_num_threads(args.threads)
llm = LLM(max_num_seqs=1, max_model_len=1024, block_size=args.block_size, adaptive_speculation=False)
runner, size = llm.runner, args.block_size
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
    runner.sample_first([seq], runner.prefill_batch([seq], [prompt], use_draft=True))
    batch = Batch([seq.slot], [seq.num_cached])  # every pass below writes the same scratch rows
    block = torch.full((1, size), runner.mask_token_id)
    block[:, 0] = seq.pending_token
    embed = runner.target.embed_tokens
    hidden_size, features_width = runner.draft.config.hidden_size, runner.draft.fc.in_features
    for _ in range(args.reps):
        drafts = timed("DFlash: draft (forward + ranking)", lambda: runner.draft_tokens([seq], block, batch))
        drafted = timed("  of which the draft's layers", lambda: runner.draft(embed(block), batch, runner.draft_cache))
        hidden_draft = drafted[:, 1:].reshape(-1, hidden_size)
        timed("  of which ranking proposals", lambda: runner.draft_scores(hidden_draft).argmax(-1))
        candidates = torch.cat([block[:, :1], drafts], dim=1)
        hidden, features = timed(f"DFlash: target pass, {size} rows",
                                 lambda: runner.target(candidates, batch, runner.target_cache, runner.capture))
        timed("DFlash: target's token choices", lambda: runner.target_outputs([seq], hidden))
        timed("DFlash: draft context injection", lambda: runner.draft.inject(features, batch, runner.draft_cache))
        hidden1, _ = timed("plain: target pass, 1 row",
                           lambda: runner.target(candidates[:, :1], batch, runner.target_cache))
        timed("plain: target pass, 1 row, capturing features",
              lambda: runner.target(candidates[:, :1], batch, runner.target_cache, runner.capture))
        timed("plain: target's token choice", lambda: runner.target_outputs([seq], hidden1))
        for rows in (1, 4, 16):
            backlog = torch.randn(1, rows, features_width)
            timed(f"inject {rows} positions", lambda: runner.draft.inject(backlog, batch, runner.draft_cache))
skip = args.reps // 10
for name, values in times.items():
    print(f"{name:48} {statistics.median(values[skip:]) * 1e3:7.3f} ms")
