"""What the results tables are made of: a number of a record (`Ref`, rendered as a link to that record),
a table of such cells (`Table`), and how a record is read (`lookup`) and a table written (`render`).

The tables themselves sit with their families (bench/<family>/tables.py); bench/tables.py gathers them
and writes them into their pages. A record is named by its path under bench/results/
(`speed/cpu-2026-11-22-run1.json`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

from bench.common.record import REPO, RESULTS


@lru_cache(maxsize=None)
def _record(name: str) -> object:
    return json.loads((RESULTS / name).read_text())


def lookup(record: str, path: str) -> object:
    """`figures/mnist_tta/value`: a key of a dict, or the element of a list whose id, case or seed is that key."""
    node = _record(record)
    for key in path.split("/"):
        if isinstance(node, list) and key.isdigit() and not any(isinstance(x, dict) and x.keys() & {"id", "case", "seed"} for x in node):
            node = node[int(key)]  # a plain list (a search's generations): by position
        elif isinstance(node, list):
            matches = [x for x in node if isinstance(x, dict)
                       and key in (str(x.get("id")), str(x.get("case")), str(x.get("seed")))]
            if len(matches) != 1:
                raise KeyError(f"{record}: {path}: {len(matches)} elements named {key!r}")
            node = matches[0]
        else:
            node = node[key]
    return node


FORMATS = {
    "pct": lambda v: f"{100 * v:.2f}%",
    "x": lambda v: f"{v:.2f}x",
    "s": lambda v: f"{v:.2f} s",
    "s0": lambda v: f"{v:,.0f} s",
    "ms": lambda v: f"{v:.2f} ms",
    "int": lambda v: f"{v:,.0f}",
    "num": lambda v: f"{v:.1f}",
    "p2": lambda v: f"{v:.2f}",
    "p": lambda v: f"{v:.1f}",
    # {mean, sd} of accuracies: the mean in percent, the spread in points
    "pct_sd": lambda v: f"{100 * v['mean']:.2f}% ± {100 * v['sd']:.2f}",
    "gib": lambda v: f"{v / 2**30:.2f} GiB",
    "r3": lambda v: f"{v:.3f}",  # a normalised regret
}


@dataclass(frozen=True)
class Ref:
    """A number of a record: rendered as a link to that record."""

    record: str
    path: str
    fmt: str
    none: str = "n/a"  # what a null stands for in this column (a search that never got there: "never")
    over: str | None = None  # a second path of the same record: the cell is path / over

    def text(self) -> str:
        value = lookup(self.record, self.path)
        if value is not None and self.over is not None:
            value = value / lookup(self.record, self.over)
        return self.none if value is None else FORMATS[self.fmt](value)


Cell = str | Ref | tuple  # a tuple is its parts (strings and Refs) written one after the other


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]


def _render_cell(cell: Cell, link_base: str) -> str:
    if isinstance(cell, tuple):
        return "".join(_render_cell(part, link_base) for part in cell)
    if isinstance(cell, Ref):
        return f"[{cell.text()}]({link_base}{cell.record})"
    return cell


def render(table: Table, page: str) -> str:
    link_base = os.path.relpath(RESULTS, (REPO / page).parent).replace(os.sep, "/") + "/"
    lines = ["| " + " | ".join(table.header) + " |", "|" + " --- |" * len(table.header)]
    lines += ["| " + " | ".join(_render_cell(c, link_base) for c in row) + " |" for row in table.rows]
    return "\n".join(lines)


def figure_ref(record: str, fid: str, fmt: str, field: str = "value") -> Ref:
    """A figure's value (or `field` of it) in a record's `figures`."""
    return Ref(record, f"figures/{fid}/{field}", fmt, none="not measured")
