"""How busy a search keeps its workers (issue 72, item 4): the default search (`towerlab search run` with a
function objective, a budget alone: `--max-evaluations 200`, every other setting at its default) on 4, 16
and 32 worker slots, every training sleeping 3 s +- 50% (uniform from 1.5 to 4.5 s, drawn from its seed),
beside the same work done by Optuna's GPSampler and TPESampler (constant liar) with as many processes on
one storage (a JournalFileBackend file, `study.optimize` with `MaxTrialsCallback(200)`, as Optuna's docs
run parallel studies: a `python` process each, or, `-forked`, forked from one that imported Optuna). 32 workers are more processes than one command may start on a 2-core machine (16):
there the search runs on 16 and a `towerlab search worker` joins it with 16 more, as a second machine
would (bench/common/crew.py); that worker's start is inside the span.

busy = the seconds the trainings slept, summed / (workers x the span from the first training's start to the
last one's end); `busy_used` counts only the trainings the search's result reads (its own, and the re-measures
of the networks it crowned: not those of a network re-measured ahead and then pushed out of the top,
`remeasures_unused`); `busy_while_budget` counts only up to the last search training's start (after it, the
search has no budget left to give an idle worker: the last trainings and the re-measures of the top run
out); `ideal` is what the same trainings would give with no time between one and the next on each worker
(the tail alone: 200 trainings of 3 s +- 50% on 32 workers cannot keep them busier, whatever proposes).
towerlab's spans and seconds are its store's (the tasks' claims and results on the database's clock, each
training's own seconds); Optuna's its trials' start and completion (its proposal is made inside them).

    python bench/queue/search_busy.py                       # towerlab at 4, 16, 32; Optuna's at 32
    python bench/queue/search_busy.py --workers 4 --arms towerlab
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing
import os
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.crew import crewed_search
from bench.common.machine import describe
from bench.common.record import REPO, RESULTS, script_command, write_record

TRAININGS = 200
FIGURES = {"towerlab": "busy_default", "optuna-gp": "busy_optuna_gp", "optuna-tpe": "busy_optuna_tpe",
           "optuna-gp-forked": "busy_optuna_gp_forked", "optuna-tpe-forked": "busy_optuna_tpe_forked"}


def slept(seed: int) -> float:
    """A training's seconds: 3 s +- 50%, from its seed."""
    return random.Random(seed).uniform(1.5, 4.5)


def f(x: float, y: float, seed: int) -> dict:
    """The objective towerlab's workers run: sleeps its training's seconds, returns a smooth bowl's value."""
    seconds = slept(seed)
    time.sleep(seconds)
    return {"value": -(x - 0.3) ** 2 - (y - 0.7) ** 2, "slept": seconds}


def towerlab(workers: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "s.toml").write_text("[genes]\nx = {low = 0.0, high = 1.0}\ny = {low = 0.0, high = 1.0}\n")
        objective = ["--objective", f"{Path(__file__).resolve()}:f"]
        started = time.time()
        done = crewed_search([*objective, "--space", "s.toml", "--metric", "value", "--max-evaluations", str(TRAININGS),
                              "--seed", str(seed), "--no-progress"], objective, workers, "out", Path(folder),
                             {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
        wall = time.time() - started
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        with sqlite3.connect(Path(folder, "out", "search.db")) as db:
            tasks = db.execute("SELECT t.claimed, t.finished, e.metrics, e.replicate, e.genome_hash FROM tasks t"
                               " JOIN evaluations e"
                               " ON e.search_id = t.search_id AND e.genome_hash = t.genome_hash AND e.train_config_hash ="
                               " t.train_config_hash AND e.replicate = t.replicate WHERE t.kind = 'train'").fetchall()
            quick = db.execute("SELECT COUNT(*) FROM generations WHERE proposed LIKE '%\"quickly\": true%'").fetchone()[0]
            proposals = [json.loads(p)["seconds"] for (p,) in db.execute("SELECT proposed FROM generations")]
        crowned = {t["genome_hash"] for t in json.loads(Path(folder, "out", "summary.json").read_text())["top"]}
    trainings = [(claimed, finished, json.loads(metrics)["slept"], replicate == 0)
                 for claimed, finished, metrics, replicate, _ in tasks]
    unused = [json.loads(metrics)["slept"] for _, _, metrics, replicate, h in tasks if replicate and h not in crowned]
    measured = busy(trainings, workers)
    return {**measured, "busy_used": measured["busy"] * (1 - sum(unused) / sum(t[2] for t in trainings)),
            "remeasures_unused": len(unused), "wall_seconds": wall, "quick_proposals": quick,
            "proposal_seconds_mean": statistics.fmean(proposals)}


def _optuna_process(arm: str, storage: str, seed: int) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = (optuna.samplers.GPSampler(seed=seed) if arm == "optuna-gp"
               else optuna.samplers.TPESampler(seed=seed, constant_liar=True))
    study = optuna.load_study(study_name="busy", storage=_journal(storage), sampler=sampler)

    def objective(trial: Any) -> float:
        x, y = trial.suggest_float("x", 0.0, 1.0), trial.suggest_float("y", 0.0, 1.0)
        seconds = slept(trial.number + 1000 * seed)
        trial.set_user_attr("slept", seconds)
        time.sleep(seconds)
        return -(x - 0.3) ** 2 - (y - 0.7) ** 2

    study.optimize(objective, callbacks=[optuna.study.MaxTrialsCallback(TRAININGS, states=None)])


def _journal(path: str) -> Any:
    import optuna

    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))


