"""What a search costs a trial besides the trial: a trivial objective of yours (two float genes, a sum of
squares, microseconds of work) searched by `towerlab search run --objective` with the random sampler, 100
candidates a generation, no re-measuring, on 1 and 4 CPU workers, on SQLite and on a private PostgreSQL
server; beside Optuna's `study.optimize` on the same objective with its RandomSampler (the same sampler on
both sides: the point is what the store and the queue cost a trial, not what a sampler does), in memory
(`n_jobs` threads) and on RDBStorage (SQLite, and PostgreSQL through SQLAlchemy and psycopg 3; its
workers are processes sharing the study, as Optuna's documentation has them).

Each side's trials a second are taken over two windows of `--window` trials: the first ones, and those
finished once the history holds `--trials` trials (does the cost of a trial stay flat as the history
grows?). A window's rate is (trials - 1) over the time between its first and its last trial's end, as the
store (towerlab: each task's `finished`; Optuna: each trial's `datetime_complete`) recorded them, so a
process's start-up is left out. How each history was made:

- towerlab, the first of `--workers` (1): one search grown by running to `--trials` + `--window` trials;
  the other counts: a fresh search for their first window, and the grown search resumed (`--resume`) on
  that many workers with one window more of generations (its replay of the stored history is timed too);
- Optuna in memory, 1 thread: grown by running; 4 threads: a study prefilled with `--trials` finished
  trials (`study.add_trials`), then a window run;
- Optuna RDB: prefilled with `--trials` finished trials in bulk (`study.add_trials`; growing it by running
  takes hours at tens of ms a trial), then a window on each number of processes, one after the other.

Also measured: the peak RSS of the towerlab job's process and of its worker (the process whose driver
thread plays the search) while it grows the history, of Optuna's process in memory, and the wall time of
`towerlab search show DIR` (and `--csv`) on the grown search (median of 3).

    python bench/queue/objective_overhead.py                                     # all (about 40 min on 2 cores)
    python bench/queue/objective_overhead.py --trials 5000 --window 1000 --backends sqlite --optuna memory   # a quick look

The PostgreSQL server is a private one (bench/queue/postgres.py), stopped at the end. Optuna's side is
bench/queue/overhead_optuna.py. Writes bench/results/queue/objective-overhead-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.machine import describe
from bench.common.record import RESULTS, script_command, write_record
from bench.queue.overhead_optuna import in_child, optuna_memory, optuna_rdb, quiet, rate
from bench.queue.postgres import Server

OBJECTIVE = "def f(x, y):\n    return (x - 0.3) ** 2 + (y - 0.7) ** 2\n"
SPACE = "[genes]\nx = {low = 0.0, high = 1.0}\ny = {low = 0.0, high = 1.0}\n"
TOWERLAB = [sys.executable, "-m", "towerlab"]


TICKS = os.sysconf("SC_CLK_TCK")


class Watched:
    """A process and every process below it (and, where given, a database server's processes: `server`, the
    pid of PostgreSQL's postmaster), looked at every half second: the peak RSS (VmHWM, MB) of each process
    below `pid`, and the CPU seconds used by them and by the server (`cpu`: (time.time(), CPU seconds)
    pairs), which, unlike a window's wall time on a machine that other jobs share, says what a trial costs."""

    def __init__(self, pid: int, server: int | None = None) -> None:
        self.pid, self.server = pid, server
        self.peaks: dict[int, float] = {}
        self.cpu: list[tuple[float, float]] = []
        self._used: dict[int, float] = {}  # each process's CPU seconds when last seen (those that ended count on)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(root: int, stats: dict[int, list[str]]) -> set[int]:
        tree, grew = {root}, True
        while grew:
            grew = False
            for pid, fields in stats.items():
                if int(fields[1]) in tree and pid not in tree:
                    tree.add(pid)
                    grew = True
        return tree & stats.keys()

    def _watch(self) -> None:
        while not self._done.wait(0.5):
            stats: dict[int, list[str]] = {}
            for entry in os.listdir("/proc"):
                try:
                    with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                        stats[int(entry)] = f.read().rsplit(")", 1)[1].split()
                except (OSError, ValueError, IndexError):
                    continue
            ours = self._tree(self.pid, stats)
            for pid in ours | (self._tree(self.server, stats) if self.server else set()):
                self._used[pid] = (int(stats[pid][11]) + int(stats[pid][12])) / TICKS  # utime + stime
            for pid in ours:
                try:
                    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
                        line = next(x for x in f if x.startswith("VmHWM:"))
                    self.peaks[pid] = max(self.peaks.get(pid, 0.0), int(line.split()[1]) / 1024)
                except (OSError, StopIteration, ValueError):
                    continue
            self.cpu.append((time.time(), sum(self._used.values())))

    def stop(self) -> dict:
        """The peak RSS of the process (`job_mb`) and of the largest process below it (`worker_mb`)."""
        self._done.set()
        self._thread.join()
        workers = [mb for pid, mb in self.peaks.items() if pid != self.pid]
        return {"job_mb": round(self.peaks.get(self.pid, 0.0), 1), "worker_mb": round(max(workers, default=0.0), 1)}

    def cpu_between(self, start: float, end: float) -> float | None:
        """CPU seconds used between two moments (time.time()), read off the series; None where it does not
        cover them."""
        if len(self.cpu) < 2 or start < self.cpu[0][0] or end > self.cpu[-1][0]:
            return None

        def at(moment: float) -> float:
            i = max(1, next(i for i, (t, _) in enumerate(self.cpu) if t >= moment))
            (t0, c0), (t1, c1) = self.cpu[i - 1], self.cpu[i]
            return c0 + (c1 - c0) * (moment - t0) / (t1 - t0)
        return at(end) - at(start)


def towerlab(args: list[str], folder: Path, server: int | None = None) -> dict:
    """Run a towerlab command in `folder`: its wall seconds, its processes' peak RSS, its start (time.time),
    and its processes (and the database `server`'s) watched (`watched`)."""
    started, clock = time.time(), time.perf_counter()
    process = subprocess.Popen([*TOWERLAB, *args], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    watched = Watched(process.pid, server)
    out, err = process.communicate()
    seconds, rss = time.perf_counter() - clock, watched.stop()
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({process.returncode}): {err.strip()[-2000:]}")
    return {"seconds": seconds, "rss": rss, "started": started, "stdout": out, "watched": watched}


def window(stamps: list[float], watched: Watched) -> dict:
    """A window's trials a second, and the CPU milliseconds a trial took in it (towerlab's processes and the
    database server's, all cores together)."""
    cpu = watched.cpu_between(stamps[0], stamps[-1])
    return {"rate": rate(stamps), "cpu_ms": None if cpu is None else 1000 * cpu / (len(stamps) - 1)}


def finished_stamps(target: str) -> list[float]:
    """The end of every training task of the store's search, in order (the database's clock)."""
    query = "SELECT finished FROM tasks WHERE kind = 'train' AND state = 'done' ORDER BY finished"
    if target.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(target) as db:
            return [row[0] for row in db.execute(query)]
    import sqlite3

    db = sqlite3.connect(f"file:{target}?mode=ro", uri=True)
    try:
        return [row[0] for row in db.execute(query)]
    finally:
        db.close()


class TowerlabSide:
    """towerlab's searches on one backend, in `folder`."""

    def __init__(self, folder: Path, backend: str, server: Server | None, args: argparse.Namespace) -> None:
        self.folder, self.backend, self.server, self.args = folder, backend, server, args
        (folder / "trivial.py").write_text(OBJECTIVE)
        (folder / "space.toml").write_text(SPACE)

    def _target(self, out: str) -> tuple[list[str], str]:
        if self.server is None:
            return [], str(self.folder / out / "search.db")
        url = self.server.database()
        return ["--store", url], url

    def _run(self, out: str, workers: int, trials: int) -> tuple[dict, str]:
        store, target = self._target(out)
        generations = -(-trials // self.args.population)
        ran = towerlab(["search", "run", "--objective", "trivial.py:f", "--direction", "minimize", "--space",
                        "space.toml", "--sampler", "random", "--population", str(self.args.population),
                        "--generations", str(generations), "--max-epochs", "1", "--remeasure", "0", "--device",
                        "cpu", "--devices", str(workers), "--threads", "1", "--no-progress", "--out", out, *store],
                       self.folder, self.postmaster)
        return ran, target

    @property
    def postmaster(self) -> int | None:
        """The pid of the PostgreSQL server's first process (None on SQLite)."""
        if self.server is None:
            return None
        return int((self.server.data / "postmaster.pid").read_text().split()[0])

    def measure(self) -> dict:
        """Trials a second (and CPU ms a trial) over the first window and the one once the history holds
        --trials, on each number of workers; the grown search's show times and peak RSS."""
        args, size = self.args, self.args.window
        first, *others = args.workers
        grown, target = self._run("grown", first, args.trials + size)
        stamps = finished_stamps(target)
        start, later = window(stamps[:size], grown["watched"]), window(stamps[args.trials:args.trials + size],
                                                                       grown["watched"])
        result = {f"{first}w": {"start": start["rate"], "history": later["rate"], "start_cpu_ms": start["cpu_ms"],
                                "history_cpu_ms": later["cpu_ms"], "trials": len(stamps), "seconds": grown["seconds"],
                                "peak_rss_mb": grown["rss"]}}
        print(f"towerlab {self.backend} {first} worker(s): {result[f'{first}w']}", flush=True)
        result["show_seconds"] = self._show()
        print(f"towerlab {self.backend} search show: {result['show_seconds']}", flush=True)
        for workers in others:
            fresh, fresh_target = self._run(f"fresh-{workers}w", workers, size + args.population)
            start = window(finished_stamps(fresh_target)[:size], fresh["watched"])
            before = len(finished_stamps(target))
            generations = -(-(before + size) // args.population)
            resumed = towerlab(["search", "run", "--resume", "grown", "--generations", str(generations),
                                "--devices", str(workers), "--no-progress"], self.folder, self.postmaster)
            new = finished_stamps(target)[before:]
            later = window(new, resumed["watched"])
            result[f"{workers}w"] = {"start": start["rate"], "history": later["rate"], "start_cpu_ms": start["cpu_ms"],
                                     "history_cpu_ms": later["cpu_ms"], "history_trials": before,
                                     "window_trials": len(new), "resume_seconds": resumed["seconds"],
                                     "resume_to_first_trial_seconds": new[0] - resumed["started"]}
            print(f"towerlab {self.backend} {workers} worker(s): {result[f'{workers}w']}", flush=True)
        return result

    def _show(self) -> dict:
        times: dict[str, list[float]] = {"text": [], "csv": []}
        for _ in range(3):
            for kind, extra in (("text", []), ("csv", ["--csv"])):
                times[kind].append(towerlab(["search", "show", "grown", *extra], self.folder)["seconds"])
        return {kind: statistics.median(values) for kind, values in times.items()} | {"samples": times}


# --- Optuna ----------------------------------------------------------------------------------------


# --- the record ------------------------------------------------------------------------------------

NAMES = {"sqlite": "SQLite", "postgresql": "PostgreSQL", "inmemory": "in memory", "rdb_sqlite": "RDBStorage on SQLite",
         "rdb_postgresql": "RDBStorage on PostgreSQL"}
NOTES = ("The machine is a 2-core CPU box shared with other jobs running at the same time (its load average "
         "stood at 4 to 8 during the run): the sides' ratios, measured in one run, count; absolute figures are "
         "indicative. Every side runs the same objective, f(x, y) = (x - 0.3)^2 + (y - 0.7)^2 over two uniform "
         "floats in [0, 1], with the random sampler (towerlab's random, Optuna's RandomSampler): what is measured "
         "is what the store and the queue cost a trial. A window's rate: its trials after the first over the time "
         "between its first and last trial's end as the store recorded them (towerlab: tasks.finished; Optuna: "
         "datetime_complete). towerlab's first worker count grows its history by running; the others start "
         "fresh, and resume the grown search (--resume) for the second window. Optuna in memory, 1 thread: grown "
         "by running; 4 threads: prefilled with study.add_trials. Optuna RDBStorage: its tables prefilled in bulk "
         "with the trials' rows (add_trials takes about 20 ms a trial there), then windows of at most --rdb-window "
         "trials or --rdb-seconds seconds, the processes started by fork after their imports.")


def figures(towerlab_sides: dict, optuna_sides: dict, trials: int, window: int) -> list[dict]:
    """The record's figures from what each side measured (`towerlab_sides`: by backend; `optuna_sides`:
    by storage), each with its stable id."""
    out, at = [], f"{trials // 1000}k"
    for backend, side in towerlab_sides.items():
        for counted in [key for key in side if key.endswith("w")]:
            workers = counted[:-1]
            for when, suffix, which in (("start", "start", f"the first {window:,} trials"),
                                        ("history", at, f"{window:,} trials once the history holds {trials:,}")):
                out.append({"id": f"objective_trials_per_s_{backend}_{counted}_{suffix}", "value": side[counted][when],
                            "unit": "trials/s", "title": f"towerlab, {NAMES[backend]}, {workers} worker(s): trials a "
                                                         f"second over {which}", "detail": side[counted]})
                out.append({"id": f"objective_cpu_ms_per_trial_{backend}_{counted}_{suffix}",
                            "value": side[counted][f"{when}_cpu_ms"], "unit": "ms",
                            "title": f"towerlab, {NAMES[backend]}, {workers} worker(s): CPU milliseconds a trial "
                                     f"(towerlab's processes and the database server's) over {which}"})
        grown = next(side[key] for key in side if key.endswith("w") and "peak_rss_mb" in side[key])
        for kind, flag in (("text", ""), ("csv", " --csv")):
            out.append({"id": f"search_show{'_csv' if flag else ''}_seconds_{backend}_{at}",
                        "value": side["show_seconds"][kind], "unit": "s",
                        "title": f"towerlab search show DIR{flag} on a search of {grown['trials']:,} trials "
                                 f"({NAMES[backend]}), median of 3", "detail": {"samples": side["show_seconds"]["samples"][kind]}})
        out.append({"id": f"driver_peak_rss_mb_{backend}_{at}", "value": grown["peak_rss_mb"]["worker_mb"], "unit": "MB",
                    "title": f"peak RSS of the worker process whose driver thread played the search to {grown['trials']:,} "
                             f"trials ({NAMES[backend]}); job_mb: the job's own process, which watches the store",
                    "detail": grown["peak_rss_mb"]})
    for kind, side in optuna_sides.items():
        for counted in [key for key in side if key.endswith("w")]:
            unit = "thread(s)" if kind == "inmemory" else "process(es)"
            for when, suffix, which in (("start", "start", "its first trials"), ("history", at, f"trials once it holds {trials:,}")):
                out.append({"id": f"optuna_{kind}_trials_per_s_{counted}_{suffix}", "value": side[counted][when],
                            "unit": "trials/s", "title": f"Optuna, {NAMES[kind]}, {counted[:-1]} {unit}: trials a "
                                                         f"second over {which}",
                            "detail": side[counted] | {"prefill_seconds": side.get("prefill_seconds")}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100_000, help="the history before the second window")
    parser.add_argument("--window", type=int, default=2000, help="trials a window (towerlab, Optuna in memory)")
    parser.add_argument("--rdb-window", type=int, default=500,
                        help="trials a window of Optuna on RDBStorage (tens of ms a trial)")
    parser.add_argument("--rdb-seconds", type=float, default=120,
                        help="seconds a window of Optuna on RDBStorage may take at most (seconds a trial at 100,000)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--population", type=int, default=100, help="towerlab's candidates a generation")
    parser.add_argument("--backends", nargs="*", choices=["sqlite", "postgresql"], default=["sqlite", "postgresql"],
                        help="towerlab's stores")
    parser.add_argument("--optuna", nargs="*", choices=["memory", "sqlite", "postgresql"],
                        default=["memory", "sqlite", "postgresql"], help="Optuna's storages")
    parser.add_argument("--label", default="", help="added to the record's name (objective-overhead-LABEL-<date>)")
    parser.add_argument("--out-dir", default=str(RESULTS / "queue"))
    args = parser.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent).stdout.strip()
    optuna = quiet()
    folder = Path(tempfile.mkdtemp(prefix="towerlab-overhead-"))
    server = Server() if "postgresql" in [*args.backends, *args.optuna] else None
    towerlab_sides, optuna_sides = {}, {}
    try:
        for backend in args.backends:
            where = folder / f"towerlab-{backend}"
            where.mkdir()
            towerlab_sides[backend] = TowerlabSide(where, backend, server if backend == "postgresql" else None,
                                                   args).measure()
        if "memory" in args.optuna:
            optuna_sides["inmemory"] = {f"{w}w": in_child(optuna_memory, args.trials, args.window, w, i == 0)
                                        for i, w in enumerate(args.workers)}
            print(f"optuna in memory: {optuna_sides['inmemory']}", flush=True)
        for kind in [k for k in args.optuna if k != "memory"]:
            if kind == "sqlite":
                urls = [f"sqlite:///{folder}/optuna-{name}.db" for name in ("fresh", "filled")]
            else:
                urls = [server.database().replace("postgresql://", "postgresql+psycopg://") for _ in range(2)]
            optuna_sides[f"rdb_{kind}"] = optuna_rdb(*urls, args.trials, args.rdb_window, args.rdb_seconds,
                                                     args.workers)
            print(f"optuna RDB {kind}: {optuna_sides[f'rdb_{kind}']}", flush=True)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(folder, ignore_errors=True)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": describe(),
              "command": script_command(__file__, argv),
              "git_head": head, "pythonpath": os.environ.get("PYTHONPATH"), "optuna_version": optuna.__version__,
              "postgresql": server.version if server else None, "trials": args.trials, "window": args.window,
              "rdb_window": args.rdb_window, "rdb_seconds": args.rdb_seconds, "population": args.population,
              "notes": NOTES, "figures": figures(towerlab_sides, optuna_sides, args.trials, args.window)}
    name = "-".join(["objective-overhead", *([args.label] if args.label else []), datetime.date.today().isoformat()])
    path = write_record(args.out_dir, f"{name}.json", record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
