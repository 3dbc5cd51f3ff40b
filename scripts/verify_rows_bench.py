"""The target's B-row verify pass on CPU under each weight layout `Linear.pack_for` could pick.

Usage: python scripts/verify_rows_bench.py [--threads 2]
Times one SmolLM2 forward of 2 and 4 rows at position 300 (features captured, as in a DFlash step) with
a row-major weight copy (NT GEMM), an MKL-packed copy, and the stored column-major weight (NN GEMM),
against a one-row decode forward; interleaved rounds, medians.
"""

import argparse
import statistics
import time

import torch

from blockspec.engine.kv_cache import Batch
from blockspec.models.default_model import ensure_default_model
from blockspec.models.layers import Linear
from blockspec.models.loader import load_target

CAPTURE = (1, 8, 14, 20, 27)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(ensure_default_model(), torch.float32, torch.device("cpu"))
    target.fold_norm_weights()
    layers = [m for m in target.modules() if isinstance(m, Linear) and m is not target.lm_head]
    layouts: dict[tuple[str, int], list] = {("column-major", 1): [None] * len(layers)}
    for rows in (2, 4):
        layouts[("row-major", rows)] = [{rows: (m.weight.detach().contiguous(), None)} for m in layers]
        layouts[("mkl-packed", rows)] = [{rows: (m.weight, torch.ops.mkl._mkl_reorder_linear_weight(
            m.weight.detach().contiguous(), rows))} for m in layers]
        layouts[("column-major", rows)] = [None] * len(layers)
    cache = target.new_cache(1, 512)
    times: dict[tuple[str, int], list[float]] = {k: [] for k in layouts}
    with torch.inference_mode():
        target(torch.randint(0, 1000, (1, 300)), Batch([0], [0]), cache)
        for _ in range(args.rounds):
            for (name, rows), fast in layouts.items():
                for module, layout in zip(layers, fast):
                    module.fast = layout
                start = time.perf_counter()
                target(torch.randint(0, 1000, (1, rows)), Batch([0], [300]), cache, CAPTURE)
                times[(name, rows)].append(time.perf_counter() - start)
    one = statistics.median(times[("column-major", 1)][5:])
    print(f"threads={args.threads}  (median ms per target forward, batch 1, position 300)")
    for (name, rows), values in times.items():
        ms = statistics.median(values[5:])
        print(f"{name:>13} rows={rows}  {ms * 1e3:7.2f} ms  {ms / one:.2f}x one row")


if __name__ == "__main__":
    main()
