"""A job's output folder and the lock that makes one live job its owner.

The lock is an exclusive `flock` on `<out>/.towerlab.lock`, held by the job's launching process
(under torchrun: global rank 0) for as long as the job runs. The kernel drops it when that process
ends, however it ends, so a crashed or killed job never leaves a folder locked; a second job on a
folder in use (a new run, a `--resume`, a search) is refused with one line. A forked worker closes
its inherited copy of the descriptor at once, so the lock goes with the launcher, not with the last
of its children.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
from pathlib import Path
from typing import Any

from towerlab import atomic
from towerlab.errors import UserError
from towerlab.job_files import CONFIG, is_job_folder

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
        if is_job_folder(self.path):
            raise UserError(f"output folder {self.path} already holds files: continue that run with --resume "
                            f"{self.path}, or choose another --out")
        raise UserError(f"output folder {self.path} already holds files and is not a towerlab run (no "
                        f"{CONFIG}): choose another --out, or an empty or new folder")

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
