"""An objective of yours as a worker's objective (`towerlab.search.work.objective`): a search's task is a
trial of your function or your command (`towerlab.objective`: `FunctionObjective`, `CommandObjective`, the
second and third implementations of the task interface after towerlab's own training), run on this
worker's device in a folder of its own, and its Result is the task's Outcome: the searched metric as the
fitness (higher is better: negated where it is minimized), every metric by its name, the curve it reported.

What a trial runs comes only from this process's own command line (`Own`: `search run --objective
FILE.py:FUNCTION` or `--command '...'`, `search worker --objective ... / --command ...`), never from the
store (docs/distributed-search.md: the trust boundary). A worker joining a search compares its objective
with the search's before it runs anything (`identity.admit`, the item "objective": its kind, metric,
direction and proof, `towerlab.proof`): a function's file by its bytes before it is imported, then the
modules of yours it imports once it is; a command's text, the files it names (relative to the worker's
folder) and the modules a Python program of it imports. A worker that names no --metric or --direction
takes the search's (data, not code). And a trial's result is recorded only if what it ran is still what
the worker proved when it joined (`Objective.unproven`, asked before the trial runs and again once it
has): otherwise the worker stops, in one line saying what changed, and the task goes back on the queue.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from towerlab.config import SearchConfig
from towerlab.checks import check_direction_named
from towerlab.data.load import Dataset
from towerlab.distributed.env import device_name
from towerlab.distributed.signals import StopFlag
from towerlab.errors import UserError
from towerlab.fields import replace
from towerlab.jobs.search.identity import admit, row_provenance
from towerlab.jobs.search.training import FROM_PYTHON
from towerlab.jobs.search.worker_times import WorkerTimes
from towerlab.objective import (DEFAULT_METRIC, CommandObjective, FunctionObjective, Goal, Objective, Trial,
                                setup)
from towerlab.proof import file_digest
from towerlab.report import printable
from towerlab.search import Candidate, Outcome, Search, Store
from towerlab.search.ranges import Range
from towerlab.search.work.objective import Assignment

# The SearchConfig settings that only towerlab's own training reads: set away from their defaults in a
# search of your own objective, they are refused (they would do nothing).
TRAINING_ONLY = ("dataset", "val_size", "image_size", "test_size", "patience", "batch_size", "export_best")
LISTED = 10_000  # the most values of a range gene a command's proof lists (the files a gene may name)


@dataclass(frozen=True)
class Own:
    """The objective of yours a process's command line names: its `kind` ("function", "command") and `spec`
    (FILE.py:FUNCTION, the command's text), and the --metric and --direction it names (None: the search's)."""

    kind: str
    spec: str
    metric: Optional[str] = None
    direction: Optional[str] = None

    @classmethod
    def of(cls, cfg: SearchConfig) -> Optional[Own]:
        """A search's own objective, as its settings name it (None: towerlab's own training)."""
        if cfg.trial_command is not None:
            return cls("command", cfg.trial_command, cfg.metric, cfg.direction)
        return None if cfg.objective is None else cls("function", cfg.objective, cfg.metric, cfg.direction)


def goal_of(metric: Optional[str], direction: Optional[str]) -> Goal:
    """The goal that --metric (value where none is given) and --direction (maximize) name, checked (an empty
    --metric is refused, not taken for none)."""
    return Goal(DEFAULT_METRIC if metric is None else metric, direction or "maximize")


def own_settings(cfg: SearchConfig, model_function: object = None) -> SearchConfig:
    """A search of your own objective's settings with its goal decided (--metric value and --direction
    maximize where not given, checked), once those that only towerlab's training reads were refused."""
    defaults = SearchConfig()
    for name in TRAINING_ONLY:
        if getattr(cfg, name) != getattr(defaults, name):
            raise UserError(f"--{name.replace('_', '-')} does nothing in a search of your own objective, which trains "
                            "whatever it trains: drop it (your objective reads its own data)")
    if model_function is not None:
        raise UserError("--model builds towerlab's networks; a search of your own objective trains whatever it trains: "
                        "drop --model")
    goal = goal_of(cfg.metric, cfg.direction)
    check_direction_named(goal.metric, cfg.direction)
    return replace(cfg, metric=goal.metric, direction=goal.direction)


def epochs_ignored(objective: Objective, cfg: SearchConfig) -> Optional[str]:
    """A warning where a search gives its trials a number of epochs that decides something (pruned: each rung's;
    --budget-epochs: what is counted) and `objective` takes none; None otherwise."""
    if cfg.min_epochs is None and cfg.budget_epochs is None:
        return None
    how = "a pruned search trains each rung for its own epochs" if cfg.min_epochs is not None else \
        "--budget-epochs counts the epochs it gives each trial"
    if isinstance(objective, FunctionObjective) and "epochs" not in objective.given:
        return (f"towerlab: warning: your {objective.spec} takes no epochs, and {how}: each of its trials trains "
                "as long as any other; take epochs (a parameter), and train that many")
    if isinstance(objective, CommandObjective) and "epochs" not in {name for pieces in objective.arguments
                                                                   for _, name in pieces}:
        return (f"towerlab: warning: your command names no {{epochs}}, and {how}: unless the program reads "
                "$TOWERLAB_EPOCHS, each of its trials trains as long as any other")
    return None


