"""Where a search worker's time goes, for the benchmarks (bench/gpu/suite.py's search figure): how many
evaluations a minute a device gives is decided as much by what a worker waits on between candidates as
by the training itself.

Measured only where $TOWERLAB_WORKER_TIMES names a folder (the benchmark sets it; nothing is measured
or written otherwise). Each worker process then writes `<pid>.json` there when it leaves: its wall time,
from its process's start to its leaving, split into

- `start`: the process's start (interpreter, imports) and its own setup before its first claim (CUDA,
  the store, the search's settings), less `data`;
- `data`: reading the search's data and moving it to the device (once per search);
- `store`: the store's round trips on the worker's critical path (claiming a task, writing its result);
- per candidate, from its own training's record: `build` (the network, its checks and optimizer,
  what the loop does around the steps), `setup` (the warm-up before the clock: a CUDA graph's recording
  or a compilation), `training` (the optimizer steps), `evaluation` (validation and test passes);
- `idle`: the rest (no task open: a generation's end, the search's record).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

ENV = "TOWERLAB_WORKER_TIMES"
PARTS = ("start", "data", "store", "build", "setup", "training", "evaluation", "idle")


def process_age() -> float:
    """Seconds since this process started (Linux: /proc); 0.0 where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(stat[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class WorkerTimes:
    """One worker's clock (see the module's docstring); `from_env()` is None where nothing is measured."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.entered = time.perf_counter()
        self.before_entry = process_age()
        self.first_claim: Optional[float] = None
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.tasks = 0

    @classmethod
    def from_env(cls) -> Optional[WorkerTimes]:
        folder = os.environ.get(ENV, "").strip()
        return cls(Path(folder)) if folder else None

    def timed(self, name: str, seconds: float, started: float) -> None:
        """One of the worker's own store calls (`name`: claim, complete, put_back), its `seconds` from `started`."""
        if name == "claim" and self.first_claim is None:
            self.first_claim = started
        self.seconds["store"] += seconds

    def data(self, seconds: float) -> None:
        self.seconds["data"] += seconds

    def candidate(self, seconds: float, result: Any) -> None:
        """A candidate's training: `seconds` of it in all, `result` its TrainResult (None: it failed)."""
        self.tasks += 1
        parts = {"setup": result.setup_seconds, "training": result.train_seconds,
                 "evaluation": result.eval_seconds} if result is not None else {}
        for part, value in parts.items():
            self.seconds[part] += value
        self.seconds["build"] += max(0.0, seconds - sum(parts.values()))

    def write(self, name: str, device: str) -> None:
        now = time.perf_counter()
        first = self.first_claim if self.first_claim is not None else now
        self.seconds["start"] = max(0.0, self.before_entry + first - self.entered - self.seconds["data"])
        wall = self.before_entry + now - self.entered
        self.seconds["idle"] = max(0.0, wall - sum(v for k, v in self.seconds.items() if k != "idle"))
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"worker": name, "device": device, "tasks": self.tasks, "wall_seconds": wall, "seconds": self.seconds}
        (self.folder / f"{os.getpid()}.json").write_text(json.dumps(record, indent=1))
