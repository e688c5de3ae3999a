"""towerlab's own training as a kind of objective (`towerlab.objective.kind.Kind`, "training": the kind of a
search that names no objective of yours): a search's task is a network built from its genome and trained on
this process's device (`towerlab.objective.candidate.train_candidate`), ranked by its validation accuracy
(`towerlab.search.goal.VALIDATION`), stopped and failed past --trial-timeout by its worker's process
(`towerlab.objective.deadline`), as a function of yours is.

One is made per search a process works on (`Training(search, here)`): the search's data (what its job handed
over, or read here as the search records them: `Search.recorded`) and its model (a family's name, the job's
own function, or the model file this worker's command names), once `admission.admit` has compared every item
that decides the search's results: besides the common ones, its own (`items`): the data's content
(`towerlab.data.digest`), the model file's content (for `--model FILE.py:FUNCTION`) and, once it is imported,
its proof (the file and the modules of yours it imports, as they ran: `towerlab.proof`). Otherwise it says
which differs, once, and the worker leaves that search to others.

Which model files a worker imports (the trust boundary): a model file is code, and a store's rows are data
that anyone who can write the store may change. So a worker imports a model file only where its own command
names it (`towerlab search worker --model FILE.py:FUNCTION`; a search's own job, and its `--resume`, name
theirs with --model), never because the store names a path, and only once every other check has passed and
the named file's SHA-256 is the one the search recorded; what it imports in turn is compared once it is
loaded, before anything trains. `check_function` checks a space's genes against the model function that
builds its networks, and `model_spec` is what a search records of that model.
"""

from __future__ import annotations

import dataclasses
import shlex
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

import torch

from towerlab.checks import ARRAYS_DATASET
from towerlab.catalog.models import not_taken
from towerlab.config import CUSTOM_MODEL, SearchConfig
from towerlab.data.digest import digest_as
from towerlab.data.load import Dataset, search_data
from towerlab.errors import UserError
from towerlab.models.custom import FROM_PYTHON, function_file, function_proof, function_spec
from towerlab.objective.admission import row_provenance
from towerlab.objective.candidate import (TRAINING_GENES, CandidateModel, Rung, estimated_cost,
                                          model_function, train_candidate, train_config_hash)
from towerlab.objective.deadline import Deadline, TrialTimedOut, lapses, timed_out
from towerlab.objective.kind import Here, Item, Named
from towerlab.objective.yours import trial_name, trials_folder
from towerlab.proof import Proof, file_digest, short
from towerlab.report import discard_line
from towerlab.search import Candidate, Outcome, Search, Space, Store
from towerlab.search.goal import TRAINING, VALIDATION, Aim, Goal
from towerlab.search.work.objective import Assignment