def build(own: Own, search: Search, function: Optional[Callable[..., Any]] = None) -> Objective:
    """The objective that runs `search`'s trials here, with its goal: a function (`function` given from
    Python, or `own`'s FILE.py:FUNCTION, imported here) or a command, checked against the space's genes
    (each refusal a UserError of one line)."""
    genes, cfg, goal = list(search.space.genes), search.cfg, goal_of(search.cfg.metric, search.cfg.direction)
    conditional = list(search.space.when)  # left out of a trial where inactive
    if own.kind == "command":
        return CommandObjective(own.spec, genes, goal, timeout=cfg.trial_timeout, conditional=conditional,
                                values=listed(search))
    if function is None and own.spec == FROM_PYTHON:
        raise UserError("its objective is a function given from Python, which only its own process has: give the "
                        "function again (objective=), or its file (--objective FILE.py:FUNCTION)")
    return FunctionObjective(function if function is not None else own.spec, genes, goal, conditional,
                             timeout=cfg.trial_timeout)


def listed(search: Search) -> dict[str, tuple]:
    """The values of each gene of `search`'s space that can be listed, as a trial gets them: a list's, an int
    range's of at most LISTED (a float's are not: each sampler computes its own)."""
    return {name: values if isinstance(values, tuple) else tuple(values.value_at(i) for i in range(int(values.count)))
            for name, values in search.space.genes.items()
            if not isinstance(values, Range) or (values.kind == "int" and values.count <= LISTED)}


class OwnSide:
    """A process's side of a search of your own objective, as `identity.admit` measures it (`identity.Here`):
    its numerics (device kind; on a CPU, a function's threads), and its objective, built here from `own` (or
    `function`, given from Python) where it is the search's."""

    def __init__(self, own: Own, search: Search, device: str, threads: Optional[int], *, resuming: bool = False,
                 function: Optional[Callable[..., Any]] = None) -> None:
        self.own, self.search, self.function, self.resuming, self.device = own, search, function, resuming, device
        self.threads = threads if own.kind == "function" else None  # a command's program runs as it likes
        self.built: Optional[Objective] = None
        self._setup: Optional[dict] = None
        self.model_path = ""

    def objective(self, recorded: Optional[dict]) -> Optional[dict]:
        """The objective's setup this process would run; against a `recorded` one (the search's), a function's
        file is compared by its bytes first, and imported only where they are the search's."""
        if self._setup is not None:
            return self._setup
        own, search = self.own, self.search
        metric, direction = own.metric or search.cfg.metric, own.direction or search.cfg.direction
        if recorded is not None and own.kind == "function" and self.function is None:
            path = own.spec.rpartition(":")[0]
            try:
                digest = file_digest(path)
            except OSError as exc:
                raise UserError(f"cannot read the objective's file {path}: {exc.strerror or exc}") from None
            module = Path(path).stem
            if recorded.get("proof", {}).get(module) != digest:  # not the search's: never imported
                return {"kind": own.kind, "metric": metric, "direction": direction, "proof": {module: digest}}
        if metric != search.cfg.metric or direction != search.cfg.direction:
            return {"kind": own.kind, "metric": metric, "direction": direction, "proof": {}}
        self.built = build(own, search, self.function)
        self._setup = setup(self.built)
        if recorded is not None and own.kind == "command":
            # A file the command names that was not there when the search started (so not in its proof) is one
            # its program writes (--out last.json): no input of the search's first trials, and never a reason to
            # refuse its resume ("last.json only here").
            theirs = recorded.get("proof", {})
            self._setup["proof"] = {k: v for k, v in self._setup["proof"].items() if k in theirs}
        return self._setup

    def data(self) -> Dataset:
        raise TypeError("a search of your own objective has no data of towerlab's")

    def digest(self, recorded: Optional[str] = None) -> None:
        return None  # no data of towerlab's

    def model_digest(self, recorded: Optional[str]) -> None:
        return None

    def model(self) -> Any:
        raise TypeError("a search of your own objective has no model of towerlab's")

    def model_proof(self) -> None:
        return None  # its proof is the objective's (`objective`)


@dataclass
class _Setup:
    """How this worker runs one search's trials: the objective, the CPU threads of a function's trials, and
    the provenance its rows record."""

    objective: Objective
    threads: Optional[int]
    provenance: dict


