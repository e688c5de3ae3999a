"""Search quality with many workers (issue 72, item 3): LCBench's 10 open tasks (YAHPO Gym's surrogate, as
bench/quality/lcbench.py), seeds 0-2, 5,200 epochs a run, each search run by 8 and by 32 workers at once, every
training sleeping in proportion to its epochs (`--scale` seconds an epoch) so that the workers overlap as
they do on a cluster:

- towerlab's default, as a user runs it: `towerlab search run --objective ... --devices W --budget-epochs
  5200 --max-epochs 52` (every other setting at its default: auto -> gp, asynchronous, re-measuring its top
  within the budget), the surrogate queried in a function objective (`objective` below); where one
  command may not start W processes here (32 on 2 cores), the search runs on as many as it may and
  `towerlab search worker` joins it with the rest, as further machines would (bench/common/crew.py);
- Optuna's GPSampler and TPESampler (constant_liar, as its docs advise for parallel runs) with W processes on
  one storage (a JournalFileBackend file), as Optuna's docs run them: each process `study.optimize` with
  `MaxTrialsCallback(100, states=None)` (100 trials of 52 epochs: the same budget), its sampler seeded
  `seed * 1000 + process` (the same seed in every process would draw the same start-up);
- random search: its proposals read no outcome, so W workers give the same distribution as one (the
  sequential runs of bench/quality/lcbench.py's `random` arm, re-run here).

Each run's trace is every training in the order it finished, charged the epochs it was given; the regret
is bench/quality/lcbench.py's (its `regrets`, against bench/results/quality/lcbench-random-20000.json and the best seen).
Runs go `--jobs` at a time (they sleep, mostly) and are kept in bench/results/lcbench-runs/parallel/.

    python bench/quality/lcbench_parallel.py --workers 8 32 --arms towerlab gp-parallel tpe-parallel random
    python bench/quality/lcbench_parallel.py --workers 8 --arms towerlab --tasks 3945 --seeds 0   # one run
    python bench/quality/lcbench_parallel.py --kept-only        # the record of the kept runs
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.quality import lcbench_problem as problem
from bench.quality.lcbench_problem import BUDGET, FULL, GENES, TASKS
from bench.common.crew import crewed_search
from bench.common.record import REPO, RESULTS, script_command, write_json, write_record

RUNS = RESULTS / "lcbench-runs" / "parallel"
NOTES = ("towerlab's default measured as a user runs it: `towerlab search run --objective ... --budget-epochs 5200 "
         "--max-epochs 52 --devices W` through the command line, every other setting at its default (beyond what one "
         "command may start here, a joining `towerlab search worker`: bench/common/crew.py); the anchors as Optuna's "
         "docs run a parallel study (W processes on one journal file)")
POINTS = (0.25, 0.5, 1.0)
ARMS = {
    "towerlab": "towerlab's default search (search run --devices W)",
    "gp-parallel": "Optuna GPSampler, W processes on one storage",
    "tpe-parallel": "Optuna TPESampler (constant liar), W processes on one storage",
    "random": "random search (Optuna's RandomSampler; its draws read no outcome)",
}
ANCHORS = ("gp-parallel", "tpe-parallel", "random")
# kept runs of an earlier towerlab, for the record's comparison: this script runs only the arms above
KEPT = {"towerlab-int": "towerlab's default before gp took an int range of more than 32 values as floats "
                        "(each int gene modelled value by value), the same command",
        "towerlab-quick": "towerlab's default before its leader knew how long a training takes (it gave every "
                          "worker that waited TPE's quick proposal: a fifth of the proposals), the same command",
        "towerlab-before-pacing": "towerlab's default before its leader proposed quickly for the workers that "
                                  "finish during the model's proposal (only for one idle when it looked), the same "
                                  "command"}


def objective(batch_size: int, learning_rate: float, max_dropout: float, max_units: int, momentum: float,
              num_layers: int, weight_decay: float, epochs: int) -> dict:
    """The surrogate as towerlab's function objective (task $LCB_TASK), sleeping $LCB_SCALE s an epoch."""
    genes = {"batch_size": batch_size, "learning_rate": learning_rate, "max_dropout": max_dropout,
             "max_units": max_units, "momentum": momentum, "num_layers": num_layers, "weight_decay": weight_decay}
    accuracy = _surrogate(os.environ["LCB_TASK"]).at(genes, epochs)
    time.sleep(epochs * float(os.environ["LCB_SCALE"]))
    return {"val_accuracy": accuracy / 100}


