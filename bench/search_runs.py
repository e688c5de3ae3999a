"""What the search benchmarks share: one real search command per run, its evaluations read back
from its own store (`towerlab search show --json` would give the same records), best-so-far curves,
and the statistics of a table (mean +- sd over seeds, a permutation test between two methods)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

import machine
import measure

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


RUN_RECORD = "bench-run.json"  # the command and wall seconds of a finished run, beside its summary


def run_search(command: list[str], flags: list[str], out: Path, data_dir: str, *, reuse: bool = False) -> dict:
    """`towerlab <command> <flags>` into `out` (replaced, unless `reuse` finds the same command
    finished there); its summary, its evaluations (in the order they finished) and the wall seconds
    of the whole process."""
    cmd = [sys.executable, "-m", "towerlab", *command, *flags, "--data-dir", data_dir, "--no-progress", "--out", str(out)]
    done = out / RUN_RECORD
    if reuse and done.exists() and json.loads(done.read_text())["command"] == ["towerlab", *command, *flags]:
        wall = json.loads(done.read_text())["wall_seconds"]
    else:
        if out.exists():
            import shutil

            shutil.rmtree(out)
        started = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "MPLBACKEND": "Agg"})
        wall = time.perf_counter() - started
        done.write_text(json.dumps({"command": ["towerlab", *command, *flags], "wall_seconds": wall}))
    summary = json.loads((out / "summary.json").read_text())
    from towerlab.search import evaluation_records

    records = [r for r in evaluation_records(out / "search.db") if r["search"] == summary["search_id"]]
    return {"command": ["towerlab", *command, *flags], "summary": summary, "records": records, "wall_seconds": wall}


def best_so_far(records: list[dict], max_epochs: Optional[int] = None) -> list[tuple[float, float, int]]:
    """(training seconds spent, best validation accuracy so far, evaluations so far) after each new
    evaluation at `max_epochs` (None: any); every training counts in the seconds (every rung, every
    re-measure), only first measurements count as evaluations."""
    spent, best, count, curve = 0.0, None, 0, []
    for r in records:
        spent += r["seconds"]
        if r["replicate"] or (max_epochs is not None and r["max_epochs"] != max_epochs):
            continue
        count += 1
        if r["status"] == "ok":
            best = r["val_accuracy"] if best is None else max(best, r["val_accuracy"])
        if best is not None:
            curve.append((spent, best, count))
    return curve


def best_at(curve: list[tuple[float, float, int]], evaluations: int) -> Optional[float]:
    """The best accuracy among the first `evaluations` evaluations."""
    values = [best for _, best, count in curve if count <= evaluations]
    return values[-1] if values else None


def seconds_to_reach(curve: list[tuple[float, float, int]], target: float) -> Optional[float]:
    return next((spent for spent, best, _ in curve if best >= target), None)


def mean_sd(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    return {"mean": statistics.fmean(xs) if xs else None, "sd": statistics.stdev(xs) if len(xs) > 1 else None,
            "n": len(xs), "values": xs}


def permutation_p(a: list[float], b: list[float], *, samples: int = 20000, seed: int = 0) -> Optional[float]:
    """Two-sided p-value of the difference of means of `a` and `b` under random relabelling: exact
    when the relabellings are few, else `samples` of them drawn with a fixed seed."""
    if len(a) < 2 or len(b) < 2:
        return None
    pooled, n = np.array(a + b, dtype=float), len(a)
    observed = abs(np.mean(a) - np.mean(b))
    total = pooled.sum()
    if math.comb(len(pooled), n) <= samples:
        picks = [list(c) for c in itertools.combinations(range(len(pooled)), n)]
    else:
        rng = np.random.default_rng(seed)
        picks = [rng.choice(len(pooled), n, replace=False) for _ in range(samples)]
    hits = 0
    for pick in picks:
        first = pooled[pick].sum()
        if abs(first / n - (total - first) / (len(pooled) - n)) >= observed - 1e-12:
            hits += 1
    return hits / len(picks)


def pct(stat: dict) -> str:
    if stat["mean"] is None:
        return "-"
    return f"{100 * stat['mean']:.2f}%" + (f" +- {100 * stat['sd']:.2f}" if stat["sd"] is not None else "")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the runs happen and where their records go."""
    parser.add_argument("--devices", type=int, default=2, help="CPU worker processes")
    parser.add_argument("--threads", type=int, default=1, help="threads per worker")
    parser.add_argument("--data-dir", default=measure.default_data_dir())
    parser.add_argument("--out-dir", default=None,
                        help="where the record and the runs' folders go (default: bench/results; --smoke: "
                             "bench/results/quick, not committed)")
    parser.add_argument("--reuse", action="store_true",
                        help="take runs that finished in an earlier invocation (same command) from their folders")


def out_dir(args: argparse.Namespace) -> Path:
    """--out-dir, else bench/results (a smoke run's: bench/results/quick, which git ignores)."""
    return Path(args.out_dir) if args.out_dir else BENCH / "results" / ("quick" if args.smoke else "")


def save(out_dir: str | Path, kind: str, dataset: str, record: dict) -> None:
    print(machine.write_record(out_dir, f"{kind}-{dataset}-{time.strftime('%Y-%m-%d')}.json", record))
