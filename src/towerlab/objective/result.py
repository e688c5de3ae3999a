"""What a trial of your code gives back, the one protocol of every objective of yours: a number, or a dict of
numbers of which one, the metric, is the one searched (`towerlab.search.goal.Goal`: its name and whether higher
or lower is better). `read_result` reads it; `failed` is the one function that builds a failed trial's Result.

A bare number is the metric's value, whatever the metric is named (DEFAULT_METRIC, "value", where none
is: Optuna's name for a trial's one result, so that a search exported as an Optuna study reads the same).
A dict gives every metric by name: the searched one must be there and finite, the others are recorded
(a non-finite one as None). Anything else, a missing metric, or a NaN fails the trial with a reason
that says which; a failed trial keeps the metrics it gave (a resume naming another metric reads them).
`Result.fitness` is what a search ranks by, higher is better (`Goal.fitness`); `Result.metrics` keeps the
values as returned.

Read within bounds, whatever a trial gives: at most MAX_METRICS metrics, each named by a string of at
most MAX_NAME characters, at most MAX_CURVE points of a curve (`curve_point` checks each, for a
function's `report` and a command's lines alike); an integer beyond a float's range is that infinity
(so an objective's 10**400 fails its trial as an infinite metric), and code of yours that raises while
its value is read (a `__float__`, a `__repr__`) makes that value no number rather than an error here.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from towerlab.search.goal import Goal

MAX_METRICS = 1000  # metrics in one result
MAX_NAME = 200  # characters of a metric's name
MAX_CURVE = 100_000  # points of one trial's curve (a point an epoch, or a step: a row stays a few MB)


def number(value: Any) -> Optional[float]:
    """`value` as a float where it is a real number (a numpy scalar, a one-element array or tensor too);
    None otherwise (a bool is not a number here: `True` is a mistake, not 1)."""
    try:
        if isinstance(value, bool):
            return None
        if isinstance(value, numbers.Real):
            return _float(value)
        count = getattr(value, "numel", None)  # a tensor's; an array's is its `size`
        count = count() if callable(count) else getattr(value, "size", None)
        if count == 1 and callable(getattr(value, "item", None)):
            found = value.item()
            if isinstance(found, numbers.Real) and not isinstance(found, bool):
                return _float(found)
    except Exception:  # noqa: BLE001 - a value of yours whose methods raise is no number
        return None
    return None


def _float(value: numbers.Real) -> float:
    """`value` as a float; an integer beyond a float's range (10**400) as the infinity of its sign."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if int(value) > 0 else -math.inf  # type: ignore[call-overload]  # a Real too large for a float is an integer


def extend_curve(curve: list[dict[str, Any]], epoch: Any, metrics: Mapping[Any, Any]) -> None:
    """`curve` with one more point (`curve_point`), at most MAX_CURVE of them (a ValueError beyond)."""
    if len(curve) >= MAX_CURVE:
        raise ValueError(f"more than {MAX_CURVE} points of a curve in one trial")
    curve.append(curve_point(epoch, metrics))


def curve_point(epoch: Any, metrics: Mapping[Any, Any]) -> dict[str, Any]:
    """A point of a learning curve, {"epoch": N, metric: value, ...}: the epoch a whole number from 0, each
    metric named by a string and a number (a non-finite one as None); a ValueError that says what is
    wrong otherwise."""
    at = number(epoch)
    if at is None or not math.isfinite(at) or not at.is_integer() or at < 0:
        raise ValueError(f"the epoch must be a whole number from 0, got {_shown(epoch)}")
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"a point gives {len(metrics)} metrics, more than {MAX_METRICS}")
    point: dict[str, Any] = {"epoch": int(at)}
    for name, value in metrics.items():
        found = number(value)
        if not isinstance(name, str) or len(name) > MAX_NAME:
            raise ValueError(f"a metric's name must be a string of at most {MAX_NAME} characters, got {_shown(name)}")
        if found is None:
            raise ValueError(f"{name} must be a number, got {_shown(value)}")
        point[name] = found if math.isfinite(found) else None
    return point


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


