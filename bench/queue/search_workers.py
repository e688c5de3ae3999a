"""A real search on 1 and on 2 CPU workers, and a worker that joins one: evaluations a minute, whole
commands timed, and the seconds a joining worker takes from its start to its first candidate.

Each side is `towerlab search run` on MNIST (random sampler, one-epoch MLPs, no re-measures, the top
one tested), `--devices 1` against `--devices 2`, alternated over `--rounds`; a figure is the median
ratio. Evaluations a minute count the search's evaluations over the command's whole wall time,
start-up and the test retraining included. The join: a search on one worker, and once its first
generation is complete, `towerlab search worker DIR` started beside it; its first claim's time (the
store's clock, which is this machine's) less its start.

    python bench/queue/search_workers.py                     # MNIST, 24 evaluations, 3 rounds (~15 min on 2 cores)
    python bench/queue/search_workers.py --rounds 1 --population 4 --generations 2   # a quick look

Writes bench/results/queue/search-workers-<date>.json (figures `search_two_workers` and `worker_join_seconds`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.machine import describe
from bench.common.measure import child_env, default_data_dir, shown, timed
from bench.common.record import REPO, RESULTS, script_command, write_record


def search_command(out: Path, args: argparse.Namespace, devices: int) -> list[str]:
    return [sys.executable, "-m", "towerlab", "search", "run", "--sampler", "random", "--dataset", "mnist",
            "--data-dir", args.data_dir, "--population", str(args.population), "--generations", str(args.generations),
            "--max-epochs", "1", "--remeasure", "0", "--top", "1", "--seed", str(args.seed), "--device", "cpu",
            "--devices", str(devices), "--threads", "1", "--no-progress", "--out", str(out)]


def one_search(folder: Path, args: argparse.Namespace, devices: int) -> dict:
    out = folder / f"d{devices}-{time.monotonic_ns()}"
    command = search_command(out, args, devices)
    wall, _, cpu = timed(command)
    summary = json.loads((out / "summary.json").read_text())
    return {"devices": devices, "wall_seconds": wall, "evaluations": summary["evaluations"],
            "per_minute": 60 * summary["evaluations"] / wall, "train_seconds": summary["train_seconds"],
            "cpu": cpu, "command": ["towerlab", *shown(command[3:-1], data_dir=args.data_dir), "DIR"]}


def first_claim(store: Path, other_than: set[str]) -> float | None:
    with contextlib.suppress(sqlite3.Error), contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT worker, MIN(claimed) FROM tasks WHERE claimed IS NOT NULL GROUP BY worker").fetchall()
        times = [t for worker, t in rows if worker not in other_than]
        return min(times) if times else None
    return None


def join(folder: Path, args: argparse.Namespace) -> dict:
    """Seconds from a joining worker's start to its first claimed task."""
    out = folder / f"join-{time.monotonic_ns()}"
    job = subprocess.Popen(search_command(out, args, 1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=child_env(), cwd=REPO)
    try:
        store = out / "search.db"
        while True:
            with contextlib.suppress(sqlite3.Error), contextlib.closing(
                    sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as db:
                if db.execute("SELECT COUNT(*) FROM generations WHERE complete = 1").fetchone()[0]:
                    job_workers = {w for (w,) in db.execute("SELECT DISTINCT worker FROM tasks WHERE worker IS NOT NULL")}
                    break
            if job.poll() is not None:
                raise RuntimeError("the search ended before its first generation was complete: give it more")
            time.sleep(0.05)
        started = time.time()
        worker = subprocess.Popen([sys.executable, "-m", "towerlab", "search", "worker", str(out), "--device", "cpu",
                                   "--devices", "1", "--data-dir", args.data_dir],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=child_env(), cwd=REPO)
        claimed = None
        while claimed is None and worker.poll() is None:
            claimed = first_claim(store, job_workers)
            time.sleep(0.02)
        worker.wait(timeout=600)
        job.wait(timeout=600)
    finally:
        for p in (job,):
            if p.poll() is None:
                p.kill()
    if claimed is None:
        raise RuntimeError("the joining worker claimed nothing: the search left it no work")
    return {"seconds": claimed - started}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--generations", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", default=default_data_dir())
    parser.add_argument("--out-dir", default=str(RESULTS / "queue"))
    args = parser.parse_args(argv)
    samples: dict[str, list[dict]] = {"one": [], "two": [], "join": []}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):
            samples["one"].append(one_search(Path(folder), args, 1))
            samples["two"].append(one_search(Path(folder), args, 2))
            samples["join"].append(join(Path(folder), args))
            print(f"1 worker {samples['one'][-1]['per_minute']:.1f}/min, 2 workers {samples['two'][-1]['per_minute']:.1f}/min, "
                  f"join {samples['join'][-1]['seconds']:.2f} s", flush=True)
    ratios = [b["per_minute"] / a["per_minute"] for a, b in zip(samples["one"], samples["two"])]
    ratio = statistics.median(ratios)
    joins = [s["seconds"] for s in samples["join"]]
    record = {"suite": "search-workers", "date": datetime.date.today().isoformat(), "machine": describe(),
              "command": script_command(__file__, argv),
              "figures": [
                  {"id": "search_two_workers", "title": "search evaluations/min, 2 CPU workers over 1 (whole commands)",
                   "target": ">= 1.8x", "target_value": 1.8, "value": ratio, "unit": "x", "met": ratio >= 1.8,
                   "detail": {"per_round": ratios,
                              "one_per_minute": statistics.median(s["per_minute"] for s in samples["one"]),
                              "two_per_minute": statistics.median(s["per_minute"] for s in samples["two"])},
                   "samples": {"one": samples["one"], "two": samples["two"]}},
                  {"id": "worker_join_seconds", "title": "seconds from `towerlab search worker` to its first candidate",
                   "value": statistics.median(joins), "unit": "s", "detail": {"per_round": joins}}]}
    path = write_record(args.out_dir, f"search-workers-{record['date']}.json", record)
    print(f"2 workers: x{ratio:.2f}; a joining worker's first candidate after {statistics.median(joins):.2f} s; "
          f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
