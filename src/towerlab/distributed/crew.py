"""Local worker processes that come and go (a search's): `Crew` starts `slots` processes, each running
`fn(slot, slots, reports, *args)`, and, unlike `launch` (whose replicas stand or fall together),
replaces one that dies after telling `on_lost` who it was and how it ended. The work itself is
elsewhere (a search's store), so a death costs only what that process held. The processes die with
the launcher however it dies (the parent-death signal), SIGINT and SIGTERM are passed on, a worker's
UserError ends the crew with that message, and a crew whose processes keep dying without anything
being done in between (`progressed`) gives up rather than restart them forever.

A process that dies says why, in the crew's lines: one that fails by an exception of none of the known
kinds (a bug) leaves its type and message (`last_words`, a file beside the rendezvous store, as a user
error's message is), and so does code of its own that ends it on purpose (`say_last`: a trial stuck past
its timeout); the crew names it with the exit status. A process that exits with status 0 while it still
held work (`on_lost` says whether it released any: `os._exit(0)` in code it ran) is a death, not a
process that left."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

from towerlab.distributed.launch import (RDZV_PREFIX, ForkingThread, first_user_error, signal_alive, start_spawned,
                                         sweep_rendezvous, worker_entry)
from towerlab.distributed.signals import EXIT_STOPPED, EXIT_USER_ERROR, Interrupted, signal_name
from towerlab.errors import UserError
from towerlab.proof import LoaderThere

LAST_WORDS = "last-words-"  # + a process's pid: why it died, in the rendezvous folder
_last_words: Path | None = None  # in a crew's process: where it says why it dies


def say_last(words: str) -> None:
    """In a crew's process about to die: why, for the crew's line about its death (nothing elsewhere)."""
    if _last_words is not None:
        with contextlib.suppress(OSError):
            _last_words.write_text(" ".join(words.split())[:500], encoding="utf-8")


def _speaking(slot: int, slots: int, store_path: str, fn: Callable[..., None], *args: Any) -> None:
    """`fn` in a crew's process, which leaves its last words where it fails by an exception of no known
    kind (a bug: its traceback goes to stderr as before)."""
    global _last_words
    _last_words = Path(store_path).parent / f"{LAST_WORDS}{os.getpid()}"
    try:
        fn(slot, slots, store_path, *args)
    except (UserError, Interrupted, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        try:
            say_last(f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001 - an exception whose __str__ fails: its type alone
            say_last(type(exc).__name__)
        raise


class Crew:
    """See the module's docstring. `name(slot)` is what messages call a slot's process; `patience`:
    deaths in a row, with no `progressed()` between them, after which the crew gives up."""

    def __init__(self, fn: Callable[..., None], slots: int, args: tuple = (), *, start_method: str = "spawn",
                 on_lost: Callable[[int, int, str], int] = lambda slot, pid, ended: 0,
                 log: Callable[[str], None] | None = None, name: Callable[[int], str] = lambda slot: f"worker {slot}",
                 patience: int | None = None) -> None:
        self.fn, self.slots, self.args, self.start_method = fn, slots, args, start_method
        self.on_lost, self.name = on_lost, name
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.patience = patience if patience is not None else max(3, 2 * slots)
        self.deaths = 0  # in a row, since the last progress
        self.finished: set[int] = set()  # slots whose process left by itself (status 0) or on request
        self.stopped: int | None = None  # the exit status of a process that stopped on request (130, 143)
        self._ctx: Any = mp.get_context(start_method)  # a fork or spawn context: Process, Array
        self._beats = self._ctx.Array("d", slots, lock=False)
        self._procs: dict[int, Any] = {}
        self._forker: ForkingThread | None = None
        sweep_rendezvous()
        self._reports = tempfile.mkdtemp(prefix=f"{RDZV_PREFIX}{os.getpid()}-")

    def __enter__(self) -> Crew:
        for slot in range(self.slots):
            self._start(slot)
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self._procs.values():
            if p.is_alive():
                p.kill()
            p.join()
        if self._forker is not None:
            self._forker.release()
        shutil.rmtree(self._reports, ignore_errors=True)

    def _start(self, slot: int) -> None:
        p = self._ctx.Process(target=worker_entry, daemon=False,
                              args=(_speaking, slot, self.slots, os.path.join(self._reports, "store"), LoaderThere(),
                                    (self.fn, *self.args), os.getpid(), self._beats))
        self._procs[slot] = p
        if self.start_method == "fork":
            if self._forker is None:
                self._forker = ForkingThread()
            self._forker.start(p)
        else:
            start_spawned([p])

    @property
    def pids(self) -> dict[int, int]:
        return {slot: p.pid for slot, p in self._procs.items() if p.is_alive()}

    def running(self) -> int:
        return sum(p.is_alive() for p in self._procs.values())

    def ended(self) -> bool:
        """Whether every process has left and `watch` has seen how: by itself or on request (a process
        that died a moment ago, and that `watch` has not seen yet, is no end: it is replaced)."""
        return len(self.finished) == len(self._procs)

    def progressed(self) -> None:
        """Something was done since the last death: the deaths in a row start again from none."""
        self.deaths = 0

    def watch(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for a process to end; replace each that died."""
        alive = [p.sentinel for p in self._procs.values() if p.is_alive()]
        if alive:
            wait(alive, timeout=timeout)
        else:
            time.sleep(timeout)
        for slot, p in list(self._procs.items()):
            if p.is_alive() or slot in self.finished:
                continue
            p.join()
            if p.exitcode == EXIT_USER_ERROR:
                raise UserError(first_user_error(self._reports, None) or f"{self.name(slot)} failed")
            if p.exitcode in EXIT_STOPPED:
                self.finished.add(slot)  # stopped on request (Ctrl-C, SIGTERM): not replaced
                self.stopped = p.exitcode
                continue
            ended = self._ended(p.pid, p.exitcode)
            if not self.on_lost(slot, p.pid, ended) and p.exitcode == 0:
                self.finished.add(slot)  # it left by itself, holding nothing
                continue
            self.deaths += 1
            if self.deaths > self.patience:
                raise CrewFailed(f"{self.deaths} worker processes died in a row without finishing anything (the last, "
                                 f"{self.name(slot)}, pid {p.pid}, {ended}): giving up")
            self.log(f"towerlab: warning: {self.name(slot)} (pid {p.pid}) {ended}; starting another in its place")
            self._start(slot)

    def _ended(self, pid: int, exitcode: int) -> str:
        """How a process ended, in words: its signal or exit status, and its last words where it left some."""
        ended = f"was killed by {signal_name(-exitcode)}" if exitcode < 0 else f"exited with status {exitcode}"
        with contextlib.suppress(OSError, UnicodeDecodeError):
            return f"{ended} ({Path(self._reports, f'{LAST_WORDS}{pid}').read_text(encoding='utf-8')})"
        return ended

    def stop(self, signum: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Ask every process to leave (`signum`), and kill those still there after `grace` seconds."""
        signal_alive(list(self._procs.values()), signum)
        deadline = time.monotonic() + grace
        for p in self._procs.values():
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every process to leave by itself; whether they all did."""
        deadline = time.monotonic() + timeout
        while self.running() and time.monotonic() < deadline:
            self.watch(min(1.0, max(0.0, deadline - time.monotonic())))
        return not self.running()


class CrewFailed(Exception):
    """The crew's processes keep dying (the message says how): a fault of the machine or a bug, not
    of one task."""
