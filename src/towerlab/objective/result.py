"""What a trial gives back, the one protocol of every objective: a number, or a dict of numbers of which
one, the metric, is the one searched (`Goal`: its name and whether higher or lower is better).

A bare number is the metric's value, whatever the metric is named (DEFAULT_METRIC, "value", where none
is: Optuna's name for a trial's one result, so that a search exported as an Optuna study reads the same).
A dict gives every metric by name: the searched one must be there and finite, the others are recorded
(a non-finite one as None). Anything else, a missing metric, or a NaN fails the trial with a reason
that says which. `Result.fitness` is what a search ranks by, higher is better: the value as it is where
the goal maximizes, negated where it minimizes; `Result.metrics` keeps the values as returned.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from towerlab.config import DIRECTIONS
from towerlab.errors import UserError

DEFAULT_METRIC = "value"


def number(value: Any) -> Optional[float]:
    """`value` as a float where it is a real number (a numpy scalar, a one-element array or tensor too);
    None otherwise (a bool is not a number here: `True` is a mistake, not 1)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    count = getattr(value, "numel", None)  # a tensor's; an array's is its `size`
    count = count() if callable(count) else getattr(value, "size", None)
    if count == 1 and callable(getattr(value, "item", None)):
        found = value.item()
        if isinstance(found, numbers.Real) and not isinstance(found, bool):
            return float(found)
    return None


@dataclass(frozen=True)
class Result:
    """A trial's result: `status` "ok" or "failed" (with its `reason`); `metrics`, every number it
    returned, by name (a non-finite one other than the searched one as None); `fitness`, the searched
    metric as higher-is-better (None unless ok); `curve`, the points it reported on the way, each
    {"epoch": N, metric: value, ...}; `seconds`, how long it ran."""

    status: str
    metrics: Mapping[str, Optional[float]] = field(default_factory=dict)
    fitness: Optional[float] = None
    reason: Optional[str] = None
    curve: tuple[Mapping[str, Any], ...] = ()
    seconds: float = 0.0


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

    def fitness(self, value: float) -> float:
        """What the search ranks by, higher is better, for the metric's `value` (and back: it is its own inverse)."""
        return value if self.direction == "maximize" else -value

    def failed(self, reason: str, curve: tuple[Mapping[str, Any], ...] = (), seconds: float = 0.0) -> Result:
        return Result("failed", reason=reason, curve=curve, seconds=seconds)

    def result(self, returned: Any, curve: tuple[Mapping[str, Any], ...] = (), seconds: float = 0.0) -> Result:
        """The Result of what a trial gave back (see the module's docstring)."""
        if isinstance(returned, Mapping):
            metrics: dict[str, Optional[float]] = {}
            for name, value in returned.items():
                found = number(value)
                if not isinstance(name, str) or found is None:
                    return self.failed(f"its result's {name!r} is {_shown(value)}, not a number", curve, seconds)
                metrics[name] = found
            if self.metric not in metrics:
                return self.failed(f"its result has no {self.metric!r} (it has {', '.join(map(repr, metrics)) or 'none'}):"
                                   " name the metric to search (--metric)", curve, seconds)
        else:
            found = number(returned)
            if found is None:
                return self.failed(f"it returned {_shown(returned)}: return a number or a dict of numbers",
                                   curve, seconds)
            metrics = {self.metric: found}
        value = metrics[self.metric]
        if value is None or not math.isfinite(value):
            return self.failed(f"its {self.metric} is {value}", curve, seconds)
        kept = {name: v if v is not None and math.isfinite(v) else None for name, v in metrics.items()}
        return Result("ok", metrics=kept, fitness=self.fitness(value), curve=curve, seconds=seconds)


def _shown(value: Any) -> str:
    """A value in a reason: its type, and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