_surrogates: dict[str, problem.Surrogate] = {}


def _surrogate(task: str) -> problem.Surrogate:
    if task not in _surrogates:
        _surrogates[task] = problem.Surrogate(task)
    return _surrogates[task]


if "LCB_TASK" in os.environ:  # imported as towerlab's objective: opened once, by the launcher, before its workers fork
    _surrogate(os.environ["LCB_TASK"])


def towerlab_run(task: str, seed: int, workers: int, scale: float, budget: int) -> dict:
    """One run of the default search through the command line: its rows in the order they finished."""
    import sqlite3

    space = "\n".join(["[genes]", *(f"{name} = {{low = {g['low']}, high = {g['high']}"
                                     f"{', log = true' if g.get('log') else ''}}}" for name, g in GENES.items())])
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "lcb.toml").write_text(space + "\n")
        objective = ["--objective", f"{Path(__file__).resolve()}:objective"]
        started = time.time()
        done = crewed_search(
            [*objective, "--space", "lcb.toml", "--metric", "val_accuracy", "--direction", "maximize", "--max-epochs",
             str(FULL), "--budget-epochs", str(budget), "--seed", str(seed), "--no-progress"], objective, workers, "out",
            Path(folder), {**os.environ, "LCB_TASK": task, "LCB_SCALE": str(scale),
                           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
        wall = time.time() - started
        if done.returncode != 0:
            raise RuntimeError(f"towerlab on task {task} seed {seed}: {done.stderr[-2000:]}")
        with sqlite3.connect(Path(folder, "out", "search.db")) as db:
            rows = db.execute("SELECT max_epochs, status, fitness, replicate, generation, genome FROM evaluations"
                              " ORDER BY id").fetchall()
            proposed = [json.loads(p) for (p,) in db.execute("SELECT proposed FROM generations WHERE proposed IS NOT"
                                                             " NULL ORDER BY generation")]
    spent, trace = 0, []
    for max_epochs, status, fitness, *_ in rows:
        spent += max_epochs or FULL
        if (max_epochs or FULL) == FULL and status == "ok":
            trace.append((spent, 100 * fitness))
    in_flight = [len(p["in_flight"]) for p in proposed[10:]]
    return {"spent": spent, "trainings": len(rows), "trace": trace, "wall_seconds": wall,
            "in_flight_at_proposal": statistics.fmean(in_flight) if in_flight else None,
            "proposal_seconds": statistics.fmean(p["seconds"] for p in proposed) if proposed else None,
            "quick_proposals": sum(bool(p.get("quickly")) for p in proposed)}


def _optuna_worker(arm: str, storage: str, name: str, seed: int, task: str, scale: float, trials: int) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = {"gp-parallel": lambda: optuna.samplers.GPSampler(seed=seed),
               "tpe-parallel": lambda: optuna.samplers.TPESampler(seed=seed, constant_liar=True),
               "random": lambda: optuna.samplers.RandomSampler(seed=seed)}[arm]()
    study = optuna.load_study(study_name=name, storage=_journal(storage), sampler=sampler)

    def trial_objective(trial: Any) -> float:
        genes = {n: (trial.suggest_int(n, g["low"], g["high"], log=g.get("log", False)) if isinstance(g["low"], int)
                     else trial.suggest_float(n, g["low"], g["high"], log=g.get("log", False)))
                 for n, g in GENES.items()}
        accuracy = _surrogate(task).at(genes, FULL)
        time.sleep(FULL * scale)
        return accuracy

    study.optimize(trial_objective, callbacks=[optuna.study.MaxTrialsCallback(trials, states=None)])


def _journal(path: str) -> Any:
    import optuna

    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))


