"""Search quality on a mixed, conditional space (issue 73, item 2): YAHPO Gym's rbv2_xgboost surrogate, its 10
open tasks (../shared/data/rbv2_xgboost/OPEN.md), 14 genes (2 categorical, 8 active only for some boosters:
bench/quality/rbv2_xgboost.toml), target acc at trainsize 1.0 and repl 10, seeds 0, 1, 2, 150 trainings a run. The
incumbent is the best acc among a run's trainings; its normalised regret is (best known - incumbent) / (best
known - median of 20,000 random configurations), best known being the best of those 20,000 and of every run
of the record; reported after 25%, 50% and 100% of the budget, as the mean over tasks and seeds.

    python bench/quality/rbv2_xgboost.py --arms random tpe tpe-mv gp   # .venv-lcbench (yahpo-gym, Optuna)
    .venv-anchors/bin/python bench/quality/rbv2_xgboost.py --arms smac-hpo smac-bb hebo --no-record   # SMAC3, HEBO
    python bench/quality/rbv2_xgboost.py --arms towerlab --jobs 1      # the default on its workers, one run at a time
    python bench/quality/rbv2_xgboost.py --kept-only                   # the record of the kept runs
    python bench/quality/rbv2_xgboost.py --smoke                       # one task, one seed, 15 trainings: the plumbing
    python bench/quality/rbv2_xgboost.py --arms towerlab --kept-only --carry rbv2-xgboost-2026-12-06   # with its anchors
    python bench/quality/rbv2_xgboost.py --held-out 10 --seeds 0 --arms random tpe towerlab   # on kept-out tasks

Runs go --jobs at a time, each on one thread; an arm whose search starts workers of its own (towerlab) runs in
this process, one run at a time, beside --jobs - 1 others. Each run is kept in bench/results/rbv2-runs/
(git-ignored) and reused unless --rerun names its arm; the record is made from the kept runs of the arms
asked: bench/results/quality/rbv2-xgboost-<date>.json, written whole or not at all.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch or numpy read it: one core a run

import argparse
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.record import RESULTS, script_command, write_json, write_record
from bench.quality import rbv2_arms
from bench.quality import rbv2_problem as problem
from bench.quality.rbv2_problem import BUDGET, TASKS

RUNS = RESULTS / "rbv2-runs"
POINTS = (0.25, 0.5, 1.0)
GOAL = 0.01  # issue 73: the default's regret at or below the best anchor's at 50% and 100%, or within this
SLOW = ("hebo", "smac-bb", "gp", "smac-hpo")
_surrogates: dict[str, problem.Surrogate] = {}


def _run(job: tuple[str, str, int, int]) -> dict:
    """One arm on one task and seed (its surrogates kept between runs of the process)."""
    arm, task, seed, budget = job
    if task not in _surrogates:
        _surrogates[task] = problem.Surrogate(task)
    ledger = problem.Ledger(budget)
    started, cpu = time.time(), time.process_time()
    try:
        info = rbv2_arms.ARMS[arm][1](_surrogates[task], seed, ledger)
    except problem.BudgetSpent:
        info = {"sampler_seconds": None}
    return {"arm": arm, "task": task, "seed": seed, "budget": budget, "trainings": ledger.trainings,
            "trace": ledger.trace, "wall_seconds": time.time() - started, "cpu_seconds": time.process_time() - cpu,
            **info}


def _path(runs: Path, arm: str, task: str, seed: int) -> Path:
    return runs / f"{arm}-{task}-{seed}.json"


def _keep(runs: Path, result: dict) -> None:
    write_json(_path(runs, result["arm"], result["task"], result["seed"]), result, indent=None)


def run_all(arms: list[str], tasks: tuple[str, ...], seeds: list[int], budget: int, jobs: int, runs: Path,
            rerun: set[str], kept_only: bool = False) -> list[dict]:
    """Every (arm, task, seed) run, from `runs` where kept there (same budget), else run now."""
    runs.mkdir(parents=True, exist_ok=True)
    wanted = [(a, t, s, budget) for s in seeds for a in arms for t in tasks]
    todo = [j for j in wanted if j[0] in rerun or not _path(runs, *j[:3]).exists()
            or json.loads(_path(runs, *j[:3]).read_text())["budget"] != budget]
    if kept_only:
        wanted, todo = [j for j in wanted if j not in todo], []
    print(f"{len(wanted)} runs, {len(todo)} to run, {jobs} at a time", flush=True)
    todo.sort(key=lambda j: (j[2], j[0] not in SLOW, j[1], j[0]))  # seed by seed, the slow arms first in each
    here = [j for j in todo if j[0] in rbv2_arms.OWN_WORKERS]
    pooled = [j for j in todo if j not in here]
    with multiprocessing.get_context("fork").Pool(max(1, jobs - bool(here))) as pool:
        done = pool.imap_unordered(_run, pooled)
        for n, result in enumerate(itertools.chain(map(_run, here), done), 1):
            _keep(runs, result)
            best = max((a for _, a in result["trace"]), default=None)
            print(f"[{n}/{len(todo)}] {result['arm']} task {result['task']} seed {result['seed']}: best {best}, "
                  f"{result['trainings']} trainings, {result['wall_seconds']:.0f} s", flush=True)
    return [json.loads(_path(runs, *j[:3]).read_text()) for j in wanted]


def regrets(results: list[dict], reference: dict, budget: int, carried: dict | None = None) -> dict:
    """Each arm's regret at POINTS and its curve (every 5 trainings), mean over its runs; best known per task.
    `carried`: an earlier record whose arms are taken as it measured them (one run now too as "ARM-before"),
    and whose best known normalises every arm (a run beyond it scores below 0), so that they compare."""
    best_known = {t: max([reference[t]["best"]] + [a for r in results if r["task"] == t for _, a in r["trace"]])
                  for t in reference} if carried is None else carried["best_known"]

    def at(run: dict, trainings: float) -> float:
        ref = reference[run["task"]]
        return problem.regret(best_known[run["task"]], ref["median"], problem.incumbent(run["trace"], trainings))

    out: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in results):
        mine = [r for r in results if r["arm"] == arm]
        by_seed = {s: [r for r in mine if r["seed"] == s] for s in sorted({r["seed"] for r in mine})}
        seconds = [r["sampler_seconds"] for r in mine if r.get("sampler_seconds") is not None]
        out[arm] = {
            "what": rbv2_arms.ARMS[arm][0],
            "points": {str(p): statistics.fmean(at(r, p * budget) for r in mine) for p in POINTS},
            "standard_error": {str(p): statistics.stdev([at(r, p * budget) for r in mine]) / len(mine) ** 0.5
                               if len(mine) > 1 else None for p in POINTS},
            "per_seed": {str(p): {str(s): statistics.fmean(at(r, p * budget) for r in rs) for s, rs in by_seed.items()}
                         for p in POINTS},
            "per_task": {str(p): {t: statistics.fmean(at(r, p * budget) for r in mine if r["task"] == t)
                                  for t in reference if any(r["task"] == t for r in mine)} for p in POINTS},
            "curve": [statistics.fmean(at(r, n) for r in mine) for n in range(5, budget + 1, 5)],
            "sampler_seconds": statistics.fmean(seconds) if seconds else None,
            "wall_seconds": statistics.fmean(r["wall_seconds"] for r in mine),
            "trainings": statistics.fmean(r["trainings"] for r in mine),
            "runs": len(mine),
            **({"resolved": mine[0]["resolved"]} if "resolved" in mine[0] else {}),
            **({"first_line": mine[0]["first_line"]} if "first_line" in mine[0] else {}),
            # of a search on its workers: how many of its proposals were made quickly, for a worker that waited
            # (gp's by TPE), a run's mean
            **({"quick_proposals": statistics.fmean(r["quick_proposals"] for r in mine)}
               if "quick_proposals" in mine[0] else {}),
            # what each run's first line said of the sampler (one entry: every run said the same)
            **({"said": sorted({line.split(" over space ")[0] for r in mine for line in r["first_line"]})}
               if "first_line" in mine[0] else {}),
        }
    if carried is not None:
        out.update(_carried_arms(carried, set(out)))
    out = {arm: out[arm] for arm in sorted(out, key=lambda arm: arm not in rbv2_arms.ANCHORS)}  # the anchors first
    anchors = [a for a in rbv2_arms.ANCHORS if a in out]
    paired = {}
    # the default, and the former default's runs, each against every anchor and the default against its
    # former runs and its former sampler on the same code ("ARM vs OTHER")
    for arm, others in (("towerlab", (*anchors, "towerlab-tpe", "towerlab-sampler-tpe", "towerlab-serial-gp")),
                        ("towerlab-tpe", (*anchors, "towerlab-sampler-tpe")), ("towerlab-pruned", ("towerlab",))):
        for other in others:
            if arm in out and other in out:
                paired[f"{arm} vs {other}"] = _paired(results, at, budget, arm, other)
    # a carried normalisation's best known, where a run now went beyond it: the task's best acc now
    beyond = {t: best for t in best_known if (best := max((a for r in results if r["task"] == t for _, a in r["trace"]),
                                                         default=best_known[t])) > best_known[t]}
    return {"arms": out, "best_known": best_known, **({"beyond_best_known": beyond} if carried else {}),
            "paired": {k: v for k, v in paired.items() if v}}


def _carried_arms(carried: dict, measured_now: set[str]) -> dict[str, dict]:
    """The arms of the `carried` record as the record that ran them measured them (`carried` names it: the
    carried record, or the one it carried them from, whose best known it normalised by too); one measured now
    too as "ARM-before"."""
    out = {}
    for arm, measured in carried["arms"].items():
        source = measured.get("carried", carried["name"])
        if arm in measured_now:
            out[f"{arm}-before"] = {**measured, "carried": source,
                                    "what": f"{measured['what']}: before, as {source} measured it"}
        else:
            out[arm] = {**measured, "carried": source}
    return out


def _paired(results: list[dict], at: Callable[[dict, float], float], budget: int, arm: str,
            against: str) -> dict | None:
    """`arm`'s regret minus `against`'s on the same tasks and seeds, at POINTS: the mean, its standard error,
    and on how many runs `arm` was lower and higher."""
    theirs = {(r["task"], r["seed"]): r for r in results if r["arm"] == against}
    pairs = [(r, theirs[r["task"], r["seed"]]) for r in results if r["arm"] == arm and (r["task"], r["seed"]) in theirs]
    if len(pairs) < 2:
        return None
    out: dict = {"arm": arm, "against": against, "runs": len(pairs)}
    for p in POINTS:
        d = [at(a, p * budget) - at(b, p * budget) for a, b in pairs]
        out[str(p)] = {"difference": statistics.fmean(d), "standard_error": statistics.stdev(d) / len(d) ** 0.5,
                       "lower": sum(x < 0 for x in d), "higher": sum(x > 0 for x in d)}
    return out


def _seeds(arm: dict) -> str:
    return ", ".join(arm["per_seed"]["1.0"])


def figures(measured: dict, prefix: str = "rbv2") -> list[dict]:
    """Every arm's regret at POINTS; the default's (`towerlab`), the former default's (`towerlab-tpe`), the best
    anchor's at 50% and 100% among the anchors run on every task and seed the default was (those run on fewer
    named in its detail), and the default's gap to it: the goal is a gap of at most GOAL."""
    arms = measured["arms"]
    out = [{"id": f"{prefix}_regret_{arm.replace('-', '_')}_{round(100 * float(p))}", "value": value,
            "detail": {"what": arms[arm]["what"], "per_seed": arms[arm]["per_seed"][p],
                       "standard_error": arms[arm]["standard_error"][p], "runs": arms[arm]["runs"]}}
           for arm in arms for p, value in arms[arm]["points"].items()]
    anchors = [a for a in rbv2_arms.ANCHORS if a in arms]
    default = arms.get("towerlab")
    complete = [a for a in anchors if default is None or (arms[a]["runs"] >= default["runs"]
                                                          and set(arms[a]["per_seed"]["1.0"]) >= set(default["per_seed"]["1.0"]))]
    not_counted = {a: f"{arms[a]['runs']} runs, seed {_seeds(arms[a])}" for a in anchors if a not in complete}
    for p in ("0.25", "0.5", "1.0"):
        pct = round(100 * float(p))
        for arm, fid, what in (("towerlab", "default", "towerlab's default search, on its default workers"),
                               ("towerlab-tpe", "former_default", "towerlab's former default (auto -> tpe for a "
                                                                  "listed gene), on its default workers"),
                               ("towerlab-pruned", "pruned", "towerlab's default search pruned on trainsize (each "
                                                             "evaluation charged its trainsize), on its default workers")):
            if arm in arms:
                out.append({"id": f"{prefix}_regret_{fid}_{pct}", "value": arms[arm]["points"][p],
                            "detail": {"what": what, "arm": arm, "runs": arms[arm]["runs"], "seeds": _seeds(arms[arm]),
                                       "standard_error": arms[arm]["standard_error"][p],
                                       "said": arms[arm].get("said"), **arms[arm].get("resolved", {})}})
        if complete and p != "0.25":
            best = min(complete, key=lambda a: arms[a]["points"][p])
            out.append({"id": f"{prefix}_regret_best_anchor_{pct}", "value": arms[best]["points"][p],
                        "detail": {"anchor": best, "what": arms[best]["what"], "runs": arms[best]["runs"],
                                   "seeds": _seeds(arms[best]), "counted": complete, "not_counted": not_counted}})
            if default is not None:
                gap = default["points"][p] - arms[best]["points"][p]
                out.append({"id": f"{prefix}_default_minus_best_anchor_{pct}", "value": gap,
                            "detail": {"anchor": best, "goal": f"at most {GOAL} (at or below the best anchor, or "
                                                               f"within {GOAL})", "met": gap <= GOAL}})
    return out


