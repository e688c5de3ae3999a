"""A search's workers: processes that claim its tasks from the store and train them on one device each
(`towerlab.search.work.worker`), each search's tasks by the objective its command names, of whatever kind
(`Objectives`: `towerlab.objective`, admitted by `towerlab.objective.admission.admit`).
`towerlab search run` starts them on this machine for its own search, with the data and model it loaded;
`towerlab search worker STORE` starts them on any machine to join the searches of a store, each with its
own data and model read as the search records them; both as one `SearchCrew` (a slot's device and worker
name, a lost worker's tasks released at once, the loop that watches them). Under torchrun each rank is one.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from towerlab.config import RunConfig
from towerlab.data.load import Dataset
from towerlab.distributed.crew import Crew, CrewFailed
from towerlab.distributed.signals import STOP_SIGNALS, Interrupted, StopFlag
from towerlab.errors import UserError
from towerlab.fields import replace
from towerlab.jobs.search import worker_times
from towerlab.models.custom import check_function_file
from towerlab.objective import kind_class
from towerlab.objective.admission import admit
from towerlab.objective.kind import Here, Kind, Named
from towerlab.report import printable
from towerlab.search import Candidate, Search
from towerlab.search.store.integrity import records_of
from towerlab.search.store.schema import NoStore
from towerlab.search.store import Store
from towerlab.search.work.worker import Worker, WorkerOptions, lease_seconds, release_the_dead, worker_name

LEAVE = 10.0  # seconds the workers of a finished search get to leave before they are stopped


def warm_up() -> threading.Thread:
    """Import, in a thread of this process, what every worker's first training imports: torch's compiler
    front end, which every optimizer's construction imports (about 1.9 s on a 2-core machine). Started
    before the data is read, it overlaps that; joined before the workers are forked, no worker pays it
    again. (Measured on the 2-core machine, a grid of 4 MNIST MLPs on 2 workers: the first candidate
    finished 5.3 s after the command where it had 8.8 s, with the tasks queued before they are ranked.)"""
    def run() -> None:
        import torch._dynamo  # noqa: F401 - imported for its side effect: the import itself

    thread = threading.Thread(target=run, name="towerlab-warm-up", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs besides its device: the store (its file or URL, with any password),
    the run's settings (device kind, data folder, downloads), the workers per device, the CPU threads per
    candidate (None: each search's own), the searches to work on (None: every search it can join), and
    whether it waits for new work when there is none."""

    store: str
    run: RunConfig
    per_device: int = 1
    threads: Optional[int] = None
    search_ids: Optional[tuple[int, ...]] = None
    wait: bool = False
    speaks: bool = False
    token: str = field(default_factory=lambda: secrets.token_hex(3))  # in each worker's name (`worker_name`)
    tells: bool = False
    model_files: tuple[str, ...] = ()  # FILE.py:FUNCTION that `search worker --model` names: the only ones it imports
    named: Named = Named()  # the objective its command names (of yours, or towerlab's own training): it runs that
    trials: str = "trials"  # the folder where the trials of an objective of yours keep theirs


class _OptunaLines:
    """A filter on the "optuna" logger: each warning said once a process, as one line of towerlab's
    (`towerlab: warning: Optuna: ...`), rather than Optuna's own "[W date] ..." over several lines."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def filter(self, record: Any) -> bool:
        with contextlib.suppress(Exception):  # a message that cannot be formatted: Optuna's own line
            text = " ".join(record.getMessage().split())
            if text not in self.said and len(self.said) < 100:
                self.said.add(text)
                _say(f"towerlab: {record.levelname.lower()}: Optuna: {text}")
            return False
        return True


def optuna_lines() -> None:
    """Have Optuna's warnings said as towerlab's lines in this process (`_OptunaLines`), once."""
    import logging

    logger = logging.getLogger("optuna")
    if not any(isinstance(f, _OptunaLines) for f in logger.filters):
        logger.addFilter(_OptunaLines())


def slot_device(spec: WorkerSpec, slot: int) -> str:
    """The device of a crew's slot: its GPU (`per_device` slots each), or the CPU."""
    return f"cuda:{slot // spec.per_device}" if spec.run.device == "cuda" else "cpu"


def work(slot: int, _slots: int, _reports: str, spec: WorkerSpec, data: Optional[Dataset] = None,
         fallback: Optional[bool] = None, function: Optional[Callable[..., Any]] = None) -> None:
    """A Crew's worker process: slot `slot` on its device (its parent opened and checked the store)."""
    run_worker(spec, torch.device(slot_device(spec, slot)), data, fallback, function, speaks=spec.speaks and slot == 0,
               checked=True)


