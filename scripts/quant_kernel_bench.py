"""The block kernels on SmolLM2's own GGUF tensors, int8 activations (each instruction-set variant this CPU
has) against fp32 activations, per shape and row count: microseconds per call and multiply-adds per second.

    PYTHONPATH=. python scripts/quant_kernel_bench.py [--threads 2] [--rows 1,2,5,9,17,33,64] [--rounds 30]
        [--types q4_k,q6_k,q8_0,... | --gguf FILE]

Each call takes the next layer's tensor (30 layers round robin), so the weights come from memory or the last
level of cache as in a step, not from L1; the forms alternate call by call; medians. Prints a markdown table.
With --gguf, another file of the model (a requantized one from make_gguf_variants.py): its tensors of each
shape grouped by their type. With --types, the tensors are random blocks of each type at SmolLM2's shapes
(those the type's block size divides: 256-weight K-quant blocks fit only down_proj's 1536 inputs), 8 copies
round robin; F16 / BF16 take fp32 activations only.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from blockspec.layers.quant import QUANT_TYPES, Blocks, kernels
from blockspec.models.default_model import gguf_path
from blockspec.models.gguf_checkpoint import GGUFCheckpoint

SHAPES = {  # HF tensor name pattern -> label
    "model.layers.{}.self_attn.q_proj.weight": "q_proj 576x576",
    "model.layers.{}.self_attn.k_proj.weight": "k_proj 192x576",
    "model.layers.{}.mlp.gate_proj.weight": "gate_proj 1536x576",
    "model.layers.{}.mlp.down_proj.weight": "down_proj 576x1536",
}
VARIANT_NAMES = {1: "portable", 2: "AVX2", 3: "AVX-VNNI", 4: "AVX512-VNNI"}
SIZES = {"q_proj 576x576": (576, 576), "k_proj 192x576": (192, 576), "gate_proj 1536x576": (1536, 576),
         "down_proj 576x1536": (576, 1536), "lm_head 49152x576": (49152, 576)}
SCALE_AT = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q4_k": (0, 2),
            "q5_k": (0, 2), "q6_k": (208,), "f16": (), "bf16": ()}  # where each type's fp16 scales sit


def random_blocks(name: str, rows: int, cols: int) -> Blocks:
    """Random quants and sub-scales with small finite fp16 scales (the speed does not depend on values)."""
    qt = QUANT_TYPES[name]
    if qt.floats:
        values = (torch.randn(rows, cols) * 0.05).to(torch.float16 if name == "f16" else torch.bfloat16)
        return Blocks(qt, values.view(torch.uint8).contiguous(), cols)
    data = torch.randint(0, 256, (rows, cols // qt.block_elems, qt.block_bytes), dtype=torch.uint8)
    for at in SCALE_AT[name]:
        scale = (torch.rand(rows, data.shape[1]) * 0.01 + 1e-4).half()
        data[:, :, at : at + 2] = scale.view(torch.uint8).view(rows, data.shape[1], 2)
    return Blocks(qt, data.reshape(rows, -1).contiguous(), cols)


def synthetic_cases(types: str) -> list[tuple[str, list[Blocks]]]:
    cases = []
    for name in types.split(","):
        for label, (n, k) in SIZES.items():
            if k % QUANT_TYPES[name].block_elems == 0:
                cases.append((label, [random_blocks(name, n, k) for _ in range(2 if n > 10000 else 8)]))
    return cases


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,2,5,9,17,33,64")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--types", default=None, help="random blocks of these types instead of SmolLM2's own")
    parser.add_argument("--gguf", type=Path, default=None, help="this file's tensors instead of the embedded")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    op = kernels()
    variants = [v for v in op.int8_variants() if v > 1]  # the portable path is a reference, not a contender
    forms = [f"int8 {VARIANT_NAMES[v]}" for v in variants] + ["fp32"]
    print(f"threads={args.threads}; median us per call (G multiply-adds/s)\n")
    print("| tensor | type | rows | " + " | ".join(forms) + " | best int8 vs fp32 |")
    print("|---|---|---|" + "---|" * len(forms) + "---|")
    if args.types:
        cases = synthetic_cases(args.types)
    else:
        checkpoint = GGUFCheckpoint(args.gguf or gguf_path())
        cases = []
        for pattern, label in list(SHAPES.items()) + [("model.embed_tokens.weight", "lm_head 49152x576")]:
            by_type: dict[str, list[Blocks]] = {}
            for i in range(30 if "{}" in pattern else 1):  # the head: one tensor (twice, below)
                tensor = checkpoint.get(pattern.format(i))
                if isinstance(tensor, Blocks):  # float tensors have no block kernel
                    by_type.setdefault(tensor.qtype.name, []).append(tensor)
            cases += [(label, tensors * max(1, 2 // len(tensors))) for tensors in by_type.values()]
    for label, tensors in cases:
        floats = tensors[0].qtype.floats  # F16 / BF16: fp32 activations only
        packed = [None if floats else op.int8_pack(t.data, t.qtype.ggml_id) for t in tensors]
        n, k = tensors[0].shape
        qtype = tensors[0].qtype.ggml_id
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            times: dict[str, list[float]] = {form: [] for form in (forms[-1:] if floats else forms)}
            for i in range(args.rounds):
                blocks, pack = tensors[i % len(tensors)], packed[i % len(packed)]
                for form, variant in zip(forms, variants + [None]):
                    if form not in times:
                        continue
                    if variant is None:
                        times[form].append(timed(lambda: op.quant_matmul(x, blocks.data, qtype)))
                    else:
                        times[form].append(timed(lambda: op.int8_matmul(x, pack, qtype, n, None, variant)))
            med = {form: statistics.median(values[3:]) for form, values in times.items()}
            cells = [f"{med[f] * 1e6:.0f} ({rows * n * k / med[f] / 1e9:.0f})" if f in med else "-"
                     for f in forms]
            ratio = "-" if floats else f"{med['fp32'] / min(med[f] for f in forms[:-1]):.2f}x"
            print(f"| {label} | {tensors[0].qtype.name} | {rows} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
