"""The load-aware thread count: the engine computes on the CPUs other processes leave free, never more than
it started with, and back up when they go; measured from /proc/stat less this process's own CPU time."""

from __future__ import annotations

import torch

import blockspec.cpu_load as cpu_load
from blockspec.cpu_load import LoadAwareThreads, busy_ticks


class Clock:
    """Stands in for time and /proc/stat: each step advances wall time, this process's CPU time and the
    CPUs' busy ticks by the given loads (in CPUs)."""

    def __init__(self, monkeypatch, hz: int = 100) -> None:
        self.wall, self.mine, self.busy, self.hz = 0.0, 0.0, 0, hz
        monkeypatch.setattr(cpu_load.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(cpu_load.time, "process_time", lambda: self.mine)
        monkeypatch.setattr(cpu_load, "busy_ticks", lambda cpus: self.busy)

    def advance(self, seconds: float, mine: float, others: float) -> None:
        self.wall += seconds
        self.mine += mine * seconds
        self.busy += round((mine + others) * seconds * self.hz)


def test_threads_follow_the_free_cpus(monkeypatch):
    clock = Clock(monkeypatch)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        policy = LoadAwareThreads(ceiling=2)
        policy.cpus, policy.hz = {0, 1}, clock.hz
        policy._mark = policy._sample()
        clock.advance(0.6, mine=1.33, others=0.67)  # another process took a core from our two threads
        policy.tick()
        assert torch.get_num_threads() == 1
        clock.advance(0.6, mine=1.0, others=1.0)  # still there
        policy.tick()
        assert torch.get_num_threads() == 1
        clock.advance(0.1, mine=1.0, others=0.0)  # gone, but checked only every half second
        policy.tick()
        assert torch.get_num_threads() == 1
        clock.advance(0.5, mine=1.0, others=0.0)
        policy.tick()
        assert torch.get_num_threads() == 2  # back to what it started with, never more
        clock.advance(0.6, mine=2.0, others=0.1)  # a little background work: both cores stay ours
        policy.tick()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


def test_busy_ticks_reads_this_machine():
    ticks = busy_ticks({0})
    assert ticks is None or ticks > 0
    assert LoadAwareThreads.for_this_process() is None or torch.get_num_threads() >= 2


def test_more_threads_than_cpus_are_capped_with_a_warning(monkeypatch, caplog):
    """--threads 999 on 2 CPUs decoded ~300x slower, silently: now it warns and uses the 2."""
    import logging

    import blockspec.device as device

    previous = torch.get_num_threads()
    monkeypatch.setattr(device, "allowed_cpus", lambda: 2)
    try:
        with caplog.at_level(logging.WARNING, logger="blockspec"):
            device.set_threads(999)
        assert torch.get_num_threads() == 2
        assert "threads=999 is more than the 2 CPUs this process may use" in caplog.text
        caplog.clear()
        device.set_threads(1)
        assert torch.get_num_threads() == 1 and not caplog.text
    finally:
        torch.set_num_threads(previous)
