"""Processes and process groups. The ONLY module that reads RANK / WORLD_SIZE / LOCAL_RANK, picks
nccl or gloo, spawns local workers and tears groups down.

Three ways a process can be part of a run:
- alone (world size 1): no process group at all;
- spawned by `launch` for `--devices N`: rendezvous through a FileStore in a private temp folder,
  so no code names a port;
- started by torchrun (RANK and WORLD_SIZE set): join the group torchrun describes (env://).
"""

from __future__ import annotations

import contextlib
import os
import platform
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from towerlab.errors import UserError
# Defined apart so the CLI reads them without torch; the modules that use torch import them from here.
from towerlab.exits import (EXIT_PEER_LOST, EXIT_SIGINT, EXIT_SIGPIPE, EXIT_SIGTERM, EXIT_STOPPED,  # noqa: F401
                            EXIT_USER_ERROR, Interrupted)


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
        self._previous = _handle_stop_signals(self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def _handle_stop_signals(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """Have `handler` take SIGINT and SIGTERM; returns the handlers it replaced. Python runs signal
    handlers in the main thread only, so a job started from another thread (a GUI, a server, a
    notebook's background job) leaves the main thread's handlers as they are (and returns {}): the
    program that owns the main thread decides what a signal does. Its forked workers still stop
    in order on a Ctrl-C from the terminal, which reaches them directly."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}


@dataclass(frozen=True)
class Context:
    """Who this process is in the run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: a single process without a process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int, low: int = 0) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise UserError(f"environment variable {name}={text!r} is not a whole number >= {low}: torchrun sets it; "
                        "start under torchrun, or unset it")
    return value


def under_torchrun() -> bool:
    """Whether torchrun started this process (RANK and WORLD_SIZE set). A half-set environment
    (RANK without WORLD_SIZE, no MASTER_ADDR, a rank beyond the world) is refused in one line
    rather than running alone or failing deep inside the rendezvous."""
    present = [name for name in ("RANK", "WORLD_SIZE") if os.environ.get(name, "").strip()]
    if not present:
        return False
    if len(present) == 1:
        missing = "WORLD_SIZE" if present == ["RANK"] else "RANK"
        raise UserError(f"{present[0]} is set but {missing} is not: both come from torchrun; start under "
                        f"torchrun, or unset {present[0]} to run alone")
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1, low=1)
    if rank >= world_size:
        raise UserError(f"RANK={rank} is not below WORLD_SIZE={world_size}: start under torchrun, or unset both")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name, "").strip():
            raise UserError(f"RANK and WORLD_SIZE are set but {name} is not: start under torchrun (it sets all "
                            "of them), or unset RANK and WORLD_SIZE to run alone")
    if not 0 < _env_int("MASTER_PORT", 0) < 65536:
        raise UserError(f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a port number (1-65535)")
    if _env_int("LOCAL_RANK", 0) >= _env_int("LOCAL_WORLD_SIZE", world_size, low=1):
        raise UserError("LOCAL_RANK is not below LOCAL_WORLD_SIZE: start under torchrun, or unset them")
    _env_int("TORCHELASTIC_RESTART_COUNT", 0)
    return True


def torchrun_world_size() -> int:
    return _env_int("WORLD_SIZE", 1, low=1)


def torchrun_restart() -> tuple[str | None, int]:
    """(the torchrun job's run id, how many times torchrun restarted this worker group); (None, 0)
    outside torchrun. The run id stays the same across the restarts of one `torchrun` command
    (`--standalone` makes a fresh one per command), so it tells "my own earlier attempt" apart from
    an older run that happens to use the same output folder."""
    if not under_torchrun():
        return None, 0
    return os.environ.get("TORCHELASTIC_RUN_ID"), _env_int("TORCHELASTIC_RESTART_COUNT", 0)


def device_type(device: str = "auto") -> str:
    """The device kind a run with `--device` `device` uses: "cuda" or "cpu"."""
    if device == "cpu":
        return "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but CUDA is not available here (no GPU, or a CPU-only build of "
                        "torch): use --device cpu or auto")
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_devices(devices: int | None, device: str = "auto") -> int:
    """How many local replicas `--devices` asks for on this machine: every GPU, or two CPU processes
    (one on a one-core machine) when it is None; more GPUs than present is a user error."""
    kind = device_type(device)
    if kind == "cuda":
        present = torch.cuda.device_count()
        if devices is not None and devices > present:
            raise UserError(f"--devices {devices} asks for more GPUs than the {present} present: use "
                            f"--devices {present} or fewer, or --device cpu for {devices} CPU processes")
        return present if devices is None else devices
    return min(2, os.cpu_count() or 1) if devices is None else devices


