"""How tensor-parallel ranks stay in step: rank 0 is the engine a user (or the server) drives; every other
rank replays, in order, what changed the engine's shared state on rank 0 between steps (a scheduler
made, requests added and aborted, a block size or tree budget set), then runs the same step. Everything
else a step decides follows from that state alone (admission, preemption, prompt lookup, keyed random
draws), from values all ranks share after a collective (greedy choices, gathered logits, a tree's ranked
candidates), or is broadcast from rank 0 (the governor's wall-clock step times), so no rank can decide
differently.
"""

from __future__ import annotations

from blockspec.distributed import TPGroup, leave

Command = tuple  # (name, *arguments)


class EngineStopped(RuntimeError):
    """A tensor-parallel engine whose ranks fell out of step: it takes no more work."""


class Mirror:
    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.pending: list[Command] = []
        self.broken: str | None = None  # why the ranks fell out of step (`fail`); then nothing is sent

    def fail(self, error: BaseException) -> None:
        """Rank 0: a step failed part-way, so the other ranks wait in a collective that will never come.
        Leave the group (they see it close and stop) and refuse every later command, instead of hanging."""
        self.broken = f"{type(error).__name__}: {error}"
        leave()

    def record(self, *command) -> None:
        """Rank 0: a change the other ranks must replay before the next step."""
        self.pending.append(command)

    def publish(self, *command) -> None:
        """Rank 0: send what was recorded, then `command`, to the other ranks (one broadcast)."""
        if self.broken is not None:
            raise EngineStopped(f"The tensor-parallel engine stopped after a step failed ({self.broken}); "
                                f"its ranks are out of step. Build a new LLM (or restart the server).")
        commands, self.pending = [*self.pending, command], []
        self.group.broadcast_object(commands)

    def receive(self) -> list[Command]:
        """Another rank: rank 0's next commands."""
        return self.group.broadcast_object(None)
