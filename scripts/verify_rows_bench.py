"""The target's verify pass on CPU under each weight layout `Linear.set_layouts` can pick, per row count.

Usage: PYTHONPATH=. python scripts/verify_rows_bench.py [--threads 2] [--rows 2,4,8,16] [--rounds 15]
Times one SmolLM2 forward of R rows at position 300 (features captured, as in a DFlash step) plus the
greedy LM head on every row, with every Linear (the tied head included where no copy is needed) in each
layout, against a one-row decode step; interleaved rounds, medians. `engine/layout_tuning.py` makes the
same measurement, shorter, when a runner starts.
"""

import argparse
import statistics
import time

import torch

from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache
from blockspec.layers.layout_tuning import CANDIDATES, apply_plan
from blockspec.layers.linear import Linear
from blockspec.models.default_model import ensure_default_model
from blockspec.models.loader import load_target

CAPTURE = (1, 8, 14, 20, 27)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="2,4,8,16")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(ensure_default_model(), torch.float32, torch.device("cpu"))
    target.fold_norm_weights()
    layers = [m for m in target.modules() if isinstance(m, Linear)]  # the LM head included, never copied
    cases = [("nn", 1)] + [(layout, int(r)) for r in args.rows.split(",") for layout in CANDIDATES]
    cache = KVCache.for_model(target, 1, 512)
    times: dict[tuple[str, int], list[float]] = {case: [] for case in cases}
    with torch.inference_mode():
        target(ForwardBatch.in_cache(cache, [0], [0], torch.randint(0, 1000, (1, 300))))
        for _ in range(args.rounds):
            for layout, rows in cases:
                apply_plan(layers, {rows: layout})  # copies are reused between plans
                start = time.perf_counter()
                ids = torch.randint(0, 1000, (1, rows))
                hidden, _ = target(ForwardBatch.in_cache(cache, [0], [300], ids), CAPTURE)
                target.logits(hidden).argmax(-1)
                times[(layout, rows)].append(time.perf_counter() - start)
    one = statistics.median(times[("nn", 1)][3:])
    print(f"threads={args.threads}  (median ms per target forward + LM head, batch 1, position 300)")
    for (layout, rows), values in times.items():
        ms = statistics.median(values[3:])
        print(f"{layout:>7} rows={rows:<3} {ms * 1e3:7.2f} ms  {ms / one:.2f}x one row")


if __name__ == "__main__":
    main()
