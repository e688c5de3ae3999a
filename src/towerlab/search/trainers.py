"""The protocol between a search and whoever trains its candidates (the torch side), as types that mypy
checks: `Trainer`, `Record`, `Prefetching`.

A `Trainer`, `train(candidates, record) -> None`, is the swappable batch map. The engine passes only
the candidates the store cannot serve (each key once) and a `Record`, `record(candidate, outcome)`.
The trainer calls `record` exactly once per candidate, as soon as that candidate has finished, in any
order and from any thread of this process; `record` writes the outcome to the store in its own
transaction before it returns, so a crash loses only the unfinished candidates. A candidate that
fails (out of memory, diverged, ...) is recorded as `Outcome.failed(reason)`; an exception escaping
`train` stops the search (it can be resumed), and a trainer that returns without recording
every candidate is a bug (RuntimeError). `serial(fitness)` turns a function
`fitness(candidate) -> Outcome` into a trainer that trains in this process.

Work that unlocks as results come in (a pruned generation's next rung): after a `record`, a
trainer may call `record.more()`, which returns the candidates that became trainable (each once,
possibly none); it then trains them too before it returns, so its workers need not wait for a rung's
last trainings. A trainer that never asks is called again with them; the history is the same.

A trainer whose workers write their results to the store themselves (`towerlab.search.work.driver`) hands
the engine each candidate's row instead (`record.served(candidate, row)`, the row stored under
`record.train_config_hash(candidate)`); one that can start work before it is asked to wait for it
(the next generation's first rung, while this one trains) is `Prefetching`; one whose workers take
candidates as they free up is `Pacing`: it says how many more candidates it could start now (`pace`),
so that an asynchronous search proposes as workers need them, and waits for results (`wait`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

from towerlab.errors import UserError
from towerlab.search.candidates import Candidate, Outcome, raised
from towerlab.search.store.rows import Evaluation


class Record(Protocol):
    """What a trainer is handed with its candidates (see the module's docstring)."""

    def __call__(self, candidate: Candidate, outcome: Outcome) -> None:
        """The outcome of a candidate handed to the trainer, written to the store before it returns."""

    def served(self, candidate: Candidate, row: Evaluation) -> None:
        """The candidate's row, which is in the store already (its worker wrote it)."""

    def more(self) -> list[Candidate]:
        """Candidates that became trainable since they were last asked for (each handed out once)."""

    def train_config_hash(self, candidate: Candidate) -> str:
        """What the candidate's row is stored under (its rung's training-config hash)."""


class Trainer(Protocol):
    """Trains the candidates the store cannot serve, recording each (see the module's docstring)."""

    def __call__(self, candidates: list[Candidate], record: Record) -> None: ...


@runtime_checkable
class Prefetching(Trainer, Protocol):
    """A trainer that can start on candidates before it is asked to wait for them."""

    def prefetch(self, candidates: list[Candidate], train_config_hash: str) -> None: ...


@dataclass(frozen=True)
class Pace:
    """How many more candidates a `Pacing` trainer could start now (`wanted`): its idle workers, and
    `spare` more kept ready so that a worker that frees up finds one at once, less the candidates already
    `waiting` for a worker; the workers `busy` and `idle` when it looked; and whether the next proposal
    should be made `quickly` (`Sampler.propose_quickly`), for a worker that has nothing to take now or will
    have nothing by the time the model's proposal is made."""

    wanted: int
    busy: int = 0
    idle: int = 0
    waiting: int = 0
    spare: int = 0
    by: str = ""  # who looked: the worker whose driver proposes
    quickly: bool = False  # a worker would wait long for the model's next proposal: make it quickly


@runtime_checkable
class Pacing(Prefetching, Protocol):
    """A trainer whose workers take candidates as they free up (the queue): see the module's docstring."""

    def pace(self) -> Pace:
        """How many more candidates it could start now, and why."""

    def wait(self) -> None:
        """Until results may have come in (or a worker may have freed up): at most a poll's interval."""

    def proposed(self, seconds: float) -> None:
        """A proposal took `seconds` (what `pace` weighs against a training's length)."""

    def trained(self, seconds: Sequence[float]) -> None:
        """The search's latest trainings, as told, took `seconds` each (a training's length, for `pace`)."""

    def doing(self, activity: str) -> None:
        """What the search is doing now, for whoever watches it."""


def serial(fitness: Callable[[Candidate], Outcome]) -> Trainer:
    """A trainer that trains the candidates one after another in this process. An exception
    from `fitness` becomes a failed outcome, except a UserError (a mistake no other candidate
    would escape) and KeyboardInterrupt/SystemExit, which stop the search."""

    def train(candidates: list[Candidate], record: Record) -> None:
        queue = deque(candidates)
        while queue:
            candidate = queue.popleft()
            started = time.perf_counter()
            try:
                outcome = fitness(candidate)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - a candidate's failure is data, not a crash
                outcome = Outcome.failed(raised(e), seconds=time.perf_counter() - started)
            record(candidate, outcome)
            queue.extend(record.more())

    return train
