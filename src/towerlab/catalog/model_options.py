"""What values a model option accepts: the checks a network's constructor runs on its options, and
the rules (`GeneRule`) a search space's genes are checked against before anything trains. Plain
Python, no torch: the search core reads a family's gene rules through the catalog.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from towerlab.errors import UserError

# The most layers a model option may ask for (mlp layers, whitenet depth per stage), checked before
# anything is built: far above any network that trains without residual connections, and low
# enough that building one, even on the meta device (a model.pt's skeleton, a search's cost
# estimate), takes seconds: 50,000 mlp layers took minutes and 1.65 GB there, then crashed torch.
MAX_LAYERS = 1000
# The most any other int option may be (a width, a number of units): torch takes sizes as 64-bit ints
# and refuses a larger one with a TypeError traceback (a smaller one too wide for any memory is the
# memory checks' to refuse: check_setup, load_model).
MAX_SIZE = 2**63 - 1


def require_positive_int(name: str, value: Any, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"model option {name} must be a positive integer, got {value!r}")
    if value > (maximum or MAX_SIZE):
        raise UserError(f"model option {name} must be at most {maximum or MAX_SIZE}, got {value}")


def require_fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise UserError(f"model option {name} must be a number in [0, 1), got {value!r}")


@dataclass(frozen=True)
class GeneRule:
    """The values a gene accepts: ints and floats within bounds, or one of fixed strings."""

    kind: str  # "int", "float", "choice" or "any" (a model function's gene: a number, a string or a bool)
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    high_open: bool = False
    odd: bool = False
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind == "any":
            return "a number, a string or a boolean"
        text = ("an odd int" if self.odd else "an int") if self.kind == "int" else "a number"
        if self.low is not None and self.high is not None:
            return (f"{text} in {'(' if self.low_open else '['}{_num(self.low)}, "
                    f"{_num(self.high)}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{text} {'>' if self.low_open else '>='} {_num(self.low)}"
        return text

    def normalize(self, value: Any) -> Any:
        """The value in canonical form (floats stay floats even when written as ints), or None
        when the value is not valid."""
        if self.kind == "choice":
            return value if isinstance(value, str) and value in self.choices else None
        if self.kind == "any":
            ok = isinstance(value, (str, bool, int)) or (isinstance(value, float) and math.isfinite(value))
            return value if ok else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        if self.kind == "int":
            if not isinstance(value, int) or (self.odd and value % 2 == 0):
                return None
        else:
            value = float(value)
            if not math.isfinite(value):
                return None
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return None
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return None
        return value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE_INT = GeneRule("int", low=1)
FRACTION = GeneRule("float", low=0.0, high=1.0, high_open=True)
