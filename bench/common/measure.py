"""Running one timed sample (towerlab's CLI or the baseline, each in a fresh process), alternating
the sides of a comparison, and the statistics every figure uses.

A towerlab sample is a real `towerlab train` command; its figures come from the run's own record
(`summary.json`, `metrics.jsonl`), so the benchmark measures exactly what a user's run reports.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from bench.common import worker_times
from bench.common.machine import CpuWatch, wait_for_quiet
from bench.common.record import BENCH, REPO
CONTENDED_CORES = 0.3   # a sample during which others kept this many cores busy is flagged
EXTRA_ROUNDS = 1        # re-runs allowed per comparison for rounds spoiled by foreign load
QUIET_TIMEOUT = 20.0    # seconds a sample waits for the machine to quieten before it runs anyway


DRY_RUN = False         # set by speed/run.py --dry-run: validate and list every command, run none
DRY_COMMANDS: list[list[str]] = []


def default_data_dir() -> str:
    return os.environ.get("TOWERLAB_DATA") or str(REPO.parent / "shared" / "data")


class BenchError(RuntimeError):
    pass


def _dry_towerlab(cmd: list[str]) -> dict:
    """Check a `towerlab train` command with towerlab's own parser and configs; a stand-in sample."""
    from towerlab.cli import build_parser
    from towerlab.commands import resolve_train

    resolve_train(build_parser().parse_args(cmd[3:]))
    DRY_COMMANDS.append(["towerlab", *cmd[3:-1], "DIR"])
    summary = {"train_seconds": 1.0, "wall_seconds": 1.0, "examples_per_sec": 1.0, "steps": 1, "epochs": 1.0,
               "global_batch_size": 1, "world_size": 1, "test_accuracy": 1.0, "val_accuracy": 1.0,
               "stopped": None, "threads_per_process": 1}
    return {"command": DRY_COMMANDS[-1], "summary": summary, "steady_examples_per_sec": 1.0, "evals": [],
            "cpu": {"foreign_cores": 0.0}}


def child_env(threads: int | None = None) -> dict:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    with CpuWatch() as watch:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or child_env(), cwd=REPO)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
        raise BenchError(f"exit status {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return proc, watch.use.as_dict()


def timed(command: list[str]) -> tuple[float, subprocess.CompletedProcess, dict]:
    """Run a whole command (from the repo, output captured): its wall seconds, the process and the CPU
    it and the machine used; a failure raises with its stderr's end."""
    with CpuWatch() as watch:
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=REPO)
        wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return wall, done, watch.use.as_dict()


def shown(command: list[str], **names: str) -> list[str]:
    """`command` as a record keeps it: each argument that is one of `names`' paths (this machine's) is
    given as its name in capitals (`data_dir="/x/data"`: "/x/data" becomes "DATA_DIR")."""
    by_path = {str(path): name.upper() for name, path in names.items()}
    return [by_path.get(arg, arg) for arg in command]


def flags(options: dict) -> list[str]:
    """{'batch_size': 64, 'augment': True} -> ['--batch-size', '64', '--augment']."""
    out: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            for k, v in value.items():
                out += ["--model-opt", f"{k}={v}"]
        elif value is not None:
            out += [flag, str(value)]
    return out


def preset_flags(name: str, **overrides: object) -> list[str]:
    """A preset as `towerlab train` flags: `--preset NAME` plus the benchmark's own overrides (towerlab
    resolves the preset for the device type it finds; flags typed here win over it)."""
    return ["--preset", name, *flags(overrides)]


def steady_rate(steps: list[dict]) -> float | None:
    """Median examples/s of the display windows after the first (which holds the warm-up)."""
    rates = [r["examples_per_sec"] for r in steps[1:]]
    return statistics.median(rates) if rates else None


