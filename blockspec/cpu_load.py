"""How many CPU threads to compute with while other processes load the machine.

torch's OpenMP workers spin while they wait for each other. On a quiet 2-core machine that is what makes a
SmolLM2 step fast (two threads decode 98 tok/s, one 62); with one core kept busy by another process, the
two threads take turns with it and each step waits for the descheduled one: plain decoding fell to 6-30
tok/s. Letting the workers sleep instead (OMP_WAIT_POLICY=PASSIVE) costs the quiet machine as much as one
thread does (55 tok/s). So the engine keeps spinning workers but uses only the CPUs others leave free:
`LoadAwareThreads.tick`, called between engine steps, measures every half second how much CPU time other
processes took on this process's CPUs (/proc/stat less this process's own time) and sets torch's thread
count to the free CPUs, never above the count it started with. Tokens do not depend on it: the block
kernels sum in a fixed order whatever the thread count.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

INTERVAL_S = 0.5
STAT = Path("/proc/stat")


def busy_ticks(cpus: set[int]) -> int | None:
    """Clock ticks the CPUs in `cpus` spent busy (all but idle and iowait) since boot; None off Linux."""
    try:
        lines = STAT.read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(v) for v in rest.split()]
            total += sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
    return total


class LoadAwareThreads:
    def __init__(self, ceiling: int, interval: float = INTERVAL_S) -> None:
        """`ceiling`: the most threads to use (the count the engine was built with)."""
        self.cpus = set(os.sched_getaffinity(0))
        self.ceiling, self.interval = max(1, ceiling), interval
        self.hz = os.sysconf("SC_CLK_TCK")
        self._mark = self._sample()

    @classmethod
    def for_this_process(cls) -> LoadAwareThreads | None:
        """A policy over torch's current thread count, or None where there is nothing to adapt (one thread,
        or no /proc/stat to read)."""
        threads = torch.get_num_threads()
        if threads < 2 or not hasattr(os, "sched_getaffinity") or busy_ticks({0}) is None:
            return None
        return cls(threads)

    def _sample(self) -> tuple[float, int, float]:
        return time.monotonic(), busy_ticks(self.cpus) or 0, time.process_time()

    def others(self, before: tuple[float, int, float], after: tuple[float, int, float]) -> float:
        """CPUs' worth of time other processes used on our CPUs between two samples."""
        seconds = after[0] - before[0]
        theirs = (after[1] - before[1]) / self.hz - (after[2] - before[2])
        return max(0.0, theirs / seconds) if seconds > 0 else 0.0

    def tick(self) -> None:
        """Between engine steps: every `interval`, compute on the CPUs others leave free."""
        now = time.monotonic()
        if now - self._mark[0] < self.interval:
            return
        sample = self._sample()
        free = len(self.cpus) - self.others(self._mark, sample)
        self._mark = sample
        threads = min(self.ceiling, max(1, int(free + 0.5)))
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
