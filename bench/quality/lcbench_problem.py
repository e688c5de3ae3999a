"""LCBench as bench/quality/lcbench.py measures searches on it: YAHPO Gym's surrogate of an MLP trained on an
OpenML task (7 hyperparameters, 1 to 52 epochs, validation accuracy in percent), the space as towerlab
and Optuna take it, the epochs a run may spend (`Ledger`), and each task's reference: the median and the
best of 20,000 random configurations at 52 epochs, cached in bench/results/quality/lcbench-random-20000.json.

The 10 tasks of ../shared/data/lcbench/OPEN.md are measured and tuned on (`TASKS`); the other 24
(`held_out`) only check a change made on those, in a record of their own. The surrogate (yahpo-gym, onnxruntime) is a benchmark dependency, not towerlab's:
its module is imported where a task is opened.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.common.record import REPO, RESULTS, figure, write_record
from towerlab.search import random_genome
from towerlab.search.space import space_of

TASKS = ("3945", "7593", "34539", "126025", "126026", "126029", "146212", "167104", "167149", "167152")
FULL = 52  # epochs of a full training: the fidelity at which an incumbent counts
BUDGET = 100 * FULL  # epochs a run may give its trainings: 100 full trainings' worth
REFERENCE = RESULTS / "quality" / "lcbench-random-20000.json"
RANDOM_CONFIGS, RANDOM_SEED = 20_000, 20_000

# The surrogate's space (config_space.json), as towerlab ranges: weight decay is linear there.
GENES = {
    "batch_size": {"low": 16, "high": 512, "log": True},
    "learning_rate": {"low": 1e-4, "high": 0.1, "log": True},
    "max_dropout": {"low": 0.0, "high": 1.0},
    "max_units": {"low": 64, "high": 1024, "log": True},
    "momentum": {"low": 0.1, "high": 0.99},
    "num_layers": {"low": 1, "high": 5},
    "weight_decay": {"low": 1e-5, "high": 0.1},
}
SPACE = space_of({"model": "custom", "genes": GENES}, "lcbench", "the LCBench space")


def data_dir() -> Path:
    """The shared data folder that holds lcbench/ (beside the repository)."""
    return (REPO.parent / "shared" / "data").resolve()


def held_out() -> tuple[str, ...]:
    """The surrogate's tasks outside TASKS (from its configuration space: the 24 kept for an independent check)."""
    space = json.loads((data_dir() / "lcbench" / "config_space.json").read_text())
    tasks = next(p["choices"] for p in space["hyperparameters"] if p["name"] == "OpenML_task_id")
    return tuple(t for t in tasks if t not in TASKS)


class Surrogate:
    """One task's surrogate. A configuration's whole curve (epochs 1..52) is one query, remembered, so
    that a value never depends on which other epochs were asked with it."""

    def __init__(self, task: str) -> None:
        from bench.quality import anchors

        benchmark_set = anchors.yahpo(data_dir())  # (its configuration file: see there)
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # its request to cite; ConfigSpace 1.x
            warnings.simplefilter("ignore")
            # check=False: its check refuses the bounds themselves (learning_rate 1e-4 is below the
            # 0.00010000000000000009 its ConfigSpace export holds), where a model often proposes
            self._bench = benchmark_set.BenchmarkSet("lcbench", instance=task, multithread=False, check=False)
        self.task = task
        self._curves: dict[tuple, np.ndarray] = {}

    def _rows(self, config: dict, epochs: range) -> list[dict]:
        return [{**config, "epoch": e, "OpenML_task_id": self.task} for e in epochs]

    def curve(self, config: dict) -> np.ndarray:
        """Validation accuracy (percent) after 1, 2, ..., 52 epochs."""
        key = tuple(config[name] for name in GENES)
        if key not in self._curves:
            out = self._bench.objective_function(self._rows(config, range(1, FULL + 1)), multithread=False)
            self._curves[key] = np.array([r["val_accuracy"] for r in out])
        return self._curves[key]

    def at(self, config: dict, epochs: int) -> float:
        return float(self.curve(config)[epochs - 1])

    def full(self, configs: list[dict]) -> np.ndarray:
        """Validation accuracy at 52 epochs of many configurations, in batches (the random reference)."""
        rows = [r for c in configs for r in self._rows(c, range(FULL, FULL + 1))]
        out = [r["val_accuracy"] for i in range(0, len(rows), 2000)
               for r in self._bench.objective_function(rows[i:i + 2000], multithread=False)]
        return np.array(out)


