"""One `towerlab evolve`, `towerlab grid` or `towerlab search run` job: the search resolved once, put in
its store (a new search, or the one to resume), worked on by this machine's workers until it is
finished, whoever else joins (`towerlab search worker`), then its record written (`record`).

The job's own process trains nothing: it starts the workers (`distributed.crew.Crew`, one per device
and `--workers-per-device`), replaces one that dies (its task goes back on the queue at once), follows
the store for the console, and writes the record. Under torchrun, each rank is a worker and rank 0
writes the record (the ranks agree on the store at the start, then need each other no more). Where its
folder is `place`'s, what its store's name means `towerlab.search.store.location`'s.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from towerlab.config import RunConfig, SearchConfig
from towerlab.distributed.crew import CrewFailed
from towerlab.distributed.env import (check_capacity, search_threads, search_workers, torchrun_ranks, under_torchrun)
from towerlab.distributed.group import broadcast_object, session
from towerlab.distributed.launch import start_method_for
from towerlab.distributed.signals import Interrupted
from towerlab.errors import UserError
from towerlab.fields import replace, to_dict
from towerlab.jobs.folder import check_writable_file
from towerlab.jobs.handover import handover, load_everywhere
from towerlab.jobs.job import Job, require_out_under_torchrun, resolved_run, start_job
from towerlab.jobs.provenance import write_config
from towerlab.jobs.search.place import open_store, restarted, search_out, store_token, stored_search_id
from towerlab.jobs.search.record import RecordOptions, Watch, export_best, write_record
from towerlab.jobs.search.workers import SearchCrew, WorkerSpec, optuna_lines, run_worker, warm_up
from towerlab.data.load import Dataset, search_data
from towerlab.models.custom import ModelFunction
from towerlab.objective import kind_class, resolve
from towerlab.objective.admission import VERSIONS, admit, recorded, versions
from towerlab.objective.candidate import CandidateModel
from towerlab.objective.kind import Here, Kind, Named
from towerlab.report import Reporter, format_plan
from towerlab.search import Search, load_space, refuse_unused_settings
from towerlab.search.samplers.auto import described
from towerlab.search.store.location import STORE_NAME, is_url, recorded_store, store_target
from towerlab.search.work.worker import lease_seconds, release_the_dead
from towerlab.search.store.integrity import records_of
from towerlab.search.store import Store
from towerlab.job_files import is_job_folder

# The command of each kind of search job (`towerlab <command>`).
COMMANDS = {"evolve": "evolve", "grid": "grid", "search": "search run"}
WATCH = 0.5  # seconds between looks at the store while the workers work
TRIALS = "trials"  # the folder in the job's where the trials of your own objective keep theirs


def check_settings(cfg: SearchConfig, run: RunConfig, model_function: object = None) -> Search:
    """The search, resolved once every setting it would refuse has been: its objective's kind and goal, decided
    here once and carried on it (`towerlab.objective.resolve`: the settings the kind refuses, a model function
    with an objective of yours), an unknown sampler, a setting it refuses or one only other samplers read (a
    UserError; before any folder or worker)."""
    cfg, aim = resolve(cfg, model_function)
    search = Search.resolve(cfg, load_space(cfg.space, objective=aim.own), aim)
    if run.resume is None:  # a search started before this check keeps what it recorded
        refuse_unused_settings(cfg)
    return search


def start_search(kind: str, cfg: SearchConfig, run: RunConfig, *, data: Optional[Dataset] = None,
                 function: Optional[ModelFunction] = None, objective: Optional[Callable[..., Any]] = None,
                 start_method: str | None = None) -> int:
    """Run the search job; returns its exit status. `data` (a towerlab.data.Dataset, arrays from
    Python) replaces loading `cfg.dataset`; `function` builds the networks of a space of model
    "custom" (see `towerlab.objective.candidate.CandidateModel`); `objective`, a function of yours given from
    Python, is the objective that `cfg.objective` names (`towerlab.objective.function`); `start_method` as in
    `distributed.launch` (None: `distributed.start_method_for` the run's device)."""
    search = check_settings(cfg, run, function)
    function = objective if objective is not None else function  # what its kind was given from Python
    # Its objective checked now (your function imported, checked against the genes): a mistake of yours is
    # refused before anything is written.
    notes = kind_class(search.aim.kind).check(search, function)
    lease_seconds()  # a bad TOWERLAB_LEASE_SECONDS is refused before anything starts
    require_out_under_torchrun(run)
    out = search_out(kind, search.cfg, run, search.space)
    target = store_target(search.cfg.store, out)
    if not is_url(target) and target != str(out / STORE_NAME):  # the folder's own is checked with the folder
        check_writable_file(target, "--store")
    if not under_torchrun():
        run = replace(run, devices=search_workers(run.devices, run.device))
    run = resolved_run(run)
    if run.resume is None and restarted(out, kind, search.cfg):
        run = replace(run, resume=str(out))  # torchrun restarted this job's workers: continue the search
    workers = 1
    if not under_torchrun():
        assert run.devices is not None, "resolved_run resolves --devices"
        workers = run.devices * search.cfg.workers_per_device
        # Recorded as resolved: a resume trains its candidates with as many threads.
        threads = search_threads(run.threads, run.device, workers)
        run = replace(run, threads=threads)
        check_capacity(workers, threads, f"--devices {run.devices} x --workers-per-device "
                                         f"{search.cfg.workers_per_device}")
    return start_job(SearchJob(out=out, resume=run.resume is not None, kind=kind, search=search, run=run,
                               target=target, data=data, function=function, workers=workers,
                               start_method=start_method or start_method_for(run.device), notes=notes))


@dataclass(kw_only=True)
class SearchJob(Job):
    """The search job (see the module's docstring); `start_job` runs it in this process."""

    kind: str
    search: Search
    run: RunConfig
    target: str
    data: Optional[Dataset] = None
    function: Optional[Callable[..., Any]] = None  # the model function, or an objective of yours given from Python
    workers: int = 1
    notes: tuple[str, ...] = ()  # warnings said once the search's first lines are

    @property
    def trains(self) -> type[Kind]:
        """The kind of objective that trains its tasks (its search's)."""
        return kind_class(self.search.aim.kind)

    def run_here(self) -> int:
        if under_torchrun():
            return self._rank()
        reporter = Reporter(None, progress=self.run.progress)
        optuna_lines()  # the record's play of the search asks its sampler too
        warming = warm_up() if self.start_method == "fork" and self.trains.torch_here else None  # joined before forking
        # A database out of reach is refused before the data is read; a file is made once the data is
        # found (bad data leaves no store behind).
        first = open_store(self.target) if is_url(self.target) else None
        data = self.data if self.data is not None or not self.trains.data else _load(self.search.cfg, self.run)
        with first or open_store(self.target) as store, records_of(store):
            search = self._in_store(store, data, reporter)
            started = time.perf_counter()
            if warming is not None:
                warming.join()
            self._work(store, search, data, reporter)
            self._finish(store, search, data, reporter, time.perf_counter() - started,
                         torch.device("cuda", 0) if self.run.device == "cuda" else torch.device("cpu"))
        reporter.close()
        return 0

    def hint(self) -> str:
        return (f"Continue the search with: towerlab {COMMANDS[self.kind]} --resume {self.out}"
                if is_job_folder(self.out) else "")

    def name(self, rank: int) -> str:
        return f"worker {rank}"

    # -- the search in its store ------------------------------------------------------------------------

    @property
    def model(self) -> CandidateModel:
        assert not self.search.own, "a search of your own objective has no model of towerlab's"
        return self.function or self.search.space.model

    def _threads(self) -> Optional[int]:
        return self.run.threads if self.run.device == "cpu" else None

    @property
    def named(self) -> Named:
        """The objective its search names, as its workers' command lines name it."""
        aim = self.search.aim
        return Named(aim.kind, aim.spec, aim.goal.metric, aim.goal.direction)

    def _objective(self, data: Optional[Dataset]) -> Kind:
        """The job's objective for its search (`towerlab.objective.kind.Kind`): its numerics, and its data and
        model, or its objective, as `admission` measures them."""
        here = Here(torch.device(self.run.device), self.run.threads, self.named, resuming=self.run.resume is not None,
                    run=self.run, data=data, function=self.function)
        return self.trains(self.search, here)

    def _in_store(self, store: Store, data: Optional[Dataset], reporter: Optional[Reporter]) -> Search:
        """The search in `store`: created (and config.json written, with what its workers must share:
        `towerlab.objective.admission`), or the one this folder continues, admitted as any worker is (another
        towerlab or torch is recorded as the search's from now on, with a warning)."""
        objective = self._objective(data)
        if self.run.resume:
            search_id = stored_search_id(self.out)
            row = store.records.search(search_id)
            stored = None if row is None else Search.of_row(row, str(store.path))
            if stored is not None:  # an objective of yours with another --metric or --direction: its rows read again
                stored = objective.resume(store, stored)
            try:
                adopted = [] if stored is None else admit(stored, objective)
            except UserError as exc:
                raise UserError(f"cannot resume search {search_id} of {store.path}: {exc}") from None
            search = self.search.resume(store, search_id, objective.training_hash(stored))
            if search.recorded("device") is not None and (adopted or any(search.recorded(k) is None for k in VERSIONS)):
                if adopted and reporter is not None:
                    reporter.line(f"towerlab: warning: resuming search {search.id} on other software ({adopted[0]}): "
                                  "from now on its workers need this machine's, and `search show` tells its rows "
                                  "apart")
                search = search.adopt(store, versions())
            store.queue.reopen_failed_tests(search.stored_id)  # a resume retries them: the machine's fault, as often as not
            release_the_dead(store)  # the tasks of this machine's workers that died with an earlier start
            done = store.records.generations(search.stored_id)
            resuming = (f"resuming search {search.id} of {store.path} ({sum(g.complete for g in done)} generation(s) "
                        f"complete, {len(store.records.evaluations(search.stored_id))} training(s) kept): ")
        else:
            setup = recorded(objective)
            cfg = replace(self.search.cfg, store=recorded_store(self.target) if self.search.cfg.store else None)
            search = dataclasses.replace(self.search, cfg=cfg).create(store, objective.training_hash(None), setup)
            write_config(self.out, {"kind": self.kind, "search": to_dict(cfg), "run": to_dict(self.run),
                                    "search_id": search.id, "store": recorded_store(self.target),
                                    "workers": self.workers, "device_type": self.run.device})
            resuming = ""
        if reporter is not None:
            space, aim = search.space, search.aim
            trains = (f"{space.size_text}) for your {aim.kind} {aim.spec} ({aim.goal.metric}, {aim.goal.direction})"
                      if aim.own else f"{space.size_text}, model {space.model}) on {search.cfg.dataset}")
            reporter.line(f"towerlab {COMMANDS[self.kind]}: {resuming}{described(search.cfg, space)} over space "
                          f"{space.name} "
                          f"({trains}, {self.workers} worker(s) on {self.run.device} -> {self.out}")
            reporter.line(format_plan(search.plan))
            judgement = search.judgement(store)
            if judgement is not None:
                reporter.line(f"Pruning where a rung ranks as the last does, judged on the generations before: "
                              f"{judgement.text()}")
            for note in self.notes:
                reporter.line(note)
        return search

    def _spec(self, search_id: int, **more: Any) -> WorkerSpec:
        """What this job's workers need besides their device (`more`: WorkerSpec's other fields)."""
        return WorkerSpec(store=self.target, run=self.run, threads=self._threads(), search_ids=(search_id,),
                          named=self.named, trials=str(self.out / TRIALS), **more)

    def _work(self, store: Store, search: Search, data: Optional[Dataset], reporter: Reporter) -> None:
        """This machine's workers on the search until it is finished (whoever else works on it)."""
        spec = self._spec(search.stored_id, per_device=search.cfg.workers_per_device, speaks=True)
        watch = Watch(store, search, self.out, reporter, self.workers, resumed=self.run.resume is not None,
                      tensorboard=self.run.tensorboard)
        handed = (None, None) if data is None else handover(data, self.start_method)
        search.prepare()  # once here: forked workers inherit what their drivers propose with
        crew = SearchCrew(spec, self.workers, store, handed=(*handed, self.function),
                          start_method=self.start_method, log=reporter.line)
        try:
            if not crew.run(until=lambda: store.records.finished(search.stored_id), step=watch.step, every=WATCH):
                raise UserError(f"this machine's workers left search {search.id} before it was finished: "
                                f"see `towerlab search show {self.out}`")
            watch.step()
        except Interrupted:
            reporter.line(f"Interrupted: the {watch.trained} evaluation(s) finished since this start are kept in "
                          f"{store.path}, with every earlier one")
            raise
        except CrewFailed as exc:
            raise UserError(f"{exc}. Every result so far is kept: continue with `towerlab {COMMANDS[self.kind]} "
                            f"--resume {self.out}`") from None
        finally:
            watch.close()

    def _finish(self, store: Store, search: Search, data: Optional[Dataset], reporter: Reporter, seconds: float,
                device: torch.device) -> None:
        """The record, from the store: the search played once more here (every result is there)."""
        result = search.run(store, _nothing_to_train)
        model = None if search.own else self.model
        top = write_record(search, store, result, reporter,
                           RecordOptions(kind=self.kind, out=self.out, model=model, data=data, workers=self.workers,
                                         cpu_threads=self._threads(), seconds=seconds))
        if search.cfg.export_best:
            assert data is not None and model is not None, "--export-best is refused in a search of your own objective"
            export_best(search, model, top[0], data.to(device), device, self.out, reporter)

    # -- under torchrun ---------------------------------------------------------------------------------

    def _rank(self) -> int:
        """One torchrun rank: rank 0 puts the search in the store and tells the others which it is (the
        process group serves for that alone); every rank then works on it; rank 0 writes the record."""
        rank = torchrun_ranks()[0]
        with session(timeout=self.run.timeout, backend="gloo", device=self.run.device) as ctx:
            data = None if not self.trains.data else load_everywhere(ctx, lambda **loading: search_data(
                self.search.cfg, self.run, **loading))
            told: dict = {}
            if ctx.is_main:
                try:
                    with open_store(self.target) as store:
                        search = self._in_store(store, data, Reporter(None, progress=False))
                    told = {"search": search.id, "token": store_token(self.target, search.stored_id)}
                except UserError as exc:
                    told = {"error": str(exc)}
            told = broadcast_object(ctx, told)
            device = ctx.device
        if "error" in told:
            raise UserError(told["error"])
        if store_token(self.target, told["search"]) != told["token"]:
            raise UserError(f"rank {rank} cannot reach the search store {recorded_store(self.target)} that rank 0 "
                            "made (it lies on rank 0's machine): give --store postgresql://... that every machine "
                            "reaches, or start `towerlab search worker` on the other machines")
        spec = self._spec(told["search"], speaks=rank == 0)
        started = time.perf_counter()
        run_worker(spec, device, data, None, self.function, speaks=rank == 0)
        if rank == 0:
            reporter = Reporter(None, progress=False)
            with open_store(self.target) as store:
                search = Search.open(store, told["search"])
                self._finish(store, search, data, reporter, time.perf_counter() - started, device)
            reporter.close()
        return 0


def _nothing_to_train(candidates: list, record: Any) -> None:
    raise RuntimeError(f"the search's record found {len(candidates)} training(s) that its workers did not make, "
                       f"e.g. {candidates[0]}")


def _load(cfg: SearchConfig, run: RunConfig) -> Any:
    # Every data problem (and the download, or the offline fallback) once, before any worker
    # starts; the workers get this data, so every one of them reads the very same.
    return search_data(cfg, run)
