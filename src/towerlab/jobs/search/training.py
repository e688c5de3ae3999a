"""towerlab's own training as a worker's objective (`towerlab.search.work.objective`): a search's task is a
network built from its genome and trained on this worker's device (`jobs.candidate.train_candidate`).

A worker makes one objective per search it joins (`Training.objective`): the search's data (what its job
handed over, or read here as the search records them: `Search.recorded`) and its model (a family's
name, the job's own function, or the model file this worker's command names), once `identity.admit` has
compared every item that decides the search's results (`WorkerSide`: this worker's side of them).
Otherwise it says which differs, once, and leaves that search to others. The search job's side of the
same items is `JobSide`; `check_function` checks a space's genes against the model function that
builds its networks, and `model_spec` is what a search records of that model.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch

from towerlab.checks import ARRAYS_DATASET
from towerlab.catalog.models import not_taken
from towerlab.config import CUSTOM_MODEL, RunConfig
from towerlab.data.digest import digest_as
from towerlab.data.load import Dataset
from towerlab.distributed.signals import StopFlag
from towerlab.errors import UserError
from towerlab.jobs.candidate import (TRAINING_GENES, CandidateModel, estimated_cost, model_function, outcome,
                                     train_candidate)
from towerlab.jobs.handover import search_data
from towerlab.jobs.search.identity import admit, model_proof, row_provenance
from towerlab.jobs.search.worker_times import WorkerTimes
from towerlab.models.custom import ModelFunction, function_file
from towerlab.report import discard_line
from towerlab.search import Candidate, Outcome, Search, Space
from towerlab.search.work.objective import Assignment
from towerlab.proof import file_digest

# What a search records of its model in its setup (of its objective, in its settings: --objective) when it
# is a function given from Python that no file defines, which no other process can load.
FROM_PYTHON = "a function given from Python"


class Given(Protocol):
    """What a worker's command gives its training (`workers.WorkerSpec`): the run's settings (device kind, data
    folder, downloads), the CPU threads per candidate (None: each search's own), the model files it may import."""

    @property
    def run(self) -> RunConfig: ...

    @property
    def threads(self) -> Optional[int]: ...

    @property
    def model_files(self) -> tuple[str, ...]: ...


class WorkerSide:
    """A worker's side of one search, as `identity.admit` measures it (`identity.Here`): its device and
    threads, its data (handed over by the job, or read as the search records them), and its model."""

    resuming = False

    def __init__(self, training: Training, search: Search) -> None:
        self.training, self.search = training, search
        self.device = training.device.type
        spec = training.spec
        self.threads: Optional[int] = spec.threads if spec.threads is not None else search.recorded("threads")
        self._data: Optional[Dataset] = None
        self._digest: Optional[str] = None
        self._model_file: Optional[str] = None  # FILE.py:FUNCTION, of those this worker's command names
        self.data_seconds = 0.0  # reading the data and its digest

    def data(self) -> Dataset:
        if self._data is None:
            started = time.perf_counter()
            self._data = self._read()
            self.data_seconds += time.perf_counter() - started
        return self._data

    def _read(self) -> Dataset:
        given = self.training.given
        if given is not None:
            return given
        cfg, recorded = self.search.cfg, self.search.recorded("data") or {}
        if cfg.dataset == ARRAYS_DATASET:
            raise UserError("its data are arrays given from Python, which only its own process has")
        fallback = self.training.fallback
        return search_data(cfg, self.training.spec.run, download=fallback is None, allow_fallback=False,
                           fallback_only=fallback if fallback is not None else bool(recorded.get("fallback")),
                           log=discard_line)

    def digest(self, recorded: Optional[str] = None) -> str:
        if self._digest is None:
            data = self.data()
            started = time.perf_counter()
            self._digest = digest_as(data, recorded)
            self.data_seconds += time.perf_counter() - started
        return self._digest

    def _from_a_file(self) -> bool:
        return self.search.space.model == CUSTOM_MODEL and self.training.function is None

    def model_digest(self, recorded: Optional[str]) -> Optional[str]:
        """The digest of the model file this worker would import: of those its command names with the search's
        function name, the one whose digest is `recorded` (else the first); never a file only the store names."""
        if not self._from_a_file():
            return None
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
        named = [given for given in self.training.spec.model_files if given.rpartition(":")[2] == name]
        if not named:
            raise UserError(f"its networks come from the model file {Path(path).name}, function {name}, and a worker "
                            "imports only the model files its command names: start it with --model "
                            f"{shlex.quote(spec)} (that file, or a copy of it)")
        return named

    @property
    def model_path(self) -> str:
        return (self._model_file or "").rpartition(":")[0]

    def objective(self, recorded: Optional[dict]) -> None:
        return None  # towerlab's own training

    def model(self) -> CandidateModel:
        """The search's model: a family's name, the job's own function, or the model file this worker's command
        names where its content is the search's (imported only here, once every check before has passed)."""
        if self.search.space.model != CUSTOM_MODEL:
            return self.search.space.model
        if self.training.function is not None:
            return self.training.function
        if self._model_file is None:  # the search recorded no digest of its file: the first named
            self._model_file = self._named()[0]
        from towerlab.models.custom import load_function

        return load_function(self._model_file)

    def model_proof(self) -> Optional[dict]:
        """The proof of the model's file and the modules of yours it imports, once loaded (`model`)."""
        return model_proof(self.model())


@dataclass
class _Setup:
    """How this worker trains one search: its data, its model, its CPU threads per candidate, and the
    provenance its rows record."""

    data: Dataset
    model: CandidateModel
    threads: Optional[int]
    provenance: dict  # what each of its rows records of where it was trained


class Training:
    """What trains a task of each search in this worker, made once per search (see the module's docstring):
    `objective(search)` for `search.work.worker.Worker`, and `priority(search)`, each task's cost."""

    def __init__(self, spec: Given, device: torch.device, name: str, stop: StopFlag,
                 data: Optional[Dataset] = None, fallback: Optional[bool] = None,
                 function: Optional[ModelFunction] = None, times: Optional[WorkerTimes] = None) -> None:
        self.spec, self.device, self.name, self.stop = spec, device, name, stop
        self.given, self.fallback, self.function, self.times = data, fallback, function, times
        self._setups: dict[int, _Setup] = {}

    def setup(self, search: Search) -> _Setup:
        """The search's data and model on this worker, once it is admitted (a UserError says why not)."""
        if search.stored_id in self._setups:
            return self._setups[search.stored_id]
        here = WorkerSide(self, search)
        admit(search, here)
        started = time.perf_counter()
        setup = _Setup(here.data().to(self.device), here.model(), here.threads,
                       row_provenance(self.device, here.digest()))
        self._setups[search.stored_id] = setup
        if self.times is not None:
            self.times.data(here.data_seconds + time.perf_counter() - started)
        return setup

    def objective(self, search: Search) -> Callable[[Assignment], Outcome]:
        """A task of `search` trained on this worker's device: its Outcome, with its test accuracy where its
        network was scored on the test split."""
        setup = self.setup(search)

        def train(assignment: Assignment) -> Outcome:
            if setup.threads is not None and torch.get_num_threads() != setup.threads:
                torch.set_num_threads(setup.threads)
            c = assignment.candidate
            fields, result = train_candidate(search.cfg, setup.model, c.genome, c.seed, setup.data, self.device,
                                             test_from=assignment.test_from, stop=self.stop, max_epochs=c.max_epochs)
            if self.times is not None:
                self.times.candidate(fields["seconds"], result)
            return outcome({**fields, "worker": self.name, "provenance": setup.provenance})

        return train

    def priority(self, search: Search) -> Callable[[Candidate], float]:
        """Largest first: a generation then ends on small candidates, not on a big one that started last
        while the other workers sat idle."""
        setup = self.setup(search)
        shape, classes = setup.data.input_shape, setup.data.num_classes
        return lambda c: estimated_cost(search.cfg, setup.model, c.genome, shape, classes, c.max_epochs)


class JobSide:
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

    def objective(self, recorded: Optional[dict]) -> None:
        return None  # towerlab's own training

    def model_proof(self) -> Optional[dict]:
        return model_proof(self._model)


def model_spec(model: CandidateModel) -> str:
    """What a search records of its model for the workers that join it: a family's name, a model
    function's FILE.py:FUNCTION, or that it was given from Python (no other process can load it)."""
    if isinstance(model, str):
        return model
    return function_file(model) or FROM_PYTHON


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
