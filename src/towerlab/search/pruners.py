"""Pruners: what a search's rungs are (the epochs each trains for) and which members of a rung go on
to the next. `towerlab.search.rounds` plays a generation's rungs through the store and asks the
pruner only these two questions, so a pruner never trains, never touches the store and reads no
clock: a resumed search replays the same promotions.

Successive halving (`--min-epochs`, `SuccessiveHalving`) is the only pruner: every member trains
for the first rung's epochs, and the best 1/`--prune-factor` of those that succeeded go on to the
next rung, up to `--max-epochs`; of the rungs a generation uses, which its judge decides
(`towerlab.search.judge`: those shown to rank as the last does, and the last). A member that already holds the next rung (the store serves it a
training there from an earlier generation: the genetic algorithm's elite, a genome proposed again)
goes on as well, at no cost; `--prune-places` says whether such members take places (`all`) or
the places are counted over, and given to, the others (`new`). An unpruned search has one rung.

A search in a store keeps each rung's trainings under a training-config hash of their own (`rung_hash`):
the search's own for its last rung, so its rows are shared with unpruned searches of the same settings,
a derived one for the shorter rungs. `Ladder` is a stored search's rungs: its pruner, each rung's epochs
and hash (`towerlab.search.search.Search.ladder` makes it, once).

Adding a pruner: a `Pruner` subclass here, and its choice in `make_pruner`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

from towerlab.config import SearchConfig
from towerlab.search.space import genome_hash


def rung_epochs(max_epochs: int, min_epochs: Optional[int], factor: int) -> list[int]:
    """The epochs each rung of a pruned search trains for: `min_epochs`, times `factor` while a
    rung `factor` times longer still fits under `max_epochs`, then `max_epochs` (1, 3, 10 for
    1 / 3 / 10). Unpruned (min_epochs None): [max_epochs]."""
    ladder = []
    epochs = min_epochs
    while epochs is not None and epochs * factor <= max_epochs:
        ladder.append(epochs)
        epochs *= factor
    if min_epochs is not None and not ladder:
        ladder.append(min_epochs)
    return ladder + [max_epochs]


class Pruner:
    """A search's rungs and its promotions. Members are named by their genome hashes; `held` are
    the members of a rung that already hold the next one. The last rung promotes nobody."""

    rungs: list[int]  # the epochs each rung trains for, rising; the last is --max-epochs

    def promoted(self, ranked: Sequence[str], held: Collection[str]) -> set[str]:
        """The members that go on to the next rung, decided on all of the rung's results: `ranked`
        are those that succeeded, best first."""
        raise NotImplementedError

    def sure(self, ranked: Sequence[str], done: int, running: Collection[str], held: Collection[str]) -> list[str]:
        """The members that `promoted` will promote whatever the trainings still `running` give,
        and that must train for it (not held), so that they can go on before the rung is complete:
        `ranked` are those of the `done` members whose results are in that succeeded, best first.
        None is a correct answer, only slower."""
        raise NotImplementedError

    def most_promoted(self, members: int) -> list[int]:
        """At most how many of a generation of `members` each rung above the first trains (for the
        budget's plan), the held ones aside."""
        raise NotImplementedError


class SuccessiveHalving(Pruner):
    """Each rung keeps the best 1/`factor` of the rung below (rounded up), which trains about
    `factor` times longer. `places`: "all" (held members take places) or "new" (they go on besides)."""

    def __init__(self, max_epochs: int, min_epochs: Optional[int], factor: int, places: str) -> None:
        self.rungs = rung_epochs(max_epochs, min_epochs, factor)
        self.factor, self.places = factor, places

    def _places(self, contenders: int) -> int:
        return math.ceil(contenders / self.factor)

    def _counted(self, members: Collection[str], held: Collection[str]) -> list[str]:
        return list(members) if self.places == "all" else [h for h in members if h not in held]

    def promoted(self, ranked: Sequence[str], held: Collection[str]) -> set[str]:
        contenders = self._counted(ranked, held)
        return {h for h in ranked if h in held} | set(contenders[:self._places(len(contenders))])

    def sure(self, ranked: Sequence[str], done: int, running: Collection[str], held: Collection[str]) -> list[str]:
        # A member that succeeded at position k among the contenders so far is sure of a place when
        # k plus the contenders still running stays below the places the contenders so far already
        # give (contenders only add up).
        still = len(self._counted(running, held))
        if still >= self._places(done):
            return []  # not even a full rung of successes would leave a place to be sure of
        contenders = self._counted(ranked, held)
        return [h for h in contenders[:max(0, self._places(len(contenders)) - still)] if h not in held]

    def most_promoted(self, members: int) -> list[int]:
        return [math.ceil(members / self.factor ** i) for i in range(1, len(self.rungs))]


def make_pruner(cfg: SearchConfig) -> Pruner:
    """The pruner of a search: successive halving, with a single rung (no pruning) without --min-epochs."""
    return SuccessiveHalving(cfg.max_epochs, cfg.min_epochs, cfg.prune_factor, cfg.prune_places)


def rung_hash(train_config_hash: str, epochs: int, max_epochs: int) -> str:
    """The training-config hash a rung's trainings are stored under: the search's own for its last
    rung (`max_epochs`), a derived one for the shorter rungs."""
    if epochs == max_epochs:
        return train_config_hash
    return genome_hash({"train_config_hash": train_config_hash, "max_epochs": epochs})


@dataclass(frozen=True)
class Ladder:
    """A stored search's rungs: its `pruner`, the epochs each rung trains for (`epochs`, rising: the
    last is --max-epochs) and the training-config hash each rung's trainings are stored under."""

    pruner: Pruner
    train_config_hash: str

    @property
    def epochs(self) -> list[int]:
        return self.pruner.rungs

    @functools.cached_property
    def hashes(self) -> tuple[str, ...]:
        """Each rung's training-config hash, first rung first."""
        return tuple(rung_hash(self.train_config_hash, epochs, self.epochs[-1]) for epochs in self.epochs)

    def hash(self, rung: int) -> str:
        """The training-config hash of rung `rung` (0: the first)."""
        return self.hashes[rung]

    def rung(self, epochs: Optional[int]) -> int:
        """The rung that trains for `epochs` (None: the last, --max-epochs)."""
        return len(self.epochs) - 1 if epochs is None else self.epochs.index(epochs)

    def hash_of(self, epochs: Optional[int]) -> str:
        """The training-config hash of the rung that trains for `epochs` (None: the last, --max-epochs)."""
        return self.hash(self.rung(epochs))

    def rung_of(self, epochs: Optional[int]) -> Optional[int]:
        """The rung that trains for `epochs` (None: none does)."""
        return self.epochs.index(epochs) if epochs in self.epochs else None
