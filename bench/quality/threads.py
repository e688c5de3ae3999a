"""One candidate trained on 1 and on 2 CPU threads, by the function a search trains it with: does its
result follow the thread count? (It did; that is why a search's candidates train on one thread
each, whatever the number of workers: issue 43.)

    python bench/quality/threads.py        # MNIST, neurons=768,layers=1,activation=relu,optimizer=nadam, 3 seeds, 1 epoch

Writes bench/results/quality/threads-<dataset>-<date>.json: each seed's validation and test accuracy on
each thread count, and how many seeds score differently (`seeds_that_differ`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import RESULTS, figure, write_record
from bench.quality.search_runs import fresh_seeds, retrain


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--val-size", type=int, default=5000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--data-dir", default=measure.default_data_dir())
    parser.add_argument("--out", default=str(RESULTS / "quality"))
    args = parser.parse_args(argv)
    pick = {"neurons": 768, "layers": 1, "activation": "relu", "optimizer": "nadam"}
    settings = {"dataset": args.dataset, "val_size": args.val_size, "max_epochs": args.epochs}
    seeds = fresh_seeds(args.seeds)
    runs = {threads: retrain(pick, settings, seeds, args.data_dir, processes=1, threads=threads)
            for threads in (1, 2)}
    for threads, results in runs.items():
        print(f"{threads} thread(s): " + ", ".join(f"{r['val_accuracy']:.4f}" for r in results))
    scores = {t: [(r["val_accuracy"], r["test_accuracy"]) for r in results] for t, results in runs.items()}
    differ = sum(a != b for a, b in zip(scores[1], scores[2]))
    print(f"{differ} of {len(seeds)} seeds score differently (validation or test) on 1 and 2 threads")
    record = {"machine": machine.describe(), "date": measure.now(), "pick": pick, "settings": settings,
              "seeds": seeds, "runs": {str(t): r for t, r in runs.items()}, "seeds_that_differ": differ,
              "figures": [figure("seeds_that_differ", differ, {"seeds": len(seeds), "threads": [1, 2], "scores": scores})]}
    path = write_record(args.out, f"threads-{args.dataset}-{measure.now()[:10]}.json", record)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
