"""The dense fp32 product on the CPU: blockspec's fixed-order kernel against torch's F.linear (MKL/oneDNN)
at the row counts a decode step, a verify block and a batch run, on SmolLM2-135M's shapes (and a 1B-size
projection), column-major as the engine holds its weights (and the head row-major too). Interleaved in one
run, medians of microseconds.

    python scripts/dense_kernel_bench.py [--threads 2] [--reps 30] [--rows 1,2,4,5,9,17,64] [--variant 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from blockspec.bench.machine import cpu_model
from blockspec.layers.dense import VARIANTS, available_variants
from blockspec.layers.quant import kernels

SHAPES = {  # name: (inputs, outputs, row-major)
    "qkv 576->960": (576, 960, False),
    "o 576->576": (576, 576, False),
    "gate_up 576->3072": (576, 3072, False),
    "down 1536->576": (1536, 576, False),
    "head 576->49152": (576, 49152, False),
    "head 576->49152 row-major": (576, 49152, True),
    "1B gate_up 2048->16384": (2048, 16384, False),
}


STREAMED_BYTES = 256 << 20  # weights cycled through per shape: more than a last-level cache holds


def weights_of(inputs: int, outputs: int, row_major: bool) -> list[torch.Tensor]:
    """Copies of one weight, used in turn: each call reads its weight from memory, as a model's step does
    (one weight in cache would flatter whichever product re-reads it best)."""
    w = torch.randn(outputs, inputs) * 0.02
    w = w if row_major else w.t().contiguous().t()  # column-major: a Linear's storage
    copies = max(1, min(64, STREAMED_BYTES // (w.numel() * 4)))
    return [w.clone(memory_format=torch.preserve_format) for _ in range(copies)]


def median_us(fn, weights: list[torch.Tensor], reps: int) -> float:
    fn(weights[-1])
    times = []
    for i in range(reps):
        w = weights[i % len(weights)]
        start = time.perf_counter()
        fn(w)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--rows", default="1,2,4,5,9,17,64")
    parser.add_argument("--variant", type=int, default=0, help="1 portable, 2 AVX2, 3 AVX-512 (0: widest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = kernels()
    variant = args.variant or max(available_variants())
    rows = [int(r) for r in args.rows.split(",")]
    print(f"# {cpu_model()}, {args.threads} threads, torch {torch.__version__}, kernel variant "
          f"{VARIANTS[variant]}, load {os.getloadavg()[0]:.1f}; median us of {args.reps}")
    print("| shape | rows | ours us | F.linear us | ours / F.linear |")
    print("|---|---:|---:|---:|---:|")
    with torch.inference_mode():
        for name, (inputs, outputs, row_major) in SHAPES.items():
            weights = weights_of(inputs, outputs, row_major)
            for m in rows:
                x = torch.randn(m, inputs)
                ours, theirs = [], []
                for _ in range(3):  # alternate, so drifts in the machine's speed hit both alike
                    ours.append(median_us(lambda w: ops.dense_matmul(x, w, None, None, variant), weights,
                                          args.reps))
                    theirs.append(median_us(lambda w: F.linear(x, w), weights, args.reps))
                a, b = statistics.median(ours), statistics.median(theirs)
                print(f"| {name} | {m} | {a:.1f} | {b:.1f} | {a / b:.2f} |", flush=True)


if __name__ == "__main__":
    main()