def run_worker(spec: WorkerSpec, device: torch.device, data: Optional[Dataset] = None,
               fallback: Optional[bool] = None, function: Optional[Callable[..., Any]] = None,
               speaks: bool = False, checked: bool = False) -> int:
    """Work on the store's searches on `device` until none is left (or Ctrl-C / SIGTERM: the task in
    flight goes back on the queue). `data`, `fallback`, `function`: what the search's own job hands its
    workers (the data it loaded, or whether it fell back offline; its model function, or its objective
    given from Python). Each search's tasks are trained by the objective its command names (`spec.named`).
    `checked`: this process's parent opened the store and checked it (`Store`)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    optuna_lines()
    name = worker_name(str(device), os.getpid(), spec.token)
    times = worker_times.from_env()  # a benchmark's clock of this worker's time, where one is named
    # An edited row of the wrong form stops the worker in one line naming it (it was a traceback in every
    # worker process, then "worker processes died").
    with StopFlag() as stop, Store(spec.store, create=False, checked=checked) as store, records_of(store):
        def check_stop() -> None:
            if stop.signum:
                raise Interrupted(stop.signum)

        here = Here(device, spec.threads, spec.named, name=name, stop=stop, run=spec.run, model_files=spec.model_files,
                    trials=Path(os.path.abspath(spec.trials)), store=store, times=times, data=data, fallback=fallback,
                    function=function)
        objectives = Objectives(here)
        options = WorkerOptions(search_ids=spec.search_ids, priority=objectives.priority, wait=spec.wait,
                                speaks=speaks, tells=spec.tells, check_stop=check_stop,
                                timed=None if times is None else times.timed)
        trained = Worker(store, name, device.type, objectives.objective, options).run()
    if times is not None:
        times.leave(name, str(device))
    return trained


class Objectives:
    """What trains each search's tasks in this worker: one objective per search, of the kind its command names
    (`Here.named`), made when it first joins the search, admitted (`admit`: a UserError says why not, and the
    worker leaves that search to others) and joined (its data and model, or its objective, loaded here)."""

    def __init__(self, here: Here) -> None:
        self.here = here
        self._made: dict[int, Kind] = {}

    def objective(self, search: Search) -> Kind:
        if search.stored_id not in self._made:
            made = kind_class(self.here.named.kind)(search, self.here)
            admit(search, made)
            made.join()
            self._made[search.stored_id] = made
        return self._made[search.stored_id]

    def priority(self, search: Search) -> Callable[[Candidate], float]:
        """Each task's rank among its generation's (its objective's `priority`)."""
        return self.objective(search).priority


class SearchCrew:
    """This machine's workers of a store, as both `search run` and `search worker` start them: one process a
    slot (`work`: its device, `slot_device`, and its worker name), each replaced when it dies, the tasks of
    a lost one put back on the queue at once (`log` says so), and the loop that watches them (`run`).
    `handed`: what the job hands its workers besides the spec (its data, or whether it fell back; its
    model function)."""

    def __init__(self, spec: WorkerSpec, slots: int, store: Store, *, handed: tuple = (), start_method: str,
                 log: Callable[[str], None]) -> None:
        self.spec, self.slots, self.store, self.handed, self.start_method, self.log = (spec, slots, store, handed,
                                                                                         start_method, log)

    def _lost(self, slot: int, pid: int, ended: str) -> int:
        """A worker process is gone (`ended` says how): its tasks back on the queue, and how many (a worker that
        left by itself held none)."""
        name = worker_name(slot_device(self.spec, slot), pid, self.spec.token)
        released = self.store.queue.release(name, ended)
        if released:
            self.log(f"towerlab: warning: worker {printable(name)} {ended} while training; its task is back on the queue")
        return released

    def run(self, until: Callable[[], bool] = lambda: False, step: Callable[[], bool] = lambda: False,
            every: float = 1.0) -> bool:
        """Watch the workers every `every` seconds (`step()` between looks: whether anything was done) until
        `until()` holds, then give them LEAVE seconds to leave (stopping those that do not), or until every
        one has left by itself; whether `until()` held. Ctrl-C or SIGTERM here, or a worker stopped so, is
        Interrupted; workers that keep dying are CrewFailed."""
        crew = Crew(work, self.slots, (self.spec, *self.handed), start_method=self.start_method, on_lost=self._lost,
                    log=self.log)
        with StopFlag() as stop, crew:
            # Until `watch` has seen how the last process left: one that died or stopped after the last look
            # is no end (the loop once ended on `running()`, and said "nothing left to do" with exit status 0
            # after a Ctrl-C, a crash or an outage).
            while not crew.ended():
                if stop.signum:
                    crew.stop(stop.signum)
                    raise Interrupted(stop.signum)
                if until():
                    if not crew.join(LEAVE):  # one that is stopped (SIGSTOP) or hung lost its task long ago
                        crew.stop(signal.SIGTERM, grace=LEAVE)
                    return True
                crew.watch(every)
                if step():
                    crew.progressed()
            if stop.signum:  # the workers were interrupted
                raise Interrupted(stop.signum)
            if crew.stopped is not None:  # the workers were interrupted themselves
                raise Interrupted(STOP_SIGNALS[crew.stopped])
        return until()


def start_workers(target: str, run: RunConfig, *, per_device: int = 1, search_id: Optional[int] = None,
                  wait: bool = False, start_method: Optional[str] = None, model_files: tuple[str, ...] = (),
                  named: Named = Named(), trials: str = "trials") -> int:
    """`towerlab search worker`: this machine's workers (one per device, or per core on a CPU, times
    `per_device`) join the searches of the store at `target` (or search `search_id` alone) until
    nothing is left to do (with `wait`, until Ctrl-C, and on a store that no search has made yet, until
    one does); the exit status. `model_files`: the FILE.py:FUNCTION it may import (`--model`); `named`: the
    objective it runs (`--objective`, `--command`; none: towerlab's training), the trials of one of yours in
    folders under `trials`."""
    from towerlab.distributed.env import check_capacity, device_type, search_threads, search_workers
    from towerlab.distributed.launch import start_method_for
    from towerlab.search.store.location import is_url, redacted

    kind = device_type(run.device)
    devices = search_workers(run.devices, run.device)
    slots = devices * per_device
    check_capacity(slots, search_threads(run.threads, kind, slots), f"--devices {devices} x --workers-per-device "
                                                                      f"{per_device}")
    lease_seconds()  # a bad TOWERLAB_LEASE_SECONDS is refused before anything starts
    for model_file in model_files:
        check_function_file(model_file, "--model")
    kind_class(named.kind).check_worker(named, trials)
    where = printable(redacted(target) if is_url(target) else target)
    with _store_once_made(target, wait, where) as store:
        release_the_dead(store)
        if search_id is not None and store.records.search(search_id) is None:
            raise UserError(f"store {where} holds no search {search_id}: `towerlab search show {where}` lists them")
        unfinished = [row.id for row in store.records.unfinished_searches()]
        which = (f"search {search_id}" if search_id is not None
                 else f"its {len(unfinished)} unfinished search(es)" + (" and those to come" if wait else ""))
        print(f"towerlab search worker: {slots} worker(s) on {kind} joining {which} of {where}", file=sys.stderr,
              flush=True)
        spec = WorkerSpec(store=target, run=replace(run, device=kind), per_device=per_device, threads=run.threads,
                          search_ids=None if search_id is None else (search_id,), wait=wait, speaks=True, tells=True,
                          model_files=model_files, named=named, trials=trials)

        for row in store.records.unfinished_searches():  # once here: forked workers inherit it (`Search.prepare`)
            if search_id in (None, row.id):
                with contextlib.suppress(UserError, KeyError):  # a worker that cannot propose for it says why
                    Search.of_row(row, where).prepare()
        crew = SearchCrew(spec, slots, store, start_method=start_method or start_method_for(kind), log=_say)
        try:
            crew.run()
        except CrewFailed as exc:
            raise UserError(str(exc)) from None
    print("towerlab search worker: nothing left to do", file=sys.stderr, flush=True)
    return 0


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


WAIT_FOR_STORE = 2.0  # seconds between looks for a store that no search has made yet (--wait)


def _store_once_made(target: str, wait: bool, where: str) -> Store:
    """The store at `target`; with `wait`, one that no search has made yet is waited for (a cluster's
    workers may start before the search), saying so once."""
    said = False
    while True:
        try:
            return Store(target, create=False)
        except NoStore:
            if not wait:
                raise
            if not said:
                print(f"towerlab search worker: {where} holds no search store yet: waiting for a search to start "
                      "there (Ctrl-C to stop)", file=sys.stderr, flush=True)
                said = True
        time.sleep(WAIT_FOR_STORE)
