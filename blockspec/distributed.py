"""Tensor parallelism's process group: starting the ranks, the few collectives the layers and the engine
use, and a count of what they send.

All communication is torch.distributed's (gloo on the CPU, NCCL on CUDA). The ranks start in one of two
ways: under `torchrun` (or any launcher that sets RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, multi-node
included), or from the engine itself, which spawns ranks 1..N-1 on this machine and is rank 0. Rank 0 is the
only one a user talks to; the others replay its engine commands (blockspec/engine/mirror.py).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from blockspec.device import allowed_cpus
from blockspec.errors import BlockspecError, setting

BACKENDS = ("auto", "gloo", "nccl")
# Ranks wait for rank 0's next command as long as a server stays idle; a dead peer still fails a
# collective at once (its sockets close), so this bounds only a peer that hangs while alive.
IDLE_TIMEOUT = timedelta(days=7)
OBJECT_HEAD = 1024  # bytes of every `broadcast_object`: most engine steps' commands need no second one


@dataclass
class CommStats:
    """Collectives issued by this rank and the bytes it contributed, per kind (reported by `bench`)."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


@dataclass
class TPGroup:
    """This process's place among the tensor-parallel ranks (the default process group)."""

    rank: int
    size: int
    device: torch.device
    stats: CommStats = field(default_factory=CommStats)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place (every rank gets the same bits: each element is reduced once)."""
        self.stats.add("all_reduce", x.numel() * x.element_size())
        dist.all_reduce(x)
        return x

    def sum_parts(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial product x, in the order one rank's dense kernel sums (a tree of
        halves: (r0 + r1) + (r2 + r3), ...), so row-parallel layers give one rank's bits. Two ranks (or
        a GPU, whose products make no such promise) take a plain all-reduce."""
        if self.size <= 2 or x.device.type != "cpu":
            return self.all_reduce(x)
        return _tree_sum(list(self.all_gather(x).unbind(0)))

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x, in rank order."""
        x = x.contiguous()
        self.stats.add("all_gather", x.numel() * x.element_size())
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x)  # concatenated along dim 0 (gloo needs that shape)
        return out.view(self.size, *x.shape)

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled; rank 0 keeps its own object). One broadcast of
        OBJECT_HEAD bytes (the length, then the start of the pickle: a step's commands fit), a second
        only for the rest of a longer one."""
        import pickle

        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        head = torch.zeros(OBJECT_HEAD, dtype=torch.uint8, device=device)
        if self.rank == 0:
            data = pickle.dumps(obj)
            payload = torch.frombuffer(bytearray(len(data).to_bytes(8, "little") + data), dtype=torch.uint8)
            head[: min(OBJECT_HEAD, payload.numel())] = payload[:OBJECT_HEAD].to(device)
        self.stats.add("broadcast", OBJECT_HEAD)
        dist.broadcast(head, src=0)
        size = 8 + int.from_bytes(head[:8].cpu().numpy().tobytes(), "little")
        if size > OBJECT_HEAD:
            rest = payload[OBJECT_HEAD:].to(device) if self.rank == 0 else torch.empty(
                size - OBJECT_HEAD, dtype=torch.uint8, device=device)
            self.stats.add("broadcast", rest.numel())
            dist.broadcast(rest, src=0)
        if self.rank == 0:
            return obj
        whole = head[: min(size, OBJECT_HEAD)] if size <= OBJECT_HEAD else torch.cat([head, rest])
        return pickle.loads(whole[8:].cpu().numpy().tobytes())

    def broadcast_float(self, value: float) -> float:
        """Rank 0's number on every rank (a wall-clock measurement all ranks must decide alike on)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.stats.add("broadcast", 8)
        dist.broadcast(t, src=0)
        return float(t.item())


def _tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Ranks hold equal consecutive parts of the inputs: the first half of them, then the rest."""
    if len(parts) == 1:
        return parts[0]
    half = len(parts) - len(parts) // 2
    return _tree_sum(parts[:half]) + _tree_sum(parts[half:])


