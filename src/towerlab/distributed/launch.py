"""Local workers: `launch` starts `--devices N` processes (fork or spawn) that rendezvous through a
FileStore in a private temp folder, so no code names a port; it watches their exits and heartbeats,
stops the others when one fails and names the cause. `leave` is how every worker exits, towerlab's
own and torchrun's.

It is over 350 lines because both ends of one protocol live here: what a worker does (heartbeats,
reporting a user error through the rendezvous folder, leaving) and what the launcher reads of it
(`_monitor`); distributed/crew.py reuses the same pieces for a search's workers."""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from towerlab.distributed.group import peer_lost
from towerlab.distributed.signals import (EXIT_PEER_LOST, EXIT_SIGINT, EXIT_SIGTERM, EXIT_STOPPED, EXIT_USER_ERROR,
                                          Interrupted, alive, handle_stop_signals, interrupt_once)
from towerlab.errors import UserError
from towerlab.proof import LoaderThere


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _die_with(launcher_pid: int) -> None:
    """Have the kernel kill this process when its launcher dies (Linux's parent-death signal), so a
    launcher killed with SIGKILL leaves no replica or worker running on, writing into its folder."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != launcher_pid:  # it died before the signal was armed
        os._exit(EXIT_PEER_LOST)


HEARTBEAT = 1.0  # seconds between a spawned process's heartbeats
STARTUP = 60.0  # seconds a spawned process may take to import torch and beat for the first time


def _beat(beats: Any, rank: int) -> None:
    """Write this process's time into its slot of the launcher's shared array, every HEARTBEAT s,
    from a thread of its own: a process stopped (SIGSTOP) or hung with the GIL held stops beating,
    while one that waits in a collective or computes in torch's kernels (which release the GIL) beats on."""
    def run() -> None:
        while True:
            beats[rank] = time.monotonic()
            time.sleep(HEARTBEAT)

    threading.Thread(target=run, name="towerlab-heartbeat", daemon=True).start()


def worker_entry(fn: Callable[..., None], rank: int, world_size: int, store_path: str, _loader: object,
                  args: tuple, launcher_pid: int, beats: Any) -> None:
    # `_loader`: towerlab.proof's loader, installed in a spawned process before `args` are unpickled
    # (proof.LoaderThere), where the launcher has it.
    # Each worker exits with a status the launcher understands. A user error's message goes to the
    # launcher (a file beside the rendezvous store), which reports the first one, whichever rank had it.
    _die_with(launcher_pid)
    _beat(beats, rank)
    signal.signal(signal.SIGINT, interrupt_once)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked worker inherits the launcher's forwarding
    try:
        fn(rank, world_size, store_path, *args)
    except BaseException as exc:  # noqa: BLE001 - every way out is an exit status
        # Left from inside the handler: `exc` holds the failed run's frames (its model, DDP's reducer,
        # the process group), and freeing them runs gloo's teardown with the GIL held, which deadlocks
        # with a gloo thread that still drops a finished collective's tensors (seen on a diverged run:
        # the replica hung until --timeout). `leave` skips that teardown.
        leave(_failure_status(exc, store_path, rank))
    leave(0)


def _failure_status(exc: BaseException, store_path: str, rank: int) -> int:
    """The exit status of a worker that raised `exc`; one that is none of the known ways to fail
    (a bug) has its traceback printed, as multiprocessing would, and exits with 1."""
    if isinstance(exc, SystemExit):
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    if isinstance(exc, UserError):
        _report_user_error(store_path, rank, str(exc))
        return EXIT_USER_ERROR
    if isinstance(exc, Interrupted):
        return exc.exit_status
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_SIGINT
    if peer_lost(exc):  # the launcher names the peer that died
        return EXIT_PEER_LOST
    traceback.print_exception(exc)
    return 1


