"""Attention cost on CPU: contiguous per-sequence slabs vs paged KV (gather pages, then attend).

Usage: python scripts/kv_layout_bench.py   (prints median ms per layer-call, interleaved rounds)
Shapes are SmolLM2's (9 query heads, 3 KV heads, head_dim 64); page size 16.
"""

import statistics
import time

import torch

from blockspec.layers.attention import attention
from blockspec.layers.forward_batch import fold_mask

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def main() -> None:
    torch.manual_seed(0)
    print(f"threads={torch.get_num_threads()}  (median ms per attention call, batch 1)")
    print(f"{'context':>8} {'q':>3} {'slab':>8} {'paged':>8} {'paged/slab':>10}")
    for length in (256, 1024, 4096):
        for q_len in (1, 16):
            slab_k = torch.randn(1, KV_HEADS, 8192, HEAD_DIM)
            slab_v = torch.randn(1, KV_HEADS, 8192, HEAD_DIM)
            pages = length // PAGE
            pool_k = torch.randn(4 * pages, PAGE, KV_HEADS, HEAD_DIM)
            pool_v = torch.randn(4 * pages, PAGE, KV_HEADS, HEAD_DIM)
            table = torch.randperm(4 * pages)[:pages]
            q = torch.randn(1, q_len, HEADS, HEAD_DIM)
            causal = torch.ones(1, q_len, length, dtype=torch.bool).tril(length - q_len)
            mask = None if q_len == 1 else fold_mask(causal, HEADS // KV_HEADS, torch.float32)

            def slab() -> None:
                attention(q, slab_k[:, :, :length], slab_v[:, :, :length], mask)

            def paged() -> None:
                k = pool_k[table].reshape(1, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
                v = pool_v[table].reshape(1, length, KV_HEADS, HEAD_DIM).transpose(1, 2)
                attention(q, k, v, mask)

            times = {"slab": [], "paged": []}
            for _ in range(60):  # interleaved so machine drift hits both
                for name, fn in (("slab", slab), ("paged", paged)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            s, p = statistics.median(times["slab"]) * 1e3, statistics.median(times["paged"]) * 1e3
            print(f"{length:>8} {q_len:>3} {s:>8.3f} {p:>8.3f} {p / s:>10.2f}")


if __name__ == "__main__":
    main()
