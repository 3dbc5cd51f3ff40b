"""The offline engine loop: feed a fixed list of sequences through the continuous-batching scheduler."""

from __future__ import annotations

from typing import Callable

from blockspec.engine.runner import ModelRunner
from blockspec.engine.scheduler import Scheduler
from blockspec.engine.sequence import Sequence


def run_to_completion(
    runner: ModelRunner,
    seqs: list[Sequence],
    use_draft: bool,
    on_step: Callable[[list[Sequence]], None] | None = None,
    max_total_tokens: int | None = None,
) -> Scheduler:
    """Continuous batching over a fixed list: a sequence joins as soon as a slot (and KV budget) frees
    up and leaves the moment it finishes. `on_step` sees the sequences that ran after every step,
    finished ones included (for streaming). Returns the scheduler (for its statistics)."""
    scheduler = Scheduler(runner, use_draft, max_total_tokens=max_total_tokens)
    for seq in seqs:
        scheduler.add(seq)
    while scheduler.has_work:
        ran = scheduler.step()
        if on_step is not None:
            on_step(ran)
    return scheduler