def leave(status: int) -> None:
    """Exit without the interpreter's teardown. Everything is written and closed by now; what is
    left are native threads (gloo's, the store's) that a full teardown may destroy while they still
    run, which aborts the process ("terminate called without an active exception", SIGABRT) and
    turns a finished replica into a failed one."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a broken pipe: nothing to keep
            stream.flush()
    os._exit(status)


RDZV_PREFIX = "towerlab-rdzv-"


def sweep_rendezvous() -> None:
    """Remove the rendezvous folders of launchers that are gone (one killed with SIGKILL cannot
    remove its own); each folder's name carries its launcher's pid."""
    for folder in Path(tempfile.gettempdir()).glob(RDZV_PREFIX + "*"):
        pid = folder.name[len(RDZV_PREFIX):].split("-")[0]
        if pid.isdigit() and not alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class LaunchOptions:
    """How `launch` runs its processes. When one worker dies, the others get `grace` seconds to stop on
    their own (they usually fail at once on the broken collective), then are terminated; `log` hears
    what happened (None: stderr) and `hint()` says how to continue after a failure. With `essential`
    given, only the failure of those ranks stops the job; the others' deaths are logged and the job goes
    on (the search hands their work to someone else). `start_method` is "spawn" (fresh interpreters:
    `fn` and `args` must pickle) or "fork" (see `start_method_for`). With `timeout`, a process whose
    heartbeat is older than that (stopped, or hung) is killed and named as the cause, exactly as if it
    had died. `name(rank)` is what messages call a rank (None: "replica rank N")."""

    grace: float = 20.0
    log: Callable[[str], None] | None = None
    hint: Callable[[], str] | None = None
    essential: set[int] | None = None
    start_method: str = "spawn"
    timeout: float | None = None
    name: Callable[[int], str] | None = None


def launch(fn: Callable[..., None], world_size: int, args: tuple = (), options: LaunchOptions = LaunchOptions()) -> int:
    """Run `fn(rank, world_size, store_path, *args)` in `world_size` fresh processes, as `options` say.

    Returns the job's exit status, or raises the UserError of the worker that failed first with one
    (whichever its rank). SIGINT and SIGTERM are passed on to the workers, which save a checkpoint and
    exit 130 / 143. The workers die with the launcher, however it dies.
    """
    log = options.log or (lambda line: print(line, file=sys.stderr, flush=True))
    start_method = options.start_method
    sweep_rendezvous()
    rdzv = tempfile.mkdtemp(prefix=f"{RDZV_PREFIX}{os.getpid()}-")
    store_path = os.path.join(rdzv, "store")
    ctx: Any = mp.get_context(start_method)  # a fork or spawn context: Process, Array
    beats = ctx.Array("d", world_size, lock=False)  # each process's last heartbeat (time.monotonic)
    procs = [ctx.Process(target=worker_entry, args=(fn, rank, world_size, store_path, LoaderThere(), args, os.getpid(),
                                                    beats), daemon=False)
             for rank in range(world_size)]
    received: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        signal_alive(procs, signum)

    previous = handle_stop_signals(forward)
    starter = ForkingThread() if start_method == "fork" else None
    status = None
    try:
        if starter is not None:
            for p in procs:
                starter.start(p)
        else:
            start_spawned(procs)
        watch = _Heartbeats(beats, options.timeout) if options.timeout is not None else None
        status = _monitor(procs, options, received, watch, log, options.name or (lambda rank: f"replica rank {rank}"))
        error = first_user_error(rdzv, options.essential) if status == EXIT_USER_ERROR else None
        if error is not None:
            raise UserError(error)
        return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.pid is None:
                continue  # never started
            if p.is_alive():
                p.kill()
            p.join()
        if starter is not None:
            starter.release()
        shutil.rmtree(rdzv, ignore_errors=True)


def start_method_for(device_kind: str) -> str:
    """How a job starts its local workers. "fork" on Linux for CPU workers while CUDA is not
    initialised here: a forked worker needs nothing pickled and never re-imports `__main__`, so a
    notebook, code fed through stdin, or a script without an `if __name__ == "__main__"` guard can
    train its own module classes and in-memory arrays. "spawn" otherwise: CUDA cannot be used in a
    child forked after CUDA was touched (torch.cuda.is_available() already does), and macOS
    frameworks are not fork-safe. A forked worker also starts at once, where a spawned one imports
    torch first (about 1.3 s on a 2-core machine)."""
    if sys.platform.startswith("linux") and device_kind == "cpu" and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def start_spawned(procs: list) -> None:
    try:
        for p in procs:
            p.start()
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise UserError(f"the worker processes are spawned (fresh interpreters), and what they run cannot be "
                        f"sent to them ({' '.join(str(exc).split())[:200]}): define your model class or factory "
                        "in an importable module (a .py file), not in a notebook or __main__") from None


class ForkingThread:
    """Forks worker processes from a thread of its own, which lives until they are gone.

    A fresh thread, because GNU OpenMP (torch's CPU thread pool) cannot run a parallel region in a
    child forked from a thread that has used its pool: the child waits for pool threads that fork
    did not copy, and hangs. A child forked from a thread that never used OpenMP builds a pool of its
    own. Kept alive, because Linux's parent-death signal (`_die_with`) follows the thread that
    forked, not its process. `start(p)` may be called again later (a replacement worker)."""

    def __init__(self) -> None:
        self._orders: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="towerlab-workers", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            order = self._orders.get()
            if order is None:
                return
            process, answer = order
            try:
                process.start()
                answer.put(None)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the thread that asked
                answer.put(exc)

    def start(self, process: Any) -> None:
        answer: queue.Queue = queue.Queue()
        self._orders.put((process, answer))
        error = answer.get()
        if error is not None:
            raise error

    def release(self) -> None:
        """After the workers are gone."""
        self._orders.put(None)
        self._thread.join()


USER_ERROR_PREFIX = "user-error-"


def _report_user_error(store_path: str, rank: int, message: str) -> None:
    path = Path(store_path).parent / f"{USER_ERROR_PREFIX}{rank}"
    with contextlib.suppress(OSError):  # the exit status still says "user error"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(message, encoding="utf-8")
        os.replace(tmp, path)


def first_user_error(rdzv: str, essential: set[int] | None) -> str | None:
    """The message of the first worker (in time) that failed with a user error: later ones are
    usually the same mistake, or a consequence of the first."""
    reports = []
    for path in Path(rdzv).glob(USER_ERROR_PREFIX + "*"):
        rank = path.name[len(USER_ERROR_PREFIX):]
        if not rank.isdigit() or (essential is not None and int(rank) not in essential):
            continue
        with contextlib.suppress(OSError, UnicodeDecodeError):
            reports.append((path.stat().st_mtime_ns, int(rank), path.read_text(encoding="utf-8")))
    return min(reports)[2] if reports else None


class _Heartbeats:
    """The launcher's view of its processes' heartbeats."""

    def __init__(self, beats: Any, timeout: float):
        self.beats, self.timeout = beats, timeout
        self.started = time.monotonic()

    def silence(self, rank: int) -> float:
        """Seconds since `rank` last beat; before its first beat, the time past its STARTUP allowance."""
        last = self.beats[rank] or self.started + STARTUP
        return time.monotonic() - last

    def hung(self, procs: list, known: dict) -> list[int]:
        """Live ranks, not yet in `known`, silent for longer than the timeout."""
        return [rank for rank, p in enumerate(procs)
                if rank not in known and p.is_alive() and self.silence(rank) > self.timeout]


HUNG = "hung"  # a failure that is a process which stopped answering, not an exit status


def _monitor(procs: list, options: LaunchOptions, received: list[int], watch: _Heartbeats | None,
             log: Callable[[str], None], name: Callable[[int], str]) -> int:
    grace, hint, essential = options.grace, options.hint, options.essential
    failures: dict[int, int | str] = {}  # rank -> exit code (or HUNG), in the order seen
    silent: dict[int, float] = {}  # rank -> seconds without a heartbeat, when it was found hung
    ended_here: set[int] = set()
    deadline = None
    while any(p.is_alive() for p in procs):
        wait([p.sentinel for p in procs if p.is_alive()], timeout=HEARTBEAT)
        for rank in watch.hung(procs, failures) if watch is not None and not received else []:
            silent[rank] = watch.silence(rank)  # type: ignore[union-attr]  # a rank watch.hung named
            procs[rank].kill()  # SIGKILL ends a stopped process too; its peers then fail at once
            failures[rank] = HUNG
            if essential is not None and rank not in essential:
                log(f"towerlab: warning: {name(rank)} (pid {procs[rank].pid}) {_describe_hung(silent[rank])}: "
                    "killed it; the others carry on")
            elif deadline is None:
                deadline = time.monotonic() + grace
                if essential is not None:
                    signal_alive(procs, signal.SIGTERM)
        for rank, p in enumerate(procs):
            if p.exitcode in (None, 0) or rank in failures:
                continue
            failures[rank] = p.exitcode
            if essential is not None and rank not in essential and not received:
                if deadline is None:  # once the job ends, the others' exits are no news
                    log(f"towerlab: warning: {name(rank)} (pid {p.pid}) {describe_exit(p.exitcode)}; "
                        "the others carry on")
            elif deadline is None:
                deadline = time.monotonic() + grace
                if essential is not None and rank in essential and not received:
                    # Without this rank the job cannot go on, and the others would only wait for it:
                    # ask them to stop now (they exit at their next step) rather than after `grace`.
                    signal_alive(procs, signal.SIGTERM)
        if essential is not None and deadline is None and not any(procs[r].is_alive() for r in essential):
            deadline = time.monotonic() + grace  # the job is over; the rest only have to leave
        if deadline is not None and time.monotonic() > deadline:
            for rank, p in enumerate(procs):
                if p.is_alive():
                    ended_here.add(rank)  # its exit is this launcher's doing, not a cause
                    p.terminate()
            for p in procs:
                p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
    for rank, p in enumerate(procs):
        if p.exitcode not in (None, 0) and rank not in failures:
            failures[rank] = p.exitcode
    if essential is not None:
        failures = {r: c for r, c in failures.items() if r in essential}
    if not failures:
        return 0
    if received:
        return EXIT_SIGINT if received[0] == signal.SIGINT else EXIT_SIGTERM
    # The root cause: a process that stopped answering, else the first failure that is neither a
    # survivor noticing a lost peer (or timing out waiting for one) nor ended by this launcher.
    rank, code = min(failures.items(), key=lambda item: (item[1] != HUNG, item[0] in ended_here,
                                                         item[1] == EXIT_PEER_LOST))
    if code == EXIT_USER_ERROR or code in EXIT_STOPPED:
        return code
    advice = hint() if hint is not None else ""
    what = _describe_hung(silent[rank]) if code == HUNG else describe_exit(int(code))
    others = "the others were stopped" if essential is not None else "the other replicas were stopped"
    log(f"towerlab: error: {name(rank)} (pid {procs[rank].pid}) {what}; {others}" + (f". {advice}" if advice else ""))
    return 1


def _describe_hung(seconds: float) -> str:
    return f"stopped answering: no heartbeat for {seconds:.0f} s (stopped or hung), more than --timeout"


def signal_alive(procs: list, signum: int) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)


def describe_exit(exitcode: int) -> str:
    if exitcode == EXIT_PEER_LOST:
        return "lost contact with the others (a peer failed, or a collective waited longer than --timeout)"
    return f"was killed by {_signal_name(exitcode)}" if exitcode < 0 else f"exited with status {exitcode}"
