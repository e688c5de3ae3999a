"""The seeds' examples as towerlab commands, beside what the seeds reported (their GPUs' figures).

    python bench/speed/seed_examples.py              # as the seeds ran them (for GPUs)
    python bench/speed/seed_examples.py --budget cpu # cut where a 2-core CPU cannot finish them (said per row)

Each example is a real `towerlab train` run; the figures come from its summary.json and
metrics.jsonl. Writes bench/results/speed/seeds-<budget>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import REPO, RESULTS, figure, script_command, write_record


# name -> (the seed's report, towerlab flags, flags replacing them on a 2-core CPU, or None)
EXAMPLES = {
    "lenet5_4_replicas": (
        "~99% validation accuracy; 17 s on 4 GPUs vs 42 s on 1",
        ["--model", "lenet5", "--dataset", "mnist", "--devices", "4", "--batch-size", "512", "--epochs", "20"],
        None),
    "lenet5_1_replica": (
        "the 1-GPU side of the comparison above",
        ["--model", "lenet5", "--dataset", "mnist", "--devices", "1", "--batch-size", "512", "--epochs", "20"],
        None),
    "convnet_2_replicas": (
        "~99% training accuracy after 200 steps; ~6,700 examples/sec on 2 GPUs",
        ["--model", "convnet", "--dataset", "mnist", "--devices", "2", "--batch-size", "1024", "--steps", "200",
         "--lr", "0.001", "--display-step", "20"],
        ["--steps", "6", "--display-step", "2"]),
    "cifarnet_towers_ps": (
        "the CIFAR-10 tutorial in towers, parameters and optimizer on the CPU",
        ["--model", "cifarnet", "--dataset", "cifar10", "--devices", "2", "--strategy", "ps", "--preset", "cifar-fast"],
        None),
}


def run(flags: list[str], data_dir: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix="towerlab-seed-")) / "run"
    cmd = [sys.executable, "-m", "towerlab", "train", *flags, "--data-dir", data_dir, "--no-progress",
           "--out", str(out)]
    try:
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "MPLBACKEND": "Agg"})
        summary = json.loads((out / "summary.json").read_text())
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    finally:
        shutil.rmtree(out.parent, ignore_errors=True)
    steps = [m for m in metrics if m["kind"] == "step"]
    keep = ("world_size", "device_type", "strategy", "global_batch_size", "steps", "epochs", "train_seconds",
            "wall_seconds", "examples_per_sec", "val_accuracy", "test_accuracy", "threads_per_process")
    return {"command": ["towerlab", "train", *flags], **{k: summary[k] for k in keep},
            "last_minibatch_accuracy": steps[-1]["accuracy"] if steps else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", choices=("seeds", "cpu"), default="seeds")
    parser.add_argument("--only", nargs="*", default=list(EXAMPLES))
    parser.add_argument("--data-dir", default=measure.default_data_dir())
    parser.add_argument("--out-dir", default=str(RESULTS / "speed"))
    args = parser.parse_args(argv)
    record = {"budget": args.budget, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine.describe(),
              "command": script_command(__file__, argv),
              "examples": {}, "figures": []}
    for name in args.only:
        reported, flags, cpu_cut = EXAMPLES[name]
        if args.budget == "cpu" and cpu_cut:
            # The later flag wins in argparse: the cut replaces the seed's budget.
            flags = [*flags, *cpu_cut]
        print(f"== {name}: towerlab train {' '.join(flags)}", flush=True)
        result = run(flags, args.data_dir)
        result["reported_by_the_seeds"] = reported
        result["cut_for_cpu"] = bool(args.budget == "cpu" and cpu_cut)
        record["examples"][name] = result
        record["figures"].append(figure(f"test_accuracy_{name}", result["test_accuracy"],
                                        {k: result[k] for k in ("val_accuracy", "train_seconds", "examples_per_sec",
                                                                "cut_for_cpu", "reported_by_the_seeds")}))
        print(f"   test {result['test_accuracy']}, last minibatch {result['last_minibatch_accuracy']}, "
              f"{result['train_seconds']:.1f} s training, {result['examples_per_sec']:.0f} examples/s", flush=True)
    print(write_record(args.out_dir, f"seeds-{args.budget}-{time.strftime('%Y-%m-%d')}.json", record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
