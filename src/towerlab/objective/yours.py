"""What the kinds of objective of your code share (`Yours`: a function, `towerlab.objective.function.Function`;
a command, `towerlab.objective.command.Command`): a search's task is a trial of your code (a `TrialRunner`:
`towerlab.objective.trial`), run on this worker's device in a folder of its own, and its Result is the task's
Outcome (`outcome`): the searched metric as the fitness (higher is better: `Goal.fitness`), every metric by its
name, the curve it reported.

What a trial runs comes only from this process's own command line (`Here.named`: `search run --objective
FILE.py:FUNCTION` or `--command '...'`, `search worker --objective ... / --command ...`), never from the store
(docs/distributed-search.md: the trust boundary). A worker joining a search compares its objective with the
search's before it runs anything (`admission.admit`, the item "objective": its kind, metric, direction and
proof, `towerlab.proof`): a function's file by its bytes before it is imported, then the modules of yours it
imports once it is; a command's text, the files it names (relative to the worker's folder) and the modules a
Python program of it imports. A worker that names no --metric or --direction takes the search's (data, not
code). And a trial's result is recorded only if what it ran is still what the worker proved when it joined
(`TrialRunner.unproven`, asked before the trial runs and again once it has): otherwise the worker stops, in
one line saying what changed, and the task goes back on the queue. A search of yours resumed with another
goal is ranked anew from its rows (`towerlab.objective.regoal`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch

from towerlab.checks import check_direction_named
from towerlab.config import SearchConfig
from towerlab.distributed.env import device_name
from towerlab.errors import UserError
from towerlab.fields import replace
from towerlab.objective.admission import row_provenance
from towerlab.objective.kind import Here, Item, Named
from towerlab.objective.result import Result
from towerlab.objective.trial import Trial, TrialRunner, setup
from towerlab.proof import Proof
from towerlab.report import printable
from towerlab.search import Candidate, Outcome, Search, Store, genome_hash
from towerlab.search.goal import Aim, Goal
from towerlab.search.work.objective import Assignment

# The SearchConfig settings that only towerlab's own training reads: set away from their defaults in a
# search of your own objective, they are refused (they would do nothing).
TRAINING_ONLY = ("dataset", "val_size", "image_size", "test_size", "patience", "batch_size", "export_best")


class Yours:
    """A kind of objective of your code (see the module's docstring); a subclass says its `name`, `setting`,
    `flag`, `runs` and `torch_here`, builds its trial runner (`runner`), says when a search's epochs are lost on it
    (`epochs_ignored`) and how long after its timeout a trial is surely over (`lapses`)."""

    name: ClassVar[str]
    setting: ClassVar[Optional[str]]
    flag: ClassVar[str]
    runs: ClassVar[str]  # what a worker of it runs, as a refusal says
    data: ClassVar[bool] = False
    torch_here: ClassVar[bool]

    @classmethod
    def goal(cls, cfg: SearchConfig) -> Goal:
        """The goal that --metric (DEFAULT_METRIC where none is given) and --direction (maximize) name."""
        return Goal.named(cfg.metric, cfg.direction)

    @classmethod
    def settings(cls, cfg: SearchConfig, model_function: object) -> SearchConfig:
        """A search of your objective's settings with its goal decided (--metric value and --direction maximize
        where not given, checked), once those that only towerlab's training reads were refused."""
        defaults = SearchConfig()
        for name in TRAINING_ONLY:
            if getattr(cfg, name) != getattr(defaults, name):
                raise UserError(f"--{name.replace('_', '-')} does nothing in a search of your own objective, which "
                                "trains whatever it trains: drop it (your objective reads its own data)")
        if model_function is not None:
            raise UserError("--model builds towerlab's networks; a search of your own objective trains whatever it "
                            "trains: drop --model")
        goal = cls.goal(cfg)
        check_direction_named(goal.metric, cfg.direction)
        return replace(cfg, metric=goal.metric, direction=goal.direction)

    @classmethod
    def check(cls, search: Search, function: Optional[Callable[..., Any]]) -> tuple[str, ...]:
        """Its runner built now (imported, and checked against the genes: a mistake of yours before anything
        is written), and a warning where the search's epochs would be lost on it."""
        runner = cls.runner(search, search.aim.spec, function)
        cfg = search.cfg
        if cfg.min_epochs is None and cfg.budget_epochs is None:
            return ()
        how = "a pruned search trains each rung for its own epochs" if cfg.min_epochs is not None else \
            "--budget-epochs counts the epochs it gives each trial"
        ignored = cls.epochs_ignored(runner, how)
        return () if ignored is None else (ignored,)

    @classmethod
    def check_worker(cls, named: Named, trials: str) -> None:
        Goal.named(named.metric, named.direction)  # a --metric that is no name is refused before any worker starts
        check_trials_folder(trials)

    @classmethod
    def searches(cls, search: Search) -> str:
        """What a search of it searches, as a refusal says."""
        return f"your own {cls.name} objective"

    @classmethod
    def runner(cls, search: Search, spec: str, function: Optional[Callable[..., Any]]) -> TrialRunner:
        """What runs `search`'s trials here, named by `spec` (or `function`, given from Python), with its goal,
        checked against the space's genes (each refusal a UserError of one line)."""
        raise NotImplementedError

    @classmethod
    def epochs_ignored(cls, runner: Any, how: str) -> Optional[str]:
        """A warning where `runner` takes no epochs, though the search's decide something (`how`)."""
        raise NotImplementedError

    def __init__(self, search: Search, here: Here) -> None:
        self.search, self.here = search, here
        recorded = search.recorded("threads")
        self.threads: Optional[int] = self._threads(here.threads if here.threads is not None else recorded)
        self.built: Optional[TrialRunner] = None
        self._setup: Optional[dict] = None
        self._provenance: dict = {}
        self._trials = Path()
        self._home = os.getcwd()  # where each trial leaves the worker again

    def _threads(self, threads: Optional[int]) -> Optional[int]:
        """The CPU threads of its trials (a command's program runs as it likes: None)."""
        return threads

    # -- what decides its results -------------------------------------------------------------------------

    def _measured(self, recorded: dict) -> Optional[dict]:
        """What it measures of its code before it is imported, against the search's `recorded` objective: a
        function's file by its bytes (None: nothing to compare before the import)."""
        return None

    def objective(self, recorded: Optional[dict]) -> dict:
        """The objective's setup this process would run; against a `recorded` one (the search's), what can be
        compared before anything of yours is imported is compared first (`_measured`)."""
        if self._setup is not None:
            return self._setup
        named, search = self.here.named, self.search
        goal = Goal.named(named.metric or search.goal.metric, named.direction or search.goal.direction)
        if named.kind != self.name or (recorded is not None and recorded.get("kind") != self.name):
            return {**Aim(self.name, named.spec, goal).recorded(), "proof": {}}  # another kind: never built
        if recorded is not None:
            measured = self._measured(recorded)
            if measured is not None:
                return {**Aim(self.name, named.spec, goal).recorded(), "proof": measured}
        if goal != search.goal:
            return {**Aim(self.name, named.spec, goal).recorded(), "proof": {}}
        self.built = self.runner(search, named.spec, self.here.function)
        self._setup = setup(self.built)
        if recorded is not None:
            # A file the command names that was not there when the search started (so not in its proof) is one
            # its program writes (--out last.json): no input of the search's first trials, and never a reason to
            # refuse its resume ("last.json only here").
            theirs = recorded.get("proof", {})
            self._setup["proof"] = {k: v for k, v in self._setup["proof"].items() if k in theirs}
        return self._setup

    @property
    def items(self) -> tuple[Item, ...]:
        return ()  # its proof is the objective's

    def training_hash(self, stored: Optional[Search]) -> str:
        """The training-config hash of a search of your own objective: what decides a trial's result besides
        its genes and seed (the objective's kind, metric, direction and proof, the last rung's epochs, and the
        numerics: device kind, a function's CPU threads). Not --trial-timeout, which decides no result a row
        holds (a trial past it fails, and a failed row serves no other search): a resume may change it, and a
        new search with one is served the rows of one without. A search made while the hash held its
        --trial-timeout keeps that hash (`stored`'s)."""
        objective = self.objective(self.search.recorded("objective"))
        timeout = None if stored is None else stored.cfg.trial_timeout
        if stored is not None and timeout is not None:
            made_before = self._hash(objective, timeout)
            if made_before == stored.train_config_hash:
                return made_before
        return self._hash(objective, None)

    def _hash(self, objective: dict, timeout: Optional[float]) -> str:
        return genome_hash({"objective": {key: objective[key] for key in ("kind", "metric", "direction")},
                            "proof": Proof(objective["proof"]).digest, "max_epochs": self.search.cfg.max_epochs,
                            "trial_timeout": timeout,
                            "numerics": {"device": self.here.device.type, "threads": self.threads}})

    def setup(self) -> dict:
        return {"test": False, "spec": self.search.aim.spec}

    def resume(self, store: Store, stored: Search) -> Search:
        """`stored`, ranked from now on by this search's goal where the resume names another (`regoal`)."""
        from towerlab.objective.regoal import regoal

        return regoal(store, stored, self.search, self)

    # -- its trials ---------------------------------------------------------------------------------------

    @property
    def lapses(self) -> Optional[float]:
        raise NotImplementedError

    def join(self) -> None:
        """Once admitted: the provenance its rows record, and where its trials keep their folders."""
        assert self.built is not None, "admitted: its objective was built"
        self._provenance = {**row_provenance(self.here.device, None), "objective": self.built.proof().digest}
        self._trials = trials_folder(self.search, self.here.trials or Path("trials"), self.here.store)

    def __call__(self, assignment: Assignment, /) -> Outcome:
        """A task of the search run as a trial on this worker's device, in its folder: its Outcome. Each trial
        leaves the worker in its own folder again."""
        assert self.built is not None, "joined: admitted, its objective built"
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        c = assignment.candidate
        epochs = c.max_epochs or self.search.cfg.max_epochs
        stop = self.here.stop
        # one folder for the genome and seed, from rung to rung: a promotion continues there (`start`)
        trial = Trial(dict(c.genome), c.seed, epochs, str(self.here.device),
                      self._trials / trial_name(c),
                      stop=None if stop is None else (lambda: stop.signum), start=c.starts)
        self._still_proven(trial, "the trial was not run")
        started = time.perf_counter()
        try:
            result = self.built.run(trial)
        finally:
            with contextlib.suppress(OSError):  # a trial that changed the process's folder (os.chdir)
                os.chdir(self._home)
        self._still_proven(trial, "its result is dropped")
        if self.here.times is not None:
            self.here.times.candidate(time.perf_counter() - started, None)
        return outcome(result, epochs, self.here.name, {"device": device_name(self.here.device),
                                                         "threads": self.threads}, self._provenance,
                       trial.start if getattr(self.built, "continues", False) else 0)

    def priority(self, candidate: Candidate) -> float:
        """Longest first: a trial's budget of epochs is all that is known of its cost."""
        return float(candidate.max_epochs or self.search.cfg.max_epochs)

    def _still_proven(self, trial: Trial, so: str) -> None:
        """Nothing, where what `trial` runs (or ran) is what this worker's objective proved when it joined the
        search; else a UserError saying what changed, and `so`."""
        assert self.built is not None
        problem = self.built.unproven(trial)
        if problem is not None:
            raise UserError(f"search {self.search.stored_id}: what its trials run is no longer what this worker "
                            f"proved when it joined ({printable(problem)}): {so}; put back the files the search was "
                            "started with, or start a new search with these")


