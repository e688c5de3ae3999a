"""Where a search worker's time goes (the GPU suite's search figure, bench/proof/worker_start.py): how many
evaluations a minute a device gives is decided as much by what a worker waits on between candidates as by
the training itself.

towerlab's workers tell a clock through a seam (towerlab.jobs.search.worker_times) that is inert unless
$TOWERLAB_WORKER_CLOCK names one; `environment(folder)` is what a benchmark gives a towerlab command so that
its workers take this one, which writes `<pid>.json` into `folder` ($TOWERLAB_WORKER_TIMES) when a worker
leaves: its wall time, from its process's start to its leaving, split into

- `start`: the process's start (interpreter, imports) and its own setup before its first claim (CUDA,
  the store, the search's settings), less `data`;
- `data`: reading the search's data and moving it to the device (once per search);
- `store`: the store's round trips on the worker's critical path (claiming a task, writing its result);
- per candidate, from its own training's record: `build` (the network, its checks and optimizer,
  what the loop does around the steps), `setup` (the warm-up before the clock: a CUDA graph's recording
  or a compilation), `training` (the optimizer steps), `evaluation` (validation and test passes);
- `idle`: the rest (no task open: a generation's end, the search's record).

An older towerlab (before the seam: its src folder on PYTHONPATH, as worker_start.py's --before runs it)
measured the same in its own code wherever $TOWERLAB_WORKER_TIMES named a folder, and writes the same files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

from bench.common.record import REPO, write_json

CLOCK = "TOWERLAB_WORKER_CLOCK"  # towerlab.jobs.search.worker_times.ENV: which clock a worker takes
FOLDER = "TOWERLAB_WORKER_TIMES"  # where this clock writes (and where an older towerlab wrote its own)
PARTS = ("start", "data", "store", "build", "setup", "training", "evaluation", "idle")


def environment(folder: Path, pythonpath: Optional[str] = None) -> dict[str, str]:
    """The variables that give a towerlab command's workers this clock, writing into `folder`
    (`pythonpath`: the command's own, which this repository's root is added to; default: the environment's)."""
    path = pythonpath if pythonpath is not None else os.environ.get("PYTHONPATH", "")
    return {CLOCK: f"{__name__}:from_env", FOLDER: str(folder),
            "PYTHONPATH": os.pathsep.join(filter(None, [path, str(REPO)]))}


def from_env() -> Optional[WorkerTimes]:
    """The clock of a worker whose environment names a folder ($TOWERLAB_WORKER_TIMES); None otherwise."""
    folder = os.environ.get(FOLDER, "").strip()
    return WorkerTimes(Path(folder)) if folder else None


def breakdown(records: list[dict]) -> dict:
    """The workers' time (one record per worker process, as `WorkerTimes.leave` writes it) in all, and per
    trained candidate: each part's seconds summed over the workers and divided by the candidates they
    trained (the search's and its test retrainings), with each part's share of the workers' wall time."""
    parts = list(records[0]["seconds"]) if records else []
    tasks = sum(r["tasks"] for r in records)
    total = {p: sum(r["seconds"][p] for r in records) for p in parts}
    wall = sum(r["wall_seconds"] for r in records)
    return {"workers": len(records), "candidates": tasks, "wall_seconds": wall, "seconds": total,
            "per_candidate": {p: (v / tasks if tasks else None) for p, v in total.items()},
            "share": {p: (v / wall if wall else None) for p, v in total.items()}, "each_worker": records}


def process_age() -> float:
    """Seconds since this process started (Linux: /proc); 0.0 where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(stat[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class WorkerTimes:
    """One worker's clock (see the module's docstring): what towerlab's WorkerTimes protocol asks."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.entered = time.perf_counter()
        self.before_entry = process_age()
        self.first_claim: Optional[float] = None
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.tasks = 0

    def timed(self, name: str, seconds: float, started: float) -> None:
        """One of the worker's own store calls (`name`: claim, complete, put_back), its `seconds` from `started`."""
        if name == "claim" and self.first_claim is None:
            self.first_claim = started
        self.seconds["store"] += seconds

    def data(self, seconds: float) -> None:
        self.seconds["data"] += seconds

    def candidate(self, seconds: float, result: Any) -> None:
        """A candidate's training: `seconds` of it in all, `result` its TrainResult (None: it failed, or a trial
        of your objective, which has no parts)."""
        self.tasks += 1
        parts = {"setup": result.setup_seconds, "training": result.train_seconds,
                 "evaluation": result.eval_seconds} if result is not None else {}
        for part, value in parts.items():
            self.seconds[part] += value
        self.seconds["build"] += max(0.0, seconds - sum(parts.values()))

    def leave(self, name: str, device: str) -> None:
        """The worker leaves: its record, `<pid>.json` in the folder."""
        now = time.perf_counter()
        first = self.first_claim if self.first_claim is not None else now
        self.seconds["start"] = max(0.0, self.before_entry + first - self.entered - self.seconds["data"])
        wall = self.before_entry + now - self.entered
        self.seconds["idle"] = max(0.0, wall - sum(v for k, v in self.seconds.items() if k != "idle"))
        record = {"worker": name, "device": device, "tasks": self.tasks, "wall_seconds": wall, "seconds": self.seconds}
        write_json(self.folder / f"{os.getpid()}.json", record)
