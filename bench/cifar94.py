"""CIFAR-10 to 94% test accuracy, training seconds, one GPU: `towerlab train --preset cifar-94` over
several seeds, beside the public record.

    python bench/cifar94.py                   # 5 seeds of the preset as it is (one H100 in the target)
    python bench/cifar94.py --seeds 10
    python bench/cifar94.py --budget smoke    # seconds on a CPU: tiny synthetic data, tiny widths, 3 steps

Each seed is a fresh `towerlab train` process; its figures come from its own summary.json:
test accuracy (mean, std over seeds), validation accuracy beside it, training seconds (`train_seconds`:
the optimizer steps and the whitening pass over 5,000 training images, the device synchronised at the
edges; no evaluation), and, apart, the setup time (`setup_seconds` where towerlab reports it: compilation,
graph capture) and the whole run's wall time. Writes bench/results/cifar94-<budget>-<date>.json.
Also `python bench/run.py --suite gpu --only cifar94`.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import machine
import measure
from presets_bridge import preset_flags

PRESET = "cifar-94"
TARGET_ACCURACY = 0.94
TARGET_SECONDS = 1.8  # issue 13: 1.3x the record's 1.40 s measured here
RECORD = {
    "what": "airbench94_muon.py (K. Jordan, github.com/KellerJordan/cifar10-airbench), the public record",
    "measured_here": "94.01% mean test accuracy over 5 runs (std 0.12) in 1.40 s of training, one H100 80GB, "
                     "torch 2.11, side by side with towerlab's runs (issue 13)",
    "reported": "94.01% in 2.59 s on a 400W A100 (n=200, torch 2.4.1; the repository's README); the paper's "
                "airbench94: 94.01% in 3.83 s on an A100, 3.09 s compiled (arXiv 2404.00498)",
    "its_timing": "CUDA events around the whitening initialisation, the training steps and the final "
                  "test-time-augmented evaluation; torch.compile's compilation left out (a warm-up run)",
    "its_accuracy": "on the CIFAR-10 test set, on which its hyperparameters were tuned: it holds out no "
                    "validation split",
}
BUDGETS = {
    "full": {"seeds": 5, "overrides": {}},
    "quick": {"seeds": 1, "overrides": {"epochs": 1}},
    "smoke": {"seeds": 2, "overrides": {
        "dataset": "synthetic", "synthetic_shape": "3x32x32", "synthetic_train": 1200, "val_size": 200,
        "batch_size": 64, "steps": 3, "device": "cpu", "devices": 1, "threads": 1, "display_step": 1,
        "model_options": {"width1": 8, "width2": 16, "width3": 16}}},
}

Log = Callable[[str], None]


def _spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def figure(data_dir: str, seeds: int, budget: str, log: Log) -> dict:
    """The figure: every seed's run, the accuracy spread, the training seconds, the record beside them."""
    overrides = BUDGETS[budget]["overrides"]
    samples = []
    log(f"[cifar94] towerlab --preset {PRESET} ({budget}), seeds 0..{seeds - 1}")
    for seed in range(seeds):
        sample = measure.towerlab(preset_flags(PRESET, seed=seed, **overrides), data_dir)
        summary = sample["summary"]
        sample.update(value=summary["train_seconds"], unit="s", round=seed)
        samples.append(sample)
        log(f"  seed {seed}: test {summary['test_accuracy']:.4f}, validation {summary['val_accuracy']:.4f}, "
            f"training {summary['train_seconds']:.3f} s, setup {summary.get('setup_seconds')}, "
            f"wall {summary['wall_seconds']:.1f} s, {summary['world_size']} x {summary.get('device_type')}")
    summaries = [s["summary"] for s in samples]
    test = _spread([s["test_accuracy"] for s in summaries])
    seconds = _spread([s["train_seconds"] for s in summaries])
    median_seconds = statistics.median(s["train_seconds"] for s in summaries)
    full = budget == "full"
    return {
        "id": "cifar94", "title": "whitenet (--preset cifar-94) to 94% CIFAR-10 test accuracy, training seconds, "
        "one GPU", "target": f"mean test >= {TARGET_ACCURACY:.0%} in <= {TARGET_SECONDS:g} s",
        "target_value": TARGET_SECONDS, "value": median_seconds, "unit": "s",
        "met": (test["mean"] >= TARGET_ACCURACY and median_seconds <= TARGET_SECONDS) if full else None,
        "detail": {
            "budget": budget, "overrides": overrides,
            "test_accuracy": test, "val_accuracy": _spread([s["val_accuracy"] for s in summaries]),
            "seeds_reaching_target": sum(s["test_accuracy"] >= TARGET_ACCURACY for s in summaries),
            "train_seconds": {**seconds, "median": median_seconds},
            "setup_seconds": _spread([s.get("setup_seconds") for s in summaries]),
            "wall_seconds": _spread([s["wall_seconds"] for s in summaries]),
            "device_type": summaries[0].get("device_type"),
            "our_accuracy": "test accuracy of the final weights on the 10,000 test images; the validation "
                            "accuracy is on 5,000 training images held out, never trained on",
            "our_timing": "train_seconds: the whitening pass and the optimizer steps, the device synchronised "
                          "at the edges; evaluations (each epoch's validation, the final test, all with "
                          "flip-translate test-time augmentation) are in the wall time only",
            "record": RECORD,
        },
        "samples": {"towerlab": samples},
    }


