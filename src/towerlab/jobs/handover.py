"""A job's data: loaded once (where the download, or the offline fallback, happens) and the same on
every process: rank 0 decides under torchrun (`load_everywhere`); a local launcher loads it before its
workers start and hands it over, or the source it read (`handover`, `worker_data`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Protocol

from towerlab.distributed.group import Context, barrier, broadcast_object
from towerlab.errors import UserError
from towerlab.report import discard_line, stderr_line

if TYPE_CHECKING:
    from towerlab.data.load import Dataset


class Loader(Protocol):
    """Loads a job's dataset as `load_everywhere` and `worker_data` ask (see `towerlab.data.load.load_data`'s
    keywords)."""

    def __call__(self, *, download: bool, allow_fallback: bool, fallback_only: bool,
                 log: Callable[[str], None]) -> Dataset: ...


def load_everywhere(ctx: Context, load: Loader) -> Dataset:
    """The same data on every rank of a torchrun job (or in a single process). Rank 0 loads first,
    downloading or falling back offline as it must, and tells the others what it read, or its error;
    then the first process of each other machine loads that same source (downloading if it must,
    never falling back on its own), and the others read what it fetched. Only rank 0 prints.

    `load(download=..., allow_fallback=..., fallback_only=..., log=...)` loads the job's dataset.
    (Workers of a local launcher follow its decision instead: see `handover`.)"""
    decision: dict = {}
    data: Optional[Dataset] = None
    if ctx.is_main:
        try:
            data = load(download=True, allow_fallback=True, fallback_only=False, log=stderr_line)
            decision["fallback"] = bool(data.source.get("fallback"))
        except UserError as exc:
            decision["error"] = str(exc)
    decision = broadcast_object(ctx, decision)
    if "error" in decision:
        raise UserError(decision["error"])
    if not ctx.is_main and ctx.local_rank == 0:
        data = load(download=True, allow_fallback=False, fallback_only=decision["fallback"], log=discard_line)
    barrier(ctx)
    if data is None:
        data = load(download=False, allow_fallback=False, fallback_only=decision["fallback"], log=discard_line)
    return data


def handover(data: Dataset, start_method: str) -> tuple[Optional[Dataset], Optional[bool]]:
    """What a local launcher hands its workers of the data it loaded (which is where the download,
    or the offline fallback, happened, once): (the data, None) where that costs no copy (forked
    workers share the launcher's memory) or nothing else holds it (arrays given from Python); else
    (None, whether it fell back), and spawned workers read the same source themselves, since
    sending them the data would go through /dev/shm, which containers keep small."""
    if start_method == "fork" or data.source.get("format") == "arrays":
        return data, None
    return None, bool(data.source.get("fallback"))


def worker_data(ctx: Context, load: Loader, data: Optional[Dataset], fallback: Optional[bool]) -> Dataset:
    """A worker's data: what its launcher handed over, or the source it read (`handover`), or,
    with neither (a single process, a torchrun rank), as `load_everywhere` decides."""
    if data is not None:
        return data
    if fallback is not None:
        return load(download=False, allow_fallback=False, fallback_only=fallback, log=discard_line)
    return load_everywhere(ctx, load)
