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
from typing import Any, Optional

import torch

from towerlab import atomic
from towerlab.config import CUSTOM_MODEL, RunConfig, SearchConfig
from towerlab.distributed.crew import CrewFailed
from towerlab.distributed.env import (check_capacity, search_threads, search_workers, torchrun_ranks, under_torchrun)
from towerlab.distributed.group import broadcast_object, session
from towerlab.distributed.launch import start_method_for
from towerlab.distributed.signals import Interrupted
from towerlab.errors import UserError
from towerlab.fields import replace, to_dict
from towerlab.jobs.candidate import TRAINING_GENES, CandidateModel, model_function
from towerlab.jobs.folder import check_writable_file
from towerlab.jobs.handover import handover, load_everywhere, search_data
from towerlab.jobs.search.identity import VERSIONS, admit, model_proof, recorded, training_hash, versions
from towerlab.jobs.job import Job, require_out_under_torchrun, resolved_run, start_job
from towerlab.jobs.provenance import write_config
from towerlab.jobs.search.place import open_store, restarted, search_out, store_token, stored_search_id
from towerlab.jobs.search.record import RecordOptions, Watch, export_best, write_record
from towerlab.jobs.search.training import FROM_PYTHON
from towerlab.jobs.search.workers import SearchCrew, WorkerSpec, run_worker, warm_up
from towerlab.catalog.models import not_taken
from towerlab.data.digest import digest_as
from towerlab.data.load import Dataset
from towerlab.models.custom import ModelFunction, function_file
from towerlab.report import Reporter, format_plan
from towerlab.search import Search, Space, load_space, refuse_unused_settings
from towerlab.search.store.location import STORE_NAME, is_url, recorded_store, store_target
from towerlab.search.work.worker import lease_seconds, release_the_dead
from towerlab.search.store.integrity import records_of
from towerlab.search.store import Store
from towerlab.proof import file_digest

# The command of each kind of search job (`towerlab <command>`).
COMMANDS = {"evolve": "evolve", "grid": "grid", "search": "search run"}
WATCH = 0.5  # seconds between looks at the store while the workers work


def check_settings(cfg: SearchConfig, run: RunConfig) -> Search:
    """The search, resolved once every setting it would refuse has been: an unknown sampler, a
    setting it refuses or one only other samplers read (a UserError; before any folder or worker)."""
    search = Search.resolve(cfg, load_space(cfg.space))
    if run.resume is None:  # a search started before this check keeps what it recorded
        refuse_unused_settings(cfg)
    return search


def start_search(kind: str, cfg: SearchConfig, run: RunConfig, *, data: Optional[Dataset] = None,
                 function: Optional[ModelFunction] = None,
                 start_method: str | None = None) -> int:
    """Run the search job; returns its exit status. `data` (a towerlab.data.Dataset, arrays from
    Python) replaces loading `cfg.dataset`; `function` builds the networks of a space of model
    "custom" (see `towerlab.jobs.candidate.Model`); `start_method` as in `distributed.launch` (None:
    `distributed.start_method_for` the run's device)."""
    search = check_settings(cfg, run)
    check_function(search.space, function)
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
                               start_method=start_method or start_method_for(run.device)))


