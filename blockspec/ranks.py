"""Starting and stopping an `LLM`'s tensor-parallel ranks, and what ranks > 0 do: replay rank 0.

`LLM(tp_size=N)` in a plain process is rank 0 and spawns ranks 1..N-1 on this machine
(torch.multiprocessing, one process each, joined over 127.0.0.1). Under `torchrun` (one or several
nodes: torch.distributed's own rendezvous) every process is already a rank: rank 0 returns an `LLM` as
usual, and on the other ranks `LLM(...)` serves rank 0 until it closes and then exits the process.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from blockspec.config import EngineConfig
from blockspec.device import allowed_cpus
from blockspec.distributed import TPGroup, free_address, join, launched, leave
from blockspec.engine.mirror import Mirror
from blockspec.errors import BlockspecError

log = logging.getLogger("blockspec")
STOP_SECONDS = 10.0  # how long a closing rank 0 waits for a spawned rank before terminating it
RankMain = Callable[[int, str, EngineConfig], None]  # a spawned rank's work: (rank, rank 0's address, cfg)


def rank_threads(cfg: EngineConfig) -> int | None:
    """Intra-op threads per rank: as asked, or on the CPU this machine's cores shared by its ranks (N ranks
    each spinning torch's default thread count would fight over the same cores): the CPUs this process may
    use, shared."""
    if cfg.threads is not None or cfg.tp_size == 1 or cfg.device.type != "cpu":
        return cfg.threads
    local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.tp_size))
    return max(1, allowed_cpus() // local)


def start_ranks(cfg: EngineConfig, rank_main: RankMain) -> tuple[TPGroup, list]:
    """Join (under a launcher) or start (spawning the others) cfg.tp_size ranks; (this rank's group, the
    processes it spawned). A spawned rank runs rank_main(rank, address, cfg) (a module-level function of
    the caller's, which builds its shard of the engine: this module stays below the engine it starts)."""
    if launched():
        return join(cfg.tp_size, cfg.device, cfg.tp_backend), []
    address = free_address()
    context = mp.get_context("spawn")
    processes = []
    for rank in range(1, cfg.tp_size):
        process = context.Process(target=rank_main, args=(rank, address, cfg), daemon=True,
                                  name=f"blockspec-rank{rank}")
        process.start()
        processes.append(process)
    try:
        return join(cfg.tp_size, cfg.device, cfg.tp_backend, 0, address), processes
    except BaseException:
        stop_processes(processes)
        raise


def join_spawned(rank: int, address: str, cfg: EngineConfig) -> TPGroup:
    """A spawned rank's side of `start_ranks`: join rank 0's group."""
    return join(cfg.tp_size, cfg.device, cfg.tp_backend, rank, address)


def build_together(group: TPGroup | None, build: Callable[[], None], close: Callable[[], None]) -> None:
    """Run this rank's `build`; under TP every rank then hears every other's outcome (so none waits for a
    rank that failed), and a failure anywhere is raised everywhere, after `close`."""
    try:
        build()
        error = None
    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it before it is raised
        error = exc
    except BaseException:  # an interrupt: stop the ranks and go
        close()
        raise
    if group is not None:
        error = error or ranks_failed(group, error)
    if error is not None:
        close()
        raise error


def ranks_failed(group: TPGroup, error: Exception | None) -> Exception | None:
    """Every rank's build outcome, exchanged once loading is over (so no rank waits for one that failed):
    None if all built, else the first other rank's error, named (a BlockspecError stays one)."""
    outcomes: list = [None] * group.size
    mine = None if error is None else (isinstance(error, BlockspecError), f"{type(error).__name__}: {error}")
    dist.all_gather_object(outcomes, mine)
    for rank, outcome in enumerate(outcomes):
        if outcome is not None and rank != group.rank:
            kind = BlockspecError if outcome[0] else RuntimeError
            return kind(f"tensor-parallel rank {rank} of {group.size} failed to build its shard: "
                        f"{outcome[1]}")
    return None


def follow(llm) -> None:
    """Ranks > 0: replay rank 0's commands (engine/mirror.py) until it stops, then leave the group."""
    schedulers = {}
    try:
        while True:
            for name, *args in llm.mirror.receive():
                if name == "stop":
                    return
                if name == "scheduler":
                    schedulers[args[0]] = llm.scheduler(*args[1:])
                elif name == "add":
                    schedulers[args[0]].add(args[1])
                elif name == "abort":
                    schedulers[args[0]].abort(*args[1:])
                elif name == "step":
                    schedulers[args[0]].step()
                elif name == "block_size":
                    llm.set_block_size(args[0])
                elif name == "tree_budget":
                    llm.set_tree_budget(args[0])
                elif name == "clear_prefix_cache":
                    llm.clear_prefix_cache()
    except RuntimeError as exc:  # rank 0 (or another rank) is gone: nothing left to serve
        log.error("tensor-parallel rank %d stops: %s", llm.tp.rank, exc)
    finally:
        leave()


def stop(group: TPGroup, mirror: Mirror, processes: list) -> None:
    """Rank 0: tell the other ranks to stop, leave the group, and wait for the ranks it spawned."""
    try:
        if mirror.broken is None:  # else the group is gone already and the ranks stopped
            mirror.publish("stop")
    except RuntimeError as exc:  # a rank is already gone
        log.warning("tensor-parallel ranks could not all be told to stop: %s", exc)
    leave()
    stop_processes(processes)


def stop_processes(processes: list) -> None:
    for process in processes:
        process.join(timeout=STOP_SECONDS)
        if process.is_alive():
            process.terminate()
            process.join(timeout=STOP_SECONDS)
