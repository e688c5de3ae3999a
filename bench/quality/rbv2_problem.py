"""rbv2_xgboost as bench/quality/rbv2_xgboost.py measures searches on it: YAHPO Gym's surrogate of XGBoost (an mlr3
pipeline with imputation) trained on OpenML tasks, 14 hyperparameters, 2 of them categorical and 8 active
only for some boosters, its target `acc` (maximized) read at the full fidelity (trainsize 1.0, repl 10). The
space is a towerlab space file with `when` conditions (bench/quality/rbv2_xgboost.toml), read by towerlab as a user's
file is; a run may give 150 trainings (`Ledger`); each task's reference is the median and the best of 20,000
random configurations, cached in bench/results/quality/rbv2-xgboost-random-20000.json.

The 10 tasks of ../shared/data/rbv2_xgboost/OPEN.md are measured and tuned on (`TASKS`); the other 109 are
kept for an independent check. The surrogate (yahpo-gym, onnxruntime) is a benchmark dependency, not
towerlab's: its module is imported where a task is opened. `objective` is the surrogate as a user's function
objective (`towerlab search run --objective bench/quality/rbv2_problem.py:objective`, the task in $RBV2_TASK);
`objective_trainsize` the same with the share of the training data as its fidelity, for a pruned search: a
training of `epochs` is the surrogate at trainsize epochs / FULL_EPOCHS, and costs that share of a training.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from bench.common.record import REPO, RESULTS, figure, write_record
from bench.quality import anchors
from towerlab.search import random_genome
from towerlab.search.space import load_space

HERE = Path(__file__).resolve().parent
TASKS = ("12", "1501", "16", "40499", "1067", "1461", "1590", "31", "40983", "4534")
BUDGET = 150  # trainings a run may do, each at the full fidelity
FIDELITY = {"trainsize": 1.0, "repl": 10}
# A pruned search's --max-epochs: `objective_trainsize` reads a training of e epochs at trainsize e / 27, so
# that --min-epochs 1 and the default --prune-factor 3 give rungs of trainsize 1/27, 1/9, 1/3 and 1 (the
# surrogate's range is 0.03 to 1; Hyperband's brackets with eta 3).
FULL_EPOCHS = 27
SPACE_FILE = HERE / "rbv2_xgboost.toml"
SPACE = load_space(SPACE_FILE, objective=True)
REFERENCE = RESULTS / "quality" / "rbv2-xgboost-random-20000.json"
RANDOM_CONFIGS, RANDOM_SEED = 20_000, 20_000


def held_out(n: int) -> tuple[str, ...]:
    """`n` of the surrogate's tasks kept out of every choice (not in TASKS), drawn once (seed 73): an
    independent check of what was measured on the open ones."""
    space = json.loads((data_dir() / "rbv2_xgboost" / "config_space.json").read_text())
    tasks = next(h["choices"] for h in space["hyperparameters"] if h["name"] == "task_id")
    others = sorted((t for t in tasks if t not in TASKS), key=int)
    return tuple(np.random.Generator(np.random.PCG64(73)).choice(others, size=n, replace=False).tolist())


def data_dir() -> Path:
    """The shared data folder that holds rbv2_xgboost/ (beside the repository)."""
    return (REPO.parent / "shared" / "data").resolve()


def active(config: Mapping[str, Any]) -> dict:
    """`config`'s active genes only, each as the space takes it: what the surrogate is given, whatever a
    method proposed for the genes its booster does not use (HEBO proposes every gene)."""
    return anchors.active(SPACE, config)


class Surrogate:
    """One task's surrogate at the full fidelity: a configuration's `acc` (a fraction), remembered."""

    def __init__(self, task: str) -> None:
        benchmark_set = anchors.yahpo(data_dir())
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ConfigSpace 1.x on yahpo's file: "'default' should be 'default_value'"
            self._bench = benchmark_set.BenchmarkSet("rbv2_xgboost", instance=task, multithread=False, check=False)
        self.task = task
        self._seen: dict[str, float] = {}

    def _row(self, config: Mapping[str, Any], trainsize: float = 1.0) -> dict:
        return {**active(config), **FIDELITY, "trainsize": trainsize, "task_id": self.task}

    def acc(self, config: Mapping[str, Any], trainsize: float = 1.0) -> float:
        row = self._row(config, trainsize)
        key = json.dumps(row, sort_keys=True)
        if key not in self._seen:
            self._seen[key] = float(self._bench.objective_function([row], multithread=False)[0]["acc"])
        return self._seen[key]

    def many(self, configs: list[dict]) -> np.ndarray:
        """The `acc` of many configurations, in batches (the random reference)."""
        rows = [self._row(c) for c in configs]
        return np.array([r["acc"] for i in range(0, len(rows), 2000)
                         for r in self._bench.objective_function(rows[i:i + 2000], multithread=False)])


class BudgetSpent(BaseException):
    """The run's trainings are spent: it stops whatever search is running (a BaseException, so that a
    method that records an Exception as a failed trial lets it through)."""


class Ledger:
    """The trainings a run has done and, after each, its accuracy (`trace`: (trainings, acc)); one past the
    budget is not done (BudgetSpent). A training on a share of the data counts as that share of one."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.budget, self.trainings = budget, 0.0
        self.trace: list[tuple[float, float]] = []

    def train(self, surrogate: Surrogate, config: Mapping[str, Any]) -> float:
        if self.trainings >= self.budget:
            raise BudgetSpent
        accuracy = surrogate.acc(config)
        self.trainings += 1
        self.trace.append((self.trainings, accuracy))
        return accuracy


