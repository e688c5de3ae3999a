"""Numeric genes: a `Range` (`{low = A, high = B}`, ints when both bounds are ints, floats otherwise,
with `log`, `step` or `points`), how a sampler draws from one, moves it, or walks its values by
position, and `parse_range`, which checks a range table before any sampler meets it. A range is
never listed out: a search draws from a range of any width without materialising it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from towerlab.errors import UserError
from towerlab.catalog.model_options import GeneRule

# numpy is imported where it is used: the samplers import this module, and the command line imports
# them to build its flags from their settings, where `towerlab --help` answers without numpy.
if TYPE_CHECKING:
    import numpy as np

RANGE_KEYS = ("low", "high", "log", "step", "points")


@dataclass(frozen=True)
class Range:
    """A numeric gene given by its bounds (both included) instead of a list: ints when `kind` is
    "int", floats otherwise; `log`: drawn on a log scale; `step`: only low + k * step; `points`: how
    many values a grid takes from an unstepped float range (evenly spaced, on the log scale if `log`).
    Build one with `parse_gene`, which checks it."""

    kind: str  # "int" or "float"
    low: float
    high: float
    log: bool = False
    step: float | None = None
    points: int | None = None

    @property
    def count(self) -> float:
        """How many values it holds: an int, or math.inf for an unstepped float range."""
        if self.kind == "int":  # exact, however wide (a float quotient loses the last values past 2**53)
            return (int(self.high) - int(self.low)) // int(self.step or 1) + 1
        if self.step is None:
            return math.inf
        return round((self.high - self.low) / self.step) + 1

    def value_at(self, index: int) -> float:
        """The value at `index` of a stepped (or int) range, in increasing order."""
        value = self.low + index * (self.step or 1)
        return value if self.kind == "int" else min(float(value), self.high)

    @property
    def grid_count(self) -> int | None:
        """How many values a grid tries (None: an unstepped float range without `points`)."""
        if self.count != math.inf:
            return int(self.count)
        return self.points

    def grid_value_at(self, index: int) -> Any:
        """The value at `index` of those a grid tries, in increasing order, without listing the others:
        every value of an int or stepped range; `points` values of a float range, evenly spaced from
        low to high (on the log scale with `log`)."""
        if self.count != math.inf:
            return self.value_at(index)
        assert self.points is not None, "a grid refuses a float range without points (Space.grid_counts)"
        last = self.points - 1
        if index in (0, last):
            return float(self.low if index == 0 else self.high)
        if self.log:
            a, b = math.log(self.low), math.log(self.high)
            return math.exp(a + (b - a) * index / last)
        return self.low + (self.high - self.low) * index / last

    def draw(self, rng: np.random.Generator) -> Any:
        """A value drawn from the range's distribution (uniform, or log-uniform with `log`)."""
        if self.log:  # an int range spans low - 0.5 .. high + 0.5 before rounding, as Optuna's does
            pad = 0.5 if self.kind == "int" else 0.0
            x = math.exp(rng.uniform(math.log(self.low - pad), math.log(self.high + pad)))
            return self.clip(round(x)) if self.kind == "int" else self.clip(x)
        if self.count != math.inf:
            return self.value_at(uniform_below(rng, int(self.count)))
        return self.clip(float(rng.uniform(self.low, self.high)))

    def moved(self, rng: np.random.Generator, value: Any) -> Any:
        """The genetic algorithm's mutation of a value: a uniform random step of at most a fifth of
        the range, on the log scale for a log range, reflected at the bounds and rounded to the
        step; an int or stepped range moves by at least one step."""
        scale = math.log if self.log else float
        low, high = scale(self.low), scale(self.high)
        x = scale(value) + rng.uniform(-(high - low) / 5, (high - low) / 5)
        x = 2 * high - x if x > high else 2 * low - x if x < low else x
        x = math.exp(x) if self.log else x
        if self.count == math.inf:
            return self.clip(x)
        step, last = self.step or 1, int(self.count) - 1
        here = round((value - self.low) / step)
        k = min(max(round((x - self.low) / step), 0), last)
        if k == here:  # the step was too small to leave the value: one step, away from a bound
            k = here + 1 if here == 0 or (here < last and rng.random() < 0.5) else here - 1
        return self.value_at(k)

    def clip(self, x: float) -> Any:
        x = min(max(x, self.low), self.high)
        return int(x) if self.kind == "int" else float(x)

    def holds(self, value: Any) -> bool:
        if type(value) is not (int if self.kind == "int" else float) or not self.low <= value <= self.high:
            return False
        if self.step is None:
            return True
        k = (value - self.low) / self.step
        return abs(k - round(k)) < 1e-9

    def to_dict(self) -> dict:
        """The TOML table it was written as (the defaults left out)."""
        data = {"low": self.low, "high": self.high}
        data.update({k: getattr(self, k) for k in ("log", "step", "points") if getattr(self, k)})
        return data