class Training:
    """towerlab's training of one search's networks in this process (see the module's docstring)."""

    name: ClassVar[str] = TRAINING
    setting: ClassVar[Optional[str]] = None
    flag: ClassVar[str] = ""
    data: ClassVar[bool] = True
    torch_here: ClassVar[bool] = True
    runs: ClassVar[str] = "towerlab's training"  # what a worker of it runs, as a refusal says

    @classmethod
    def goal(cls, cfg: SearchConfig) -> Goal:
        return VALIDATION

    @classmethod
    def settings(cls, cfg: SearchConfig, model_function: object) -> SearchConfig:
        """Its settings, as given: --metric and --direction are refused (it searches validation accuracy)."""
        _no_goal(cfg.metric, cfg.direction)
        return cfg

    @classmethod
    def check(cls, search: Search, function: Optional[Callable[..., Any]]) -> tuple[str, ...]:
        check_function(search.space, function)
        return ()

    @classmethod
    def check_worker(cls, named: Named, trials: str) -> None:
        _no_goal(named.metric, named.direction)

    @classmethod
    def searches(cls, search: Search) -> str:
        """What a search of it searches, as a refusal says."""
        return f"towerlab's networks (model {search.space.model} on {search.cfg.dataset})"

    def __init__(self, search: Search, here: Here) -> None:
        self.search, self.here = search, here
        self.threads: Optional[int] = here.threads if here.threads is not None else search.recorded("threads")
        self._data: Optional[Dataset] = None
        self._digest: Optional[str] = None
        self._model_file: Optional[str] = None  # FILE.py:FUNCTION, of those this worker's command names
        self.data_seconds = 0.0  # reading the data and its digest
        self._ready: Optional[tuple[Dataset, CandidateModel, dict]] = None  # once joined: data on the device, ...

    # -- what decides its results -------------------------------------------------------------------------

    def objective(self, recorded: Optional[dict]) -> dict:
        return Aim(self.name, "", self.goal(self.search.cfg)).recorded()

    @property
    def items(self) -> tuple[Item, ...]:
        return ITEMS

    def data_read(self) -> Dataset:
        """The search's data here: its job's, or read as the search records them (once)."""
        if self._data is None:
            started = time.perf_counter()
            self._data = self._read()
            self.data_seconds += time.perf_counter() - started
        return self._data

    def _read(self) -> Dataset:
        if self.here.data is not None:
            return self.here.data
        cfg, recorded = self.search.cfg, self.search.recorded("data") or {}
        if cfg.dataset == ARRAYS_DATASET:
            raise UserError("its data are arrays given from Python, which only its own process has")
        fallback = self.here.fallback
        return search_data(cfg, self.here.run, download=fallback is None, allow_fallback=False,
                           fallback_only=fallback if fallback is not None else bool(recorded.get("fallback")),
                           log=discard_line)

    def digest(self, recorded: Optional[str] = None) -> str:
        """The digest of its data's content (`towerlab.data.digest.digest_as`: the `recorded` one where an older
        towerlab's formula gives it of these data)."""
        if self._digest is None:
            data = self.data_read()
            started = time.perf_counter()
            self._digest = digest_as(data, recorded)
            self.data_seconds += time.perf_counter() - started
        return self._digest

    def model_digest(self, recorded: Optional[str]) -> Optional[str]:
        """The digest of the model file it would import (None where its networks come from no file: a family,
        a function given from Python): the job's function's file (measured where the search is recorded or
        resumed: a worker handed that very function compares its proof, `model_proof`), or, of the files this
        worker's command names with the search's function name, the one whose digest is `recorded` (else the
        first); never a file only the store names."""
        if self.search.space.model != CUSTOM_MODEL:
            return None
        if self.here.function is not None:
            self._model_file = function_file(self.here.function)
            return file_digest(self.model_path) if self.model_path and (recorded is None or self.here.resuming) else None
        named = self._named()
        try:
            digests = {given: file_digest(given.rpartition(":")[0]) for given in named}
        except OSError as exc:
            raise UserError(f"cannot read the model file {exc.filename}: {exc.strerror}") from None
        self._model_file = next((given for given in named if digests[given] == recorded), named[0])
        return digests[self._model_file]

    def _named(self) -> list[str]:
        spec = self.search.recorded("model")
        if not spec or spec == FROM_PYTHON:
            raise UserError("its networks come from a function given from Python, which only its own process has")
        path, _, name = spec.rpartition(":")
        named = [given for given in self.here.model_files if given.rpartition(":")[2] == name]
        if not named:
            raise UserError(f"its networks come from the model file {Path(path).name}, function {name}, and a worker "
                            "imports only the model files its command names: start it with --model "
                            f"{shlex.quote(spec)} (that file, or a copy of it)")
        return named

    @property
    def model_path(self) -> str:
        return (self._model_file or "").rpartition(":")[0]

    def model(self) -> CandidateModel:
        """The search's model: a family's name, the job's own function, or the model file this worker's command
        names where its content is the search's (imported only here, once every check before has passed)."""
        if self.search.space.model != CUSTOM_MODEL:
            return self.search.space.model
        if self.here.function is not None:
            return self.here.function
        if self._model_file is None:  # the search recorded no digest of its file: the first named
            self._model_file = self._named()[0]
        from towerlab.models.custom import load_function

        return load_function(self._model_file)

    def model_proof(self) -> Optional[dict]:
        """The proof of the model's file and the modules of yours it imports, once loaded (`model`): the parts of
        `towerlab.proof.Proof`; None where no file of yours was loaded through towerlab.proof."""
        model = self.model()
        found = function_proof(model) if callable(model) else None
        return None if found is None else dict(found.parts)

    def training_hash(self, stored: Optional[Search]) -> str:
        """The search's training-config hash, made here: its settings, and this process's numerics, data and
        model, with the data's digest and the model's proof where `stored` records them (None: a new search,
        which records both)."""
        def where(key: str, measure: Callable[[], Any]) -> Any:
            return measure() if stored is None or stored.recorded(key) is not None else None

        proven = where("model_proof", self.model_proof)
        return train_config_hash(self.search.cfg, self.here.device.type, self.threads, self.model(),
                                 where("data_digest", self.digest), None if proven is None else Proof(proven).digest)

    def setup(self) -> dict:
        data = self.data_read()
        return {"model": model_spec(self.model()), "test": data.n_test > 0,
                "data": {"format": data.source.get("format"), "fallback": bool(data.source.get("fallback"))}}

    def resume(self, store: Store, stored: Search) -> Search:
        return stored

    # -- its trials ---------------------------------------------------------------------------------------

    @property
    def lapses(self) -> Optional[float]:
        return lapses(self.search.cfg.trial_timeout)

    def join(self) -> None:
        started = time.perf_counter()
        device = self.here.device
        self._ready = (self.data_read().to(device), self.model(), row_provenance(device, self.digest()))
        if self.search.cfg.min_epochs is not None:  # a pruned search: a lower rung leaves its promotion a checkpoint
            self._trials = trials_folder(self.search, self.here.trials or Path("trials"), self.here.store)
        if self.here.times is not None:
            self.here.times.data(self.data_seconds + time.perf_counter() - started)

    def __call__(self, assignment: Assignment, /) -> Outcome:
        """A task of the search trained on this process's device: its Outcome, with its test accuracy where its
        network was scored on the test split; past --trial-timeout, a failed one."""
        assert self._ready is not None, "joined: admitted, its data and model here"
        data, model, provenance = self._ready
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        c, timeout = assignment.candidate, self.search.cfg.trial_timeout
        started = time.perf_counter()
        try:
            with Deadline(timeout):
                outcome, result = train_candidate(self.search.cfg, model, c.genome, c.seed, data, self.here.device,
                                                  test_from=assignment.test_from, stop=self.here.stop,
                                                  rung=self._rung(c))
        except TrialTimedOut:
            assert timeout is not None, "a deadline only where there is a timeout"
            outcome, result = Outcome.failed(timed_out(timeout), seconds=time.perf_counter() - started), None
        if self.here.times is not None:
            self.here.times.candidate(outcome.seconds, result)
        return dataclasses.replace(outcome, worker=self.here.name, provenance=provenance)

    _trials: Optional[Path] = None  # where a pruned search's trials keep their folders here

    def _rung(self, c: Candidate) -> Rung:
        """The candidate's epochs and, in a pruned search, its trial folder (its genome's and seed's, from rung
        to rung, as an objective of yours has: `towerlab.objective.yours`; none for a re-measure) and the
        epochs it starts from."""
        if self._trials is None or c.replicate:
            return Rung(c.max_epochs)
        return Rung(c.max_epochs, self._trials / trial_name(c), c.starts)

    def priority(self, candidate: Candidate) -> float:
        """Largest first: a generation then ends on small candidates, not on a big one that started last
        while the other workers sat idle."""
        assert self._ready is not None, "joined: admitted, its data and model here"
        data, model, _ = self._ready
        return estimated_cost(self.search.cfg, model, candidate.genome, data.input_shape, data.num_classes,
                              candidate.max_epochs)


