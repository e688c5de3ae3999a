"""The original search's headline, rerun with towerlab: the MLP space on MNIST (reported > 98%) and on
CIFAR-10 (reported 56%) after 10 generations of 20 networks.

    python bench/quality/search_headline.py                 # the original's budget (hours on a CPU; for a GPU)
    python bench/quality/search_headline.py --budget cpu    # a budget that fits a 2-core machine (said in the output)
    python bench/quality/search_headline.py --budget cpu-long --datasets cifar10   # longer trainings per candidate

Each search is a real `towerlab evolve` run; the figures come from its summary.json: best validation
accuracy (the fitness), the test accuracy of that genome (computed once, at the end), wall time,
evaluations, cache hits and workers. Writes bench/results/quality/search-<budget>-<date>.json.
Unlike the original, fitness is measured on held-out validation data, never on the test set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import REPO, RESULTS, figure, script_command, write_record


# (dataset, the original's reported accuracy)
SEARCHES = (("mnist", 0.98), ("cifar10", 0.56))
BUDGETS = {
    # The original: population 20, 10 generations, early stopping with patience 5 (max 10 epochs here).
    "original": {"population": 20, "generations": 10, "max_epochs": 10, "patience": 5},
    # Fits a 2-core CPU in about half an hour per dataset: fewer, shorter trainings.
    "cpu": {"population": 10, "generations": 5, "max_epochs": 3, "patience": 2},
    # The same population and generations with the original's longer trainings (about 45 minutes for
    # CIFAR-10 on 2 cores): what the epochs per candidate are worth.
    "cpu-long": {"population": 10, "generations": 5, "max_epochs": 10, "patience": 3},
}


def run_search(dataset: str, budget: dict, devices: int, data_dir: str, out: Path, extra: list[str]) -> dict:
    shown = ["towerlab", "evolve", "--space", "mlp", "--dataset", dataset, "--devices", str(devices), *extra]
    for key, value in budget.items():
        shown += ["--" + key.replace("_", "-"), str(value)]
    cmd = [sys.executable, "-m", *shown, "--data-dir", data_dir, "--no-progress", "--out", str(out)]
    started = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "MPLBACKEND": "Agg"})
    wall = time.perf_counter() - started
    summary = json.loads((out / "summary.json").read_text())
    return {"command": shown, "wall_seconds": wall,
            **{k: summary[k] for k in ("best_genome", "best_val_accuracy", "best_test_accuracy", "evaluations",
                                       "cache_hits", "failures", "generations", "seconds", "workers",
                                       "device_type", "generation_stats", "top")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", choices=sorted(BUDGETS), default="original")
    parser.add_argument("--devices", type=int, default=2, help="workers (GPUs, or CPU processes)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    parser.add_argument("--datasets", nargs="*", default=[d for d, _ in SEARCHES])
    parser.add_argument("--data-dir", default=measure.default_data_dir())
    parser.add_argument("--out-dir", default=None, help="where the record and the runs' folders go "
                        "(default: bench/results/quality, the runs in bench/results/search-runs)")
    args = parser.parse_args(argv)
    budget = BUDGETS[args.budget]
    record = {"budget": args.budget, "settings": budget, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine.describe(),
              "command": script_command(__file__, argv),
              "searches": {}, "figures": []}
    runs = Path(args.out_dir or RESULTS) / "search-runs"
    for dataset, reported in SEARCHES:
        if dataset not in args.datasets:
            continue
        print(f"== {dataset}: mlp space, {budget} on {args.devices} worker(s)", flush=True)
        result = run_search(dataset, budget, args.devices, args.data_dir, runs / f"{args.budget}-{dataset}",
                            ["--threads", str(args.threads)])
        result["reported_by_the_original"] = reported
        record["searches"][dataset] = result
        record["figures"].append(figure(f"best_val_accuracy_{dataset}", result["best_val_accuracy"],
                                        {k: result[k] for k in ("best_test_accuracy", "best_genome", "evaluations",
                                                                "cache_hits", "wall_seconds", "workers")}
                                        | {"reported_by_the_original": reported}))
        print(f"   best validation {result['best_val_accuracy']:.4f} (test {result['best_test_accuracy']:.4f}), "
              f"reported {reported:.2f}; {result['evaluations']} evaluations, {result['cache_hits']} cache hits, "
              f"{result['wall_seconds'] / 60:.1f} min on {result['workers']} worker(s)", flush=True)
    print(write_record(args.out_dir or RESULTS / "quality", f"search-{args.budget}-{time.strftime('%Y-%m-%d')}.json", record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
