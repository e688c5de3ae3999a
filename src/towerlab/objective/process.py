"""A trial's program as a process group of its own: started without a shell, waited for with a timeout
and a stop, and ended whole.

The program runs in a new session (its own process group, no terminal: a Ctrl-C at the terminal
reaches towerlab, which ends the program in order, rather than both at once), its stdin empty, its
stdout and stderr written straight to files. Its leader is waited for without being reaped (a pidfd
on Linux, `waitid(WNOWAIT)` elsewhere), so that its process group's id cannot be taken by another
process before the group's stragglers are killed: every process a trial leaves behind dies with it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from towerlab.distributed.signals import Interrupted

GRACE = 5.0  # seconds a program has to end on SIGTERM (SIGINT) before SIGKILL
STOP_POLL = 0.2  # seconds between looks at a worker's stop while a program runs


@dataclass(frozen=True)
class Ended:
    """How a program ended: its exit `status`, or the `signal` that killed it, or that it ran past its
    timeout (and was ended)."""

    status: int = 0
    signal: int = 0
    timed_out: bool = False


def start(argv: list[str], env: dict[str, str], stdout: Path, stderr: Path) -> Child:
    """`argv` started as its own session, its output written to `stdout` and `stderr` (an OSError where
    it cannot start)."""
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                   start_new_session=True)
    return Child(process)


class Child:
    """A started program (see the module's docstring)."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        try:
            self._pidfd: Optional[int] = os.pidfd_open(process.pid)
        except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
            self._pidfd = None

    def finish(self, timeout: Optional[float], stop: Optional[Callable[[], int]] = None) -> Ended:
        """Wait for the program to end (at most `timeout` seconds, then end it), and end what it left.
        A KeyboardInterrupt while it runs ends it with SIGINT and is raised again; a `stop()` that
        returns a signal's number ends it with that signal and raises Interrupted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._end(signal.SIGTERM)
                    return Ended(timed_out=True)
                wait = STOP_POLL if stop is not None else 3600.0
                if self._exited(wait if left is None else min(wait, left)):
                    break
                signum = stop() if stop is not None else 0
                if signum:
                    self._end(signum)
                    raise Interrupted(signum)
        except BaseException as exc:
            self._end(signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
            raise
        self._reap()
        code = self.process.returncode
        return Ended(status=max(code, 0), signal=max(-code, 0))

    def _exited(self, seconds: float) -> bool:
        """Whether the program's leader has exited, waiting at most `seconds`; it is not reaped."""
        if self._pidfd is not None:
            poll = select.poll()
            poll.register(self._pidfd, select.POLLIN)
            return bool(poll.poll(max(seconds, 0.0) * 1000))
        until = time.monotonic() + seconds
        while True:
            if os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            if time.monotonic() >= until:
                return False
            time.sleep(min(0.02, max(until - time.monotonic(), 0.0)))

    def _signal(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass  # no process of the group is left

    def _end(self, signum: int) -> None:
        """End the program: `signum` to its group, GRACE seconds for its leader to exit, then SIGKILL to
        the group and reap it."""
        if self.process.returncode is not None:
            return
        self._signal(signum)
        self._exited(GRACE)
        self._reap()

    def _reap(self) -> None:
        """Kill what the program's group still holds (its leader, exited but not reaped, keeps the group's
        id its own), then reap the leader."""
        self._signal(signal.SIGKILL)
        self.process.wait()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
