"""Search quality on a published benchmark (issue 64, item 6): YAHPO Gym's LCBench surrogate, its 10
open tasks (../shared/data/lcbench/OPEN.md; the other 24 only with --held-out), seeds 0, 1, 2, a budget
of 5,200 epochs a run (100 full trainings' worth; every rung and re-measure counted, a restarted
training charged its whole length). The incumbent is the best validation accuracy among trainings
of the full 52 epochs; its normalised regret is (best known - incumbent) / (best known - median of
20,000 random configurations at 52 epochs), best known being the best of those 20,000 and of every
run of the record; reported after 25%, 50% and 100% of the budget, as the mean over tasks and seeds.

    pip install yahpo-gym onnxruntime dehb greenlet    # besides towerlab[tpe]: the bench's own needs
    python bench/quality/lcbench.py                  # every arm (bench/quality/lcbench_arms.py): the record, its plot
    python bench/quality/lcbench.py --arms gp towerlab --seeds 0   # some arms (each run is kept: see --rerun)
    python bench/quality/lcbench.py --smoke          # one task, one seed, a tenth of the budget: the plumbing
    python bench/quality/lcbench.py --held-out --arms gp towerlab-serial   # the 24 other tasks: a change tuned on
                                             # the 10 checked where it was not (lcbench-held-out-<date>)

Runs go two at a time (--jobs), each on one thread. Each run's trace is kept in
bench/results/lcbench-runs/ (git-ignored) and reused unless --rerun names its arm; the record is made
from the kept runs of the arms asked: bench/results/quality/lcbench-<date>.json and lcbench-<date>.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch (Optuna's GPSampler) reads it: one core a run

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

from bench.quality import lcbench_arms
from bench.quality import lcbench_problem as problem
from bench.quality.lcbench_problem import BUDGET, FULL, TASKS
from bench.common.record import RESULTS, script_command, write_json, write_record

RUNS = RESULTS / "lcbench-runs"
POINTS = (0.25, 0.5, 1.0)
# a Gaussian process proposes
SLOW = ("gp", "towerlab-serial", "towerlab-serial-int", "towerlab-p2", "towerlab-before", "towerlab-m1", "towerlab-m4")
PRUNED = (1, 4)  # the pruned default's --min-epochs: arms towerlab-m1, towerlab-m4 (and -api, through its workers)
_surrogates: dict[str, problem.Surrogate] = {}


def _run(job: tuple[str, str, int, int]) -> dict:
    """One arm on one task and seed, in a pool's process (its surrogates kept between runs)."""
    arm, task, seed, budget = job
    if task not in _surrogates:
        _surrogates[task] = problem.Surrogate(task)
    ledger = problem.Ledger(budget)
    started, cpu = time.time(), time.process_time()
    info = lcbench_arms.ARMS[arm][1](_surrogates[task], seed, ledger)
    return {"arm": arm, "task": task, "seed": seed, "budget": budget, "spent": ledger.spent,
            "trainings": ledger.trainings, "full_trainings": len(ledger.trace), "trace": ledger.trace,
            "wall_seconds": time.time() - started, "cpu_seconds": time.process_time() - cpu, **info}


def _path(runs: Path, arm: str, task: str, seed: int) -> Path:
    return runs / f"{arm}-{task}-{seed}.json"


def run_all(arms: list[str], tasks: tuple[str, ...], seeds: list[int], budget: int, jobs: int, runs: Path,
            rerun: set[str], kept_only: bool = False) -> list[dict]:
    """Every (arm, task, seed) run, from `runs` where kept there (same budget), else run now."""
    runs.mkdir(parents=True, exist_ok=True)
    wanted = [(a, t, s, budget) for a in arms for t in tasks for s in seeds]
    todo = [j for j in wanted if j[0] in rerun or not _path(runs, *j[:3]).exists()
            or json.loads(_path(runs, *j[:3]).read_text())["budget"] != budget]
    if kept_only:  # the record of what is kept: an arm measured on fewer seeds counts its own runs
        wanted, todo = [j for j in wanted if j not in todo], []
    print(f"{len(wanted)} runs, {len(todo)} to run on {jobs} processes", flush=True)
    # the slow arms first, so that the pool's last minutes are not one long run
    todo.sort(key=lambda j: (j[0] not in SLOW, j[2], j[1], j[0]))  # seed by seed: a partial record pairs its arms
    # an arm that starts worker processes of its own runs here, one run at a time (a pool's processes
    # are daemons, which may not start any)
    here = [j for j in todo if j[0] in lcbench_arms.OWN_WORKERS]
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        done = pool.imap_unordered(_run, [j for j in todo if j not in here])
        for n, result in enumerate(itertools.chain(map(_run, here), done), 1):
            write_json(_path(runs, result["arm"], result["task"], result["seed"]), result, indent=None)
            best = max((a for _, a in result["trace"]), default=None)
            print(f"[{n}/{len(todo)}] {result['arm']} task {result['task']} seed {result['seed']}: best {best}, "
                  f"{result['trainings']} trainings, {result['wall_seconds']:.0f} s", flush=True)
    return [json.loads(_path(runs, *j[:3]).read_text()) for j in wanted]