def incumbent(trace: list[tuple[float, float]], trainings: float) -> float | None:
    """The best accuracy among the first `trainings` (None: none yet)."""
    found = [a for n, a in trace if n <= trainings]
    return max(found) if found else None


def regret(best_known: float, median: float, accuracy: float | None) -> float:
    """(best known - incumbent) / (best known - median); none yet scores as the median configuration (1)."""
    if accuracy is None:
        return 1.0
    return (best_known - accuracy) / (best_known - median)


def reference(tasks: tuple[str, ...], log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each task's 20,000 random configurations (towerlab's random_genome over SPACE, the same for every
    task): their median and best `acc` (and the best's configuration), read from REFERENCE, measured for
    the tasks it lacks."""
    cached = json.loads(REFERENCE.read_text())["tasks"] if REFERENCE.exists() else {}
    missing = [t for t in tasks if t not in cached]
    if missing:
        rng = np.random.Generator(np.random.PCG64(RANDOM_SEED))
        configs = [random_genome(rng, SPACE) for _ in range(RANDOM_CONFIGS)]
        for task in missing:
            log(f"task {task}: {RANDOM_CONFIGS} random configurations ...")
            accuracy = Surrogate(task).many(configs)
            best = int(np.argmax(accuracy))
            cached[task] = {"median": float(np.median(accuracy)), "best": float(accuracy[best]),
                            "best_config": configs[best], "mean": float(np.mean(accuracy))}
        from bench.common.machine import describe  # imports torch

        write_record(REFERENCE.parent, REFERENCE.name, {
            "what": f"{RANDOM_CONFIGS} configurations drawn from bench/quality/rbv2_xgboost.toml (towerlab's "
                    f"random_genome, numpy PCG64 seed {RANDOM_SEED}, the same for every task: the booster uniform, "
                    "each gene it activates drawn), each at trainsize 1.0, repl 10 on YAHPO Gym's rbv2_xgboost "
                    "surrogate: the median and the best acc per task",
            "machine": describe(), "tasks": dict(sorted(cached.items())),
            "figures": [figure(f"median_{task}", row["median"], {"best": row["best"], "mean": row["mean"]})
                        for task, row in sorted(cached.items())]})
    return {t: cached[t] for t in tasks}


_surrogates: dict[str, Surrogate] = {}


def objective(**genes: Any) -> dict:
    """The surrogate as a user's function objective (task $RBV2_TASK): {"acc": ...}. An inactive gene is
    not given (towerlab leaves it out of a trial)."""
    task = os.environ["RBV2_TASK"]
    if task not in _surrogates:
        _surrogates[task] = Surrogate(task)
    return {"acc": _surrogates[task].acc(genes)}


def objective_trainsize(epochs: int, **genes: Any) -> dict:
    """`objective` trained on the share epochs / FULL_EPOCHS of the task's training data (a pruned search's rung
    is a share of the data, and reports no learning curve)."""
    task = os.environ["RBV2_TASK"]
    if task not in _surrogates:
        _surrogates[task] = Surrogate(task)
    return {"acc": _surrogates[task].acc(genes, epochs / FULL_EPOCHS)}
