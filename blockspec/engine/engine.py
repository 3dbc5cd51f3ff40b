"""The engine loop: admit waiting sequences while slots are free, step all running ones together."""

from __future__ import annotations

from collections import deque
from typing import Callable

from blockspec.engine.runner import ModelRunner
from blockspec.engine.sequence import Sequence


def run_to_completion(
    runner: ModelRunner,
    seqs: list[Sequence],
    use_draft: bool,
    on_step: Callable[[list[Sequence]], None] | None = None,
) -> None:
    """Continuous batching over a fixed list: a sequence joins as soon as a slot frees up and leaves
    the moment it finishes. `on_step` sees the running sequences after every step (for streaming)."""
    waiting, running = deque(seqs), []
    while waiting or running:
        while waiting and runner.pool.num_free:
            seq = waiting.popleft()
            runner.admit(seq)
            runner.prefill(seq, use_draft)
            running.append(seq)
        live = [s for s in running if not s.finished]
        if live:
            (runner.dflash_step if use_draft else runner.decode_step)(live)
        if on_step is not None:
            on_step(running)
        for seq in running:
            if seq.finished:
                runner.release(seq)
        running = [s for s in running if not s.finished]