def default_threads(processes: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, processes))


def search_workers(devices: int | None, device: str = "auto") -> int:
    """How many local workers `--devices` gives a search: as for training on GPUs; on a CPU, one per
    core (each trains its candidates on `search_threads`' one thread), as many as memory holds."""
    if devices is not None or device_type(device) == "cuda":
        return resolve_devices(devices, device)
    return max(1, min(os.cpu_count() or 1, machine_memory() // PROCESS_BYTES))


def search_threads(threads: int | None, device: str, workers: int) -> int:
    """CPU threads per search worker. On a CPU, `--threads` or 1: never the cores shared out among
    the workers, because a float sum's order follows the thread count, so a candidate trained on 2
    threads need not score what it scores on 1 (measured: 0.9716 against 0.9706 after one MNIST
    epoch), and a search's history would then depend on how many workers ran it. On a GPU the
    threads only feed the device: cores / workers, as for training."""
    if threads is not None:
        return threads
    return 1 if device_type(device) == "cpu" else default_threads(workers)


def device_name(device: torch.device) -> str:
    """The device's model (the GPU's name; the CPU's, from /proc/cpuinfo where there is one), which
    picks the kernels and so, in the last bits, the results."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as stream:
            name = next((line.split(":", 1)[1].strip() for line in stream if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or platform.machine()


OVERSUBSCRIPTION = 8  # busy threads per core beyond which each one only slows the others down
PROCESS_BYTES = 2**29  # what one process holds at least: torch itself (~220 MiB), its data, a model


def machine_memory() -> int:
    """Bytes of physical memory on this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_capacity(processes: int, threads: int, what: str) -> None:
    """Refuse to start more local processes, or threads, than this machine can hold (a few per core,
    and the memory each process needs at least), in one line, before anything starts. `what` names
    the flags that asked for the processes."""
    cores = os.cpu_count() or 1
    memory = machine_memory()
    most = max(1, min(OVERSUBSCRIPTION * cores, memory // PROCESS_BYTES))
    if processes > most:
        raise UserError(f"{what} asks for {processes} processes on this machine, which holds at most {most} "
                        f"({cores} cores, {memory / 2**30:.0f} GiB of memory): ask for {most} or fewer")
    if processes * threads > OVERSUBSCRIPTION * cores:
        raise UserError(f"--threads {threads} in each of {processes} process(es) makes {processes * threads} threads "
                        f"on {cores} cores: at most {OVERSUBSCRIPTION * cores} in all can make progress; use fewer")


def local_processes(run: Any) -> int:
    """Processes of this job on this machine: torchrun says so, otherwise --devices."""
    if under_torchrun():
        return _env_int("LOCAL_WORLD_SIZE", 1, low=1)
    return resolve_devices(run.devices, run.device)


@contextlib.contextmanager
def session(*, rank: int = 0, world_size: int = 1, store_path: str | None = None, timeout: float = 120.0,
            backend: str | None = None, per_device: int = 1, device: str = "auto") -> Iterator[Context]:
    """Join (or skip, when alone) the process group and always tear it down.

    Under torchrun the environment decides rank and world size; otherwise the caller does.
    `per_device` processes share each GPU (the search packs small candidates that way); they must
    then talk over gloo (`backend="gloo"`), since NCCL allows one rank per GPU. `device` is the
    run's `--device` (auto, cpu or cuda).
    """
    kind = device_type(device)
    if under_torchrun():
        rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1, low=1)
        local_rank = _env_int("LOCAL_RANK", 0)
    else:
        local_rank = rank
    device = torch.device(kind, local_rank // per_device) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1 and not under_torchrun():
        yield Context(device=device)
        return
    backend = backend or ("nccl" if kind == "cuda" else "gloo")
    options: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout),
                               "rank": rank, "world_size": world_size}
    if under_torchrun():
        options["store"] = _torchrun_store(timeout)
    else:
        options["store"] = dist.FileStore(store_path, world_size)
    if backend == "nccl":
        options["device_id"] = device
    dist.init_process_group(**options)
    try:
        yield Context(rank=rank, local_rank=local_rank, world_size=world_size, device=device, backend=backend)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _torchrun_store(timeout: float) -> Any:
    """The store torchrun describes (env://), with this restart attempt's keys under their own prefix.

    torchrun's agent keeps one store for every restart of a worker group (its shared rendezvous
    store): without the prefix a restarted group reads the keys of the attempt before, and gloo
    connects to the dead workers' addresses ("Connection refused", pytorch/pytorch#167288), or the
    search's pool takes old results for new tasks.
    """
    store, _rank, _world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))
    return dist.PrefixStore(f"towerlab/attempt{torchrun_restart()[1]}", store)


