"""The methods bench/quality/rbv2_xgboost.py compares on rbv2_xgboost, each an arm `run(surrogate, seed, ledger)`
that searches until the ledger's 150 trainings are done and returns what it measured of itself
(`sampler_seconds`: the CPU its proposing took, None where the search runs in processes of its own).

The anchors (bench/quality/anchors.py) ask one trial at a time, each knowing every outcome before it, as
their users run them. towerlab's default (`towerlab`) is run as a user runs it: `towerlab search run
--objective bench/quality/rbv2_problem.py:objective --space bench/quality/rbv2_xgboost.toml --metric acc
--max-evaluations 150 --seed S`, every other setting at its default, on its default workers; its trace is
its rows in the order they finished, and its first line must say that `auto` chose `gp` (a run that says
otherwise is refused, not kept). `towerlab-tpe` is the same command as towerlab ran it before `auto` chose
`gp` for this space (auto -> tpe for a listed gene): its kept runs were made so; run again, it names
`--sampler tpe`, the sampler that `auto` chose then. `towerlab-serial` and its variants play towerlab's tpe
(that former default) in this process (no workers: each proposal knowing every outcome), where variants are
cheap to compare; `towerlab-serial-gp` plays `--sampler gp` so.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.common.record import REPO
from bench.quality import anchors
from bench.quality.rbv2_problem import FULL_EPOCHS, SPACE, SPACE_FILE, BudgetSpent, Ledger, Surrogate

Arm = Callable[[Surrogate, int, Ledger], dict]
# The re-measures the default search makes after its 150 trainings (2 fresh seeds for each of its top 5), which
# a search under --budget-epochs makes within it: the pruned arm's budget holds them besides the 150.
DEFAULT_REMEASURES = 10


def optuna_arm(make_sampler: Callable[[Any, int], Any]) -> Arm:
    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        return anchors.optuna_run(SPACE, make_sampler, lambda c: ledger.train(surrogate, c), ledger.budget, seed)

    return run


def smac_arm(facade: str) -> Arm:
    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        return anchors.smac_run(SPACE, facade, lambda c: ledger.train(surrogate, c), ledger.budget, seed)

    return run


def hebo(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
    return anchors.hebo_run(SPACE, lambda c: ledger.train(surrogate, c), ledger.budget, seed)


def towerlab_cli(options: tuple[str, ...] = (), says: str | None = None, pruned: bool = False) -> Arm:
    """towerlab's search through its command line with `options` beside the budget and seed (none: its
    default), on its default workers; the ledger charged its rows in the order they finished (re-measures
    included: they come after the search's 150), each the share of a full training it trained, its accuracy
    in the trace where it is a full training. `says`: what its first line must hold (the sampler `auto`
    chose), or the run is refused. `pruned`: the search prunes on the share of the training data
    (`objective_trainsize`, --max-epochs FULL_EPOCHS), its budget --budget-epochs: the 150 trainings and the
    epochs it keeps for re-measuring its top, which the default search spends after its 150."""

    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        return _towerlab_cli(surrogate, seed, ledger, options, says, pruned)

    return run


def _towerlab_cli(surrogate: Surrogate, seed: int, ledger: Ledger, options: tuple[str, ...], says: str | None,
                  pruned: bool) -> dict:
    problem_file = Path(__file__).resolve().parent / "rbv2_problem.py"
    budget = (("--objective", f"{problem_file}:objective_trainsize", "--max-epochs", str(FULL_EPOCHS),
               "--budget-epochs", str((ledger.budget + DEFAULT_REMEASURES) * FULL_EPOCHS))
              if pruned else ("--objective", f"{problem_file}:objective", "--max-evaluations", str(ledger.budget)))
    with tempfile.TemporaryDirectory() as folder:
        started = time.time()
        done = subprocess.run(
            [sys.executable, "-m", "towerlab", "search", "run", *budget,
             "--space", str(SPACE_FILE), "--metric", "acc", "--seed", str(seed),
             *options, "--no-progress", "--out", "out"],
            cwd=folder, capture_output=True, text=True,
            env={**os.environ, "RBV2_TASK": surrogate.task,
                 "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
        wall = time.time() - started
        if done.returncode != 0:
            raise RuntimeError(f"towerlab on task {surrogate.task} seed {seed}: {done.stderr[-2000:]}")
        first_line = [line.replace(f"{REPO}/", "") for line in done.stdout.splitlines()[:1]]  # the repo's paths
        if says is not None and not any(says in line for line in first_line):
            raise RuntimeError(f"towerlab on task {surrogate.task} seed {seed} did not say {says!r}: {first_line}")
        with sqlite3.connect(Path(folder, "out", "search.db")) as db:
            rows = db.execute("SELECT status, fitness, replicate, genome, max_epochs, continued FROM evaluations"
                              " ORDER BY id").fetchall()
            proposed = [json.loads(p) for (p,) in db.execute("SELECT proposed FROM generations WHERE proposed IS NOT"
                                                             " NULL ORDER BY generation")]
        config = json.loads(Path(folder, "out", "config.json").read_text())
        summary = json.loads(Path(folder, "out", "summary.json").read_text())
    full = config["search"]["max_epochs"]
    for status, fitness, _, _, epochs, continued in rows:
        ledger.trainings += (epochs - continued) / full
        if status == "ok" and fitness is not None and epochs == full:
            ledger.trace.append((ledger.trainings, fitness))
    return {"sampler_seconds": None, "search_wall_seconds": wall, "first_line": first_line,
            "remeasures": sum(r[2] > 0 for r in rows), "genomes": [json.loads(r[3]) for r in rows if r[2] == 0],
            **({"rows_by_epochs": {str(e): sum(r[4] == e for r in rows) for e in sorted({r[4] for r in rows})},
                "pruning": summary.get("pruning")} if pruned else {}),
            "quick_proposals": sum(bool(p.get("quickly")) for p in proposed),
            "in_flight_at_proposal": [len(p.get("in_flight", [])) for p in proposed],
            "resolved": {k: config.get("search", {}).get(k) for k in ("sampler", "population", "remeasure")}}


def towerlab_serial(settings: dict, patch: Callable[[], Callable[[], None]] | None = None) -> Arm:
    """towerlab's search with `settings` (SearchConfig's fields; the rest at their defaults) played in this
    process with a `serial` trainer over an SQLite store in a temporary folder: no workers, each proposal
    knowing every outcome. `patch()` changes a sampler for the run and returns what undoes it."""
    from towerlab.config import SearchConfig
    from towerlab.search import Candidate, Outcome, Search, serial
    from towerlab.search.store import Store

    def run(surrogate: Surrogate, seed: int, ledger: Ledger) -> dict:
        def fitness(candidate: Candidate) -> Outcome:
            return Outcome.ok(fitness=ledger.train(surrogate, candidate.genome), epochs=1)

        undo = patch() if patch is not None else None
        started = time.process_time()
        try:
            cfg = SearchConfig(**{"max_evaluations": ledger.budget, "seed": seed, "remeasure": 0, **settings})
            search = Search.resolve(cfg, SPACE)
            with tempfile.TemporaryDirectory() as folder, Store(Path(folder) / "search.db") as store:
                stored = search.create(store, f"rbv2-{surrogate.task}")
                try:
                    stored.run(store, serial(fitness))
                except BudgetSpent:
                    pass
        finally:
            if undo is not None:
                undo()
        return {"sampler_seconds": time.process_time() - started,
                "resolved": {k: v for k, v in vars(search.cfg).items() if k in ("sampler", "population")}}

    return run


def _tpe_patched_with(arguments: dict) -> Callable[[], Callable[[], None]]:
    """What makes every Optuna TPESampler of a run take `arguments` (towerlab's tpe builds one a proposal), and
    returns what undoes it."""
    return lambda: _tpe_patched(arguments)


def _tpe_patched(arguments: dict) -> Callable[[], None]:
    import optuna

    original = optuna.samplers.TPESampler

    class Patched(original):  # type: ignore[misc, valid-type]  # a class read at run time
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, **arguments})

    optuna.samplers.TPESampler = Patched

    def undo() -> None:
        optuna.samplers.TPESampler = original

    return undo


# name -> (what it is, the arm). The anchors first, then towerlab's.
ARMS: dict[str, tuple[str, Arm]] = {
    "random": ("random search (Optuna's RandomSampler)", optuna_arm(lambda o, s: o.samplers.RandomSampler(seed=s))),
    "tpe": ("Optuna TPE (univariate, its default)", optuna_arm(lambda o, s: o.samplers.TPESampler(seed=s))),
    "tpe-mv": ("Optuna TPE, multivariate=True, group=True",
               optuna_arm(lambda o, s: o.samplers.TPESampler(seed=s, multivariate=True, group=True))),
    "gp": ("Optuna GPSampler", optuna_arm(lambda o, s: o.samplers.GPSampler(seed=s))),
    "smac-hpo": ("SMAC3 HyperparameterOptimizationFacade (random forest)", smac_arm("hpo")),
    "smac-bb": ("SMAC3 BlackBoxFacade (Gaussian process)", smac_arm("bb")),
    "hebo": ("HEBO", hebo),
    "towerlab": ("towerlab's default search (search run --objective, its default workers; auto -> gp)",
                 towerlab_cli(says="auto (chose gp")),
    "towerlab-pruned": ("towerlab's default search pruned on the share of the training data (search run --objective "
                        "with trainsize = epochs / 27, --max-epochs 27 --min-epochs 1, its judge deciding the rungs; "
                        "its default workers)", towerlab_cli(("--min-epochs", "1", "--generations", "1000"), says="auto (chose gp",
                                                    pruned=True)),
    "towerlab-code-before": ("towerlab's default search, the same command run on the code before this record's "
                             "(PYTHONPATH naming a checkout of it)", towerlab_cli(says="auto (chose gp")),
    "towerlab-tpe": ("towerlab's search run with its former default (auto -> tpe for a listed gene), its default "
                     "workers", towerlab_cli(("--sampler", "tpe"))),
    "towerlab-sampler-tpe": ("towerlab's search run --sampler tpe (the former default's choice) on the default's "
                             "code, its default workers", towerlab_cli(("--sampler", "tpe"), says="search run: tpe over")),
    "towerlab-serial": ("towerlab's tpe (the former default), played in one process",
                        towerlab_serial({"sampler": "tpe"})),
    "towerlab-serial-gp": ("towerlab's gp (Optuna's GPSampler told every gene, a stand-in where one is inactive), "
                           "played in one process", towerlab_serial({"sampler": "gp"})),
    "towerlab-serial-endpoints": ("towerlab's tpe with Optuna's TPE consider_endpoints=True, played in one process",
                                  towerlab_serial({"sampler": "tpe"}, _tpe_patched_with({"consider_endpoints": True}))),
    "towerlab-serial-joint": ("towerlab's tpe with Optuna's multivariate TPE, group=True, played in one process",
                              towerlab_serial({"sampler": "tpe"}, _tpe_patched_with({"multivariate": True, "group": True}))),
    "towerlab-serial-nogroup": ("towerlab's tpe with multivariate TPE without group (Optuna's AutoSampler's), "
                                "played in one process",
                                towerlab_serial({"sampler": "tpe"},
                                                _tpe_patched_with({"multivariate": True, "group": False}))),
}
OWN_WORKERS = ("towerlab", "towerlab-pruned", "towerlab-code-before", "towerlab-tpe", "towerlab-sampler-tpe")  # arms whose search starts processes of its own
ANCHORS = ("random", "tpe", "tpe-mv", "gp", "smac-hpo", "smac-bb", "hebo")
RECORDED = (*ANCHORS, "towerlab-serial", "towerlab-serial-joint", "towerlab-serial-gp", "towerlab-tpe", "towerlab-sampler-tpe",
            "towerlab")
