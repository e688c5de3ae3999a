"""Where the benchmarks' records go, and the command line each names.

`RESULTS` (bench/results/) is the records' folder: what bench/tables.py, the docs and the tests read.
`script_command(__file__)` is the command line a record names, as a reader would type it from the repository's
root (`python bench/<family>/<script>.py ARGS`), whichever folder the script ran from.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
RESULTS = BENCH / "results"


def script_command(script: str, argv: Optional[Sequence[str]] = None) -> list[str]:
    """`["python", "bench/<family>/<script>.py", *argv]` (argv: this process's arguments when None)."""
    path = Path(script).resolve()
    shown = path.relative_to(path.parents[2]).as_posix()  # bench/<family>/<script>.py
    return ["python", shown, *(sys.argv[1:] if argv is None else argv)]
