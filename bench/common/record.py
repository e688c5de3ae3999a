"""The one writer of every JSON file a benchmark keeps, where the records go, and the command each names.

`write_record(folder, name, record)` writes a record: what bench/tables.py, the docs and the tests read,
in bench/results/<family>/ (`RESULTS`). A record says what it ran on (`machine`: `machine.describe()`, or
a sentence saying why it is unknown) and gives its figures as a list of `{"id", "value", "detail"}`
(`figure()`), one id once, whatever else it holds beside them; a record that does not is refused before
anything is written (a bug of the script, not of the run). `write_json(path, value)` writes anything else
a run keeps: a sample handed to its parent process, a run's trace, a cache.

Both write atomically: a temporary file in the same folder, then `os.replace`, so a reader (a table, a
run resumed with --reuse, a parent process) never sees half a file, and a run killed while writing leaves
the file before it whole. `script_command(__file__)` is the command line a record names, as a reader would
type it from the repository's root (`python bench/<family>/<script>.py ARGS`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
RESULTS = BENCH / "results"


def script_command(script: str, argv: Optional[Sequence[str]] = None) -> list[str]:
    """`["python", "bench/<family>/<script>.py", *argv]` (argv: this process's arguments when None)."""
    path = Path(script).resolve()
    shown = path.relative_to(path.parents[2]).as_posix()  # bench/<family>/<script>.py
    return ["python", shown, *(sys.argv[1:] if argv is None else argv)]


def figure(fid: str, value: Any, detail: Optional[dict] = None, **more: Any) -> dict:
    """One figure of a record: its id, its value (None: not measured) and what else it says (`detail`);
    `more` for fields a reader of the suites expects beside them (title, unit, target, met, samples)."""
    return {"id": fid, "value": value, **more, "detail": detail or {}}


def problems(record: Any) -> list[str]:
    """What keeps `record` from being a record (empty: nothing)."""
    if not isinstance(record, dict):
        return ["a record is a JSON object"]
    found = []
    if not record.get("machine"):
        found.append("no 'machine': say what it ran on (bench.common.machine.describe()) or why that is unknown")
    figures = record.get("figures")
    if not isinstance(figures, list):
        found.append("'figures' is a list of {'id', 'value', 'detail'} (bench.common.record.figure)")
        return found
    ids = []
    for entry in figures:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or "value" not in entry:
            found.append(f"a figure without its 'id' or 'value': {str(entry)[:80]}")
        elif not isinstance(entry.get("detail", {}), dict):
            found.append(f"figure {entry['id']}: its 'detail' is an object")
        else:
            ids.append(entry["id"])
    found += [f"figure {fid} twice" for fid in sorted({f for f in ids if ids.count(f) > 1})]
    return found


def write_json(path: str | os.PathLike, value: Any, indent: Optional[int] = 1) -> Path:
    """`value` as JSON in `path`, atomically (its folder made if need be); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, 0o644)  # mkstemp's 0600 would keep a record from whoever else reads it
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(value, out, indent=indent, default=str)
            out.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_record(folder: str | os.PathLike, name: str, record: dict) -> Path:
    """`record` as `folder`/`name`, atomically, once it is a record (see the module's docstring); the path."""
    wrong = problems(record)
    if wrong:
        raise ValueError(f"{name} is not a record: " + "; ".join(wrong))
    return write_json(Path(folder) / name, record)
