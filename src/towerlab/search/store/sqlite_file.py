"""What an SQLite store needs from its machine beyond SQLite (`towerlab.search.store.database.SQLite`): one
clock for every process that uses the file (`KernelClock`), and a watch on the file itself
(`StoreFile`): still the file the connection opened, and still writable. Standard library only."""

from __future__ import annotations

import ctypes
import os
import tempfile
from typing import Optional

from towerlab.errors import UserError


class KernelClock:
    """The time as this machine's kernel keeps it, read where no process can change it for itself: the
    modification time that the kernel stamps on a file of this process at each write. Every process of
    the machine reads the same, whatever its own clock says: SQLite's `julianday('now')` reads the
    calling process's, and a worker whose clock was shifted (faketime, an LD_PRELOAD shim) took over
    live tasks and dated a search's end before its start. Read once per `reading = None`."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # held for the connection's life, closed with it
        self.reading: Optional[float] = None

    def read(self) -> float:
        if self.reading is None:
            os.pwrite(self._file.fileno(), b"\0", 0)
            self.reading = os.fstat(self._file.fileno()).st_mtime
        return self.reading

    def close(self) -> None:
        self._file.close()


def _identity(path: str) -> Optional[tuple[int, int]]:
    """(device, inode) of the file at `path`, None where there is none."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino


class StoreFile:
    """An SQLite store's file as it was opened. `check()` raises a UserError where it is no longer safe
    to use: a store deleted under a search (`rm -rf` of its folder) took every later result with it
    without a word, and SQLite's shared memory (the -shm file, which it maps) made immutable
    (`chattr +i`) killed the next process that read or wrote it with a bus error (SIGBUS)."""

    def __init__(self, path: os.PathLike) -> None:
        self.where = str(path)
        self._path = os.path.abspath(path)
        self._opened = _identity(self._path)
        self._writable = os.access(self._path, os.W_OK)  # a store this process may only read stays readable

    def check(self) -> None:
        if self._opened is None:
            return
        now = _identity(self._path)
        if now != self._opened:
            raise UserError(f"search store {self.where} was {'deleted' if now is None else 'replaced'} while this "
                            "process used it: nothing more is written there (what is written into a deleted file is "
                            "lost with it); restore it from a copy, or start the search again")
        name = self.unwritable()
        if name is not None:
            raise UserError(f"cannot write to search store {self.where}: {name} is no longer writable (made immutable "
                            "or read-only while in use); every evaluation recorded before is kept: make it writable "
                            "again and continue with --resume")

    def unwritable(self) -> Optional[str]:
        """The first of the store's files that was writable when opened and no longer is, or None."""
        if self._writable:
            for name in (self._path, self._path + "-wal", self._path + "-shm"):
                if os.path.exists(name) and not os.access(name, os.W_OK):
                    return name
        return None


def never_close(connection: object) -> None:
    """Leave `connection` open until the process ends, without ever running its close, not even in the
    interpreter's teardown (its reference count is raised for good). For an SQLite connection whose
    files can no longer be written: the last one to close checkpoints through the mapped -shm file,
    and that is a bus error (SIGBUS) once the file is immutable. The kernel drops its locks at exit."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(connection))