def table(measured: dict) -> str:
    lines = ["| arm | 25% | 50% | 100% | sampler CPU s a run | wall s a run | runs |", "| --- " * 7 + "|"]
    for m in measured["arms"].values():
        cells = " | ".join(f"{m['points'][str(p)]:.3f}" for p in POINTS)
        cpu = "-" if m["sampler_seconds"] is None else f"{m['sampler_seconds']:.1f}"
        lines.append(f"| {m['what']} | {cells} | {cpu} | {m['wall_seconds']:.0f} | {m['runs']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="*", default=list(rbv2_arms.RECORDED), choices=list(rbv2_arms.ARMS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (towerlab's workers counted as one)")
    parser.add_argument("--rerun", nargs="*", default=[], help="arms whose kept runs are run again")
    parser.add_argument("--kept-only", action="store_true", help="run nothing: the record of the kept runs")
    parser.add_argument("--no-record", action="store_true", help="run and print, write no record")
    parser.add_argument("--notes", default="", help="what the record should say of how it was measured")
    parser.add_argument("--record", default=None, help="the record's name (default rbv2-xgboost-<date>)")
    parser.add_argument("--smoke", action="store_true", help="task 12, seed 0, 15 trainings; no record")
    parser.add_argument("--held-out", type=int, default=None, metavar="N",
                        help="N of the tasks kept out of every choice instead of the open ones (an independent check)")
    parser.add_argument("--carry", default=None, help="an earlier record (bench/results/quality/NAME.json): its "
                        "arms are taken as it measured them (one run now too as ARM-before), every arm normalised "
                        "by its best known")
    args = parser.parse_args(argv)
    budget = BUDGET // 10 if args.smoke else BUDGET
    if args.smoke:
        args.tasks, args.seeds = [TASKS[0]], [0]
    if args.held_out:
        args.tasks = list(problem.held_out(args.held_out))
    reference = problem.reference(tuple(args.tasks))
    results = run_all(args.arms, tuple(args.tasks), args.seeds, budget, args.jobs,
                      RUNS / ("smoke" if args.smoke else ""), set(args.rerun), args.kept_only)
    carried = None
    if args.carry:
        carried = {"name": args.carry, **json.loads((RESULTS / "quality" / f"{args.carry}.json").read_text())}
    measured = regrets(results, reference, budget, carried)
    print(table(measured))
    if args.smoke or args.no_record:
        return 0
    from bench.common.machine import describe  # imports torch

    name = args.record or f"rbv2-xgboost-{time.strftime('%Y-%m-%d')}"
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe(),
              "command": script_command(__file__, argv), "tasks": args.tasks, "seeds": args.seeds,
              "budget_trainings": budget, "fidelity": problem.FIDELITY, "space": "bench/quality/rbv2_xgboost.toml",
              "points": list(POINTS), "notes": args.notes, "reference": reference, "carried_from": args.carry,
              **measured,
              "figures": figures(measured, "rbv2_held_out" if args.held_out else "rbv2")}
    write_record(RESULTS / "quality", f"{name}.json", record)
    print(f"wrote bench/results/quality/{name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
