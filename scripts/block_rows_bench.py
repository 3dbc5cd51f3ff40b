"""What a target pass of R rows costs against a one-row step, on the embedded SmolLM2's own GGUF blocks, with
int8 and fp32 activations side by side: the layer stack alone, and with the greedy LM head on every row (a
verify pass: the target's choice at each verified position).

Usage: PYTHONPATH=. python scripts/block_rows_bench.py [--threads 2] [--rows 1,2,5,9,17,33,64] [--rounds 15]
    [--forms int8,fp32]
Batch 1 at position 300 (a typical context), features captured as in a DFlash step; each round times every
row count in one form, then in the other; medians of the rounds after the first three. With both forms
loaded their weights compete for the cache, which slows a one-row pass more than a wide one: `--forms
int8` alone is what decoding with the default sees.
"""

import argparse
import statistics
import time

import torch

from blockspec.layers.forward_batch import ForwardBatch
from blockspec.layers.kv_cache import KVCache
from blockspec.models.default_model import ensure_default_model, gguf_path
from blockspec.models.loader import load_target

CAPTURE = (1, 8, 14, 20, 27)
POSITION = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,5,9,17,33,64")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--forms", default="int8,fp32", help="activation forms to load and time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    targets = {}
    for form in args.forms.split(","):
        target = load_target(ensure_default_model(weights=False), torch.float32, torch.device("cpu"),
                             "stored", gguf_path())
        target.fold_norm_weights()
        if form == "int8":
            target.use_int8_activations()
        cache = KVCache.for_model(target, 1, POSITION + max(rows_list) + 1)
        targets[form] = (target, cache)
    times: dict[tuple[str, str, int], list[float]] = {}
    with torch.inference_mode():
        for target, cache in targets.values():
            target(ForwardBatch.in_cache(cache, [0], [0], torch.randint(0, 1000, (1, POSITION))))
        for _ in range(args.rounds):
            for form, (target, cache) in targets.items():
                for rows in rows_list:
                    ids = torch.randint(0, 1000, (1, rows))
                    target(ForwardBatch.in_cache(cache, [0], [POSITION], ids), CAPTURE)  # warm
                    start = time.perf_counter()
                    hidden, _ = target(ForwardBatch.in_cache(cache, [0], [POSITION], ids), CAPTURE)
                    middle = time.perf_counter()
                    target.greedy(hidden)
                    end = time.perf_counter()
                    times.setdefault((form, "stack", rows), []).append(middle - start)
                    times.setdefault((form, "verify", rows), []).append(end - start)
    median = {key: statistics.median(values[3:]) for key, values in times.items()}
    print(f"threads={args.threads}  (ms, median; x: against the same form's one-row pass)")
    columns = [f"{form} {part}" for form in targets for part in ("stack", "verify")]
    print(f"{'rows':>5}" + "".join(f"{column:>22}" for column in columns))
    for rows in rows_list:
        cells = []
        for form in targets:
            for part in ("stack", "verify"):
                ms, one = median[(form, part, rows)], median[(form, part, rows_list[0])]
                cells.append(f"{ms * 1e3:9.2f} ms {ms / one:6.2f}x")
        print(f"{rows:>5}" + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