def towerlab(args: list[str], data_dir: str, timeout: float = 900, attempts: int = 2,
             env: dict | None = None) -> dict:
    """One `towerlab train` run in a fresh process; its summary, eval history and CPU use. A failed
    run is tried again once (and the failure kept in the sample): one lost run should not end a
    20-minute suite, and a second failure is a real problem that should."""
    failures = []
    for attempt in range(attempts):
        try:
            sample = _towerlab_once(args, data_dir, timeout, env)
            if failures:
                sample["failed_attempts"] = failures
            return sample
        except BenchError as exc:
            failures.append(str(exc))
            print(f"  run failed ({'retrying' if attempt + 1 < attempts else 'giving up'}): {exc}",
                  file=sys.stderr, flush=True)
    raise BenchError(failures[-1])


def _towerlab_once(args: list[str], data_dir: str, timeout: float, env: dict | None = None) -> dict:
    out = Path(tempfile.mkdtemp(prefix="towerlab-bench-")) / "run"
    cmd = [sys.executable, "-m", "towerlab", "train", *args, "--data-dir", data_dir, "--no-progress",
           "--out", str(out)]
    if DRY_RUN:
        shutil.rmtree(out.parent, ignore_errors=True)
        return _dry_towerlab(cmd)
    try:
        _, cpu = _run(cmd, timeout, {**child_env(), **(env or {})})
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    steps = [r for r in records if r["kind"] == "step"]
    evals = [{k: r[k] for k in ("step", "train_seconds", "val_accuracy")} for r in records
             if r["kind"] in ("eval", "epoch")]
    keep = ("train_seconds", "wall_seconds", "examples_per_sec", "steps", "epochs", "global_batch_size",
            "world_size", "test_accuracy", "val_accuracy", "stopped", "threads_per_process")
    optional = ("device_type", "setup_seconds", "test_seconds", "step")
    return {"command": ["towerlab", *cmd[3:-1], "DIR"],
            "summary": {**{k: summary[k] for k in keep}, **{k: summary[k] for k in optional if k in summary}},
            "steady_examples_per_sec": steady_rate(steps), "evals": evals, "cpu": cpu}


def towerlab_search(args: list[str], data_dir: str, timeout: float = 1800) -> dict:
    """One `towerlab evolve` run in a fresh process; its summary, CPU use, and where its workers' time
    went (bench/common/worker_times.py)."""
    out = Path(tempfile.mkdtemp(prefix="towerlab-bench-")) / "search"
    cmd = [sys.executable, "-m", "towerlab", "evolve", *args, "--data-dir", data_dir, "--no-progress",
           "--out", str(out)]
    if DRY_RUN:
        from towerlab.cli import build_parser
        from towerlab.commands import resolve_search

        resolve_search(build_parser().parse_args(cmd[3:]))
        shutil.rmtree(out.parent, ignore_errors=True)
        DRY_COMMANDS.append(["towerlab", *cmd[3:-1], "DIR"])
        stats = [{"evaluated": 1, "seconds": 1.0}]
        record = {"worker": "dry", "device": "cpu", "tasks": 1, "wall_seconds": 1.0,
                  "seconds": dict.fromkeys(worker_times.PARTS, 0.125)}
        return {"command": DRY_COMMANDS[-1], "summary": {"generation_stats": stats, "workers": 1},
                "cpu": {"foreign_cores": 0.0}, "worker_time": worker_times.breakdown([record])}
    times = out.parent / "worker-times"
    try:
        _, cpu = _run(cmd, timeout, {**child_env(), **worker_times.environment(times)})
        summary = json.loads((out / "summary.json").read_text())
        records = [json.loads(path.read_text()) for path in sorted(times.glob("*.json"))]
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    keep = ("generation_stats", "evaluations", "cache_hits", "failures", "workers", "seconds", "best_val_accuracy")
    return {"command": ["towerlab", *cmd[3:-1], "DIR"], "summary": {k: summary[k] for k in keep}, "cpu": cpu,
            "worker_time": worker_times.breakdown(records)}


