"""The stdout protocol of a command's program (`towerlab.objective.command`): what it prints on stdout, one
line at a time. The last line that is a JSON object or a bare number is the result
(`towerlab.objective.result`); the JSON objects before it whose "epoch" is a whole number from 0 are its
learning curve (their numbers; a non-finite one as None). Read within bounds (`read_stdout`): a JSON line over
MAX_LINE bytes, nested past what Python reads, or giving a key twice, more than MAX_CURVE points, more than
MAX_JSON bytes of JSON lines or MAX_STDOUT bytes in all fail the trial, saying which (`Unreadable`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from towerlab.objective.result import MAX_CURVE, curve_point, number

MAX_LINE = 1 << 20  # bytes of a line of stdout read as JSON (a result, a point of the curve)
MAX_JSON = 64 << 20  # bytes of stdout's JSON lines read in all
MAX_STDOUT = 1 << 30  # bytes of stdout read in all (a program's log belongs in a file of its own, or stderr)


class Unreadable(Exception):
    """A program's stdout that `read_stdout` does not read: its message says why (the trial's reason)."""


def read_stdout(path: Path) -> tuple[Any, tuple[Mapping[str, Any], ...]]:
    """The result in a program's stdout (its last line that is a JSON object or a number; None where no
    line is) and the curve before it (the JSON objects whose "epoch" is a whole number from 0), read one
    line at a time within the module's bounds (Unreadable beyond them)."""
    size = os.path.getsize(path)
    if size > MAX_STDOUT:
        raise Unreadable(f"its stdout holds {size / (1 << 30):.1f} GiB, more than towerlab reads "
                         f"({MAX_STDOUT >> 30} GiB): print the result and the curve on stdout, and a long log to a "
                         "file of its own (or stderr)")
    last: Any = None
    curve: list[dict[str, Any]] = []
    parsed, number_ = 0, 0
    with open(path, "rb") as lines:
        while True:
            line = lines.readline(MAX_LINE + 1)
            if not line:
                break
            number_ += 1
            text = line.strip()
            if not text or text[:1] not in b"{-+.0123456789NI":
                _skip_rest(lines, line)
                continue
            if len(line) > MAX_LINE:
                raise Unreadable(f"line {number_} of its stdout is a JSON line of more than {MAX_LINE >> 20} MiB: a "
                                 "result, or a point of its curve, is one short line")
            parsed += len(line)
            if parsed > MAX_JSON:
                raise Unreadable(f"its stdout holds more than {MAX_JSON >> 20} MiB of JSON lines: print the result "
                                 "and the curve, and a log of JSON to a file of its own")
            value = _json(text, number_)
            if not isinstance(value, dict) and number(value) is None:
                continue
            point = _point(last)
            if point is not None:
                if len(curve) >= MAX_CURVE:
                    raise Unreadable(f"its stdout holds more than {MAX_CURVE} points of a curve (JSON lines with an "
                                     "\"epoch\"): report a point an epoch, or a step now and then")
                curve.append(point)
            last = value
    return last, tuple(curve)


def _skip_rest(lines: Any, line: bytes) -> None:
    """Read past the rest of a line longer than MAX_LINE that is no JSON (output), holding none of it."""
    while len(line) > MAX_LINE and not line.endswith(b"\n"):
        line = lines.readline(MAX_LINE + 1)


def _json(text: bytes, at: int) -> Any:
    """A line of stdout as JSON (None where it is no JSON); Unreadable where it gives a key twice or nests
    deeper than Python reads."""
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        found = dict(items)
        if len(found) < len(items):
            twice = next(k for i, (k, _) in enumerate(items) if any(k == other for other, _ in items[:i]))
            raise Unreadable(f"line {at} of its stdout gives the key {twice[:60]!r} twice: give each once")
        return found

    try:
        return json.loads(text.decode("utf-8", errors="replace"), object_pairs_hook=pairs)
    except RecursionError:
        raise Unreadable(f"line {at} of its stdout is JSON nested deeper than towerlab reads: a result is one "
                         "object of numbers") from None
    except ValueError:  # not JSON: output (an integer of over 4,300 digits too)
        return None


def _point(value: Any) -> Optional[dict[str, Any]]:
    """A JSON line as a point of the curve: an object whose "epoch" is a whole number from 0, with its
    metrics that are numbers (a non-finite one as None); None for any other line (output)."""
    if not isinstance(value, dict) or "epoch" not in value:
        return None
    metrics = {k: v for k, v in value.items() if k != "epoch" and number(v) is not None}
    try:
        return curve_point(value["epoch"], metrics)
    except ValueError:
        return None