def uniform_below(rng: np.random.Generator, n: int) -> int:
    """An int drawn uniformly from 0 .. n - 1, n of any size: numpy's own draw below 2**63 (so a
    seed draws what it always drew), 63 random bits at a time above it, rejecting what falls past n."""
    if n <= 2**63:
        return int(rng.integers(n))
    bits = (n - 1).bit_length()
    while True:
        x = 0
        for _ in range(-(-bits // 63)):
            x = (x << 63) | int(rng.integers(2**63))
        x >>= -bits % 63
        if x < n:
            return x


def _is_number(x: Any) -> bool:
    """A finite int or float (not a bool); an int past the floats' range (2**1024) is none."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _short(x: Any) -> str:
    """A value for a message: an int of more than 20 digits by its size (10**300 has 301 digits)."""
    if isinstance(x, int) and not isinstance(x, bool) and len(str(abs(x))) > 20:
        return f"{'-' if x < 0 else ''}an int of {len(str(abs(x)))} digits"
    return repr(x)


def parse_range(gene: str, spec: Mapping[str, Any], rule: GeneRule, where: str) -> Range:
    """A range table (`{low = A, high = B, log = true, step = S, points = N}`) checked against the
    gene's rule: ints when both bounds are ints and the gene takes ints, floats otherwise."""
    unknown = sorted(set(spec) - set(RANGE_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(map(str, unknown))} in its range: "
                        f"a range takes {', '.join(RANGE_KEYS)} (and when, for a conditional gene)")
    if "low" not in spec or "high" not in spec:
        raise UserError(f"{where}: a range needs low and high, e.g. {{low = 1, high = 8}}")
    low, high = spec["low"], spec["high"]
    if not (_is_number(low) and _is_number(high)):
        raise UserError(f"{where}: low and high must be finite numbers, got {_short(low)} and {_short(high)}")
    if rule.kind == "choice":
        raise UserError(f"{where} takes a list of values ({rule.describe()}), not a range")
    kind = "int" if isinstance(low, int) and isinstance(high, int) and rule.kind in ("int", "any") else "float"
    if rule.kind == "int" and kind == "float":
        raise UserError(f"{where} takes ints: give its range int bounds, got {low!r} and {high!r}")
    for bound in (low, high):
        if rule.normalize(bound) is None:
            raise UserError(f"{where}: bound {bound!r} is not {rule.describe()}")
    if kind == "float":
        low, high = float(low), float(high)
    if not low < high:
        raise UserError(f"{where}: low ({low!r}) must be below high ({high!r}); a fixed value is a list of one")
    if not math.isfinite(float(high) - float(low)):  # every sampler draws and moves within high - low
        raise UserError(f"{where}: the range from {_short(low)} to {_short(high)} is wider than the largest float "
                        "(high - low overflows): narrow it")
    log, step, points = spec.get("log", False), spec.get("step"), spec.get("points")
    if not isinstance(log, bool):
        raise UserError(f"{where}: log must be true or false, got {log!r}")
    if log and low <= 0:
        raise UserError(f"{where}: a log range needs low > 0, got {low!r}")
    if step is not None:
        if log:
            raise UserError(f"{where}: log and step do not go together: choose one")
        if not _is_number(step) or step <= 0 or (kind == "int" and not isinstance(step, int)):
            raise UserError(f"{where}: step must be a positive {'int' if kind == 'int' else 'number'}, got {step!r}")
        steps = (high - low) / step
        if not math.isfinite(steps):
            raise UserError(f"{where}: step {step!r} cuts the range into more values than a float counts: "
                            "take a larger step")
        if abs(steps - round(steps)) > 1e-9 * max(1.0, steps):
            raise UserError(f"{where}: high - low ({high - low!r}) must be a multiple of step ({step!r})")
        step = step if kind == "int" else float(step)
    if points is not None and (kind == "int" or step is not None):
        raise UserError(f"{where}: points is for a float range without step (a grid takes every value of the others)")
    if points is not None and (not isinstance(points, int) or isinstance(points, bool) or points < 2):
        raise UserError(f"{where}: points must be an int >= 2, got {points!r}")
    if rule.odd and not (low % 2 == 1 and step is not None and step % 2 == 0):
        raise UserError(f"{where} takes odd ints: give its range an odd low and an even step (step = 2)")
    return Range(kind, low, high, log, step, points)
