"""A job's life on its folder: the `Job` (its launch settings and hooks) and `start_job`, which owns
the folder for the job's whole life and runs the job here (one process, or a torchrun rank) or in
local worker processes; what a torchrun restart continues; the run settings resolved for this machine.
"""

from __future__ import annotations

import abc
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from towerlab.config import RunConfig
from towerlab.distributed.env import device_type, resolve_devices, torchrun_ranks, torchrun_restart, under_torchrun
from towerlab.distributed.launch import LaunchOptions, launch
from towerlab.distributed.signals import EXIT_SIGPIPE, EXIT_STOPPED, Interrupted
from towerlab.errors import UserError
from towerlab.fields import replace
from towerlab.jobs.folder import OutputFolder
from towerlab.jobs.provenance import read_config


def require_out_under_torchrun(run: RunConfig) -> None:
    if under_torchrun() and run.resume is None and run.out is None:
        raise UserError("under torchrun every rank must agree on the output folder: pass --out")


def resolved_run(run: RunConfig) -> RunConfig:
    """`run` with --device and --devices resolved for this machine (left as given under torchrun)."""
    if under_torchrun():
        return run
    return replace(run, device=device_type(run.device), devices=resolve_devices(run.devices, run.device))


def launches_here() -> bool:
    """Whether this process owns the job's folder: always, except the ranks > 0 of torchrun."""
    return not under_torchrun() or torchrun_ranks()[0] == 0


@dataclass(kw_only=True)
class Job(abc.ABC):
    """One job on one output folder, as `start_job` runs it: the launch settings are its fields,
    the job itself its hooks.

    `run_here()` runs the job in this process (a single process, or a torchrun rank); with
    `processes` > 1, `preflight()` finds every mistake once and returns what every worker needs
    (the job itself without what must not be copied to each worker, and what it hands over of the
    loaded data, so that all of them read the very same), then
    `worker(rank, world_size, store_path, *preflight())` runs in each of `processes` fresh processes
    (a static method: spawned workers get it pickled, with what `preflight` chose to send). `essential`, `start_method`, `timeout`, `hint()` and `name(rank)` are as in
    `distributed.launch`; `hint()` also says how to continue after Ctrl-C, SIGTERM or a closed stdout.
    `new` asks for an empty folder (a new job, neither resumed nor restarted). A job that always runs in
    one process (a search job: its workers are a crew of its own) provides `run_here` alone: it never gets
    to `preflight` or `worker`."""

    out: Path
    resume: bool = False
    new: bool = True
    processes: int = 1
    start_method: str = "spawn"
    timeout: float | None = None
    essential: set[int] | None = None

    @abc.abstractmethod
    def run_here(self) -> int: ...

    def preflight(self) -> tuple:
        raise TypeError(f"{type(self).__name__} runs in one process (processes = 1): it has no preflight")

    @staticmethod
    def worker(rank: int, world_size: int, store_path: str, *args: Any) -> None:
        raise TypeError("a job of one process has no workers of the launcher's")

    @abc.abstractmethod
    def hint(self) -> str: ...

    @abc.abstractmethod
    def name(self, rank: int) -> str: ...


def start_job(job: Job) -> int:
    """Run `job` on its folder, owning the folder for the job's whole life; returns the exit status."""
    folder = OutputFolder(job.out, must_exist=job.resume) if launches_here() else None
    with folder or contextlib.nullcontext():
        if folder is not None and job.new and not job.resume:
            folder.require_new()
        try:
            if job.processes == 1 or under_torchrun():
                status = job.run_here()
            else:
                status = launch(job.worker, job.processes, job.preflight(),
                                LaunchOptions(essential=job.essential, hint=job.hint, start_method=job.start_method,
                                              timeout=job.timeout, name=job.name))
        except Interrupted as exc:
            _how_to_continue(folder, job, exc.exit_status)
            raise
        if status in EXIT_STOPPED:
            _how_to_continue(folder, job, status)
        return status


def _how_to_continue(folder: OutputFolder | None, job: Job, status: int) -> None:
    advice = job.hint() if folder is not None else ""
    if advice:
        why = "stopped: the reader of its output went away" if status == EXIT_SIGPIPE else "interrupted"
        with contextlib.suppress(OSError):  # stderr may be that closed pipe too
            print(f"towerlab: {why}. {advice}", file=sys.stderr, flush=True)


def restarted_by_torchrun(out: Path, same_job: Callable[[dict], bool]) -> bool:
    """Whether this process is a torchrun restart (TORCHELASTIC_RESTART_COUNT > 0) of the very job
    that made `out`: the same TORCHELASTIC_RUN_ID, and `same_job(stored config.json)`."""
    run_id, restarts = torchrun_restart()
    if restarts == 0 or run_id is None:
        return False
    stored = read_config(out)
    try:
        return stored is not None and stored.get("torchelastic_run_id") == run_id and bool(same_job(stored))
    except (KeyError, TypeError, ValueError, UserError):
        return False