def baseline(data_dir: str, epochs: int, target: float, seed: int, threads: int | None = None,
             timeout: float = 1800) -> dict:
    """One run of bench/speed/baseline.py in a fresh process."""
    handle, path = tempfile.mkstemp(prefix="baseline-", suffix=".json")
    os.close(handle)
    cmd = [sys.executable, str(BENCH / "speed" / "baseline.py"), "--data-dir", data_dir, "--epochs", str(epochs),
           "--target", str(target), "--seed", str(seed), "--json", path]
    if threads:
        cmd += ["--threads", str(threads)]
    if DRY_RUN:
        os.unlink(path)
        DRY_COMMANDS.append(["python", "bench/speed/baseline.py", *cmd[2:-2]])
        return {"command": DRY_COMMANDS[-1], "train_seconds_to_target": 1.0, "wall_seconds_to_target": 1.0,
                "epochs_to_target": 1, "history": [], "cpu": {"foreign_cores": 0.0}}
    try:
        _, cpu = _run(cmd, timeout)
        record = json.loads(Path(path).read_text())
    finally:
        os.unlink(path)
    record["command"] = ["python", "bench/speed/baseline.py", *cmd[2:-2]]
    record["cpu"] = cpu
    return record


def contended(sample: dict) -> bool:
    return sample.get("cpu", {}).get("foreign_cores", 0.0) > CONTENDED_CORES


def alternate(sides: dict[str, Callable[[int], dict]], repeats: int, log: Callable[[str], None],
              quiet: bool = True, extra_rounds: int | None = None) -> dict[str, list[dict]]:
    """Run the sides in turn (A B A B ... for two, A B C A B C ... for more), `repeats` rounds, so
    that drift of the machine hits every side alike. A round in which another job loaded the machine
    is repeated (at most EXTRA_ROUNDS times); every sample is kept, flagged `contended`."""
    samples: dict[str, list[dict]] = {name: [] for name in sides}
    clean_rounds = extra = round_index = 0
    extra_rounds = EXTRA_ROUNDS if extra_rounds is None else min(extra_rounds, EXTRA_ROUNDS * 2)
    while clean_rounds < repeats:
        spoiled = False
        for name, run in sides.items():
            waited = wait_for_quiet(timeout=QUIET_TIMEOUT, log=log) if quiet and not DRY_RUN else 0.0
            sample = run(round_index)
            sample["round"], sample["waited_for_quiet_s"] = round_index, round(waited, 1)
            sample["contended"] = contended(sample)
            spoiled |= sample["contended"]
            samples[name].append(sample)
            log(f"  round {round_index + 1} {name}: {describe_sample(sample)}"
                + (f"  [others used {sample['cpu']['foreign_cores']:.1f} cores]" if sample["contended"] else ""))
        round_index += 1
        if spoiled and extra < extra_rounds:
            extra += 1
        else:
            clean_rounds += 1
    return samples


def describe_sample(sample: dict) -> str:
    if "value" in sample:
        return f"{sample['value']:.4g} {sample.get('unit', '')}".strip()
    return "done"


def usable_rounds(samples: dict[str, list[dict]]) -> list[int]:
    """Rounds where no side was contended; all rounds when there are none such."""
    rounds = sorted({s["round"] for side in samples.values() for s in side})
    clean = [r for r in rounds if not any(s["contended"] for side in samples.values() for s in side
                                          if s["round"] == r)]
    return clean or rounds


def values(samples: dict[str, list[dict]], name: str, rounds: list[int]) -> list[float]:
    return [s["value"] for s in samples[name] if s["round"] in rounds and s.get("value") is not None]


def median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio_stats(samples: dict[str, list[dict]], numerator: str, denominator: str,
                rounds: list[int]) -> dict:
    """Per-round ratios (numerator / denominator from the same round) and their median."""
    by_round = {name: {s["round"]: s.get("value") for s in samples[name]} for name in (numerator, denominator)}
    pairs = [by_round[numerator][r] / by_round[denominator][r] for r in rounds
             if by_round[numerator].get(r) and by_round[denominator].get(r)]
    return {"median": median(pairs), "per_round": [round(p, 4) for p in pairs],
            "min": min(pairs) if pairs else None, "max": max(pairs) if pairs else None}


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