class Trials:
    """What runs the trials of each search of your own objective in this worker, made once per search (see
    the module's docstring): `objective(search)` for `search.work.worker.Worker`, and `priority(search)`.
    Each trial has a folder of its own under `folder` (made absolute here, before any trial can change the
    process's folder): search-ID-TOKEN/GENOME-eEPOCHS-seedSEED, TOKEN the search's own in its `store`
    (`trials_folder`: two stores' searches never share one), so that a trial tried again after its worker
    was lost finds what it left there, and only that. Each trial leaves the worker in its own folder again."""

    def __init__(self, own: Own, device: torch.device, name: str, stop: StopFlag, folder: Path,
                 threads: Optional[int] = None, function: Optional[Callable[..., Any]] = None,
                 times: Optional[WorkerTimes] = None, store: Optional[Store] = None) -> None:
        self.own, self.device, self.name, self.stop = own, device, name, stop
        self.folder = Path(os.path.abspath(folder))
        self.threads, self.function, self.times, self.store = threads, function, times, store
        self.home = os.getcwd()
        self._setups: dict[int, _Setup] = {}

    def setup(self, search: Search) -> _Setup:
        """The search's objective on this worker, once it is admitted (a UserError says why not)."""
        if search.stored_id in self._setups:
            return self._setups[search.stored_id]
        if not search.own:
            raise UserError(f"it trains towerlab's networks (model {search.space.model} on {search.cfg.dataset}), and "
                            "this worker runs its own objective only: start a worker without --objective or --command")
        threads = self.threads if self.threads is not None else search.recorded("threads")
        here = OwnSide(self.own, search, self.device.type, threads, function=self.function)
        admit(search, here)
        assert here.built is not None, "admitted: its objective was built"
        provenance = {**row_provenance(self.device, None), "objective": here.built.proof().digest}
        setup = _Setup(here.built, here.threads, provenance)
        self._setups[search.stored_id] = setup
        return setup

    def objective(self, search: Search) -> Callable[[Assignment], Outcome]:
        """A task of `search` run as a trial on this worker's device: its Outcome."""
        setup = self.setup(search)
        numerics = {"device": device_name(self.device), "threads": setup.threads}

        trials = self.trials_folder(search)

        def run(assignment: Assignment) -> Outcome:
            if setup.threads is not None and torch.get_num_threads() != setup.threads:
                torch.set_num_threads(setup.threads)
            c = assignment.candidate
            epochs = c.max_epochs or search.cfg.max_epochs
            trial = Trial(dict(c.genome), c.seed, epochs, str(self.device),
                          trials / f"{c.genome_hash[:12]}-e{epochs}-seed{c.seed}", stop=lambda: self.stop.signum)
            _still_proven(setup.objective, trial, search, "the trial was not run")
            started = time.perf_counter()
            try:
                result = setup.objective.run(trial)
            finally:
                with contextlib.suppress(OSError):  # a trial that changed the process's folder (os.chdir)
                    os.chdir(self.home)
            _still_proven(setup.objective, trial, search, "its result is dropped")
            if self.times is not None:
                self.times.candidate(time.perf_counter() - started, None)
            return Outcome(result.status, fitness=result.fitness, epochs=epochs, seconds=result.seconds,
                           worker=self.name, reason=result.reason, numerics=numerics, provenance=setup.provenance,
                           metrics=dict(result.metrics) or None, curve=[dict(p) for p in result.curve] or None)

        return run

    def trials_folder(self, search: Search) -> Path:
        """Where `search`'s trials keep their folders here: search-ID-TOKEN under `folder`, TOKEN the first 12
        characters of the search's token in its store (random, made with it), or, for a search recorded
        without one, of the SHA-256 of its store's name and its id."""
        row = None if self.store is None else self.store.records.search(search.stored_id)
        token = row.token if row is not None and row.token else \
            hashlib.sha256(f"{search.where}\0{search.stored_id}".encode()).hexdigest()
        return self.folder / f"search-{search.stored_id}-{token[:12]}"

    def priority(self, search: Search) -> Callable[[Candidate], float]:
        """Longest first: a trial's budget of epochs is all that is known of its cost."""
        return lambda c: float(c.max_epochs or search.cfg.max_epochs)


def _still_proven(objective: Objective, trial: Trial, search: Search, so: str) -> None:
    """Nothing, where what `trial` runs (or ran) is what this worker's objective proved when it joined
    `search`; else a UserError saying what changed, and `so`."""
    problem = objective.unproven(trial)
    if problem is not None:
        raise UserError(f"search {search.stored_id}: what its trials run is no longer what this worker proved when "
                        f"it joined ({printable(problem)}): {so}; put back the files the search was started with, or "
                        "start a new search with these")