def best_rank_choice(group: TPGroup, values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary argmax from each rank's shard maxima: values [n] (float) and global ids [n] (each
    rank's first best in its shard). The best rank wins; ties go to the lowest rank, whose ids are the
    lowest (shards are contiguous and ascending), so the result is exactly torch.argmax over all logits.
    One all-gather: value and id travel together as float64 (exact for fp32/bf16 values and ids < 2^53)."""
    pairs = torch.stack([values.double(), ids.double()], dim=-1)  # [n, 2]
    gathered = group.all_gather(pairs)  # [size, n, 2]
    # first max: the lowest rank (a NaN counts as the maximum, as in torch.argmax)
    best = gathered[..., 0].nan_to_num(nan=float("inf")).argmax(dim=0)
    return gathered[..., 1].gather(0, best.unsqueeze(0)).squeeze(0).long()


def shard_range(total: int, group: TPGroup) -> tuple[int, int]:
    """This rank's contiguous part [start, stop) of `total` rows split as evenly as possible, padding the
    last: ceil(total / size) rows per rank, the last rank fewer (e.g. a vocabulary not divisible)."""
    per = -(-total // group.size)
    start = min(group.rank * per, total)
    return start, min(total, start + per)


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise BlockspecError(f"{setting('tp_backend')}={backend!r:.80} is not supported; use one of "
                             f"{', '.join(BACKENDS)}.")
    if backend == "nccl" and device.type != "cuda":
        raise BlockspecError(f"{setting('tp_backend')}=nccl needs CUDA devices, but the engine runs on "
                             f"{device}. Use {setting('tp_backend')}=gloo (or auto) on the CPU, or "
                             f"{setting('device')}=cuda.")
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return backend


def check_devices(tp_size: int, device: torch.device) -> None:
    """One device per rank: a CUDA device, or on the CPU a core (ranks on one core only wait on each
    other)."""
    if tp_size == 1:
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", tp_size))
    cores = allowed_cpus()
    if device.type == "cpu" and local > cores:
        raise BlockspecError(f"{setting('tp_size')}={tp_size} puts {local} ranks on this machine's "
                             f"{cores} CPU cores; each rank needs a core of its own. Use "
                             f"{setting('tp_size')}={cores} or fewer.")
    if device.type == "cuda" and tp_size > torch.cuda.device_count():
        raise BlockspecError(f"{setting('tp_size')}={tp_size} needs {tp_size} CUDA devices (one per rank), "
                             f"but {torch.cuda.device_count()} are visible. Lower {setting('tp_size')} or "
                             f"make more devices visible (CUDA_VISIBLE_DEVICES).")


def launched() -> bool:
    """Whether a launcher (torchrun) started this process as one rank of a group."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def join(tp_size: int, device: torch.device, backend: str, rank: int | None = None,
         init_method: str | None = None) -> TPGroup:
    """Join (or create) the default process group as one of `tp_size` ranks: with `rank` and `init_method`
    given (ranks the engine spawned), else from the launcher's environment."""
    backend = resolve_backend(backend, device)
    if dist.is_initialized():
        raise BlockspecError("A tensor-parallel engine is already running in this process (one process "
                             "group per process): close() it before building another.")
    if rank is None:
        world = int(os.environ["WORLD_SIZE"])
        if world != tp_size:
            raise BlockspecError(f"{setting('tp_size')}={tp_size} but the launcher started {world} ranks "
                                 f"(WORLD_SIZE); launch with --nproc-per-node x --nnodes = {tp_size}.")
        rank = int(os.environ["RANK"])
        dist.init_process_group(backend, timeout=IDLE_TIMEOUT)
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp_size,
                                timeout=IDLE_TIMEOUT)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    return TPGroup(rank, tp_size, device)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
