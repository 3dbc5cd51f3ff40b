"""The block-quantized kernel on SmolLM2's own GGUF tensors against fp32 F.linear on the same (dequantized)
weights, per shape and row count: microseconds per call, effective weight bandwidth, and the ratio.

    PYTHONPATH=. python scripts/quant_kernel_bench.py [--threads 2] [--rows 1,2,4,8,16] [--rounds 30]

Each call takes the next layer's tensor (30 layers round robin), so the weights come from memory, not the
cache, as in a decode step; the two methods alternate call by call; medians."""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from blockspec.layers.quant import kernels
from blockspec.models.default_model import gguf_path
from blockspec.models.gguf_checkpoint import GGUFCheckpoint

SHAPES = {  # HF tensor name pattern -> label
    "model.layers.{}.self_attn.q_proj.weight": "q_proj 576x576",
    "model.layers.{}.self_attn.k_proj.weight": "k_proj 192x576",
    "model.layers.{}.mlp.gate_proj.weight": "gate_proj 1536x576",
    "model.layers.{}.mlp.down_proj.weight": "down_proj 576x1536",
}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = GGUFCheckpoint(gguf_path())
    op = kernels()
    print(f"threads={args.threads}  (median us per call; GB/s = weight bytes read per call / time)")
    print(f"{'tensor':<22}{'type':>6}{'rows':>5}{'blocks us':>11}{'GB/s':>7}"
          f"{'fp32 us':>10}{'GB/s':>7}{'speedup':>9}")
    cases = [(label, [checkpoint.get(pattern.format(i)) for i in range(30)])
             for pattern, label in SHAPES.items()]
    cases.append(("lm_head 49152x576", [checkpoint.get("model.embed_tokens.weight")] * 2))
    for label, tensors in cases:
        dense = [t.dequantize() for t in tensors]
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, tensors[0].cols)
            ours, theirs = [], []
            for i in range(args.rounds):
                blocks, weight = tensors[i % len(tensors)], dense[i % len(dense)]
                ours.append(timed(lambda: op.quant_matmul(x, blocks.data, blocks.qtype.ggml_id)))
                theirs.append(timed(lambda: F.linear(x, weight)))
            a, b = statistics.median(ours[3:]), statistics.median(theirs[3:])
            quant_bytes, dense_bytes = tensors[0].data.numel(), dense[0].numel() * 4
            print(f"{label:<22}{tensors[0].qtype.name:>6}{rows:>5}"
                  f"{a * 1e6:>11.0f}{quant_bytes / a / 1e9:>7.1f}"
                  f"{b * 1e6:>10.0f}{dense_bytes / b / 1e9:>7.1f}{b / a:>8.2f}x")


if __name__ == "__main__":
    main()