def _no_goal(metric: Optional[str], direction: Optional[str]) -> None:
    """--metric and --direction refused: towerlab's own training searches validation accuracy."""
    from towerlab.objective import kinds

    yours = " or ".join(kind.flag.split()[0] for kind in kinds() if kind.setting is not None)
    for name, given, why in (("metric", metric, " (towerlab's own training searches validation accuracy)"),
                             ("direction", direction, "")):
        if given is not None:
            raise UserError(f"--{name} goes with {yours}{why}")


def _data_differs(theirs: str, ours: str, objective: Any, search: Search) -> str:
    source = objective.data_read().source
    files = source.get("files") or []
    where = f"{source.get('format')}, {files[0]}" + (f" and {len(files) - 1} more" if len(files) > 1 else "") \
        if files else str(source.get("format"))
    return (f"its data differ: {search.cfg.dataset} here ({where}) holds content {short(ours)}, the search's "
            f"{short(theirs)} (another file, a label changed?): use the search's data here (--data-dir)")


def _model_differs(theirs: str, ours: str, objective: Any, search: Search) -> str:
    if objective.here.resuming:
        return (f"its model file changed since it started ({objective.model_path} holds SHA-256 {short(ours)}, the "
                f"search's {short(theirs)}): resume with the file it started with")
    recorded_file = Path(str(search.recorded("model")).rpartition(":")[0]).name
    return (f"its model file differs: {objective.model_path} here holds SHA-256 {short(ours)}, the search's "
            f"{recorded_file} {short(theirs)}: give this worker the search's file")


def _model_proof_differs(theirs: dict, ours: dict, objective: Any, search: Search) -> str:
    difference = Proof(ours).difference(theirs)
    if objective.here.resuming:
        return (f"the modules of yours that its model file imports changed since it started ({difference}): "
                "resume with the files it started with")
    return (f"the modules of yours that its model file imports differ here ({difference}): give this worker the "
            "search's files (those beside its model file, and the packages of yours it imports)")


# Its own admission items, after the common ones: what is cheap first (the data are read, the model file
# imported, only once every item before matched).
def _digest(objective: Any, search: Search, stored: Any) -> Any:
    return objective.digest(stored)


def _model_digest(objective: Any, search: Search, stored: Any) -> Any:
    return objective.model_digest(stored)


def _model_proof(objective: Any, search: Search, stored: Any) -> Any:
    return objective.model_proof()


ITEMS = (Item("data_digest", _digest, _data_differs), Item("model_sha256", _model_digest, _model_differs),
         Item("model_proof", _model_proof, _model_proof_differs))


def model_spec(model: CandidateModel) -> str:
    """What a search records of its model for the workers that join it: a family's name, a model
    function's FILE.py:FUNCTION, or that it was given from Python (no other process can load it)."""
    return model if isinstance(model, str) else function_spec(model)


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
