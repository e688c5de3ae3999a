"""The store as the queue under many processes and kills: a whole search (random sampler, which proposes
each generation while the one before trains) played by 16 worker processes on SQLite and 30 on a private
PostgreSQL server, with trainings of 50 to 150 ms, while workers are SIGKILLed mid-task at random moments (half of
them put back at once, as a local launcher does; the other half left to their 3 s lease) and new ones
start in their place. What must hold (issue 60's list): the search finishes (no deadlock), its rows are
those of one uninterrupted process (nothing lost, nothing recorded twice, the same history), and no
connection is left on the server once the workers are gone. A check, not a speed: its record says what
held, with the numbers of kills and workers.

    python bench/queue/queue_stress.py                                   # both stores (under a minute on 2 cores)
    python bench/queue/queue_stress.py --backends sqlite --processes 4   # a quick look

The PostgreSQL server is a private one (bench/queue/postgres.py), stopped at the end. Writes
bench/results/queue-stress-<date>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.machine import describe
from bench.common.record import RESULTS, figure, script_command, write_record
from bench.queue.postgres import Server

from towerlab.config import SearchConfig
from towerlab.search import Candidate, Outcome, Search, load_space, run_search, serial
from towerlab.search.work.worker import Worker, WorkerOptions
from towerlab.search.store import Store

CONFIG = SearchConfig(sampler="random", population=40, generations=15, max_epochs=1, remeasure=0, top=2, seed=7)
LEASE = 3.0


def fitness(c: Candidate) -> Outcome:
    """Deterministic in the candidate: the same whoever trains it."""
    r = random.Random(f"{c.genome_hash}/{c.seed}/{c.max_epochs}")
    return Outcome.ok(round(r.random(), 6), epochs=c.max_epochs or 1, seconds=0.001)


def _slowly(search):
    def train(assignment):
        time.sleep(0.05 + random.random() * 0.1)
        outcome = fitness(assignment.candidate)
        return dataclasses.replace(outcome, test_accuracy=0.5) if assignment.tests(outcome.fitness) else outcome
    return train


def _work(target: str, name: str, search_id: int) -> None:
    random.seed(os.getpid())
    with Store(target) as store:
        Worker(store, name, "cpu", _slowly, WorkerOptions(search_ids=[search_id], lease=LEASE)).run()


def rows(store: Store) -> list[tuple]:
    """What decides a history: (generation, index, replicate, genome, seed, status, fitness) of every row."""
    return sorted((e.generation, e.index, e.replicate, e.genome_hash, e.seed, e.status, e.fitness)
                  for e in store.records.evaluations())


def holders(store: Store, search_id: int) -> set[str]:
    """The workers that hold a task on its first claim now: a kill mid-task. A task is lost once at most,
    so that none is lost MAX_ATTEMPTS times, which records it as failed by design (a candidate that kills
    every worker, test_queue.py's case) and would change the history."""
    return {t.worker for t in store.queue.tasks(search_id, "train")
            if t.state == "claimed" and t.worker and t.attempts == 1}


def play(target: str, processes: int, kills: int, seed: int) -> dict:
    """The search played by `processes` workers at a time, `kills` of them SIGKILLed along the way."""
    with Store(target) as store:
        search_id = Search.resolve(CONFIG, load_space("mlp")).create(store, "stress", {"test": True}).id
    rng = random.Random(seed)
    context = multiprocessing.get_context("fork")
    running: list[tuple[multiprocessing.Process, str]] = []
    started = killed = 0
    begun = time.monotonic()
    with Store(target) as store:
        while store.records.search(search_id).finished is None:
            if time.monotonic() - begun > 600:
                return {"finished": False, "killed": killed, "started": started}
            while len(running) < processes:
                p = context.Process(target=_work, args=(target, f"w{started}", search_id))
                p.start()
                running.append((p, f"w{started}"))
                started += 1
            held = holders(store, search_id) if killed < kills else set()
            holding = [i for i, (_, name) in enumerate(running) if name in held]
            if killed < kills and holding and rng.random() < 0.5:
                p, name = running.pop(rng.choice(holding))
                os.kill(p.pid, signal.SIGKILL)
                p.join()
                killed += 1
                if killed % 2:
                    store.queue.release(name, "was killed")
            time.sleep(rng.random() * 0.1)
            running = [(p, n) for p, n in running if p.is_alive() or p.join() or False]
        for p, _ in running:
            p.join(timeout=120)
        tasks = store.queue.tasks(search_id, "train")
        return {"finished": True, "killed": killed, "started": started, "seconds": time.monotonic() - begun,
                "rows": rows(store), "retrained": sum(t.attempts > 1 for t in tasks),
                "still_alive": sum(p.is_alive() for p, _ in running)}


def connections_left(server: Server) -> int:
    import psycopg

    with psycopg.connect(server.url(), autocommit=True) as db:
        return db.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'towerlab'").fetchone()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", choices=["sqlite", "postgresql"], default=["sqlite", "postgresql"])
    parser.add_argument("--processes", type=int, nargs="+", default=None,
                        help="workers at a time, one number per backend (default: 16 on SQLite, 30 on PostgreSQL)")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--out-dir", default=str(RESULTS / "queue"))
    args = parser.parse_args(argv)
    counts = args.processes or [{"sqlite": 16, "postgresql": 30}[b] for b in args.backends]
    folder = Path(tempfile.mkdtemp(prefix="towerlab-stress-"))
    with Store(folder / "reference.db") as store:
        run_search(CONFIG, load_space("mlp"), serial(fitness), store, "stress")
        expected = rows(store)
    results = {}
    for backend, processes in zip(args.backends, counts):
        server = Server() if backend == "postgresql" else None
        try:
            target = server.database() if server else str(folder / "search.db")
            outcome = play(target, processes, args.kills, seed=processes)
            played = outcome.pop("rows", None)
            outcome.update(processes=processes, same_rows=played == expected,
                           rows=len(played or []), expected_rows=len(expected))
            if server is not None:
                outcome["connections_left"] = connections_left(server)
        finally:
            if server is not None:
                server.close()
        results[backend] = outcome
        print(backend, outcome, flush=True)
    held = all(r["finished"] and r["same_rows"] and r.get("connections_left", 0) == 0 and r["killed"] == args.kills
               for r in results.values())
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": describe(),
              "command": script_command(__file__, argv),
              "search": {"sampler": CONFIG.sampler, "population": CONFIG.population,
                         "generations": CONFIG.generations, "lease_seconds": LEASE},
              "results": results, "held": held,
              "figures": [figure(f"held_{backend}", r["finished"] and r["same_rows"] and r.get("connections_left", 0) == 0
                                 and r["killed"] == args.kills, r) for backend, r in results.items()]}
    path = write_record(args.out_dir, f"queue-stress-{datetime.date.today().isoformat()}.json", record)
    print(f"{'held' if held else 'FAILED'}: {path}")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
