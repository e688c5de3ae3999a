"""Stopping in order: the exit statuses shared by workers, the launcher and the command line, the
exception that carries a signal's, and the handlers that turn SIGINT / SIGTERM into a stop at a step
boundary. Standard library only: the CLI names the statuses before it imports torch, so that
`towerlab --help` and a mistyped flag answer at once."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable

EXIT_USER_ERROR = 2
EXIT_PEER_LOST = 3
EXIT_SIGINT = 130
EXIT_SIGPIPE = 141  # stdout was closed by its reader (`towerlab train | head -1`)
EXIT_SIGTERM = 143
EXIT_STOPPED = (EXIT_SIGINT, EXIT_SIGPIPE, EXIT_SIGTERM)  # an orderly stop: saved, resumable
STOP_SIGNALS = {EXIT_SIGINT: signal.SIGINT, EXIT_SIGPIPE: signal.SIGPIPE, EXIT_SIGTERM: signal.SIGTERM}


class Interrupted(Exception):
    """Raised by the training loop after it saved its state on SIGINT / SIGTERM (or a closed stdout)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_status = {int(signal.SIGINT): EXIT_SIGINT, int(signal.SIGPIPE): EXIT_SIGPIPE}.get(signum, EXIT_SIGTERM)


class StopFlag:
    """Records SIGINT / SIGTERM instead of dying, so the training loop can stop at a step boundary,
    agree with the other ranks, save, and exit 130 / 143."""

    # A Ctrl-C reaches a worker twice (from the terminal and forwarded by the launcher), so a repeat
    # only means "stop now, without saving" once this many seconds have passed since the first.
    REPEAT_WINDOW = 3.0

    def __init__(self) -> None:
        self.signum = 0
        self._first = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if not self.signum:
            self.signum, self._first = signum, time.monotonic()
        elif time.monotonic() - self._first > self.REPEAT_WINDOW:
            raise KeyboardInterrupt

    def request(self, signum: int) -> None:
        """Stop as if `signum` had arrived (a closed stdout asks for an orderly stop this way)."""
        if not self.signum:
            self.signum, self._first = signum, time.monotonic()

    def __enter__(self) -> "StopFlag":
        self._previous = handle_stop_signals(self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def handle_stop_signals(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """Have `handler` take SIGINT and SIGTERM; returns the handlers it replaced. Python runs signal
    handlers in the main thread only, so a job started from another thread (a GUI, a server, a
    notebook's background job) leaves the main thread's handlers as they are (and returns {}): the
    program that owns the main thread decides what a signal does. Its forked workers still stop
    in order on a Ctrl-C from the terminal, which reaches them directly."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


def signal_name(signum: int) -> str:
    """A signal's name (SIGKILL), or "signal N" for one Python does not name (a real-time signal: 34 to 64)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def interrupt_once(_signum: int, _frame: Any) -> None:
    # A Ctrl-C reaches a worker twice (from the terminal and forwarded by the launcher): the repeat
    # must not interrupt the handling of the first, or the worker dies with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def alive(pid: int) -> bool:
    """Whether process `pid` runs on this machine (another user's counts; a zombie, dead and not yet
    reaped by a parent that does not reap, does not)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # the state follows the name in parentheses
    except (OSError, IndexError):
        return True  # no /proc (not Linux): the signal test alone