def optuna_run(arm: str, task: str, seed: int, workers: int, scale: float, budget: int) -> dict:
    """One run of an Optuna sampler with `workers` processes (forked) on one journal file."""
    import optuna

    with tempfile.TemporaryDirectory() as folder:
        storage = str(Path(folder) / "journal.log")
        optuna.create_study(study_name="lcb", storage=_journal(storage), direction="maximize")
        _surrogate(task)  # opened once, before the fork
        started = time.time()
        ctx = multiprocessing.get_context("fork")
        processes = [ctx.Process(target=_optuna_worker,
                                 args=(arm, storage, "lcb", seed * 1000 + i, task, scale if arm != "random" else 0.0,
                                       budget // FULL)) for i in range(workers if arm != "random" else 1)]
        for p in processes:
            p.start()
        for p in processes:
            p.join()
        wall = time.time() - started
        trials = optuna.load_study(study_name="lcb", storage=_journal(storage)).get_trials()
    finished = sorted((t for t in trials if t.datetime_complete is not None), key=lambda t: t.datetime_complete)
    spent, trace = 0, []
    for t in finished:
        spent += FULL
        if t.value is not None:
            trace.append((spent, t.value))
    return {"spent": spent, "trainings": len(finished), "trace": trace, "wall_seconds": wall}


def one(job: tuple[str, int, str, int, float, int]) -> dict:
    arm, workers, task, seed, scale, budget = job
    if arm in KEPT:
        raise RuntimeError(f"{arm} on task {task} seed {seed}: an earlier towerlab's runs, kept, not run again")
    run = (towerlab_run(task, seed, workers, scale, budget) if arm == "towerlab"
           else optuna_run(arm, task, seed, workers, scale, budget))
    return {"arm": arm, "workers": workers, "task": task, "seed": seed, "scale": scale, "budget": budget, **run}


def _path(arm: str, workers: int, task: str, seed: int) -> Path:
    return RUNS / f"{arm}-w{workers}-{task}-{seed}.json"


def run_all(jobs: list[tuple], parallel: int, rerun: bool) -> None:
    RUNS.mkdir(parents=True, exist_ok=True)
    todo = [j for j in jobs if rerun or not _path(j[0], j[1], j[2], j[3]).exists()]
    print(f"{len(jobs)} runs, {len(todo)} to run, {parallel} at a time", flush=True)
    lock, done = threading.Lock(), [0]

    def work() -> None:
        while True:
            with lock:
                if not todo:
                    return
                job = todo.pop(0)
            result = one(job)
            write_json(_path(*job[:4]), result, indent=None)
            with lock:
                done[0] += 1
                best = max((a for _, a in result["trace"]), default=None)
                print(f"[{done[0]}] {job[0]} w{job[1]} task {job[2]} seed {job[3]}: best {best}, "
                      f"{result['trainings']} trainings, {result['wall_seconds']:.0f} s", flush=True)

    threads = [threading.Thread(target=work) for _ in range(parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def measure(results: list[dict], reference: dict, budget: int) -> dict:
    best_known = {t: max([reference[t]["best"]] + [a for r in results if r["task"] == t for _, a in r["trace"]])
                  for t in reference}

    def at(run: dict, epochs: float) -> float:
        return problem.regret(best_known[run["task"]], reference[run["task"]]["median"],
                              problem.incumbent(run["trace"], epochs))

    out: dict[str, Any] = {}
    for key in dict.fromkeys((r["arm"], r["workers"]) for r in results):
        mine = [r for r in results if (r["arm"], r["workers"]) == key]
        out[f"{key[0]}-w{key[1]}"] = {
            "arm": key[0], "workers": key[1], "what": {**ARMS, **KEPT}[key[0]], "runs": len(mine),
            "points": {str(p): statistics.fmean(at(r, p * budget) for r in mine) for p in POINTS},
            "standard_error": {str(p): statistics.stdev([at(r, p * budget) for r in mine]) / len(mine) ** 0.5
                               if len(mine) > 1 else None for p in POINTS},
            "wall_seconds": statistics.fmean(r["wall_seconds"] for r in mine),
            "trainings": statistics.fmean(r["trainings"] for r in mine),
            **({"in_flight_at_proposal": statistics.fmean(r["in_flight_at_proposal"] for r in mine)}
               if key[0].startswith("towerlab") else {}),
            **({"quick_proposals": statistics.fmean(r["quick_proposals"] for r in mine)}
               if all("quick_proposals" in r for r in mine) else {}),
        }
    return {"arms": out, "best_known": best_known}


def figures(measured: dict, sequential: dict) -> list[dict]:
    arms, out = measured["arms"], []
    for workers in sorted({a["workers"] for a in arms.values()} - {0}):  # 0: random's, standing for any number
        for p in ("0.5", "1.0"):
            pct = round(100 * float(p))
            default = arms.get(f"towerlab-w{workers}")
            if default is not None:
                out.append({"id": f"lcbench_regret_default_w{workers}_{pct}", "value": default["points"][p],
                            "detail": {"runs": default["runs"], "in_flight_at_proposal": default["in_flight_at_proposal"]}})
            anchors = [a for a in arms.values() if a["arm"] in ANCHORS and a["workers"] == workers
                       or a["arm"] == "random"]
            if anchors:
                best = min(anchors, key=lambda a: a["points"][p])
                out.append({"id": f"lcbench_regret_best_parallel_anchor_w{workers}_{pct}", "value": best["points"][p],
                            "detail": {"anchor": best["arm"], "what": best["what"], "runs": best["runs"]}})
    for p, value in sequential.items():
        out.append({"id": f"lcbench_regret_best_sequential_anchor_{round(100 * float(p))}", "value": value,
                    "detail": {"anchor": "gp", "what": "Optuna GPSampler one trial at a time",
                               "record": "bench/results/quality/lcbench-2026-11-28.json"}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=[*ARMS, *KEPT])
    parser.add_argument("--workers", nargs="*", type=int, default=[8, 32])
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--scale", type=float, default=0.3, help="seconds a training sleeps per epoch")
    parser.add_argument("--jobs", type=int, default=3, help="runs at a time")
    parser.add_argument("--rerun", action="store_true")
    parser.add_argument("--kept-only", action="store_true")
    parser.add_argument("--record", default=None)
    args = parser.parse_args(argv)
    # seed by seed, task by task, the arms side by side: a record of the runs kept so far pairs its arms
    jobs = [(a, w if a != "random" else 1, t, s, args.scale, BUDGET) for w in args.workers for s in args.seeds
            for t in args.tasks for a in args.arms]
    jobs = list(dict.fromkeys(jobs))
    if not args.kept_only:
        run_all(jobs, args.jobs, args.rerun)
    results = [json.loads(_path(*j[:4]).read_text()) for j in jobs if _path(*j[:4]).exists()]
    for r in results:  # random: one draw sequence stands for every number of workers
        if r["arm"] == "random":
            r["workers"] = 0
    reference = problem.reference(tuple(args.tasks))
    measured = measure(results, reference, BUDGET)
    sequential_record = json.loads((RESULTS / "quality" / "lcbench-2026-11-28.json").read_text())
    sequential = sequential_record["arms"]["gp"]["points"]
    for name, m in measured["arms"].items():
        print(f"{name:22} " + " ".join(f"{m['points'][str(p)]:.3f}" for p in POINTS) + f"  ({m['runs']} runs)")
    name = args.record or f"lcbench-parallel-{time.strftime('%Y-%m-%d')}"
    from bench.common.machine import describe  # imports torch

    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe(),
              "command": script_command(__file__), "notes": NOTES, "tasks": args.tasks,
              "seeds": args.seeds, "workers": args.workers, "scale_seconds_per_epoch": args.scale,
              "budget_epochs": BUDGET, "points": list(POINTS), **measured,
              "sequential_gp": sequential, "figures": figures(measured, {p: sequential[p] for p in ("0.5", "1.0")})}
    print(f"wrote {write_record(RESULTS / 'quality', f'{name}.json', record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