def report(fig: dict) -> str:
    d = fig["detail"]
    test, val, secs = d["test_accuracy"], d["val_accuracy"], d["train_seconds"]
    lines = [
        fig["title"] + f" [{d['budget']}, {test['n']} seeds, {d['device_type']}]",
        f"  test accuracy        {test['mean']:.4f} +- {test['std']:.4f} (min {test['min']:.4f}, max {test['max']:.4f}); "
        f"{d['seeds_reaching_target']}/{test['n']} seeds >= {TARGET_ACCURACY:.0%}",
        f"  validation accuracy  {val['mean']:.4f} +- {val['std']:.4f} (5,000 held-out training images; the "
        "record has no validation split: it tunes on the test set)",
        f"  training seconds     median {secs['median']:.3f}, mean {secs['mean']:.3f} (min {secs['min']:.3f}, "
        f"max {secs['max']:.3f})",
    ]
    setup = d["setup_seconds"]
    lines += [
        "  setup seconds        " + (f"mean {setup['mean']:.2f}" if setup["n"] else
                                     "not reported by this towerlab (in the wall time below)"),
        f"  wall seconds         mean {d['wall_seconds']['mean']:.1f} (process start to summary, evaluations included)",
        f"  record               {RECORD['measured_here']}",
        f"                       reported: {RECORD['reported']}",
        f"  target               {fig['target']}: " + {True: "met", False: "NOT met", None: "not judged (budget "
                                                        f"{d['budget']})"}[fig["met"]],
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--budget", choices=tuple(BUDGETS), default="full",
                        help="full: the preset as it is; quick: 1 seed, 1 epoch; smoke: tiny synthetic runs "
                             "(CPU, seconds)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the budget's)")
    parser.add_argument("--data-dir", default=measure.default_data_dir(), help="folder with cifar10.npz")
    parser.add_argument("--out-dir", default=str(measure.BENCH / "results"), help="where the JSON goes")
    args = parser.parse_args(argv)
    seeds = args.seeds or BUDGETS[args.budget]["seeds"]

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    info = machine.describe()
    fig = figure(args.data_dir, seeds, args.budget, log)
    record = {"suite": "cifar94", "budget": args.budget, "date": measure.now(), "machine": info,
              "command": ["python", "bench/cifar94.py", *(argv if argv is not None else sys.argv[1:])],
              "figures": [fig]}
    written = machine.write_record(args.out_dir, f"cifar94-{args.budget}-{datetime.date.today():%Y-%m-%d}.json",
                                   record)
    print(report(fig))
    log(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
