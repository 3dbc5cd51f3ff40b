"""Device and dtype choice: `--device` / `--dtype` names resolved with clear errors, and whether bf16
matmuls are fast here."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path

import torch

from blockspec.errors import BlockspecError, setting

log = logging.getLogger("blockspec")

MAX_THREADS = 1024  # config.MAX_THREADS: more is a typo, and torch would try to start them
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | torch.device | None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or 'auto'/None (cuda when visible, else cpu); a torch.device of another
    backend is taken as given (the caller's own accelerator)."""
    if isinstance(name, torch.device):
        if name.type not in ("cpu", "cuda"):
            return name
        name = str(name)
    accepted = "'cpu', 'cuda', 'cuda:N' or 'auto'"
    key = "auto" if name is None else (name.strip().lower() if isinstance(name, str) else None)
    if key == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if key == "cpu":
        return torch.device("cpu")
    if key is not None and (key == "cuda" or (key.startswith("cuda:") and key[5:].isdigit())):
        if not torch.cuda.is_available():
            raise BlockspecError(f"{setting('device')}={name!r}: no CUDA device is visible to torch (torch "
                                 f"{torch.__version__}, CUDA build {torch.version.cuda}). Use "
                                 f"{setting('device')}=cpu, "
                                 f"which blockspec supports.")
        if key != "cuda" and int(key[5:]) >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise BlockspecError(f"{setting('device')}={name!r}: only {count} CUDA device(s) are visible "
                                 f"(cuda:0..cuda:{count - 1}). Pick one of those.")
        return torch.device(key)
    raise BlockspecError(f"Unsupported {setting('device')}={name!r}: blockspec accepts {accepted}.")


def has_fast_bf16(device: torch.device) -> bool:
    """bf16 matmuls beat fp32 here: CUDA, or a CPU with bf16 matrix units (AMX / AVX512-BF16; 2.5-2.7x
    the fp32 rate for multi-row GEMMs on this project's Xeon). Elsewhere bf16 is emulated and slower."""
    if device.type == "cuda":
        return True
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text() if device.type == "cpu" and cpuinfo.is_file() else ""
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise BlockspecError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)} or 'auto'.")
    return DTYPES[dtype]


def allowed_cpus() -> int:
    """The CPUs this process may use: its affinity mask (taskset, a cpuset), bounded by a cgroup CPU quota
    (a container's --cpus), not every core of the machine."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError, ZeroDivisionError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cpus)


def set_threads(threads: int | None) -> None:
    """torch's intra-op CPU threads, never more than the CPUs this process may use (`allowed_cpus`): more
    only wait on each other (999 threads on 2 CPUs decoded ~300x slower), so a larger count given is capped
    with a warning. None: torch's own choice when it is within them (its OpenMP runtime reads the affinity
    mask but not a cgroup quota)."""
    cpus = allowed_cpus()
    if threads is None:
        if torch.get_num_threads() > cpus:
            torch.set_num_threads(cpus)
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS:
        raise BlockspecError(f"{setting('threads')}={threads!r:.80} must be an integer in [1, {MAX_THREADS}] "
                             f"(this process may use {cpus} CPUs).")
    if threads > cpus:
        log.warning("%s=%d is more than the %d CPUs this process may use (more threads only wait on each "
                    "other); using %d.", setting("threads"), threads, cpus, cpus)
        threads = cpus
    torch.set_num_threads(threads)