def optuna_run(arm: str, workers: int, seed: int) -> dict:
    """Optuna's side: `workers` processes on one journal file, started as its users start them (`python` each,
    importing Optuna and loading the study: `optuna-gp`, `optuna-tpe`), or forked from this process once it
    imported Optuna and made the study (`...-forked`: their start is outside the wall time)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = arm.removesuffix("-forked")
    with tempfile.TemporaryDirectory() as folder:
        storage = str(Path(folder) / "journal.log")
        started = time.time()
        if arm.endswith("-forked"):
            optuna.create_study(study_name="busy", storage=_journal(storage), direction="maximize")
            started = time.time()
            ctx = multiprocessing.get_context("fork")
            processes = [ctx.Process(target=_optuna_process, args=(sampler, storage, seed * 1000 + i))
                         for i in range(workers)]
            for p in processes:
                p.start()
            for p in processes:
                p.join()
        else:
            subprocess.run([sys.executable, __file__, "--optuna-study", storage], check=True)
            started_processes = [subprocess.Popen([sys.executable, __file__, "--optuna-process", sampler, storage,
                                                   str(seed * 1000 + i)]) for i in range(workers)]
            if any(p.wait() != 0 for p in started_processes):
                raise RuntimeError(f"an {arm} process failed")
        wall = time.time() - started
        trials = optuna.load_study(study_name="busy", storage=_journal(storage)).get_trials()
    done = [t for t in trials if t.datetime_complete is not None]
    trainings = [(t.datetime_start.timestamp(), t.datetime_complete.timestamp(), t.user_attrs["slept"], True)
                 for t in done]
    return {**busy(trainings, workers), "wall_seconds": wall}


def busy(trainings: list[tuple[float, float, float, bool]], workers: int) -> dict:
    """(start, end, seconds slept, a search training and not a re-measure) of each training: the busy fractions."""
    first, last = min(t[0] for t in trainings), max(t[1] for t in trainings)
    budget_end = max(t[0] for t in trainings if t[3])
    within = sum(min(s, max(0.0, budget_end - start)) for start, _, s, _ in trainings)
    return {"trainings": len(trainings), "busy": sum(t[2] for t in trainings) / (workers * (last - first)),
            "busy_while_budget": within / (workers * (budget_end - first)) if budget_end > first else None,
            "span_seconds": last - first, "ideal": ideal([t[2] for t in sorted(trainings)], workers)}


def ideal(seconds: list[float], workers: int) -> float:
    """The busy fraction of these trainings, in this order, with nothing between one and the next on a worker."""
    free = [0.0] * workers
    end = 0.0
    for s in seconds:
        start = heapq.heappop(free)
        heapq.heappush(free, start + s)
        end = max(end, start + s)
    return sum(seconds) / (workers * end)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", nargs="*", type=int, default=[4, 16, 32])
    parser.add_argument("--arms", nargs="*", default=["towerlab", "optuna-gp", "optuna-tpe", "optuna-gp-forked",
                                                      "optuna-tpe-forked"])
    parser.add_argument("--optuna-workers", nargs="*", type=int, default=[32])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", default=None)
    parser.add_argument("--optuna-study", help=argparse.SUPPRESS)  # one of Optuna's processes (optuna_run)
    parser.add_argument("--optuna-process", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.optuna_study:
        import optuna

        optuna.create_study(study_name="busy", storage=_journal(args.optuna_study), direction="maximize")
        return 0
    if args.optuna_process:
        arm, storage, seed = args.optuna_process
        _optuna_process(arm, storage, int(seed))
        return 0
    rows = []
    for arm in args.arms:
        for workers in (args.workers if arm == "towerlab" else args.optuna_workers):
            run = towerlab(workers, args.seed) if arm == "towerlab" else optuna_run(arm, workers, args.seed)
            rows.append({"arm": arm, "workers": workers, **run})
            print(f"{arm} on {workers}: busy {run['busy']:.3f} (used {run.get('busy_used', run['busy']):.3f}, while "
                  f"budget {run['busy_while_budget']:.3f}, ideal {run['ideal']:.3f}), {run['trainings']} trainings, "
                  f"wall {run['wall_seconds']:.0f} s", flush=True)
    figures = [{"id": f"{FIGURES[r['arm']]}_w{r['workers']}", "value": r["busy"],
                "detail": {k: v for k, v in r.items() if k not in ("arm", "busy")}} for r in rows]
    name = args.record or f"search-busy-{time.strftime('%Y-%m-%d')}.json"
    write_record(RESULTS / "queue", name, {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe(),
        "command": script_command(__file__), "trainings": TRAININGS, "rows": rows,
        "notes": "towerlab's default measured as a user runs it: `towerlab search run --objective ... "
                 "--max-evaluations 200` through the command line, every other setting at its default (beyond what "
                 "one command may start here, a joining `towerlab search worker`: bench/common/crew.py); Optuna's as "
                 "its users run a parallel study, a `python` process a worker on one journal file, each importing "
                 "Optuna (busy_optuna_*), and forked from one process that imported it and made the study, their "
                 "start outside the wall time (busy_optuna_*_forked, as records before 2026-12-07 measured them)",
        "figures": figures})
    print(f"wrote bench/results/queue/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
