"""A worker joining a search with a long history (issue 72, item 4): from `towerlab search worker DIR`'s start to
its first claim, for a search holding 10,000 and 100,000 trainings, while the search runs on.

For each size: a random search (`--sampler random --population 100`, an instant function objective, 2
workers) trains the history; `search run --resume DIR` then goes on with more generations whose trainings
sleep $JOIN_SLEEP seconds (the same objective: its file is its proof); once it trains, a separate
`towerlab search worker DIR` starts, as a machine joining, and its first task's claim (the store's clock:
this machine's) is taken against its command's start. Its driver stands by while the search's leader
proposes: it reads no history (it replayed the whole search before, the claim waiting on it: 50 to 115 s
at 100,000 trainings). Also recorded: the search's proposals (each made once, by its leader: the
generations' `proposed.by`).

    python bench/queue/worker_join.py                # 10,000 and 100,000 (about 15 min here)
    python bench/queue/worker_join.py --history 2000 # a quick look
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.machine import describe
from bench.common.record import RESULTS, figure, script_command, write_record

OBJECTIVE = "import os, time\n\ndef f(x, y):\n    time.sleep(float(os.environ.get('JOIN_SLEEP', '0')))\n    return x + y\n"
POPULATION = 100


def towerlab(*args: str, cwd: Path, env: dict | None = None, wait: bool = True) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "towerlab", *args], cwd=cwd, env={**os.environ, **(env or {})},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    if wait:
        _, err = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"towerlab {' '.join(args)}: {err[-2000:]}")
    return process


def one(history: int, sleep: float) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        here = Path(folder)
        (here / "f.py").write_text(OBJECTIVE)
        (here / "s.toml").write_text("[genes]\nx = {low = 0.0, high = 1.0}\ny = {low = 0.0, high = 1.0}\n")
        generations = history // POPULATION
        started = time.time()
        towerlab("search", "run", "--objective", "f.py:f", "--space", "s.toml", "--metric", "value", "--sampler", "random",
                 "--population", str(POPULATION), "--generations", str(generations), "--remeasure", "0",
                 "--devices", "2", "--no-progress", "--out", "out", cwd=here)
        built = time.time() - started
        db = here / "out" / "search.db"
        resumed = towerlab("search", "run", "--resume", "out", "--generations", str(generations + 20), "--devices", "1",
                           "--no-progress", cwd=here, env={"JOIN_SLEEP": str(sleep)}, wait=False)
        try:
            while _count(db, "SELECT COUNT(*) FROM tasks WHERE generation >= ? AND state = 'claimed'", generations) == 0:
                time.sleep(0.2)
            before = {w for (w,) in _rows(db, "SELECT id FROM workers")}
            load_at_join = os.getloadavg()[0]  # the machine's load as the worker starts (1-minute average)
            joined_at = time.time()
            joining = towerlab("search", "worker", "out", "--objective", "f.py:f", "--devices", "1", cwd=here, env={"JOIN_SLEEP": str(sleep)},
                               wait=False)
            claimed = None
            while claimed is None and time.time() - joined_at < 600:
                # its crew's worker process (forked: a pid of its own), the first worker not there before
                rows = _rows(db, "SELECT worker, MIN(claimed) FROM tasks WHERE worker IS NOT NULL GROUP BY worker")
                claimed = min((at for worker, at in rows if worker not in before and at is not None), default=None)
                time.sleep(0.05)
            proposers = _rows(db, "SELECT DISTINCT json_extract(proposed, '$.by') FROM generations WHERE generation >= ?",
                              generations)
        finally:
            for process in (resumed, locals().get("joining")):
                if process is not None and process.poll() is None:
                    os.killpg(process.pid, signal.SIGINT)
            for process in (resumed, locals().get("joining")):
                if process is not None:
                    process.wait(timeout=120)
    return {"history": history, "build_seconds": built,
            "first_claim_seconds": None if claimed is None else claimed - joined_at, "load_at_join": load_at_join,
            "proposers_after_the_resume": sorted(p for (p,) in proposers if p is not None)}


def _rows(db: Path, sql: str, *args: object) -> list[tuple]:
    with sqlite3.connect(db, timeout=30) as connection:
        return connection.execute(sql, args).fetchall()


def _count(db: Path, sql: str, *args: object) -> int:
    return int(_rows(db, sql, *args)[0][0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history", nargs="*", type=int, default=[10_000, 100_000])
    parser.add_argument("--sleep", type=float, default=5.0, help="seconds each training after the resume sleeps")
    parser.add_argument("--record", default=None)
    args = parser.parse_args(argv)
    rows = []
    for history in args.history:
        row = one(history, args.sleep)
        rows.append(row)
        print(f"{history} trainings: first claim {row['first_claim_seconds']:.2f} s after the worker's start "
              f"(history built in {row['build_seconds']:.0f} s)", flush=True)
    figures = [figure(f"worker_join_first_claim_{r['history']}", r["first_claim_seconds"],
                      {k: v for k, v in r.items() if k != "first_claim_seconds"}) for r in rows]
    name = args.record or f"worker-join-{time.strftime('%Y-%m-%d')}.json"
    written = write_record(RESULTS / "queue", name, {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": describe(),
        "command": script_command(__file__, argv), "rows": rows, "figures": figures,
        "notes": "measured as a user meets it: `towerlab search worker DIR` started from the command line while "
                 "`search run --resume` trains on; its first claim read from the store"})
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
