"""The queue's own cost: tasks a second through towerlab's store-as-queue, with a trainer that returns
at once, beside Optuna's trials a second on the same PostgreSQL server (RDBStorage, an objective that
returns at once, the random sampler), the same number of processes each.

towerlab's side is a whole search (random sampler, `--population` candidates a generation, no
re-measures, no test retraining): every worker process plays the search against the store and claims,
"trains" and closes tasks, so the figure counts everything the queue does (proposals, the
generation barrier, leases), not a loop of claims alone. Optuna's side: each process loads the study
and runs `study.optimize` for its share of the trials. Both sides start their processes by fork
after their imports, and the clock runs from the first start to the last exit. The sides alternate
over `--rounds`; each figure is the median.

    python bench/queue/store_queue.py                        # 1, 4 and 16 processes, SQLite and PostgreSQL (~5 min)
    python bench/queue/store_queue.py --processes 4 --rounds 1 --tasks 200   # a quick look

The PostgreSQL server is a private one started here (bench/queue/postgres.py: initdb into a temporary
folder, a free loopback port), stopped at the end. Writes bench/results/queue/queue-<date>.json with the
figure `queue_vs_optuna_postgresql` (towerlab tasks/s over Optuna trials/s, 4 processes).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.machine import describe
from bench.common.record import RESULTS, script_command, write_record
from bench.queue.postgres import Server

from towerlab.config import SearchConfig
from towerlab.search import Outcome, Search, load_space
from towerlab.search.work.worker import Worker, WorkerOptions
from towerlab.search.store import Store

GENES = {"neurons": [16, 32, 64, 128, 256, 512, 768, 1024], "layers": [1, 2, 3, 4],
         "activation": ["relu", "elu", "tanh", "sigmoid"], "optimizer": ["sgd", "adam", "rmsprop", "adagrad",
                                                                          "adadelta", "adamax", "nadam"]}


def _all_at_once(processes: list) -> float:
    """Seconds from the first start to the last exit of `processes`."""
    started = time.perf_counter()
    for p in processes:
        p.start()
    for p in processes:
        p.join()
    return time.perf_counter() - started


def _instant(search):
    def train(assignment):
        r = random.Random(assignment.candidate.genome_hash)
        return Outcome.ok(r.random(), epochs=1, seconds=0.0)
    return train


def _work(target: str, name: str, search_id: int) -> None:
    with Store(target) as store:
        Worker(store, name, "cpu", _instant, WorkerOptions(search_ids=[search_id], lease=60)).run()


def towerlab_side(target: str, processes: int, tasks: int, population: int, seed: int) -> float:
    """Tasks a second of one whole search of `tasks` trainings on `processes` workers."""
    cfg = SearchConfig(sampler="random", population=population, generations=-(-tasks // population),
                       max_evaluations=tasks, remeasure=0, top=1, max_epochs=1, seed=seed)
    with Store(target) as store:
        search = Search.resolve(cfg, load_space("mlp")).create(store, f"bench{seed}", {"test": False})
    context = multiprocessing.get_context("fork")
    seconds = _all_at_once([context.Process(target=_work, args=(target, f"w{i}", search.id)) for i in range(processes)])
    with Store(target) as store:
        done = len(store.records.evaluations(search.id))
        assert store.records.search(search.id).finished is not None and done == tasks, (done, tasks)
    return done / seconds


def _objective(trial) -> float:
    genome = {name: trial.suggest_categorical(name, values) for name, values in GENES.items()}
    return random.Random(str(sorted(genome.items()))).random()


def _optimize(url: str, name: str, trials: int) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=name, storage=url, sampler=optuna.samplers.RandomSampler())
    study.optimize(_objective, n_trials=trials)


def optuna_side(url: str, processes: int, tasks: int, seed: int) -> float:
    """Trials a second of `tasks` trials on `processes` processes sharing one RDBStorage study."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = f"bench{seed}"
    optuna.create_study(study_name=name, storage=url, sampler=optuna.samplers.RandomSampler(seed=seed))
    context = multiprocessing.get_context("fork")
    share = [tasks // processes + (i < tasks % processes) for i in range(processes)]
    seconds = _all_at_once([context.Process(target=_optimize, args=(url, name, n)) for n in share])
    done = len(optuna.load_study(study_name=name, storage=url).trials)
    assert done == tasks, (done, tasks)
    return done / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tasks", type=int, default=600, help="trainings (trials) per sample")
    parser.add_argument("--population", type=int, default=40, help="towerlab's candidates per generation")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", default=str(RESULTS / "queue"))
    args = parser.parse_args(argv)
    import optuna

    server = Server()
    rows, seed = [], 0
    try:
        with tempfile.TemporaryDirectory() as folder:
            for n in args.processes:
                samples: dict[str, list[float]] = {"towerlab_sqlite": [], "towerlab_postgresql": [],
                                                    "optuna_postgresql": []}
                for _ in range(args.rounds):
                    seed += 1
                    samples["towerlab_postgresql"].append(
                        towerlab_side(server.database(), n, args.tasks, args.population, seed))
                    samples["optuna_postgresql"].append(optuna_side(server.database(), n, args.tasks, seed))
                    samples["towerlab_sqlite"].append(
                        towerlab_side(f"{folder}/s{seed}.db", n, args.tasks, args.population, seed))
                row = {"processes": n, **{k: statistics.median(v) for k, v in samples.items()},
                       "samples": samples}
                row["ratio_postgresql"] = row["towerlab_postgresql"] / row["optuna_postgresql"]
                rows.append(row)
                print(f"{n:>3} processes: towerlab {row['towerlab_sqlite']:7.1f} tasks/s (SQLite), "
                      f"{row['towerlab_postgresql']:7.1f} (PostgreSQL); Optuna {row['optuna_postgresql']:7.1f} "
                      f"trials/s (PostgreSQL): x{row['ratio_postgresql']:.2f}", flush=True)
    finally:
        server.close()
    at4 = next((r for r in rows if r["processes"] == 4), rows[0])
    record = {"suite": "queue", "date": datetime.date.today().isoformat(), "machine": describe(),
              "command": script_command(__file__, argv),
              "optuna_version": optuna.__version__, "postgresql": server.version,
              "tasks": args.tasks, "population": args.population, "rounds": args.rounds,
              "figures": [{"id": "queue_vs_optuna_postgresql",
                           "title": f"tasks/s through towerlab's queue over Optuna's trials/s, "
                                    f"{at4['processes']} processes, one PostgreSQL server, instant trainings",
                           "target": ">= 3x", "target_value": 3.0, "value": at4["ratio_postgresql"], "unit": "x",
                           "met": at4["ratio_postgresql"] >= 3.0, "detail": {"rows": rows}}]}
    path = write_record(args.out_dir, f"queue-{record['date']}.json", record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
