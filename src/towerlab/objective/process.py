"""A trial's program, started through a keeper (`towerlab.objective.keeper`): waited for with a timeout and
a stop, and ended whole, whoever dies first.

The program runs in a new session (its own process group, no terminal: a Ctrl-C at the terminal reaches
towerlab, which ends the program in order, rather than both at once), its stdin empty, its stdout and
stderr written straight to files. Between the worker and it stands the keeper, a small process of the
standard library alone in a session of its own: it starts the program, ends it when asked (a timeout, a
stop, a Ctrl-C: the signal to its group, then SIGKILL GRACE seconds later), and kills everything it left
once it exits, even in sessions of their own (the keeper is their subreaper); and when the worker dies,
however (SIGKILL, the out-of-memory killer, its launcher killed with it), the keeper sees its pipe close
and kills the program and all it started at once. A trial tried again in the same folder waits for the
last try's processes to be gone (the keeper's lock on the folder, `LOCK`).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from towerlab.distributed.signals import Interrupted

GRACE = 5.0  # seconds a program has to end on SIGTERM (SIGINT) before SIGKILL
ENDED = GRACE + 30.0  # seconds within which a program told to end is gone, its keeper's word included
STOP_POLL = 0.2  # seconds between looks at a worker's stop while a program runs
STOPPING = 1.0  # seconds a worker's stop may take to be seen after its signal killed a keeper as it started
WAITING = 60.0  # seconds a trial waits for the processes of an earlier try in its folder to be gone
LOCK = ".towerlab-trial.lock"  # in the trial's folder: held by the keeper while any process of the trial lives
KEEPER = Path(__file__).with_name("keeper.py")


@dataclass(frozen=True)
class Ended:
    """How a program ended: its exit `status`, or the `signal` that killed it, or that it ran past its
    timeout (and was ended)."""

    status: int = 0
    signal: int = 0
    timed_out: bool = False


def start(argv: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> Child:
    """`argv` started through its keeper as its own session, its output written to `stdout` and `stderr`
    (beside them, the folder's lock); an OSError where it cannot start (a ValueError: a NUL in `argv`)."""
    keeper_env = dict(env)
    if not hasattr(os, "pidfd_open"):
        keeper_env["TOWERLAB_KEEPER_NO_PIDFD"] = "1"
    keeper = subprocess.Popen([sys.executable, "-I", "-S", str(KEEPER), str(stdout.parent / LOCK), str(stdout),
                               str(stderr), repr(WAITING), "--", *argv], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=keeper_env, start_new_session=True)
    child = Child(keeper)
    word, _, rest = child.said(None).partition(" ")
    if word == "lost":
        child.close()
        raise KeeperLost(0, "its keeper process ended before it started it")
    if word != "started":
        child.close()
        errno, _, text = rest.partition(" ")
        raise OSError(int(errno) if errno.isdigit() else 0, text or "its keeper process ended before it started it")
    return child


class KeeperLost(OSError):
    """The keeper ended without a word before it started the program: killed. A stop's signal sent to the
    worker's process group kills one that is being started, before it is in a session of its own."""


def stop_seen(stop: Optional[Callable[[], int]], within: float = STOPPING) -> int:
    """The signal's number a worker's `stop()` gives within `within` seconds (0: none, or no `stop`): a keeper
    lost as it started was killed by the stop's signal where the worker is told to stop a moment later."""
    if stop is None:
        return 0
    until = time.monotonic() + within
    while not (signum := stop()) and time.monotonic() < until:
        time.sleep(0.01)
    return signum


class Child:
    """A started program, as its keeper tells of it (see the module's docstring)."""

    def __init__(self, keeper: subprocess.Popen) -> None:
        self.keeper = keeper
        self._buffer = b""

    def said(self, timeout: Optional[float]) -> str:
        """The keeper's next line, waiting at most `timeout` seconds (None: until it says one): "" where
        it said none by then, "lost" where it ended without a word (killed)."""
        assert self.keeper.stdout is not None
        fd = self.keeper.stdout.fileno()
        until = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if until is None else max(0.0, until - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                return ""
            data = os.read(fd, 4096)
            if not data:
                return "lost"
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def finish(self, timeout: Optional[float], stop: Optional[Callable[[], int]] = None) -> Ended:
        """Wait for the program to end (at most `timeout` seconds, then end it), and for all it left to be
        ended. A KeyboardInterrupt while it runs ends it with SIGINT and is raised again; a `stop()` that
        returns a signal's number ends it with that signal and raises Interrupted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._end(signal.SIGTERM)
                    return Ended(timed_out=True)
                wait = STOP_POLL if stop is not None else 3600.0
                said = self.said(wait if left is None else min(wait, left))
                if said:
                    return self._ended(said)
                signum = stop() if stop is not None else 0
                if signum:
                    self._end(signum)
                    raise Interrupted(signum)
        except BaseException as exc:
            self._end(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
            raise
        finally:
            self.close()

    def _ended(self, said: str) -> Ended:
        word, _, status = said.partition(" ")
        if word != "ended":  # its keeper was killed (and with it, the program's watch): said as a kill
            return Ended(signal=signal.SIGKILL)
        code = int(status)
        return Ended(status=max(code, 0), signal=max(-code, 0))

    def _end(self, signum: int) -> None:
        """End the program: `signum` to its group, GRACE seconds for its leader to exit, then SIGKILL to all
        it started; wait for the keeper to say so."""
        if self.keeper.returncode is not None or self.keeper.stdin is None or self.keeper.stdin.closed:
            return
        try:
            self.keeper.stdin.write(f"end {int(signum)} {GRACE!r}\n".encode())
            self.keeper.stdin.flush()
        except OSError:  # the keeper is gone, and the program with it
            return
        self.said(ENDED)

    def close(self) -> None:
        """Let the keeper go: closing its pipe ends whatever is left of the program; reap it."""
        if self.keeper.stdin is not None and not self.keeper.stdin.closed:
            try:
                self.keeper.stdin.close()
            except OSError:
                pass
        self.keeper.wait()
        if self.keeper.stdout is not None:
            self.keeper.stdout.close()