def regrets(results: list[dict], reference: dict, budget: int, known: dict | None = None) -> dict:
    """Each arm's regret at POINTS and its curve (every 52 epochs), mean over its runs; best known per task
    (`known`: a record's best known too, so that this record's regrets are on its scale)."""
    best_known = {t: max([reference[t]["best"], *([known[t]] if known and t in known else [])]
                         + [a for r in results if r["task"] == t for _, a in r["trace"]])
                  for t in reference}

    def at(run: dict, epochs: float) -> float:
        ref = reference[run["task"]]
        return problem.regret(best_known[run["task"]], ref["median"], problem.incumbent(run["trace"], epochs))

    out: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in results):
        mine = [r for r in results if r["arm"] == arm]
        by_seed = {s: [r for r in mine if r["seed"] == s] for s in sorted({r["seed"] for r in mine})}
        out[arm] = {
            "what": lcbench_arms.ARMS[arm][0],
            "points": {str(p): statistics.fmean(at(r, p * budget) for r in mine) for p in POINTS},
            # the standard error of that mean (runs differ by task and seed: the spread a comparison is up against)
            "standard_error": {str(p): statistics.stdev([at(r, p * budget) for r in mine]) / len(mine) ** 0.5
                               if len(mine) > 1 else None for p in POINTS},
            "per_seed": {str(p): {str(s): statistics.fmean(at(r, p * budget) for r in rs) for s, rs in by_seed.items()}
                         for p in POINTS},
            "per_task": {str(p): {t: statistics.fmean(at(r, p * budget) for r in mine if r["task"] == t)
                                  for t in reference if any(r["task"] == t for r in mine)} for p in POINTS},
            "curve": [statistics.fmean(at(r, e) for r in mine) for e in range(FULL, budget + 1, FULL)],
            "no_full_training": {str(p): sum(problem.incumbent(r["trace"], p * budget) is None for r in mine)
                                 for p in POINTS},
            # the CPU its proposing took (None where the search runs in processes of its own: its wall time instead)
            "sampler_seconds": None if mine[0]["sampler_seconds"] is None else
            statistics.fmean(r["sampler_seconds"] for r in mine),
            "wall_seconds": statistics.fmean(r["wall_seconds"] for r in mine),
            "trainings": statistics.fmean(r["trainings"] for r in mine),
            "full_trainings": statistics.fmean(r["full_trainings"] for r in mine),
            "runs": len(mine),
            **({"resolved": mine[0]["resolved"]} if "resolved" in mine[0] else {}),
        }
    return {"arms": out, "best_known": best_known, "same": same_history(results, at, budget),
            # the pruned default (min_epochs 1 and 4) through its workers beside the same played in one process,
            # and against the unpruned default on the same tasks and seeds
            **{f"same_pruned_m{m}": same_history(results, at, budget, f"towerlab-m{m}-api", f"towerlab-m{m}")
               for m in PRUNED},
            **{f"pruned_m{m}_against_unpruned": paired(results, at, budget, f"towerlab-m{m}", "towerlab-serial")
               for m in PRUNED},
            # ... and as a user runs both, each on its default workers
            **{f"pruned_m{m}_api_against_unpruned_api": paired(results, at, budget, f"towerlab-m{m}-api", "towerlab")
               for m in PRUNED},
            "against_before": paired(results, at, budget, "towerlab-serial", "towerlab-before"),
            "against_p2": paired(results, at, budget, "towerlab-serial", "towerlab-p2"),
            "against_gp": paired(results, at, budget, "towerlab-serial", "gp"),
            # the default as a user runs it (its 2 workers, each proposal made with a training in flight) beside it
            # played in one process (nothing in flight) and beside GPSampler; ints modelled value by value beside it
            "api_against_serial": paired(results, at, budget, "towerlab", "towerlab-serial"),
            "api_against_gp": paired(results, at, budget, "towerlab", "gp"),
            "int_against_serial": paired(results, at, budget, "towerlab-serial-int", "towerlab-serial")}


