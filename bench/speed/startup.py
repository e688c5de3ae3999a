"""How fast the command line answers before any work: `towerlab --help`, `towerlab train --help` and a
mistyped flag (`towerlab train --dev 2`, exit 2), against `python -c "import torch"`, each in a fresh
interpreter, the sides alternated within a round, the median of the rounds.

    python bench/speed/startup.py                   # 7 rounds of the 4 sides (~1 min on 2 cores)

The target (issue 39): every CLI side at most 0.3x the time of importing torch, which the CLI no
longer does before a command runs. Each sample records the cores others kept busy meanwhile, so a
reader can discount a busy round. Writes results/speed/startup-<date>.json.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import REPO, RESULTS, figure, script_command, write_record

SIDES = {
    "import_torch": ["-c", "import torch"],
    "help": ["-m", "towerlab", "--help"],
    "train_help": ["-m", "towerlab", "train", "--help"],
    "flag_error": ["-m", "towerlab", "train", "--dev", "2"],
}
EXIT_STATUS = {"flag_error": 2}
TARGET = 0.3


def sample(side: str) -> dict:
    """One fresh interpreter running `side`: its wall seconds and the foreign load meanwhile."""
    # The worktree's towerlab, whatever is installed (the same code the tests import).
    env = {**measure.child_env(), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                         os.environ.get("PYTHONPATH")]))}
    with machine.CpuWatch() as watch:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, *SIDES[side]], capture_output=True, text=True, env=env,
                              cwd=REPO, timeout=300)
        seconds = time.perf_counter() - started
    if done.returncode != EXIT_STATUS.get(side, 0):
        raise SystemExit(f"startup.py: {side} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return {"seconds": seconds, "foreign_cores": watch.use.as_dict()["foreign_cores"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out-dir", default=str(RESULTS / "speed"))
    args = parser.parse_args(argv)
    samples: dict[str, list[dict]] = {side: [] for side in SIDES}
    for _ in range(2):  # warm the page cache, so no side pays for reading torch's files from disk
        for side in SIDES:
            sample(side)
    for r in range(args.rounds):
        machine.wait_for_quiet(timeout=10.0)
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        for side in order:
            samples[side].append({"round": r, **sample(side)})
        print(f"round {r}: " + ", ".join(f"{s} {samples[s][-1]['seconds']:.2f} s" for s in SIDES), flush=True)
    medians = {side: statistics.median(s["seconds"] for s in runs) for side, runs in samples.items()}
    ratios = {side: medians[side] / medians["import_torch"] for side in SIDES if side != "import_torch"}
    print("\n| command | median s | / import torch |")
    print("| --- | --- | --- |")
    for side, argv_ in SIDES.items():
        shown = shlex.join(["python", *argv_] if side == "import_torch" else ["towerlab", *argv_[2:]])
        ratio = f"{ratios[side]:.2f}x" if side in ratios else ""
        print(f"| `{shown}` | {medians[side]:.3f} | {ratio} |")
    record = {"date": measure.now(), "machine": machine.describe(),
              "command": script_command(__file__, argv),
              "rounds": args.rounds, "sides": {side: ["python", *a] for side, a in SIDES.items()},
              "target_ratio": TARGET, "samples": samples, "median_seconds": medians,
              "ratio_to_import_torch": ratios, "within_target": all(r <= TARGET for r in ratios.values()),
              "figures": [figure(f"{side}_over_import_torch", ratio, {"median_seconds": medians[side],
                                                                       "import_torch_seconds": medians["import_torch"],
                                                                       "target": TARGET, "met": ratio <= TARGET})
                          for side, ratio in ratios.items()]}
    print(write_record(args.out_dir, f"startup-{time.strftime('%Y-%m-%d')}.json", record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
