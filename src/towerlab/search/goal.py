"""What a search ranks by, and what trains its tasks, as the search carries them (`Search.aim`): decided once,
when the search is made, by the kind of its objective (`towerlab.objective`: each kind says its goal), recorded
with it in its store (its setup's "objective" and "spec") and read back from there by every process that opens
it. Nothing else re-derives them from its settings.

A search ranks its candidates by their fitness, higher is better: the value of its goal's metric as it is
where the goal maximizes it, negated where it minimizes it (`Goal.fitness`, its own inverse: `Goal.value`),
the one place that flips the sign. A result of yours that is a bare number is the value of DEFAULT_METRIC
("value": Optuna's name for a trial's one result, so that a search exported as an Optuna study reads the
same); towerlab's own training ranks by validation accuracy (VALIDATION). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from towerlab.config import DIRECTIONS
from towerlab.errors import UserError

DEFAULT_METRIC = "value"
TRAINING = "training"  # the kind of a search that names no objective of yours: towerlab's own training


@dataclass(frozen=True)
class Goal:
    """The metric a search searches (its name in a result) and its direction."""

    metric: str = DEFAULT_METRIC
    direction: str = "maximize"

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric.strip() or self.metric != self.metric.strip():
            raise UserError(f"--metric {self.metric!r}: give the name of the result's metric to search, e.g. "
                            "--metric accuracy")
        if self.direction not in DIRECTIONS:
            raise UserError(f"--direction {self.direction!r}: choose maximize or minimize")

    @classmethod
    def named(cls, metric: Optional[str], direction: Optional[str]) -> Goal:
        """The goal that --metric and --direction name, each where given (None: DEFAULT_METRIC, maximize); an
        empty --metric is refused, not taken for none."""
        return cls(**{key: value for key, value in (("metric", metric), ("direction", direction))
                      if value is not None})

    @property
    def minimizes(self) -> bool:
        return self.direction == "minimize"

    def fitness(self, value: float) -> float:
        """What the search ranks by, higher is better, for the metric's `value` (and back: it is its own inverse)."""
        return -value if self.minimizes else value

    def value(self, fitness: Optional[float]) -> Optional[float]:
        """The metric's value for a `fitness` (None for none)."""
        return None if fitness is None else self.fitness(fitness)


VALIDATION = Goal("val_accuracy")  # what towerlab's own training ranks by


@dataclass(frozen=True)
class Aim:
    """What trains a search's tasks and what it ranks by: its objective's `kind` (a name in
    `towerlab.objective.KINDS`), `spec`, what names it (FILE.py:FUNCTION, the command's text; "" for towerlab's
    own training, whose model and data its settings name) and its `goal`."""

    kind: str = TRAINING
    spec: str = ""
    goal: Goal = VALIDATION

    @property
    def own(self) -> bool:
        """Whether it runs an objective of yours (whatever its kind), not towerlab's own training."""
        return self.kind != TRAINING

    def recorded(self) -> dict:
        """Its kind and goal as a search's setup records them (the admission item "objective", to which an
        objective of yours adds the proof of what it runs)."""
        return {"kind": self.kind, "metric": self.goal.metric, "direction": self.goal.direction}

    @classmethod
    def of_setup(cls, setup: Mapping[str, Any]) -> Aim:
        """The aim a stored search's setup records (a search recorded without one trained towerlab's networks)."""
        objective = setup.get("objective")
        if not isinstance(objective, Mapping):
            return cls()
        return cls(str(objective.get("kind", TRAINING)), str(setup.get("spec") or ""),
                   Goal.named(objective.get("metric"), objective.get("direction")))