def paired(results: list[dict], at: Callable[[dict, float], float], budget: int, arm: str, against: str) -> dict | None:
    """`arm`'s regret minus `against`'s on the same tasks and seeds, at POINTS: the mean, its standard error, and
    on how many runs `arm` was lower and higher."""
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


def same_history(results: list[dict], at: Callable[[dict, float], float], budget: int, workers: str = "towerlab",
                 serial: str = "towerlab-serial") -> dict | None:
    """The runs of a search through its workers (`workers`: the default's, towerlab) beside the same task and seed
    played in one process (`serial`: towerlab-serial): how many, and on how many the genomes proposed, and the
    regrets at POINTS (`at`), are equal.
    (The workers' trace is their rows in the order they finished, the one process's in the order it trained
    them: two members of a generation may swap.)"""
    played = {(r["task"], r["seed"]): r for r in results if r["arm"] == serial}
    pairs = [(r, played[r["task"], r["seed"]]) for r in results
             if r["arm"] == workers and (r["task"], r["seed"]) in played]
    if not pairs:
        return None
    return {"runs": len(pairs), "same_genomes": sum(a["genomes"] == b["genomes"] for a, b in pairs),
            "same_regrets": sum(all(abs(at(a, p * budget) - at(b, p * budget)) < 1e-9 for p in POINTS) for a, b in pairs)}


def figures(measured: dict, prefix: str = "lcbench") -> list[dict]:
    arms = measured["arms"]
    out = [{"id": f"{prefix}_regret_{arm.replace('-', '_')}_{round(100 * float(p))}", "value": value,
            "detail": {"what": lcbench_arms.ARMS[arm][0], "per_seed": arms[arm]["per_seed"][p],
                       "sampler_seconds_per_run": arms[arm]["sampler_seconds"]}}
           for arm in arms for p, value in arms[arm]["points"].items()]
    anchors = [a for a in lcbench_arms.ANCHORS if a in arms]
    default = _as_run(arms, "towerlab", "towerlab-serial")
    for p in ("0.5", "1.0"):
        pct = round(100 * float(p))
        if default is not None:
            out.append({"id": f"{prefix}_regret_default_{pct}", "value": arms[default]["points"][p],
                        "detail": {"what": "towerlab's default search", "arm": default, "runs": arms[default]["runs"],
                                   "same_as_its_workers": measured.get("same"), **arms[default].get("resolved", {})}})
        if anchors:
            best = min(anchors, key=lambda a: arms[a]["points"][p])
            out.append({"id": f"{prefix}_regret_best_anchor_{pct}", "value": arms[best]["points"][p],
                        "detail": {"anchor": best, "what": lcbench_arms.ARMS[best][0]}})
    for m in PRUNED:  # the pruned default's (--min-epochs 1 and 4), chosen as the default's is
        if (arm := _as_run(arms, f"towerlab-m{m}-api", f"towerlab-m{m}")) is None:
            continue
        out += [{"id": f"{prefix}_regret_pruned_m{m}_{round(100 * float(p))}", "value": value,
                 "detail": {"what": lcbench_arms.ARMS[arm][0], "arm": arm, "runs": arms[arm]["runs"],
                            "same_as_its_workers": measured.get(f"same_pruned_m{m}"), **arms[arm].get("resolved", {})}}
                for p, value in arms[arm]["points"].items()]
    return out


def _as_run(arms: dict, workers: str, serial: str) -> str | None:
    """Which arm gives a towerlab search's figure: its runs as a user runs it, on its default workers (`workers`),
    where the record has at least as many of them as of its runs played in one process (`serial`): an asynchronous
    search's history depends on what was in flight at each proposal, and one process has nothing in flight (the
    record's `same` entries say on how many runs the two were compared and found equal); else `serial`; None where
    the record has neither."""
    runs = {arm: arms[arm]["runs"] for arm in (workers, serial) if arm in arms}
    return max(runs, key=lambda arm: (runs[arm], arm == workers), default=None)