def cpu_group(ctx: Context) -> Any:
    """A group that moves CPU tensors: the default group under gloo, a gloo side group under nccl.
    Every rank must call this at the same point."""
    if ctx.backend == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def world_group(ctx: Context) -> Any:
    """The group of every rank of the run, or None for a process alone."""
    return dist.group.WORLD if ctx.distributed else None


def kv_store() -> Any:
    """The key-value store of the default process group (the search's coordination channel)."""
    return dist.distributed_c10d._get_default_store()  # noqa: SLF001 - the public API has no getter


def max_over_ranks(ctx: Context, value: float, group: Any = None) -> float:
    """The largest `value` of all ranks, on every rank. A collective: all ranks must call it."""
    if not ctx.distributed:
        return value
    device = torch.device("cpu") if group is not None else ctx.device
    tensor = torch.tensor([float(value)], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return float(tensor.item())


def sum_over_ranks(ctx: Context, values: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks (in place). A collective: all ranks must call it."""
    if ctx.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_object(ctx: Context, obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: Context) -> None:
    if ctx.distributed:
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# local workers


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _interrupt_once(_signum: int, _frame: Any) -> None:
    # A Ctrl-C reaches a worker twice (from the terminal and forwarded by the launcher): the repeat
    # must not interrupt the handling of the first, or the worker dies with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


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


def _worker_entry(fn: Callable[..., None], rank: int, world_size: int, store_path: str,
                  args: tuple, launcher_pid: int, beats: Any) -> None:
    # Each worker exits with a status the launcher understands. A user error's message goes to the
    # launcher (a file beside the rendezvous store), which reports the first one, whichever rank had it.
    _die_with(launcher_pid)
    _beat(beats, rank)
    signal.signal(signal.SIGINT, _interrupt_once)
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


def peer_lost(exc: BaseException) -> bool:
    """Whether `exc` is a collective or store operation broken by another process of the job dying,
    or timed out (--timeout) waiting for one that stopped answering (gloo says "Timed out waiting ..."
    in a receive, "Application timeout caused pair closure" when its connection times out first)."""
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError)
        and any(s in str(exc).lower() for s in ("connection", "gloo", "timed out", "timeout")))


RDZV_PREFIX = "towerlab-rdzv-"


def _sweep_rendezvous() -> None:
    """Remove the rendezvous folders of launchers that are gone (one killed with SIGKILL cannot
    remove its own); each folder's name carries its launcher's pid."""
    for folder in Path(tempfile.gettempdir()).glob(RDZV_PREFIX + "*"):
        pid = folder.name[len(RDZV_PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def launch(fn: Callable[..., None], world_size: int, args: tuple = (), *, grace: float = 20.0,
           log: Callable[[str], None] | None = None, hint: Callable[[], str] | None = None,
           essential: set[int] | None = None, start_method: str = "spawn", timeout: float | None = None,
           name: Callable[[int], str] | None = None) -> int:
    """Run `fn(rank, world_size, store_path, *args)` in `world_size` fresh processes.

    Returns the job's exit status, or raises the UserError of the worker that failed first with one
    (whichever its rank). When one worker dies, the others get `grace` seconds to stop on
    their own (they usually fail at once on the broken collective), then are terminated. SIGINT and
    SIGTERM are passed on to the workers, which save a checkpoint and exit 130 / 143. The workers die
    with the launcher, however it dies. `hint()` says how to continue after a failure.
    With `essential` given, only the failure of those ranks stops the job; the others' deaths are
    logged and the job goes on (the search hands their work to someone else).
    `start_method` is "spawn" (fresh interpreters: `fn` and `args` must pickle) or "fork" (see
    `start_method_for`). With `timeout`, a process whose heartbeat is older than that (stopped, or
    hung) is killed and named as the cause, exactly as if it had died. `name(rank)` is what messages
    call a rank.
    """
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    _sweep_rendezvous()
    rdzv = tempfile.mkdtemp(prefix=f"{RDZV_PREFIX}{os.getpid()}-")
    store_path = os.path.join(rdzv, "store")
    ctx = mp.get_context(start_method)
    beats = ctx.Array("d", world_size, lock=False)  # each process's last heartbeat (time.monotonic)
    procs = [ctx.Process(target=_worker_entry, args=(fn, rank, world_size, store_path, args, os.getpid(), beats),
                         daemon=False)
             for rank in range(world_size)]
    received: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        received.append(signum)
        _signal_alive(procs, signum)

    previous = _handle_stop_signals(forward)
    starter = _ForkingThread(procs) if start_method == "fork" else None
    status = None
    try:
        if starter is not None:
            starter.start_all()
        else:
            _start_spawned(procs)
        watch = _Heartbeats(beats, timeout) if timeout is not None else None
        status = _monitor(procs, grace, log, received, hint, essential, watch,
                          name or (lambda rank: f"replica rank {rank}"))
        error = _first_user_error(rdzv, essential) if status == EXIT_USER_ERROR else None
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


def _start_spawned(procs: list) -> None:
    try:
        for p in procs:
            p.start()
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise UserError(f"the worker processes are spawned (fresh interpreters), and what they run cannot be "
                        f"sent to them ({' '.join(str(exc).split())[:200]}): define your model class or factory "
                        "in an importable module (a .py file), not in a notebook or __main__") from None


class _ForkingThread:
    """Forks the workers from a thread of its own, which lives until they are gone.

    A fresh thread, because GNU OpenMP (torch's CPU thread pool) cannot run a parallel region in a
    child forked from a thread that has used its pool: the child waits for pool threads that fork
    did not copy, and hangs. A child forked from a thread that never used OpenMP builds a pool of its
    own. Kept alive, because Linux's parent-death signal (`_die_with`) follows the thread that
    forked, not its process."""

    def __init__(self, procs: list):
        self.procs = procs
        self._done = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="towerlab-workers", daemon=True)

    def _run(self) -> None:
        try:
            for p in self.procs:
                p.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the launching thread
            self._error = exc
        finally:
            self._started.set()
        self._done.wait()

    def start_all(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def release(self) -> None:
        """After the workers are gone."""
        self._done.set()
        self._thread.join()


USER_ERROR_PREFIX = "user-error-"


def _report_user_error(store_path: str, rank: int, message: str) -> None:
    path = Path(store_path).parent / f"{USER_ERROR_PREFIX}{rank}"
    with contextlib.suppress(OSError):  # the exit status still says "user error"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(message, encoding="utf-8")
        os.replace(tmp, path)


def _first_user_error(rdzv: str, essential: set[int] | None) -> str | None:
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


def _monitor(procs: list, grace: float, log: Callable[[str], None], received: list[int],
             hint: Callable[[], str] | None, essential: set[int] | None, watch: _Heartbeats | None,
             name: Callable[[int], str]) -> int:
    failures: dict[int, int | str] = {}  # rank -> exit code (or HUNG), in the order seen
    silent: dict[int, float] = {}  # rank -> seconds without a heartbeat, when it was found hung
    ended_here: set[int] = set()
    deadline = None
    while any(p.is_alive() for p in procs):
        wait([p.sentinel for p in procs if p.is_alive()], timeout=HEARTBEAT)
        for rank in watch.hung(procs, failures) if watch is not None and not received else []:
            silent[rank] = watch.silence(rank)
            procs[rank].kill()  # SIGKILL ends a stopped process too; its peers then fail at once
            failures[rank] = HUNG
            if essential is not None and rank not in essential:
                log(f"towerlab: warning: {name(rank)} (pid {procs[rank].pid}) {_describe_hung(silent[rank])}: "
                    "killed it; the others carry on")
            elif deadline is None:
                deadline = time.monotonic() + grace
                if essential is not None:
                    _signal_alive(procs, signal.SIGTERM)
        for rank, p in enumerate(procs):
            if p.exitcode in (None, 0) or rank in failures:
                continue
            failures[rank] = p.exitcode
            if essential is not None and rank not in essential and not received:
                if deadline is None:  # once the job ends, the others' exits are no news
                    log(f"towerlab: warning: {name(rank)} (pid {p.pid}) {_describe(p.exitcode)}; "
                        "the others carry on")
            elif deadline is None:
                deadline = time.monotonic() + grace
                if essential is not None and rank in essential and not received:
                    # Without this rank the job cannot go on, and the others would only wait for it:
                    # ask them to stop now (they exit at their next step) rather than after `grace`.
                    _signal_alive(procs, signal.SIGTERM)
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
    what = _describe_hung(silent[rank]) if code == HUNG else _describe(code)
    others = "the others were stopped" if essential is not None else "the other replicas were stopped"
    log(f"towerlab: error: {name(rank)} (pid {procs[rank].pid}) {what}; {others}" + (f". {advice}" if advice else ""))
    return 1


def _describe_hung(seconds: float) -> str:
    return f"stopped answering: no heartbeat for {seconds:.0f} s (stopped or hung), more than --timeout"


def _signal_alive(procs: list, signum: int) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signum)


def _describe(exitcode: int) -> str:
    if exitcode == EXIT_PEER_LOST:
        return "lost contact with the others (a peer failed, or a collective waited longer than --timeout)"
    return f"was killed by {_signal_name(exitcode)}" if exitcode < 0 else f"exited with status {exitcode}"
