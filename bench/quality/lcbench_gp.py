"""towerlab's gp sampler on LCBench, two questions bench/quality/lcbench.py does not ask:

    python bench/quality/lcbench_gp.py cpu        # its CPU seconds per proposal after 100 .. 1,000 outcomes
    python bench/quality/lcbench_gp.py numerics   # does a replay whose floating point differs propose the same?

`cpu`: a history of N outcomes (random configurations of task 3945, at 52 epochs), then three
generations proposed one after the other (each asked with the one before in flight, as a search asks
them), on one thread; the median CPU seconds of a proposal of one genome, for each N.

`numerics`: a gp search of 100 trainings on each open task (seed 0), played twice in fresh processes
that differ only in their numerics: Optuna's L-BFGS-B batched through greenlet or run one start at a
time (the same optimum, other rounding in the last bits, as another machine's BLAS would give). The
first generation whose members differ, if any, for each rounding of float genes (`--digits`).
Writes bench/results/quality/lcbench-gp-<what>-<date>.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.quality import lcbench_problem as problem
from bench.quality.lcbench_problem import FULL, SPACE, TASKS
from bench.common.record import RESULTS, figure, script_command, write_record


def history_of(n: int, surrogate: problem.Surrogate, rng: np.random.Generator) -> list:
    from towerlab.search import random_genome
    from towerlab.search.history import Generation, Member, statistics_of
    from towerlab.search.space import genome_hash

    genomes = [random_genome(rng, SPACE) for _ in range(n)]
    scores = surrogate.full(genomes) / 100
    members = [Member(i, g, genome_hash(g), "ok", float(s), None, FULL, 0.0, 0, "evaluated", score=float(s))
               for i, (g, s) in enumerate(zip(genomes, scores))]
    return [Generation(0, tuple(members), statistics_of(0, members, 0.0, 0.0))]


def cpu(sizes: list[int]) -> dict:
    from towerlab.config import SearchConfig
    from towerlab.search.samplers import InFlight
    from towerlab.search.samplers.gp import GPSampler

    surrogate, rows = problem.Surrogate(TASKS[0]), []
    for n in sizes:
        sampler = GPSampler(SearchConfig(sampler="gp", seed=0), SPACE, 1)
        history, in_flight, seconds = history_of(n, surrogate, np.random.default_rng(n)), None, []
        for _ in range(3):
            started = time.process_time()
            genomes = sampler.propose(history, in_flight)
            seconds.append((time.process_time() - started) / len(genomes))
            in_flight = InFlight(tuple(genomes), len(genomes))
        rows.append({"outcomes": n, "seconds_per_proposal": statistics.median(seconds), "samples": seconds})
        print(f"{n} outcomes: {rows[-1]['seconds_per_proposal']:.2f} s a proposal", flush=True)
    return {"rows": rows}


def _play(job: tuple[str, int, bool]) -> list[list[str]]:
    """The members of each generation of a gp search of 100 trainings, without greenlet if asked."""
    task, digits, greenlet = job
    if not greenlet:
        sys.modules["greenlet"] = None  # type: ignore[assignment]  # import greenlet now fails: Optuna falls back
    from towerlab.config import SearchConfig
    from towerlab.search import Candidate, Outcome, Search, serial
    from towerlab.search.samplers import gp
    from towerlab.search.store import Store

    gp.DIGITS = digits
    surrogate = problem.Surrogate(task)
    search = Search.resolve(SearchConfig(sampler="gp", seed=0, max_epochs=FULL, generations=1000,
                                         max_evaluations=100, remeasure=0, top=1), SPACE)
    with tempfile.TemporaryDirectory() as folder, Store(Path(folder) / "s.db") as store:
        def fitness(candidate: Candidate) -> Outcome:
            return Outcome.ok(surrogate.at(candidate.genome, FULL) / 100, epochs=FULL)

        result = search.create(store, "numerics").run(store, serial(fitness))
        return [[m.genome_hash for m in g.members] for g in result.history]


def numerics(digits: list[int], tasks: tuple[str, ...], jobs: int) -> dict:
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: greenlet imported or refused
    rows = []
    with ctx.Pool(jobs, maxtasksperchild=1) as pool:
        for d in digits:
            jobs_ = [(t, d, g) for t in tasks for g in (True, False)]
            played = dict(zip(jobs_, pool.map(_play, jobs_)))
            for t in tasks:
                a, b = played[(t, d, True)], played[(t, d, False)]
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                rows.append({"task": t, "digits": d, "generations": len(a), "first_differing_generation": first})
                print(f"digits {d} task {t}: {'same' if first is None else f'differ from generation {first}'}",
                      flush=True)
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("cpu", "numerics"))
    parser.add_argument("--sizes", nargs="*", type=int, default=[100, 250, 500, 1000])
    parser.add_argument("--digits", nargs="*", type=int, default=[8])
    parser.add_argument("--tasks", type=int, default=len(TASKS), help="numerics: the first N open tasks")
    parser.add_argument("--record", default=None, help="the record's name (default lcbench-gp-WHAT-<date>)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    measured = cpu(args.sizes) if args.what == "cpu" else numerics(args.digits, TASKS[:args.tasks], args.jobs)
    from bench.common.machine import describe

    name = f"{args.record or f'lcbench-gp-{args.what}-' + time.strftime('%Y-%m-%d')}.json"
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe(),
              "command": script_command(__file__), **measured, "figures": figures(args.what, measured["rows"])}
    print(f"wrote {write_record(RESULTS / 'quality', name, record)}")
    return 0


def figures(what: str, rows: list[dict]) -> list[dict]:
    """cpu: the median CPU seconds of a proposal after each number of outcomes; numerics: for each rounding,
    how many tasks' replays proposed otherwise (the first generation that differs, by task, in the detail)."""
    if what == "cpu":
        return [figure(f"seconds_per_proposal_{r['outcomes']}", r["seconds_per_proposal"], {"outcomes": r["outcomes"]})
                for r in rows]
    return [figure(f"replays_that_differ_digits{d}", sum(r["first_differing_generation"] is not None for r in mine),
                   {"tasks": len(mine), "first_differing_generation": {r["task"]: r["first_differing_generation"]
                                                                       for r in mine}})
            for d in dict.fromkeys(r["digits"] for r in rows) for mine in [[r for r in rows if r["digits"] == d]]]


if __name__ == "__main__":
    sys.exit(main())
