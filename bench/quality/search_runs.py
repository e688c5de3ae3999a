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
from datetime import datetime
from pathlib import Path
from typing import Optional

import numpy as np

from bench.common import measure
from bench.common.record import REPO, RESULTS, write_json, write_record



# Beside a run's summary: its command, the wall seconds of the parts an interruption ended, when the
# current part started, and (once finished) the whole run's wall seconds.
RUN_RECORD = "bench-run.json"


def run_search(command: list[str], flags: list[str], out: Path, data_dir: str, *, reuse: bool = False) -> dict:
    """`towerlab <command> <flags>` into `out`: replaced, unless `reuse` finds the same command there,
    finished (read back) or interrupted (continued with `--resume`, keeping every training it
    recorded). Its summary, its evaluations (in the order they finished) and its wall seconds: the
    whole process's, or a continued run's parts added up, an interrupted part counted up to the last
    evaluation it recorded (the trainings it was in the middle of are done again in the next part)."""
    given = ["towerlab", *command, *flags]
    cmd = [sys.executable, "-m", "towerlab", *command, *flags, "--data-dir", data_dir, "--no-progress", "--out", str(out)]
    path = out / RUN_RECORD
    record = json.loads(path.read_text()) if reuse and path.exists() else {}
    if record.get("command") != given:
        record = {}
    if "wall_seconds" not in record:  # not finished here: continue an interrupted run, else start afresh
        if record and (out / "config.json").exists():
            record["parts"].append(_kept_seconds(out, record["started"]))
            cmd += ["--resume", str(out)]
        else:
            if out.exists():
                import shutil

                shutil.rmtree(out)
            record = {"command": given, "parts": []}
        record["started"] = time.time()
        search = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "MPLBACKEND": "Agg"})
        while search.poll() is None and not (out / "config.json").exists():
            time.sleep(0.5)  # the record goes in once the search has made its folder its own
        if (out / "config.json").exists():
            write_json(path, record, indent=None)
        if search.wait() != 0:
            raise subprocess.CalledProcessError(search.returncode, cmd)
        record["wall_seconds"] = sum(record["parts"]) + time.time() - record["started"]
        write_json(path, record, indent=None)
    summary = json.loads((out / "summary.json").read_text())
    from towerlab.search import evaluation_records

    records = [r for r in evaluation_records(out / "search.db") if r["search"] == summary["search_id"]]
    return {"command": given, "summary": summary, "records": records, "wall_seconds": record["wall_seconds"],
            "parts": len(record.get("parts", [])) + 1}


def _kept_seconds(out: Path, started: float) -> float:
    """The wall seconds an interrupted part kept: from its start to the last evaluation it recorded."""
    from towerlab.search import evaluation_records

    finished = (datetime.fromisoformat(r["finished_at"]).timestamp() for r in evaluation_records(out / "search.db")
                if r["finished_at"] is not None)
    return max((t for t in finished if t >= started), default=started) - started  # not an earlier part's


# The search settings a candidate's training reads (SearchConfig fields): what a retraining must copy.
TRAINING_SETTINGS = ("dataset", "val_size", "max_epochs", "patience", "batch_size")


def fresh_seeds(count: int) -> list[int]:
    """The seeds every benchmark retrains a pick with (10000, 10001, ...): the same for every method."""
    return [10_000 + i for i in range(count)]


