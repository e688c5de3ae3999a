"""What every towerlab job shares, training and search alike: the output folder and the lock that
makes one live job its owner, config.json's provenance, loading the job's data (once, and the same
on every process), torchrun restart detection, starting the processes (here, spawned locally, or
under torchrun: `Job` and `start_job`), and model.pt.

The lock is an exclusive `flock` on `<out>/.towerlab.lock`, held by the job's launching process
(under torchrun: global rank 0) for as long as the job runs. The kernel drops it when that process
ends, however it ends, so a crashed or killed job never leaves a folder locked; a second job on a
folder in use (a new run, a `--resume`, a search) is refused with one line. A forked worker closes
its inherited copy of the descriptor at once, so the lock goes with the launcher, not with the last
of its children.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import fcntl
import io
import json
import os
import platform
import socket
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import towerlab
from towerlab import atomic
from towerlab.config import RunConfig, parse_shape
from towerlab.fields import replace
from towerlab.distributed.env import device_type, resolve_devices, torchrun_ranks, torchrun_restart, under_torchrun
from towerlab.distributed.group import Context, barrier, broadcast_object
from towerlab.distributed.launch import launch
from towerlab.distributed.signals import EXIT_SIGPIPE, EXIT_STOPPED, Interrupted
from towerlab.errors import UserError
from towerlab.models.files import model_record

LOCK_NAME = ".towerlab.lock"
_held_locks: set[int] = set()  # this process's lock descriptors


def _close_inherited_locks() -> None:
    for fd in _held_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


class OutputFolder:
    """A job's output folder, locked for this process while the job runs (use as a context manager).

    `claim()` creates the folder when needed and takes the lock; leaving the context releases it and
    removes the folder again when this job created it and wrote nothing into it, with the parents it
    created for it (a job refused for bad input leaves nothing behind, not even an empty runs/)."""

    def __init__(self, path: str | os.PathLike, *, must_exist: bool = False):
        self.path = Path(path)
        self.must_exist = must_exist
        self.created: list[Path] = []  # the folder and the parents this job made for it, deepest first
        self._fd: int | None = None

    def __enter__(self) -> OutputFolder:
        self.claim()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def claim(self) -> None:
        path = self.path
        if path.exists() and not path.is_dir():
            raise UserError(f"output folder {path} is a file: choose another --out")
        if self.must_exist and not path.is_dir():
            raise UserError(f"{path} does not exist: check the --resume path")
        if not path.exists():
            missing = [p for p in (path, *path.absolute().parents) if not p.exists()]
            try:
                path.mkdir(parents=True)
                self.created = missing
            except FileExistsError:
                pass  # another job made it a moment ago: the lock decides who owns it
            except OSError as exc:
                raise UserError(f"cannot create output folder {path}: {_reason(exc)}: choose another --out") from None
        self._refuse_special_files()
        self._fd = self._lock(path / LOCK_NAME)
        _held_locks.add(self._fd)
        with contextlib.suppress(OSError):  # the pid only makes the refusal of another job more helpful
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}@{socket.gethostname()}\n".encode(), 0)

    def _lock(self, lock: Path) -> int:
        """An open descriptor of `lock`, exclusively locked. The file is removed when the job ends, so
        the lock counts only if it is still the file at that path (else a job that opened the old one
        just before its removal would own a file nobody else sees)."""
        with contextlib.suppress(FileNotFoundError):  # a device is not even opened
            if not stat.S_ISREG(os.lstat(lock).st_mode):
                self._forget()
                raise self._foreign_lock(lock, "a symbolic link" if lock.is_symlink() else "not a regular file")
        while True:
            try:
                # O_NOFOLLOW, O_NONBLOCK: a planted link is never followed (its target would be truncated
                # below), and a planted pipe never blocks the open; neither is taken for the lock.
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except OSError as exc:
                self._forget()
                if exc.errno == errno.ELOOP:
                    raise self._foreign_lock(lock, "a symbolic link") from None
                raise UserError(f"cannot write into output folder {self.path}: {_reason(exc)}: "
                                "choose another --out") from None
            status = os.fstat(fd)
            if not stat.S_ISREG(status.st_mode) or status.st_nlink > 1:  # 0: removed meanwhile, see below
                os.close(fd)
                self._forget()
                raise self._foreign_lock(lock, "not a regular file" if not stat.S_ISREG(status.st_mode)
                                         else "a second name of another file (a hard link)")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                owner = _read_owner(fd)
                os.close(fd)
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise UserError(f"cannot lock output folder {self.path}: {_reason(exc)}") from None
                raise UserError(f"output folder {self.path} is in use by another towerlab job{owner}: wait for "
                                "it to end, or choose another --out") from None
            try:
                if os.fstat(fd).st_ino == os.stat(lock).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def _refuse_special_files(self) -> None:
        """A pipe, socket or device in the folder (a resumed job writes its files there), named or
        reached through a link, is refused before anything is written: never appended to, never
        replaced by a regular file."""
        for entry in self.path.iterdir():
            if entry.name != LOCK_NAME:  # the lock has checks of its own (_lock)
                try:
                    atomic.require_regular_file(entry, "the output")
                except UserError:
                    raise UserError(f"output folder {self.path} holds {entry.name}, which is not a regular file "
                                    "(a named pipe, socket or device): remove it, or choose another --out") from None

    def _foreign_lock(self, lock: Path, what: str) -> UserError:
        return UserError(f"output folder {self.path} holds {lock.name}, which is {what}, not a lock towerlab "
                         f"made: remove it if it is yours, or choose another --out")

    def holds_results(self) -> bool:
        """Whether anything besides the lock (a plain file of that name) is in the folder."""
        return self.path.is_dir() and any(p.name != LOCK_NAME or p.is_symlink() or not p.is_file()
                                          for p in self.path.iterdir())

    def require_new(self) -> None:
        if not self.holds_results():
            return
        if atomic.is_job_folder(self.path):
            raise UserError(f"output folder {self.path} already holds files: continue that run with --resume "
                            f"{self.path}, or choose another --out")
        raise UserError(f"output folder {self.path} already holds files and is not a towerlab run (no "
                        "config.json): choose another --out, or an empty or new folder")

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            (self.path / LOCK_NAME).unlink()  # before the lock goes: see _lock
        if self.created and not self.holds_results():
            self._forget()
        _held_locks.discard(self._fd)
        os.close(self._fd)
        self._fd = None

    def _forget(self) -> None:
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:
                return  # not empty: something else lives there now


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _read_owner(fd: int) -> str:
    with contextlib.suppress(OSError, UnicodeDecodeError):
        owner = os.pread(fd, 200, 0).decode().strip()
        if owner:
            return f" (process {owner})"
    return ""


def check_writable_file(path: str | os.PathLike, flag: str) -> None:
    """A file the job will create at `path`, or in `path` when it is a folder (its missing folders
    made on the way): refused in one line, before anything starts, when a file stands where a folder
    must be, the nearest existing folder cannot be written, or `path` is a pipe, socket or device."""
    atomic.require_regular_file(path, flag)
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == Path(p.anchor or "."))
    if not existing.is_dir():
        raise UserError(f"{flag} {path} lies under {existing}, which is a file: choose another {flag}")
    if not os.access(existing, os.W_OK):
        raise UserError(f"{flag} {path}: cannot write in {existing} (read-only): choose another {flag}")


def require_out_under_torchrun(run: Any) -> None:
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
    (the loaded data among it, so that all of them read the very same), then
    `worker(rank, world_size, store_path, *preflight())` runs in each of `processes` fresh processes
    (a static method: spawned workers get it pickled, and the job's own fields must not travel with
    it). `essential`, `start_method`, `timeout`, `hint()` and `name(rank)` are as in
    `distributed.launch`; `hint()` also says how to continue after Ctrl-C, SIGTERM or a closed stdout.
    `new` asks for an empty folder (a new job, neither resumed nor restarted)."""

    out: Path
    resume: bool = False
    new: bool = True
    processes: int = 1
    start_method: str = "spawn"
    timeout: float | None = None
    essential: set[int] | None = None

    @abc.abstractmethod
    def run_here(self) -> int: ...

    @abc.abstractmethod
    def preflight(self) -> tuple: ...

    @staticmethod
    @abc.abstractmethod
    def worker(rank: int, world_size: int, store_path: str, *args: Any) -> None: ...

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
                status = launch(job.worker, job.processes, job.preflight(), essential=job.essential, hint=job.hint,
                                start_method=job.start_method, timeout=job.timeout, name=job.name)
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


