"""The run's process group: who this process is (`Context`), joining the group and always tearing it
down (`session`), and the collectives the jobs use. A collective waits at most the session's
`timeout` (`--timeout`), so a dead or hung peer fails the job instead of hanging it; `peer_lost`
recognises that failure."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from towerlab.distributed.env import device_type, torchrun_ranks, torchrun_restart, under_torchrun


@dataclass(frozen=True)
class Context:
    """Who this process is in the run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


@contextlib.contextmanager
def session(*, rank: int = 0, world_size: int = 1, store_path: str | None = None, timeout: float = 120.0,
            backend: str | None = None, per_device: int = 1, device: str = "auto") -> Iterator[Context]:
    """Join (or skip, when alone) the process group and always tear it down.

    Under torchrun the environment decides rank and world size; otherwise the caller does.
    `per_device` processes share each GPU (the search packs small candidates that way); they must
    then talk over gloo (`backend="gloo"`), since NCCL allows one rank per GPU. `device` is the
    run's `--device` (auto, cpu or cuda).
    """
    kind = device_type(device)
    if under_torchrun():
        rank, local_rank, world_size = torchrun_ranks()
    else:
        local_rank = rank
    here = torch.device(kind, local_rank // per_device) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(here)
    if world_size == 1 and not under_torchrun():
        yield Context(device=here)
        return
    backend = backend or ("nccl" if kind == "cuda" else "gloo")
    options: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout),
                               "rank": rank, "world_size": world_size}
    if under_torchrun():
        options["store"] = _torchrun_store(timeout)
    else:
        assert store_path is not None, "local processes rendezvous in their launcher's store"
        options["store"] = dist.FileStore(store_path, world_size)
    if backend == "nccl":
        options["device_id"] = here
    dist.init_process_group(**options)
    try:
        yield Context(rank=rank, local_rank=local_rank, world_size=world_size, device=here, backend=backend)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _torchrun_store(timeout: float) -> Any:
    """The store torchrun describes (env://), with this restart attempt's keys under their own prefix.

    torchrun's agent keeps one store for every restart of a worker group (its shared rendezvous
    store): without the prefix a restarted group reads the keys of the attempt before, and gloo
    connects to the dead workers' addresses ("Connection refused", pytorch/pytorch#167288).
    """
    store, _rank, _world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
    return dist.PrefixStore(f"towerlab/attempt{torchrun_restart()[1]}", store)


def cpu_group(ctx: Context) -> Any:
    """A group that moves CPU tensors: the default group under gloo, a gloo side group under nccl.
    Every rank must call this at the same point."""
    if ctx.backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def world_group(ctx: Context) -> dist.ProcessGroup | None:
    """The group of every rank of the run, or None for a process alone."""
    return dist.group.WORLD if ctx.distributed else None


def max_over_ranks(ctx: Context, value: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest `value` of all ranks, on every rank. A collective: all ranks must call it."""
    if not ctx.distributed:
        return value
    device = torch.device("cpu") if group is not None else ctx.device
    tensor = torch.tensor([float(value)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def sum_over_ranks(ctx: Context, values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks (in place). A collective: all ranks must call it."""
    if ctx.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_object(ctx: Context, obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: Context) -> None:
    if ctx.distributed:
        dist.barrier()


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective or store operation broken by another process of the job dying,
    or timed out (--timeout) waiting for one that stopped answering (gloo says "Timed out waiting ..."
    in a receive, "Application timeout caused pair closure" when its connection times out first)."""
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError)
        and any(s in str(exc).lower() for s in ("connection", "gloo", "timed out", "timeout")))
