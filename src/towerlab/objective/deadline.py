"""A trial's timeout (--trial-timeout), the rule every kind of objective keeps: a trial that runs past it is
stopped and fails, its reason `timed_out`. A function's trial and towerlab's own training are stopped by their
worker's process, here (`Deadline`); a command's program is ended by `towerlab.objective.process`.

At the deadline, `TrialTimedOut` is raised in the thread that runs the trial: by SIGALRM in the main
thread (a worker runs its trials there), which interrupts Python code and a blocking call (a sleep, a
read, a wait) alike; from another thread, as an asynchronous exception, which Python code meets at its
next line. A BaseException, so that an `except Exception` of the trial's does not swallow it. Where it is
swallowed all the same (met inside a finalizer, a `__del__` or a weakref callback, whose exceptions Python
prints and ignores; or by the trial's own `except BaseException`) and the trial then ends, it still fails:
the deadline raises it again as the trial's `with` ends. A trial
still running GRACE seconds after that (stuck in native code that never returns to Python, or catching
every exception) ends its worker's process, saying so on stderr: its task goes back on the queue, and
a task that loses its workers that way three times fails (`towerlab.search.work.worker.MAX_ATTEMPTS`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any, Optional

from towerlab.distributed.crew import say_last
from towerlab.errors import UserError

GRACE = 30.0  # seconds a timed-out trial has to leave before its worker's process is ended
EXIT_STUCK = 1  # the status of a worker ended that way (its launcher replaces it, its task back on the queue)
_exit = os._exit  # the real one: a trial's os._exit is replaced while it runs (`objective.function`)


def check_timeout(timeout: object) -> None:
    """A timeout is None (none) or a number of seconds above 0 (a UserError otherwise)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise UserError(f"--trial-timeout {timeout!r}: give a number of seconds above 0")


def timed_out(timeout: float) -> str:
    """The reason of a trial stopped at its timeout, whatever its kind."""
    return f"timed out after {timeout:g} s, and was stopped"


def lapses(timeout: Optional[float]) -> Optional[float]:
    """Seconds after which a trial under `timeout` is over whatever it does (stopped, or its worker ended past
    GRACE): past them its worker renews its lease no more (None: no timeout, no end)."""
    return None if timeout is None else timeout + GRACE


class TrialTimedOut(BaseException):
    """Raised in a trial that ran past its timeout."""


class Deadline:
    """`with Deadline(timeout):` runs its body under `timeout` seconds (None: none), as the module says."""

    def __init__(self, timeout: Optional[float], grace: Optional[float] = None) -> None:
        self.timeout, self.grace = timeout, GRACE if grace is None else grace
        self._done = threading.Event()
        self._previous: Any = None
        self._alarm = False
        self._expired = False  # the timeout passed while the trial ran: it fails, whatever became of the raise

    def __enter__(self) -> Deadline:
        if self.timeout is None:
            return self
        thread = threading.current_thread()
        self._alarm = thread is threading.main_thread()
        if self._alarm:
            self._previous = signal.signal(signal.SIGALRM, self._ring)
            signal.setitimer(signal.ITIMER_REAL, self.timeout)
        threading.Thread(target=self._watch, args=(thread.ident,), name="towerlab-trial-deadline", daemon=True).start()
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        self._done.set()
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
        if self._expired and kind is None:  # the raise at the deadline was swallowed, and the trial ran on
            raise TrialTimedOut

    def _ring(self, _signum: int, _frame: Any) -> None:
        self._expired = True
        raise TrialTimedOut

    def _watch(self, ident: Optional[int]) -> None:
        assert self.timeout is not None
        if self._done.wait(self.timeout):
            return
        self._expired = True
        if not self._alarm and ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(TrialTimedOut))
        if self._done.wait(self.grace):
            return
        why = (f"a trial ran past its timeout ({self.timeout:g} s) and did not stop within {self.grace:g} s (stuck in "
               "native code, or catching every exception)")
        say_last(why)
        print(f"towerlab: error: {why}: ending its worker (pid {os.getpid()}); its task goes back on the queue",
              file=sys.stderr, flush=True)
        _exit(EXIT_STUCK)

