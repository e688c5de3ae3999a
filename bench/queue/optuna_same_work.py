"""The same work two ways: a fixed list of 24 MLPs trained one epoch each on MNIST, (a) by towerlab's
search (`towerlab grid` over a space of exactly those 24, 2 CPU workers of 1 thread, the top one
retrained for its test accuracy) and (b) by a plain PyTorch + Optuna script (bench/queue/plain_optuna.py: the
same network, optimizer, input standardisation, batch, epochs and seeds, one process per core on a
JournalFileBackend, each genome given with `study.enqueue_trial`, then the best retrained for its test
accuracy). Whole processes are timed, the sides alternated over `--rounds`.

Figures: `search_vs_optuna_same_work`, Optuna's wall time over towerlab's (the median of the rounds'
ratios); `workers_busy`, the share of towerlab's worker time spent training over the whole search:
the seconds of every training it recorded (the 24 and the test retraining) over the workers times
the command's wall time; `search_first_candidate_seconds`, from the command's start to its first
candidate (the store's first claim).

    python bench/queue/optuna_same_work.py                  # 3 rounds (~15 min on 2 cores)
    python bench/queue/optuna_same_work.py --rounds 1 --epochs 1

Writes bench/results/queue/optuna-same-work-<date>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.machine import describe
from bench.common.measure import default_data_dir, shown, timed
from bench.common.record import BENCH, RESULTS, script_command, write_json, write_record

SPACE = """model = "mlp"
[genes]
neurons = [64, 256, 512, 1024]
layers = [1, 2, 3]
lr = [0.001, 0.003]
optimizer = ["adam"]
activation = ["relu"]
"""
WORKERS = 2


def genomes_and_seeds(space_file: Path, seed: int) -> list[dict]:
    """The grid's genomes in its order, each with the training seed towerlab gives it."""
    from towerlab.search import candidate_seed, grid_genomes, load_space

    genomes = grid_genomes(load_space(str(space_file)), None, seed)
    return [{"genome": {k: v for k, v in g.items() if k in ("neurons", "layers", "lr")},
             "seed": candidate_seed(seed, 0, i)} for i, g in enumerate(genomes)]


def towerlab_side(folder: Path, space: Path, args: argparse.Namespace) -> dict:
    out = folder / f"grid-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "towerlab", "grid", "--space", str(space), "--dataset", "mnist", "--data-dir",
               args.data_dir, "--max-epochs", str(args.epochs), "--remeasure", "0", "--top", "1", "--seed",
               str(args.seed), "--device", "cpu", "--devices", str(WORKERS), "--threads", "1", "--no-progress",
               "--out", str(out)]
    started = time.time()  # the store's clock (claimed) is this machine's
    wall, _, cpu = timed(command)
    summary = json.loads((out / "summary.json").read_text())
    with contextlib.closing(sqlite3.connect(out / "search.db")) as db:
        first = db.execute("SELECT MIN(claimed) FROM tasks").fetchone()[0] - started
        trained = db.execute("SELECT SUM(seconds) FROM evaluations").fetchone()[0]
        tested = sum(json.loads(r)["seconds"] for (r,) in db.execute("SELECT result FROM tasks WHERE kind = 'test'"))
    return {"wall_seconds": wall, "train_seconds": trained + tested, "busy": (trained + tested) / (WORKERS * wall),
            "first_candidate_seconds": first,
            "best": summary["best_genome"], "val_accuracy": summary["best_val_accuracy"],
            "test_accuracy": summary["best_test_accuracy"], "evaluations": summary["evaluations"], "cpu": cpu,
            "command": ["towerlab", *shown(command[3:-1], space=space, data_dir=args.data_dir), "DIR"]}


def optuna_side(folder: Path, genomes: Path, args: argparse.Namespace) -> dict:
    journal = folder / f"journal-{time.monotonic_ns()}.log"
    command = [sys.executable, str(BENCH / "queue" / "plain_optuna.py"), "--genomes", str(genomes), "--journal", str(journal),
               "--data-dir", args.data_dir, "--processes", str(WORKERS), "--epochs", str(args.epochs)]
    wall, done, cpu = timed(command)
    return {"wall_seconds": wall, **json.loads(done.stdout.strip().splitlines()[-1]), "cpu": cpu,
            "command": ["python", "bench/queue/plain_optuna.py",
                        *shown(command[2:], genomes=genomes, journal=journal, data_dir=args.data_dir)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=default_data_dir())
    parser.add_argument("--out-dir", default=str(RESULTS / "queue"))
    args = parser.parse_args(argv)
    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        space = Path(folder) / "space24.toml"
        space.write_text(SPACE)
        genomes = Path(folder) / "genomes.json"
        write_json(genomes, genomes_and_seeds(space, args.seed))
        for r in range(args.rounds):
            sides = {}
            for side in (("towerlab", "optuna") if r % 2 == 0 else ("optuna", "towerlab")):
                sides[side] = (towerlab_side(Path(folder), space, args) if side == "towerlab"
                               else optuna_side(Path(folder), genomes, args))
            sides["ratio"] = sides["optuna"]["wall_seconds"] / sides["towerlab"]["wall_seconds"]
            rounds.append(sides)
            print(f"round {r + 1}: towerlab {sides['towerlab']['wall_seconds']:.1f} s (busy "
                  f"{sides['towerlab']['busy']:.3f}), Optuna {sides['optuna']['wall_seconds']:.1f} s: "
                  f"x{sides['ratio']:.2f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    busy = statistics.median(r["towerlab"]["busy"] for r in rounds)
    record = {"suite": "optuna-same-work", "date": datetime.date.today().isoformat(), "machine": describe(),
              "command": script_command(__file__, argv),
              "space": SPACE, "workers": WORKERS,
              "figures": [
                  {"id": "search_vs_optuna_same_work",
                   "title": "24 given MLPs, 1 epoch on MNIST, 2 CPU processes: a plain Optuna script's wall time "
                            "over towerlab's", "target": ">= 1.3x", "target_value": 1.3, "value": ratio, "unit": "x",
                   "met": ratio >= 1.3, "detail": {"per_round": [r["ratio"] for r in rounds]}},
                  {"id": "workers_busy", "title": "share of towerlab's worker time spent training, whole search",
                   "target": ">= 0.95", "target_value": 0.95, "value": busy, "unit": "fraction", "met": busy >= 0.95,
                   "detail": {"per_round": [r["towerlab"]["busy"] for r in rounds]}},
                  {"id": "search_first_candidate_seconds",
                   "title": "seconds from the command to towerlab's first candidate (its first claim)",
                   "value": statistics.median(r["towerlab"]["first_candidate_seconds"] for r in rounds), "unit": "s",
                   "detail": {"per_round": [r["towerlab"]["first_candidate_seconds"] for r in rounds]}}],
              "rounds": rounds}
    path = write_record(args.out_dir, f"optuna-same-work-{record['date']}.json", record)
    print(f"Optuna/towerlab x{ratio:.2f}, workers busy {busy:.3f}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