def code_version() -> dict | None:
    """The git commit of towerlab's own source, and whether the tree differs from it; None when
    towerlab is not run from a git checkout (an installed wheel) or git is absent."""
    source = Path(towerlab.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"git_commit": commit, "dirty": bool(status.strip())}


def provenance() -> dict:
    """What config.json records besides the configuration: versions, code, host, command."""
    return {"torch_version": torch.__version__, "towerlab_version": towerlab.__version__,
            "python_version": platform.python_version(), "code": code_version(), "host": socket.gethostname(),
            "torchelastic_run_id": torchrun_restart()[0], "command": [Path(sys.argv[0]).name, *map(_without_password, sys.argv[1:])]}


def _without_password(arg: str) -> str:
    """A command-line word as config.json records it: a database URL (`--store URL`, `--store=URL`)
    without its password."""
    from towerlab.search.database import is_url, redacted

    flag, equals, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
    return flag + equals + redacted(value) if is_url(value) else arg


def write_config(out: Path, record: dict) -> None:
    """config.json: the job's resolved configuration (`record`) with its provenance."""
    atomic.write_json(out / "config.json", {**record, **provenance()})


def read_config(out: Path, name: str = "config.json") -> dict | None:
    """config.json (or another JSON record, `name`) of `out`, or None when it is missing or unreadable."""
    try:
        stored = json.loads((out / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return stored if isinstance(stored, dict) else None


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


def save_model(path: Path, model: torch.nn.Module, cfg: Any, data: Any, *, function: Any = None) -> None:
    """model.pt: the network and what rebuilds it and feeds it (input shape, classes, the training
    split's mean and std), with the TrainConfig that trained it; written atomically. A network of
    your own records its class, and the model function that built it (FILE.py:FUNCTION), where a
    file defines it: evaluate and predict name it when they need it again."""
    from towerlab.config import CUSTOM_MODEL
    from towerlab.fields import to_dict
    from towerlab.models.custom import function_file

    buffer = io.BytesIO()
    custom = cfg.model == CUSTOM_MODEL
    extra = {"module_class": f"{type(model).__module__}.{type(model).__qualname__}"} if custom else {}
    if custom and function_file(function):
        extra["model_function"] = function_file(function)
    torch.save(model_record(model, cfg.model, data.input_shape, data.num_classes, cfg.model_options,
                            config=to_dict(cfg), mean=list(data.mean), std=list(data.std), **extra), buffer)
    atomic.write_bytes(path, buffer.getvalue())


def stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def quiet(_line: str) -> None:
    pass


def load_data(dataset: str, val_size: int, run: RunConfig, *, synthetic_shape: str | None = None,
              synthetic_train: int | None = None, download: bool = True, log: Any = stderr_line,
              allow_fallback: bool = True, fallback_only: bool = False) -> Any:
    """`dataset` with `val_size` validation images, as `run` finds it (downloading only where both
    `download` and --download allow); `synthetic_shape` ("CxHxW") and `synthetic_train` size the
    synthetic set (None: `data.load_dataset`'s own); `fallback_only`: the offline fallback without
    looking further (another rank fell back)."""
    from towerlab.data.load import load_dataset, load_fallback

    if fallback_only:
        return load_fallback(val_size, log, reason="the job's first process fell back to it")
    synthetic: dict = {}
    if synthetic_shape is not None:
        synthetic["synthetic_shape"] = parse_shape(synthetic_shape)
    if synthetic_train is not None:
        synthetic.update(synthetic_train=synthetic_train, synthetic_test=max(1, synthetic_train // 6))
    # The synthetic set is one fixed dataset (seed 0): the run's seed varies the training, not the data.
    return load_dataset(dataset, run.data_dir, val_size, download=download and run.download,
                        allow_fallback=allow_fallback, seed=0, log=log, **synthetic)


def load_everywhere(ctx: Context, load: Callable[..., Any]) -> Any:
    """The same data on every rank of a torchrun job (or in a single process). Rank 0 loads first,
    downloading or falling back offline as it must, and tells the others what it read, or its error;
    then the first process of each other machine loads that same source (downloading if it must,
    never falling back on its own), and the others read what it fetched. Only rank 0 prints.

    `load(download=..., allow_fallback=..., fallback_only=..., log=...)` loads the job's dataset.
    (Workers of a local launcher follow its decision instead: see `handed_over`.)"""
    decision: dict = {}
    data = None
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
        data = load(download=True, allow_fallback=False, fallback_only=decision["fallback"], log=quiet)
    barrier(ctx)
    if data is None:
        data = load(download=False, allow_fallback=False, fallback_only=decision["fallback"], log=quiet)
    return data


def handed_over(data: Any, start_method: str) -> tuple[Any, bool | None]:
    """What a local launcher hands its workers of the data it loaded (which is where the download,
    or the offline fallback, happened, once): (the data, None) where that costs no copy (forked
    workers share the launcher's memory) or nothing else holds it (arrays given from Python); else
    (None, whether it fell back), and spawned workers read the same source themselves, since
    sending them the data would go through /dev/shm, which containers keep small."""
    if start_method == "fork" or data.source.get("format") == "arrays":
        return data, None
    return None, bool(data.source.get("fallback"))


def worker_data(ctx: Context, load: Callable[..., Any], data: Any, fallback: bool | None) -> Any:
    """A worker's data: what its launcher handed over, or the source it read (`handed_over`), or,
    with neither (a single process, a torchrun rank), as `load_everywhere` decides."""
    if data is not None:
        return data
    if fallback is not None:
        return load(download=False, allow_fallback=False, fallback_only=fallback, log=quiet)
    return load_everywhere(ctx, load)
