"""How OpenMP's idle threads wait, quiet and with one core taken: `mnist-fast` (200 steps, 1
process x the default threads) under libgomp spin counts from 0 (towerlab's OMP_WAIT_POLICY=PASSIVE)
to libgomp's own 300,000, each side alternated within a round, the median of the rounds.

    python bench/speed/omp_wait.py                  # 3 rounds, 5 settings x quiet/busy (~6 min on 2 cores)

A busy side runs `while True: pass` in another process for the length of the run. GOMP_SPINCOUNT
sets libgomp's spin count whatever OMP_WAIT_POLICY says, so every side keeps towerlab's PASSIVE and
sets only the count. Writes results/speed/omp-wait-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import REPO, RESULTS, figure, script_command, write_record

SPIN_COUNTS = {"passive": "0", "spin1k": "1000", "spin10k": "10000", "spin100k": "100000", "spin300k": "300000"}


def train_seconds(spin_count: str, busy: bool, seed: int, steps: int, data_dir: str, out: Path) -> float:
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        subprocess.run([sys.executable, "-m", "towerlab", "train", "--preset", "mnist-fast", "--steps", str(steps),
                        "--seed", str(seed), "--data-dir", data_dir, "--no-progress", "--out", str(out)],
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": spin_count}, check=True,
                       stdout=subprocess.DEVNULL, cwd=REPO)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    return json.loads((out / "summary.json").read_text())["train_seconds"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--data-dir", default=measure.default_data_dir())
    parser.add_argument("--out-dir", default=str(RESULTS / "speed"))
    args = parser.parse_args(argv)
    samples: dict[str, list[float]] = {f"{name}_{state}": [] for name in SPIN_COUNTS for state in ("quiet", "busy")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, count in SPIN_COUNTS.items():
                for state in ("quiet", "busy"):
                    seconds = train_seconds(count, state == "busy", r, args.steps, args.data_dir,
                                            Path(tmp) / f"{name}-{state}-{r}")
                    samples[f"{name}_{state}"].append(seconds)
                    print(f"round {r} {name} {state}: {seconds:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in samples.items()}
    table = {name: {"quiet": med[f"{name}_quiet"], "busy": med[f"{name}_busy"],
                    "busy_over_quiet": med[f"{name}_busy"] / med[f"{name}_quiet"],
                    "quiet_over_spin300k": med[f"{name}_quiet"] / med["spin300k_quiet"]} for name in SPIN_COUNTS}
    print("\n| setting | GOMP_SPINCOUNT | quiet s | one core taken s | taken / quiet | quiet / libgomp default |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, row in table.items():
        print(f"| {name} | {SPIN_COUNTS[name]} | {row['quiet']:.2f} | {row['busy']:.2f} | {row['busy_over_quiet']:.2f}x | "
              f"{row['quiet_over_spin300k']:.2f}x |")
    record = {"date": measure.now(), "machine": machine.describe(), "command": script_command(__file__, argv),
              "steps": args.steps, "rounds": args.rounds,
              "spin_counts": SPIN_COUNTS, "samples": samples, "medians": table,
              "figures": [figure(f"busy_over_quiet_{name}", row["busy_over_quiet"],
                                 {**row, "gomp_spincount": SPIN_COUNTS[name]}) for name, row in table.items()]}
    print(write_record(args.out_dir, f"omp-wait-{time.strftime('%Y-%m-%d')}.json", record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