def outcome(result: Result, epochs: int, worker: str, numerics: dict, provenance: dict, continued: int = 0) -> Outcome:
    """The search's Outcome of a trial's Result (a failed trial's with its reason), the one conversion;
    `continued`, the epochs it did not train again (its `start`, where it takes it)."""
    return Outcome(result.status, fitness=result.fitness, epochs=epochs, seconds=result.seconds, worker=worker,
                   reason=result.reason, numerics=numerics, provenance=provenance,
                   metrics=dict(result.metrics) or None, curve=[dict(p) for p in result.curve] or None,
                   continued=continued)


def trials_folder(search: Search, folder: Path, store: Optional[Store]) -> Path:
    """Where `search`'s trials keep their folders here: search-ID-TOKEN under `folder` (made absolute here,
    before any trial can change the process's folder), TOKEN the first 12 characters of the search's token in
    its store (random, made with it: two stores' searches never share one), or, for a search recorded without
    one, of the SHA-256 of its store's name and its id; so that a trial tried again after its worker was lost
    finds what it left there, and only that."""
    row = None if store is None else store.records.search(search.stored_id)
    token = row.token if row is not None and row.token else \
        hashlib.sha256(f"{search.where}\0{search.stored_id}".encode()).hexdigest()
    return Path(os.path.abspath(folder)) / f"search-{search.stored_id}-{token[:12]}"


def trial_name(candidate: Candidate) -> str:
    """A trial's folder in its search's (`trials_folder`): GENOME-seedSEED, the genome's and seed's, so that a
    pruned search's promotion runs where its lower rung ran."""
    return f"{candidate.genome_hash[:12]}-seed{candidate.seed}"


def check_trials_folder(path: str) -> None:
    """`search worker --trials DIR`: a folder, made here where it is not there (a file, or one that cannot
    be made or written, is refused in one line before any worker starts: every trial would fail on it)."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"--trials {path} is a file, not a folder: give the folder where the trials of your "
                        "objective keep theirs (it is made where it is not there)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--trials {path}: cannot make it ({exc.strerror or exc}): give a folder this worker can "
                        "write") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"--trials {path} cannot be written by this worker: give a folder it can write")
