"""A search's workers: processes that claim its tasks from the store and train them on one device each
(`towerlab.search.queue`). `towerlab search run` starts them on this machine (`distributed.crew.Crew`,
its own search only, with the data and model it loaded); `towerlab search worker STORE` starts them on
any machine to join the searches of a store, each with its own data and model read as the search
records them (`Search.setup`); under torchrun each rank is one.

A joining worker trains a search only where its results are the search's own: the same device kind,
the same CPU threads per candidate, the same towerlab, training code and torch, the same data (by its
content's digest) and model (a model file by its SHA-256, checked before it is imported, and imported
only where the worker's own command names it: `towerlab.jobs.identity`), and at last the search's
training-config hash, made again here. Otherwise it says which differs, once, and leaves that search to
others.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from towerlab.config import CUSTOM_MODEL, RunConfig
from towerlab.checks import ARRAYS_DATASET
from towerlab.data.digest import content_digest
from towerlab.data.load import Dataset
from towerlab.distributed.signals import STOP_SIGNALS, Interrupted, StopFlag
from towerlab.errors import UserError
from towerlab.fields import replace
from towerlab.jobs.candidate import CandidateModel, estimated_cost, outcome, train_candidate, train_config_hash
from towerlab.jobs.handover import search_data
from towerlab.jobs.identity import data_difference, file_digest, provenance, short, version_difference, versions
from towerlab.jobs.worker_times import WorkerTimes
from towerlab.models.custom import ModelFunction
from towerlab.report import discard_line
from towerlab.search import Candidate, Outcome, Search
from towerlab.search.queue import Worker, WorkerOptions, lease_seconds, release_the_dead, worker_name
from towerlab.search.schema import NoStore
from towerlab.search.show import records_of
from towerlab.search.store import Store, Task

# What a search records of its model in its setup when the model is a function given from Python, which
# no other process can load.
FROM_PYTHON = "a function given from Python"


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


def work(slot: int, _slots: int, _reports: str, spec: WorkerSpec, data: Optional[Dataset] = None,
         fallback: Optional[bool] = None, function: Optional[ModelFunction] = None) -> None:
    """A Crew's worker process: slot `slot` on its device."""
    kind = spec.run.device
    device = torch.device("cuda", slot // spec.per_device) if kind == "cuda" else torch.device("cpu")
    run_worker(spec, device, data, fallback, function, speaks=spec.speaks and slot == 0)


def run_worker(spec: WorkerSpec, device: torch.device, data: Optional[Dataset] = None,
               fallback: Optional[bool] = None, function: Optional[ModelFunction] = None, speaks: bool = False) -> int:
    """Work on the store's searches on `device` until none is left (or Ctrl-C / SIGTERM: the task in
    flight goes back on the queue). `data`, `fallback`, `function`: what the search's own job hands its
    workers (the data it loaded, or whether it fell back offline; its model function)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    name = worker_name(str(device), os.getpid(), spec.token)
    times = WorkerTimes.from_env()  # the benchmark's breakdown of this worker's time, where it asks for one
    # An edited row of the wrong form stops the worker in one line naming it (it was a traceback in every
    # worker process, then "worker processes died").
    with StopFlag() as stop, Store(spec.store, create=False) as store, records_of(store):
        def check_stop() -> None:
            if stop.signum:
                raise Interrupted(stop.signum)

        trainers = Trainers(spec, device, name, stop, store, data, fallback, function, times)
        options = WorkerOptions(search_ids=spec.search_ids, joinable=trainers.joinable, priority=trainers.priority,
                                wait=spec.wait, speaks=speaks, tells=spec.tells, check_stop=check_stop)
        worker = Worker(store if times is None else times.store(store), name, device.type, trainers.trainer, options)
        trained = worker.run()
    if times is not None:
        times.write(name, str(device))
    return trained


@dataclass
class _Setup:
    """How this worker trains one search: its data, its model, its CPU threads per candidate, and the
    provenance its rows record."""

    data: Dataset
    model: CandidateModel
    threads: Optional[int]
    provenance: dict  # what each of its rows records of where it was trained


class Trainers:
    """What trains a task of each search in this worker, made once per search (see the module's docstring)."""

    def __init__(self, spec: WorkerSpec, device: torch.device, name: str, stop: StopFlag, store: Store,
                 data: Optional[Dataset] = None, fallback: Optional[bool] = None,
                 function: Optional[ModelFunction] = None, times: Optional[WorkerTimes] = None) -> None:
        self.spec, self.device, self.name, self.stop, self.store = spec, device, name, stop, store
        self.given, self.fallback, self.function, self.times = data, fallback, function, times
        self._setups: dict[int, _Setup] = {}

    def joinable(self, search: Search) -> Optional[str]:
        """Why this worker cannot train `search`, or None."""
        try:
            self.setup(search)
        except UserError as exc:
            return str(exc)
        return None

    def setup(self, search: Search) -> _Setup:
        if search.stored_id in self._setups:
            return self._setups[search.stored_id]
        recorded = search.setup
        if not recorded:
            raise UserError("it was made by an older towerlab, which did not record how its workers train: continue it "
                            "with `towerlab search run --resume`")
        if recorded.get("device") != self.device.type:
            raise UserError(f"it trains on {recorded.get('device')}, this worker on {self.device.type} (start the worker "
                            f"with --device {recorded.get('device')})")
        threads = self.spec.threads if self.spec.threads is not None else recorded.get("threads")
        if self.device.type == "cpu" and threads != recorded.get("threads"):
            raise UserError(f"it trains each candidate on {recorded.get('threads')} CPU thread(s), this worker on "
                            f"{threads}, which sums in another order (leave --threads out)")
        # Everything that can be checked without importing a model file first (issue 60's defect 3).
        why = version_difference(recorded, versions())
        if why is not None:
            raise UserError(why)
        started = time.perf_counter()
        data = self._data(search)
        digest = content_digest(data)
        why = data_difference(recorded, digest, search.cfg.dataset, data.source)
        if why is not None:
            raise UserError(why)
        data_seconds = time.perf_counter() - started
        model = self._model(search)
        if train_config_hash(search.cfg, self.device.type, threads, model,
                             digest if "data_digest" in recorded else None) != search.train_config_hash:
            raise UserError("its training settings differ from this worker's (the data's content, the model "
                            "function's source, or an older towerlab's settings): results here would not be the "
                            "search's")
        started = time.perf_counter()
        self._setups[search.stored_id] = setup = _Setup(data.to(self.device), model, threads, provenance(self.device, digest))
        if self.times is not None:
            self.times.data(data_seconds + time.perf_counter() - started)
        return setup

    def _model(self, search: Search) -> CandidateModel:
        """The search's model: a family's name, the job's own function, or the model file this worker's command
        names (`--model`) where its content is the search's; never a file only the store names."""
        if search.space.model != CUSTOM_MODEL:
            return search.space.model
        if self.function is not None:
            return self.function
        spec = search.setup.get("model")
        if not spec or spec == FROM_PYTHON:
            raise UserError("its networks come from a function given from Python, which only its own process has")
        path, _, name = spec.rpartition(":")
        named = [given for given in self.spec.model_files if given.rpartition(":")[2] == name]
        if not named:
            raise UserError(f"its networks come from the model file {Path(path).name}, function {name}, and a worker "
                            "imports only the model files its command names: start it with --model "
                            f"{shlex.quote(spec)} (that file, or a copy of it)")
        recorded = search.setup.get("model_sha256")
        if recorded is not None:
            try:
                digests = {given: file_digest(given.rpartition(":")[0]) for given in named}
            except OSError as exc:
                raise UserError(f"cannot read the model file {exc.filename}: {exc.strerror}") from None
            named = [given for given in named if digests[given] == recorded]
            if not named:
                given = next(iter(digests))
                raise UserError(f"its model file differs: {given.rpartition(':')[0]} here holds SHA-256 "
                                f"{short(digests[given])}, the search's {Path(path).name} {short(recorded)}: give this "
                                "worker the search's file")
        from towerlab.models.custom import load_function

        return load_function(named[0])

    def _data(self, search: Search) -> Any:
        if self.given is not None:
            return self.given
        cfg, recorded = search.cfg, search.setup.get("data", {})
        if cfg.dataset == ARRAYS_DATASET:
            raise UserError("its data are arrays given from Python, which only its own process has")
        fallback = self.fallback if self.fallback is not None else bool(recorded.get("fallback"))
        return search_data(cfg, self.spec.run, download=self.fallback is None,
                           allow_fallback=False, fallback_only=fallback, log=discard_line)

    def trainer(self, search: Search) -> Callable[[Task], tuple[Outcome, Optional[float]]]:
        setup = self.setup(search)

        def train(task: Task) -> tuple[Outcome, Optional[float]]:
            if setup.threads is not None and torch.get_num_threads() != setup.threads:
                torch.set_num_threads(setup.threads)
            c = task.candidate
            test = True if task.kind == "test" else self._entering_top(search) or False
            fields, result = train_candidate(search.cfg, setup.model, c.genome, c.seed, setup.data, self.device,
                                             test=test, stop=self.stop, max_epochs=c.max_epochs)
            if self.times is not None:
                self.times.candidate(fields["seconds"], result)
            return outcome({**fields, "worker": self.name, "provenance": setup.provenance}), fields.get("test_accuracy")

        return train

    def _entering_top(self, search: Search) -> Optional[Callable[[Optional[float]], bool]]:
        """Whether a network just trained to this validation accuracy is among the search's `top` best so
        far: it is then scored on the test split at once (its test accuracy kept with its task), so it
        needs no retraining for it at the end if it stays there (`queue.Driver`). None where the search
        tests nothing."""
        if not search.tests_top:
            return None
        search_id, training_hash, top = search.stored_id, search.ladder.train_config_hash, search.cfg.top

        def entering(val_accuracy: Optional[float]) -> bool:
            return val_accuracy is not None and self.store.records.genomes_better(search_id, training_hash, val_accuracy) < top
        return entering

    def priority(self, search: Search) -> Callable[[Candidate], float]:
        """Largest first: a generation then ends on small candidates, not on a big one that started last
        while the other workers sat idle."""
        setup = self.setup(search)
        shape, classes = setup.data.input_shape, setup.data.num_classes
        return lambda c: estimated_cost(search.cfg, setup.model, c.genome, shape, classes, c.max_epochs)


def start_workers(target: str, run: RunConfig, *, per_device: int = 1, search_id: Optional[int] = None,
                  wait: bool = False, start_method: Optional[str] = None, model_files: tuple[str, ...] = ()) -> int:
    """`towerlab search worker`: this machine's workers (one per device, or per core on a CPU, times
    `per_device`) join the searches of the store at `target` (or search `search_id` alone) until
    nothing is left to do (with `wait`, until Ctrl-C, and on a store that no search has made yet, until
    one does); the exit status. `model_files`: the FILE.py:FUNCTION it may import (`--model`)."""
    from towerlab.distributed.crew import Crew, CrewFailed
    from towerlab.distributed.env import check_capacity, device_type, search_threads, search_workers
    from towerlab.distributed.launch import start_method_for
    from towerlab.search.location import is_url, redacted

    kind = device_type(run.device)
    devices = search_workers(run.devices, run.device)
    slots = devices * per_device
    check_capacity(slots, search_threads(run.threads, kind, slots), f"--devices {devices} x --workers-per-device "
                                                                      f"{per_device}")
    lease_seconds()  # a bad TOWERLAB_LEASE_SECONDS is refused before anything starts
    for named in model_files:
        check_model_file(named)
    where = redacted(target) if is_url(target) else target
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
                          model_files=model_files)

        def lost(slot: int, pid: int, ended: str) -> None:
            store.queue.release(worker_name(f"cuda:{slot // per_device}" if kind == "cuda" else "cpu", pid, spec.token), ended)

        method = start_method or start_method_for(kind)
        try:
            with StopFlag() as stop, Crew(work, slots, (spec,), start_method=method, on_lost=lost) as crew:
                # Until `watch` has seen how the last process left: one that died or stopped after the
                # last look is no clean end (the loop once ended on `running()`, and said "nothing left
                # to do" with exit status 0 after a Ctrl-C, a crash or an outage).
                while not crew.ended():
                    if stop.signum:
                        crew.stop(stop.signum)
                        raise Interrupted(stop.signum)
                    crew.watch(1.0)
                if stop.signum:  # the workers were interrupted
                    raise Interrupted(stop.signum)
                if crew.stopped is not None:
                    raise Interrupted(STOP_SIGNALS[crew.stopped])
        except CrewFailed as exc:
            raise UserError(str(exc)) from None
    print("towerlab search worker: nothing left to do", file=sys.stderr, flush=True)
    return 0


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


def check_model_file(spec: str) -> None:
    """A `--model` of `search worker`: FILE.py:FUNCTION, a file that is there (read, never imported here)."""
    path, _, name = spec.rpartition(":")
    if not path or not name.isidentifier() or not path.endswith(".py"):
        raise UserError(f"--model {spec}: give FILE.py:FUNCTION, the model file a search of the store trains with "
                        "and its function's name")
    if not Path(path).is_file():
        raise UserError(f"--model {spec}: no file {path}")