@dataclass(kw_only=True)
class SearchJob(Job):
    """The search job (see the module's docstring); `start_job` runs it in this process."""

    kind: str
    search: Search
    run: RunConfig
    target: str
    data: Optional[Dataset] = None
    function: Optional[ModelFunction] = None
    workers: int = 1

    def run_here(self) -> int:
        if under_torchrun():
            return self._rank()
        reporter = Reporter(None, progress=self.run.progress)
        warming = warm_up() if self.start_method == "fork" else None  # joined before the workers fork
        # A database out of reach is refused before the data is read; a file is made once the data is
        # found (bad data leaves no store behind).
        first = open_store(self.target) if is_url(self.target) else None
        data = self.data if self.data is not None else _load(self.search.cfg, self.run)
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

    def preflight(self) -> tuple:
        raise NotImplementedError("a search job runs in its own process (processes = 1)")

    @staticmethod
    def worker(rank: int, world_size: int, store_path: str, *args: Any) -> None:
        raise NotImplementedError("a search job's workers are a Crew")

    def hint(self) -> str:
        return (f"Continue the search with: towerlab {COMMANDS[self.kind]} --resume {self.out}"
                if atomic.is_job_folder(self.out) else "")

    def name(self, rank: int) -> str:
        return f"worker {rank}"

    # -- the search in its store ------------------------------------------------------------------------

    @property
    def model(self) -> CandidateModel:
        return self.function or self.search.space.model

    def _threads(self) -> Optional[int]:
        return self.run.threads if self.run.device == "cpu" else None

    def _in_store(self, store: Store, data: Dataset, reporter: Optional[Reporter]) -> Search:
        """The search in `store`: created (and config.json written, with what its workers must share:
        `jobs.search.identity`), or the one this folder continues, admitted as any worker is (another
        towerlab or torch is recorded as the search's from now on, with a warning)."""
        here = _JobSide(self.run.resume is not None, self.run.device, self.run.threads, data, self.model)
        if self.run.resume:
            search_id = stored_search_id(self.out)
            row = store.records.search(search_id)
            stored = None if row is None else Search.of_row(row, str(store.path))
            try:
                adopted = [] if stored is None else admit(stored, here)
            except UserError as exc:
                raise UserError(f"cannot resume search {search_id} of {store.path}: {exc}") from None
            search = self.search.resume(store, search_id, training_hash(self.search, here, stored))
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
            setup = {"model": _model_spec(self.model), "test": data.n_test > 0, **recorded(self.search, here),
                     "data": {"format": data.source.get("format"), "fallback": bool(data.source.get("fallback"))}}
            cfg = replace(self.search.cfg, store=recorded_store(self.target) if self.search.cfg.store else None)
            search = dataclasses.replace(self.search, cfg=cfg).create(store, training_hash(self.search, here), setup)
            write_config(self.out, {"kind": self.kind, "search": to_dict(cfg), "run": to_dict(self.run),
                                    "search_id": search.id, "store": recorded_store(self.target),
                                    "workers": self.workers, "device_type": self.run.device})
            resuming = ""
        if reporter is not None:
            space = search.space
            reporter.line(f"towerlab {COMMANDS[self.kind]}: {resuming}{search.cfg.sampler} over space {space.name} "
                          f"({space.size_text}, model {space.model}) on {search.cfg.dataset}, {self.workers} "
                          f"worker(s) on {self.run.device} -> {self.out}")
            reporter.line(format_plan(search.plan))
        return search

    def _work(self, store: Store, search: Search, data: Dataset, reporter: Reporter) -> None:
        """This machine's workers on the search until it is finished (whoever else works on it)."""
        spec = WorkerSpec(store=self.target, run=self.run, per_device=search.cfg.workers_per_device,
                          threads=self._threads(), search_ids=(search.stored_id,), speaks=True)
        watch = Watch(store, search, self.out, reporter, self.workers, resumed=self.run.resume is not None,
                      tensorboard=self.run.tensorboard)
        crew = SearchCrew(spec, self.workers, store, handed=(*handover(data, self.start_method), self.function),
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

    def _finish(self, store: Store, search: Search, data: Dataset, reporter: Reporter, seconds: float,
                device: torch.device) -> None:
        """The record, from the store: the search played once more here (every result is there)."""
        result = search.run(store, _nothing_to_train)
        top = write_record(search, store, result, reporter,
                           RecordOptions(kind=self.kind, out=self.out, model=self.model, data=data, workers=self.workers,
                                         cpu_threads=self._threads(), seconds=seconds))
        if search.cfg.export_best:
            export_best(search, self.model, top[0], data.to(device), device, self.out, reporter)

    # -- under torchrun ---------------------------------------------------------------------------------

    def _rank(self) -> int:
        """One torchrun rank: rank 0 puts the search in the store and tells the others which it is (the
        process group serves for that alone); every rank then works on it; rank 0 writes the record."""
        rank = torchrun_ranks()[0]
        with session(timeout=self.run.timeout, backend="gloo", device=self.run.device) as ctx:
            data = load_everywhere(ctx, lambda **loading: search_data(self.search.cfg, self.run, **loading))
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
        spec = WorkerSpec(store=self.target, run=self.run, threads=self._threads(), search_ids=(told["search"],),
                          speaks=rank == 0)
        started = time.perf_counter()
        run_worker(spec, device, data, None, self.function, speaks=rank == 0)
        if rank == 0:
            reporter = Reporter(None, progress=False)
            with open_store(self.target) as store:
                search = Search.open(store, told["search"])
                self._finish(store, search, data, reporter, time.perf_counter() - started, device)
            reporter.close()
        return 0


class _JobSide:
    """The search job's side of its search, as `identity.admit` measures it (`identity.Here`): this machine's
    numerics, the data it loaded, and its model (a family, or a function: its file's digest)."""

    def __init__(self, resuming: bool, device: str, threads: Optional[int], data: Dataset,
                 model: CandidateModel) -> None:
        self.resuming, self.device, self.threads, self._data, self._model = resuming, device, threads, data, model
        self._digest: Optional[str] = None
        self.model_path = (function_file(model) or "") if callable(model) else ""

    def data(self) -> Dataset:
        return self._data

    def digest(self, recorded: Optional[str] = None) -> str:
        if self._digest is None:
            self._digest = digest_as(self._data, recorded)
        return self._digest

    def model_digest(self, recorded: Optional[str]) -> Optional[str]:
        return file_digest(self.model_path.rpartition(":")[0]) if self.model_path else None

    def model(self) -> CandidateModel:
        return self._model

    def model_proof(self) -> Optional[dict]:
        return model_proof(self._model)


def _nothing_to_train(candidates: list, record: Any) -> None:
    raise RuntimeError(f"the search's record found {len(candidates)} training(s) that its workers did not make, "
                       f"e.g. {candidates[0]}")


def _model_spec(model: CandidateModel) -> str:
    """What a search records of its model for the workers that join it: a family's name, a model
    function's FILE.py:FUNCTION, or that it was given from Python (no other process can load it)."""
    if isinstance(model, str):
        return model
    return function_file(model) or FROM_PYTHON


def _load(cfg: SearchConfig, run: RunConfig) -> Any:
    # Every data problem (and the download, or the offline fallback) once, before any worker
    # starts; the workers get this data, so every one of them reads the very same.
    return search_data(cfg, run)


def check_function(space: Space, function: object) -> None:
    """A space of model "custom" goes with a model function given from Python, and only it; each
    gene of a space must be a training gene or a keyword its model function takes (a family's
    builder, or yours): refused before anything trains, in one line naming the gene."""
    if (space.model == CUSTOM_MODEL) != (function is not None):
        raise UserError(f"space {space.name} has model {CUSTOM_MODEL!r}: its networks come from a function of yours, "
                        "given from Python (towerlab.api.search(space, data, model=make))" if function is None else
                        f"model= (a function of yours) goes with a space of model {CUSTOM_MODEL!r} (a dict space "
                        f"without \"model\" gets it), not with space {space.name} of model {space.model}")
    if function is not None and (not callable(function) or isinstance(function, torch.nn.Module)):
        raise UserError(f"model= of a search must be a function (input_shape, num_classes, **genes) returning a new "
                        f"nn.Module, got {type(function).__name__}")
    builder = model_function(function or space.model)
    unknown = not_taken(builder, [gene for gene in space.genes if gene not in TRAINING_GENES])
    if unknown:
        name = getattr(builder, "__name__", "your function")
        raise UserError(f"gene {unknown[0]!r} is neither a training gene ({', '.join(TRAINING_GENES)}) nor a keyword "
                        f"argument of {name}(input_shape, num_classes, ...): add it to {name}, or rename the gene")