def table(measured: dict) -> str:
    lines = ["| arm | 25% | 50% | 100% | trainings | sampler CPU s a run | runs |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for arm, m in measured["arms"].items():
        cells = " | ".join(f"{m['points'][str(p)]:.3f}" for p in POINTS)
        cpu = "-" if m["sampler_seconds"] is None else f"{m['sampler_seconds']:.1f}"
        lines.append(f"| {lcbench_arms.ARMS[arm][0]} | {cells} | {m['trainings']:.0f} | {cpu} | {m['runs']} |")
    return "\n".join(lines)


def plot(measured: dict, budget: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    epochs = list(range(FULL, budget + 1, FULL))
    default = "towerlab-serial" if "towerlab-serial" in measured["arms"] else "towerlab"
    for arm, m in measured["arms"].items():
        style = {"linewidth": 2.5, "color": "black"} if arm == default else {"linewidth": 1.2}
        if arm == "towerlab" and arm != default:
            style["linestyle"] = ":"
        ax.plot(epochs, m["curve"], label=f"{lcbench_arms.ARMS[arm][0]} ({m['runs']} runs)", **style)
    ax.set(xlabel="epochs spent (all trainings)", ylabel="normalised regret (mean over tasks and seeds)",
           yscale="log", title=f"LCBench (YAHPO Gym), {title}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="*", default=list(lcbench_arms.RECORDED), choices=list(lcbench_arms.ARMS))
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--budget", type=int, default=BUDGET, help="epochs a run may give its trainings")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, one process each")
    parser.add_argument("--rerun", nargs="*", default=[], help="arms whose kept runs are run again")
    parser.add_argument("--kept-only", action="store_true", help="run nothing: the record of the kept runs")
    parser.add_argument("--notes", default="", help="what the record should say of how it was measured")
    parser.add_argument("--record", default=None, help="the record's name (default lcbench-<date>); none with --smoke")
    parser.add_argument("--smoke", action="store_true", help="task 3945, seed 0, 520 epochs; no record")
    parser.add_argument("--prefix", default=None, help="the figures' ids' prefix (default lcbench, or lcbench_held_out)")
    parser.add_argument("--against", default=None, help="a record in bench/results/quality whose best known each task's "
                        "regret counts too: this record's arms on the same scale as that record's")
    parser.add_argument("--held-out", action="store_true",
                        help="the 24 tasks kept out of the 10 (their own runs and record): the check of a change")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tasks, args.seeds, args.budget = [TASKS[0]], [0], BUDGET // 10
    if args.held_out:
        args.tasks = list(problem.held_out())
    runs = RUNS / ("smoke" if args.smoke else "held-out" if args.held_out else "")
    kind = "held-out" if args.held_out else "open"
    reference = problem.reference(tuple(args.tasks))
    results = run_all(args.arms, tuple(args.tasks), args.seeds, args.budget, args.jobs, runs, set(args.rerun),
                      args.kept_only)
    known = json.loads((RESULTS / "quality" / args.against).read_text())["best_known"] if args.against else None
    measured = regrets(results, reference, args.budget, known)
    print(table(measured))
    if args.smoke:
        return 0
    name = args.record or f"lcbench-{'held-out-' if args.held_out else ''}{time.strftime('%Y-%m-%d')}"
    from bench.common.machine import describe  # imports torch

    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe(), "command": script_command(__file__),
              "tasks": args.tasks, "seeds": args.seeds, "budget_epochs": args.budget, "full_epochs": FULL,
              "points": list(POINTS), "notes": args.notes, "against": args.against, "reference": reference, **measured,
              "figures": figures(measured, args.prefix or ("lcbench_held_out" if args.held_out else "lcbench"))}
    write_record(RESULTS / "quality", f"{name}.json", record)
    plot(measured, args.budget, RESULTS / "quality" / f"{name}.png",
         f"{len(args.tasks)} {kind} tasks, {len(args.seeds)} seed{'s' * (len(args.seeds) != 1)}")
    print(f"wrote bench/results/quality/{name}.json and {name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