class BudgetSpent(BaseException):
    """The run's epochs are spent: it stops whatever search is running. A BaseException, so that a
    trainer that records an Exception as a failed candidate (towerlab's `serial`) lets it through."""


class Ledger:
    """The epochs a run has given its trainings, and each full training's accuracy at the moment it
    finished (`trace`: (epochs spent, accuracy)). A training is charged all the epochs it trains (a
    training restarted at a higher fidelity pays its whole length again, one that continues from
    `start` epochs the rest); one that would go past the budget is not started (BudgetSpent)."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.budget, self.spent, self.trainings = budget, 0, 0
        self.trace: list[tuple[int, float]] = []

    def charge(self, epochs: int) -> None:
        if self.spent + epochs > self.budget:
            raise BudgetSpent
        self.spent += epochs

    def train(self, surrogate: Surrogate, config: dict, epochs: int, start: int = 0) -> float:
        """The accuracy of `config` trained `epochs` epochs, from scratch or continued from `start`, charged."""
        self.charge(epochs - start)
        self.trainings += 1
        accuracy = surrogate.at(config, epochs)
        if epochs == FULL:
            self.trace.append((self.spent, accuracy))
        return accuracy

    def full_trained(self, accuracy: float) -> None:
        """A training charged epoch by epoch (`charge`) that reached the full 52."""
        self.trainings += 1
        self.trace.append((self.spent, accuracy))


def incumbent(trace: list[tuple[int, float]], epochs: float) -> float | None:
    """The best accuracy among the full trainings finished within `epochs` (None: none yet)."""
    found = [a for spent, a in trace if spent <= epochs]
    return max(found) if found else None


def regret(best_known: float, median: float, accuracy: float | None) -> float:
    """(best known - incumbent) / (best known - median); a run with no full training yet scores as
    the median configuration would (1)."""
    if accuracy is None:
        return 1.0
    return (best_known - accuracy) / (best_known - median)


def reference(tasks: tuple[str, ...], refresh: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each task's 20,000 random configurations at 52 epochs: their median and best (and the best's
    configuration), read from REFERENCE, measured for the tasks it lacks (about 5 s a task)."""
    cached = {} if refresh or not REFERENCE.exists() else json.loads(REFERENCE.read_text())["tasks"]
    missing = [t for t in tasks if t not in cached]
    if missing:
        rng = np.random.Generator(np.random.PCG64(RANDOM_SEED))
        configs = [random_genome(rng, SPACE) for _ in range(RANDOM_CONFIGS)]
        for task in missing:
            log(f"task {task}: {RANDOM_CONFIGS} random configurations at {FULL} epochs ...")
            accuracy = Surrogate(task).full(configs)
            best = int(np.argmax(accuracy))
            cached[task] = {"median": float(np.median(accuracy)), "best": float(accuracy[best]),
                            "best_config": configs[best], "mean": float(np.mean(accuracy))}
        from bench.common.machine import describe  # imports torch

        write_record(REFERENCE.parent, REFERENCE.name, {
            "what": f"{RANDOM_CONFIGS} configurations drawn from the LCBench space (towerlab's random_genome, "
                    f"numpy PCG64 seed {RANDOM_SEED}, the same for every task), each at {FULL} epochs on YAHPO "
                    "Gym's lcbench surrogate: the median and the best validation accuracy (percent) per task",
            "machine": describe(), "tasks": dict(sorted(cached.items())),
            "figures": [figure(f"median_{task}", row["median"], {"best": row["best"], "mean": row["mean"]})
                        for task, row in sorted(cached.items())]})
    return {t: cached[t] for t in tasks}
