"""A pass over a model's `Linear` layers that picks each one's fp32 CPU GEMM form by timing the real model.

For the few rows of a decode or verify step the fastest form depends on the CPU and its BLAS: on a
2-core Intel Xeon (AVX-512, bf16) MKL's NT form streamed the weight for 2 rows and an MKL-packed copy won
for 4; on a 2-core AMD EPYC (AVX2) a SmolLM2 pass of 2 rows costs 2.0x a one-row step in the NT form and
4 rows 2.0x packed, while W x^T (the weight as the GEMM's big left operand) costs 0.9x at both: there
MKL's GEMV is slower than its 2-column GEMM, so even one row goes faster as two
(scripts/verify_rows_bench.py). No fixed rule is right on both, so the runner measures: a few target
passes of each candidate at each row count it will run, the fastest kept. Output tokens don't depend on
the choice: a form that rounds otherwise than the stored one on this CPU is never kept (layout.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from blockspec.home import blockspec_home
from blockspec.layers.layout import LAYOUTS as CANDIDATES  # "packed" only for an exact row count
from blockspec.layers.linear import Linear

DEFAULT_PROBE_ROWS = 16  # key 0 (every other 2..SMALL_ROWS-row input) is chosen by timing this many rows
PLANS_FILE = "layouts.json"  # under $BLOCKSPEC_HOME: measured once per CPU, thread count and model shape
SAVE_AFTER_S = 1.0  # a plan whose measurement took longer is saved
PLAN_VERSION = "v3"  # plans saved under another version are dropped when the file is next written
# Plans measured in this process, saved or not: two runners of one model then compute alike (same rounding).
_measured: dict[str, dict[int, str]] = {}


def apply_plan(linears: list[Linear], plan: dict[int, str] | None) -> None:
    for module in linears:
        module.set_layouts(plan)


def plan_key(linears: list[Linear], counts: tuple[int, ...]) -> str:
    """What a measured plan holds for: the CPU, thread count, torch, the weight shapes, the row counts."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                    if line.startswith("model name")), cpu)
    shapes = repr([(m.in_features, m.out_features) for m in linears])
    digest = hashlib.sha256(shapes.encode()).hexdigest()[:16]
    return (f"{PLAN_VERSION}|{cpu}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|shapes={digest}|rows={sorted(set(counts))}")


def read_plans(path: Path) -> dict[str, dict[int, str]]:
    """Saved plans; none if the file is missing or unreadable (then they are measured again)."""
    try:
        raw = json.loads(path.read_text())
        return {key: {int(rows): layout for rows, layout in plan.items() if layout in CANDIDATES}
                for key, plan in raw.items() if key.startswith(f"{PLAN_VERSION}|")}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def write_plans(path: Path, plans: dict[str, dict[int, str]]) -> None:
    """Atomically; a read-only home only costs the next process a re-measure."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(plans, indent=1))
        partial.replace(path)


def tune_layouts(linears: list[Linear], run: Callable[[int], None], counts: tuple[int, ...],
                 reps: int = 2) -> dict[int, str]:
    """The fastest layout for one row (a decode step), per row count in `counts` (>= 2) and for every other
    small count (key 0), measured with run(rows) (one pass of `rows` rows through the model) unless this
    process or this machine measured it before; the plan is applied to the modules. Delete
    $BLOCKSPEC_HOME/layouts.json to measure again."""
    key = plan_key(linears, counts)
    path = blockspec_home() / PLANS_FILE
    saved = read_plans(path)
    plan = _measured.get(key) or saved.get(key)
    if plan is None:
        began = time.perf_counter()
        apply_plan(linears, None)  # fresh copies of the current weights
        plan = {}
        for rows in [1, *sorted({c for c in counts if c >= 2}), 0]:
            seconds = {}
            for layout in CANDIDATES if rows > 1 else ("nn", "wx") if rows == 1 else CANDIDATES[:-1]:
                apply_plan(linears, {**plan, rows: layout})
                run(rows or DEFAULT_PROBE_ROWS)  # warm-up: first touch of the copies, MKL's own set-up
                times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    run(rows or DEFAULT_PROBE_ROWS)
                    times.append(time.perf_counter() - start)
                seconds[layout] = statistics.median(times)
            plan[rows] = min(seconds, key=seconds.get)
        saved[key] = _measured[key] = plan
        if time.perf_counter() - began > SAVE_AFTER_S:  # a tiny model measures faster than it reads a file
            write_plans(path, saved)
    apply_plan(linears, plan)
    return dict(plan)