def retrain(pick: dict, settings: dict, seeds: list[int], data_dir: str, *, processes: int = 2, threads: int = 1,
            cache: Optional[Path] = None) -> list[dict]:
    """`pick`, a network of the mlp space, trained again with each fresh seed, by the very function a
    search trains its candidates with and under the search's `settings` (`TRAINING_SETTINGS`), on
    `processes` CPU processes of `threads` threads: each seed's validation and test accuracy (None
    where the training failed). With `cache`, a file of the same pick, settings, seeds and threads
    is read back instead, and a new result is written there."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    key = {"pick": pick, "settings": settings, "seeds": seeds, "threads": threads}
    if cache is not None and cache.exists():
        kept = json.loads(cache.read_text())
        if kept["key"] == key:
            return kept["runs"]
    with ProcessPoolExecutor(processes, mp_context=get_context("spawn"), initializer=_one_process,
                             initargs=(threads,)) as pool:
        runs = list(pool.map(_retrain_one, [(pick, settings, seed, data_dir) for seed in seeds]))
    if cache is not None:
        write_json(cache, {"key": key, "runs": runs})
    return runs


def _one_process(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


_DATA: dict = {}  # a retraining process's data sets, loaded once


def _retrain_one(task: tuple[dict, dict, int, str]) -> dict:
    import torch

    from towerlab.config import RunConfig, SearchConfig
    from towerlab.data.load import load_data
    from towerlab.objective.candidate import train_candidate

    pick, settings, seed, data_dir = task
    cfg = SearchConfig(sampler="ga", **settings)
    key = (cfg.dataset, cfg.val_size)
    if key not in _DATA:
        run = RunConfig(data_dir=data_dir, device="cpu", download=False)
        _DATA[key] = load_data(cfg.dataset, cfg.val_size, run, download=False,
                               log=lambda _line: None).to(torch.device("cpu"))
    outcome, _ = train_candidate(cfg, "mlp", pick, seed, _DATA[key], torch.device("cpu"),
                                 test_from=-math.inf)
    ok = outcome.status == "ok"
    return {"seed": seed, "val_accuracy": outcome.fitness if ok else None,
            "test_accuracy": outcome.test_accuracy if ok else None, "epochs": outcome.epochs if ok else None,
            "seconds": outcome.seconds}


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


def waiting(records: list[dict]) -> dict:
    """Worker-seconds in which a run's workers did not train, from its evaluation records (start =
    finished_at - seconds; finished_at is kept to the second): inside each generation's span, its
    first training's start to its last one's end (the ends of rungs, and a last rung with fewer
    networks than workers: the next generation is proposed from a complete one), and between
    generations (proposing, the store)."""
    workers = len({r["worker"] for r in records})
    spans: dict[int, list[float]] = {}  # generation -> [first start, last end, seconds trained]
    for r in records:
        end = datetime.fromisoformat(r["finished_at"]).timestamp()
        span = spans.setdefault(r["generation"], [math.inf, -math.inf, 0.0])
        span[0], span[1], span[2] = min(span[0], end - r["seconds"]), max(span[1], end), span[2] + r["seconds"]
    ordered = [spans[g] for g in sorted(spans)]
    inside = math.fsum(workers * (last - first) - trained for first, last, trained in ordered)
    between = math.fsum(workers * max(0.0, b[0] - a[1]) for a, b in zip(ordered, ordered[1:]))
    return {"workers": workers, "inside_generations": round(inside, 1), "between_generations": round(between, 1)}


def best_at(curve: list[tuple[float, float, int]], evaluations: int) -> Optional[float]:
    """The best accuracy among the first `evaluations` evaluations."""
    values = [best for _, best, count in curve if count <= evaluations]
    return values[-1] if values else None


def best_by(curve: list[tuple[float, float, int]], seconds: float) -> Optional[float]:
    """The best accuracy among the evaluations finished within `seconds` of training."""
    values = [best for spent, best, _ in curve if spent <= seconds]
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
                        help="where the record and the runs' folders go (default: the record in "
                             "bench/results/quality, the runs' folders in bench/results; --smoke: "
                             "bench/results/quick, not committed)")
    parser.add_argument("--reuse", action="store_true",
                        help="take runs that finished in an earlier invocation (same command) from their folders")


def records_dir(args: argparse.Namespace, kind: str = "") -> Path:
    """Where a record goes: --out-dir, else bench/results/quality/`kind` (a smoke run's: bench/results/quick,
    which git ignores)."""
    if args.out_dir:
        return Path(args.out_dir)
    return RESULTS / "quick" if getattr(args, "smoke", False) else RESULTS / "quality" / kind


def runs_dir(args: argparse.Namespace, name: str) -> Path:
    """Where a benchmark's runs keep their folders (`name`: sampler-runs, pruning-runs; git ignores them):
    under --out-dir, else bench/results/ (a smoke run's: bench/results/quick/)."""
    if args.out_dir:
        return Path(args.out_dir) / name
    return RESULTS / ("quick" if getattr(args, "smoke", False) else "") / name


def record_name(kind: str, dataset: str) -> str:
    """The file name of today's record of a benchmark."""
    return f"{kind}-{dataset}-{time.strftime('%Y-%m-%d')}.json"


def save(out_dir: str | Path, kind: str, dataset: str, record: dict) -> None:
    print(write_record(out_dir, record_name(kind, dataset), record))