def failed(reason: str, curve: tuple[Mapping[str, Any], ...] = (), seconds: float = 0.0,
           metrics: Optional[Mapping[str, Optional[float]]] = None) -> Result:
    """A failed trial's Result, the one function that builds one: its `reason`, the curve it reported, its
    seconds, and the metrics it gave (`metrics`: kept, so that a resume naming another metric reads them)."""
    return Result("failed", metrics=_kept(metrics or {}), reason=reason, curve=curve, seconds=seconds)


def read_result(goal: Goal, returned: Any, curve: tuple[Mapping[str, Any], ...] = (), seconds: float = 0.0) -> Result:
    """The Result of what a trial gave back, searched for `goal` (see the module's docstring)."""
    if isinstance(returned, Mapping):
        if len(returned) > MAX_METRICS:
            return failed(f"its result gives {len(returned)} metrics, more than {MAX_METRICS}", curve, seconds)
        metrics: dict[str, Optional[float]] = {}
        for name, value in returned.items():
            if not isinstance(name, str) or len(name) > MAX_NAME:
                return failed(f"its result names a metric {_shown(name)}: name each by a string of at most "
                              f"{MAX_NAME} characters", curve, seconds)
            found = number(value)
            if found is None:
                return failed(f"its result's {name!r} is {_shown(value)}, not a number", curve, seconds)
            metrics[name] = found
        if goal.metric not in metrics:
            return failed(f"its result has no {goal.metric!r} (it has {', '.join(map(repr, metrics)) or 'none'}):"
                          " name the metric to search (--metric)", curve, seconds, metrics)
    else:
        found = number(returned)
        if found is None:
            return failed(f"it returned {_shown(returned)}: return a number or a dict of numbers", curve, seconds)
        metrics = {goal.metric: found}
    value = metrics[goal.metric]
    if value is None or not math.isfinite(value):
        beyond = " (an integer beyond a float's range)" if isinstance(_searched(returned, goal.metric), int) else ""
        return failed(f"its {goal.metric} is {value}{beyond}", curve, seconds, metrics)
    return Result("ok", metrics=_kept(metrics), fitness=goal.fitness(value), curve=curve, seconds=seconds)


# How a failure reads where any genes would fail alike (a mistake in the setup, not in a candidate): a result
# without the metric or of no numbers, a program that exits or dies, or cannot start, an exception at one line.
_WHOLE_WAYS = ("its result has no ", "its result gives ", "its result names ", "it returned ", "it printed no result",
               "its result could not be read")
_EXCEPTION = re.compile(r"^(your .+? (?:failed with these genes|ended its worker's process)(?: at [^:]+:\d+)?: "
                        r"[\w.]+)")


def failure_way(reason: Optional[str]) -> Optional[str]:
    """What a failed trial's `reason` says that does not depend on its genes (the same for every trial of a
    mistaken setup: a metric named wrong, a flag the script does not take), or None for a failure that may
    well depend on them (a timeout, a NaN, a value out of range): a command's exit status or signal without
    its stderr's tail, a function's exception by its type and line without its message."""
    if not reason:
        return None
    head = reason.split("; stderr ends:")[0]
    if head.startswith(("exit status ", "killed by ", "cannot start ")) or head.startswith(_WHOLE_WAYS):
        return head
    found = _EXCEPTION.match(reason)
    return found.group(1) if found else None


def _kept(metrics: Mapping[str, Optional[float]]) -> dict[str, Optional[float]]:
    """Metrics as a row keeps them: a non-finite one as None."""
    return {name: v if v is not None and math.isfinite(v) else None for name, v in metrics.items()}


def _searched(returned: Any, metric: str) -> Any:
    """The value a result gives its searched metric, as it gave it."""
    return returned.get(metric) if isinstance(returned, Mapping) else returned


def _shown(value: Any) -> str:
    """A value in a reason: its type, and a short repr (of at most 60 characters, and read only that far)."""
    try:
        text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else f"<{value.bit_length()} bits>"
    except Exception:  # noqa: BLE001 - a value of yours whose __repr__ raises
        text = "(whose repr fails)"
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
