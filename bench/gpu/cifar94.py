"""CIFAR-10 to 94% test accuracy, training seconds, one GPU: `towerlab train --preset cifar-94` over
several seeds, beside the public record.

    python bench/gpu/cifar94.py                   # 5 seeds of the preset as it is (one H100 in the target)
    python bench/gpu/cifar94.py --seeds 10
    python bench/gpu/cifar94.py --budget smoke    # seconds on a CPU: tiny synthetic data, tiny widths, 3 steps
    python bench/gpu/cifar94.py --airbench PATH/airbench94_muon.py    # the record run beside it, same card
    python bench/gpu/cifar94.py --flags "--val-size 5000 --epochs 11"  # the preset with flags of one's own

Each seed is a fresh `towerlab train` process; its figures come from its own summary.json:
test accuracy (mean, std over seeds), validation accuracy beside it, training seconds (`train_seconds`:
the optimizer steps and the whitening pass over 5,000 training images, the device synchronised at the
edges; no evaluation), and, apart, the setup time (`setup_seconds` where towerlab reports it: compilation,
graph capture) and the whole run's wall time. Writes bench/results/gpu/cifar94-<budget>-<date>.json.

With `--airbench FILE` (airbench94_muon.py from github.com/KellerJordan/cifar10-airbench, read and
never committed), that script runs first in its own process on the same card, with one change: its
200 runs become `--airbench-runs` (5). Its data comes from the same cifar10.npz, written as the
train.pt and test.pt it would otherwise build with torchvision's downloader. Its own figures are read
from its output: each run's test accuracy (its `tta_val_acc`, on the test set) and its `time_seconds`
(its CUDA-event timing: the whitening, the training steps and the final test-time-augmented
evaluation; its warm-up run, which compiles, is left out). The figure is then judged against that run's
median seconds.
Also `python bench/speed/run.py --suite gpu --only cifar94`.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.measure import preset_flags
from bench.common.record import RESULTS, script_command, write_record

PRESET = "cifar-94"
TARGET_ACCURACY = 0.94
TARGET_SECONDS = 1.8  # issue 13: 1.3x the record's 1.40 s measured here
RECORD = {
    "what": "airbench94_muon.py (K. Jordan, github.com/KellerJordan/cifar10-airbench), the public record",
    "measured_here": "94.01% mean test accuracy over 5 runs (std 0.12) in 1.40 s of training, one H100 80GB, "
                     "torch 2.11, side by side with towerlab's runs (issue 13)",
    "reported": "94.01% in 2.59 s on a 400W A100 (n=200, torch 2.4.1; the repository's README); the paper's "
                "airbench94: 94.01% in 3.83 s on an A100, 3.09 s compiled (arXiv 2404.00498)",
    "its_timing": "CUDA events around the whitening initialisation, then each epoch's training steps (its "
                  "data's per-epoch flip and crop included), then the final test-time-augmented evaluation; "
                  "the per-epoch evaluations, loading the data onto the GPU and torch.compile's compilation "
                  "(a whole warm-up run on random labels, in the same process) left out",
    "its_accuracy": "on the CIFAR-10 test set, on which its hyperparameters were tuned: it holds out no "
                    "validation split",
}
# What each side's clock covers, side by side (issue 57): airbench94_muon's includes one thing ours
# leaves out (the final test-time-augmented test pass, which is ours's test_seconds), and leaves out
# nothing that ours includes.
CLOCKS = {
    "both": "the whitening layer's fit to 5,000 training images and every optimizer step, with its batch's "
            "augmentation; the data already on the GPU; compilation and warm-up before the clock",
    "airbench94_muon_only": "its final test-time-augmented pass over the 10,000 test images (6 views each), "
                            "run after a whole warm-up run, so with every kernel loaded and tuned",
    "towerlab_only": "nothing: its final test pass (flip-translate, the same 6 views) is test_seconds, apart, and "
                     "is the first evaluation of its process (cuDNN's choice of algorithms for its shapes is in it)",
    "warm_up": "airbench94_muon compiles and runs one whole training on random labels before its timed runs, in "
               "the same process; towerlab runs each seed in a fresh process, whose 3 (or 6, one per program) "
               "warm-up steps, compilation included, are undone before its clock starts (setup_seconds)",
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


AIRBENCH_RUNS_LINE = "for run in range(200)"


def airbench_data(data_dir: str, folder: Path) -> None:
    """cifar10.npz as the train.pt and test.pt airbench's CifarLoader reads (uint8 NHWC images, int64
    labels, the class names), so it never reaches for torchvision's downloader."""
    import numpy as np
    import torch

    classes = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    with np.load(Path(data_dir) / "cifar10.npz") as arrays:
        for split in ("train", "test"):
            torch.save({"images": torch.from_numpy(arrays[f"x_{split}"]),
                        "labels": torch.from_numpy(arrays[f"y_{split}"].astype("int64")), "classes": classes},
                       folder / f"{split}.pt")


def airbench_rows(output: str) -> list[dict]:
    """Each run's final row of airbench's table (its `eval` line): test accuracy and seconds; the
    warm-up run's row, the first, is left out."""
    rows = []
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1] == "eval":
            rows.append({"accuracy": float(cells[4]), "seconds": float(cells[5])})
    return rows[1:]


def airbench(script: str, data_dir: str, runs: int, log: Log) -> dict:
    """airbench94_muon.py in its own process on this card, `runs` runs after its warm-up."""
    code = Path(script).read_text()
    if code.count(AIRBENCH_RUNS_LINE) != 1:
        raise SystemExit(f"cifar94: {script} does not hold {AIRBENCH_RUNS_LINE!r} once: not the script this "
                         "bench knows")
    with tempfile.TemporaryDirectory(prefix="airbench-") as tmp:
        folder = Path(tmp)
        (folder / "cifar10").mkdir()
        airbench_data(data_dir, folder / "cifar10")
        (folder / "airbench94_muon.py").write_text(code.replace(AIRBENCH_RUNS_LINE, f"for run in range({runs})"))
        log(f"[cifar94] airbench94_muon.py, {runs} runs after its warm-up")
        done = subprocess.run([sys.executable, "airbench94_muon.py"], cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cifar94: airbench94_muon.py failed:\n{done.stderr[-3000:]}")
    rows = airbench_rows(done.stdout)
    if len(rows) != runs:
        raise SystemExit(f"cifar94: read {len(rows)} runs from airbench94_muon.py's output, not {runs}")
    for i, row in enumerate(rows):
        log(f"  airbench run {i}: test {row['accuracy']:.4f}, {row['seconds']:.3f} s")
    return {"runs": rows, "change": f"{AIRBENCH_RUNS_LINE!r} -> 'for run in range({runs})'",
            "airbench94_muon_seconds": statistics.median(r["seconds"] for r in rows),
            "airbench94_muon_accuracy": statistics.fmean(r["accuracy"] for r in rows),
            "output_tail": done.stdout.splitlines()[-4:]}


def figure(data_dir: str, seeds: int, budget: str, log: Log, extra: list[str] | None = None,
           beside: dict | None = None) -> dict:
    """The figure: every seed's run, the accuracy spread, the training seconds, the record beside them
    (`beside`: airbench94_muon run in the same call, which then sets the seconds to beat)."""
    overrides = BUDGETS[budget]["overrides"]
    extra = extra or []
    samples = []
    log(f"[cifar94] towerlab --preset {PRESET} {shlex.join(extra)} ({budget}), seeds 0..{seeds - 1}")
    for seed in range(seeds):
        sample = measure.towerlab(preset_flags(PRESET, seed=seed, **overrides) + extra, data_dir)
        summary = sample["summary"]
        sample.update(value=summary["train_seconds"], unit="s", round=seed)
        samples.append(sample)
        val = "none" if summary["val_accuracy"] is None else f"{summary['val_accuracy']:.4f}"
        log(f"  seed {seed}: test {summary['test_accuracy']:.4f}, validation {val}, "
            f"training {summary['train_seconds']:.3f} s, setup {summary.get('setup_seconds')}, "
            f"test pass {summary.get('test_seconds')}, wall {summary['wall_seconds']:.1f} s, "
            f"{summary['world_size']} x {summary.get('device_type')}, {summary.get('step')} step")
    summaries = [s["summary"] for s in samples]
    test = _spread([s["test_accuracy"] for s in summaries])
    seconds = _spread([s["train_seconds"] for s in summaries])
    median_seconds = statistics.median(s["train_seconds"] for s in summaries)
    full = budget == "full"
    limit = beside["airbench94_muon_seconds"] if beside else TARGET_SECONDS
    limit_said = "airbench94_muon's median in this call" if beside else f"{TARGET_SECONDS:g} s"
    return {
        "id": "cifar94", "title": "whitenet (--preset cifar-94) to 94% CIFAR-10 test accuracy, training seconds, "
        "one GPU", "target": f"mean test >= {TARGET_ACCURACY:.0%} in <= {limit_said}",
        "target_value": limit, "value": median_seconds, "unit": "s",
        "met": (test["mean"] >= TARGET_ACCURACY and median_seconds <= limit) if full else None,
        "detail": {
            "budget": budget, "overrides": overrides, "flags": extra,
            **({"airbench94_muon_seconds": beside["airbench94_muon_seconds"],
                "airbench94_muon_accuracy": beside["airbench94_muon_accuracy"], "airbench94_muon": beside}
               if beside else {}),
            "test_accuracy": test, "val_accuracy": _spread([s["val_accuracy"] for s in summaries]),
            "seeds_reaching_target": sum(s["test_accuracy"] >= TARGET_ACCURACY for s in summaries),
            "train_seconds": {**seconds, "median": median_seconds},
            "setup_seconds": _spread([s.get("setup_seconds") for s in summaries]),
            "wall_seconds": _spread([s["wall_seconds"] for s in summaries]),
            "device_type": summaries[0].get("device_type"),
            "step": [s.get("step") for s in summaries],  # how each seed's step ran ("program": a failed compile)
            "our_accuracy": "test accuracy of the final weights on the 10,000 test images; the validation "
                            "accuracy is on 5,000 training images held out, never trained on",
            "our_timing": "train_seconds: the whitening pass and the optimizer steps (batches gathered and "
                          "augmented on the device inside each step), the device synchronised at the edges; "
                          "evaluations (each epoch's validation, the final test, all with flip-translate "
                          "test-time augmentation) are in the wall time only, the final test in test_seconds",
            "test_seconds": _spread([s.get("test_seconds") for s in summaries]),
            "clocks": CLOCKS,
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
        f"  validation accuracy  {val['mean']:.4f} +- {val['std']:.4f} (training images held out; the "
        "record has no validation split: it tunes on the test set)" if val["n"] else
        "  validation accuracy  none held out (--val-size 0, as the record: all 50,000 images train)",
        f"  training seconds     median {secs['median']:.3f}, mean {secs['mean']:.3f} (min {secs['min']:.3f}, "
        f"max {secs['max']:.3f})",
    ]
    setup, test_pass = d["setup_seconds"], d.get("test_seconds", {"n": 0})
    lines += [
        "  test pass seconds    " + (f"mean {test_pass['mean']:.3f} (the final test-time-augmented test, apart; "
                                     "airbench94_muon's clock holds its own)" if test_pass["n"] else "not reported"),

        "  setup seconds        " + (f"mean {setup['mean']:.2f}" if setup["n"] else
                                     "not reported by this towerlab (in the wall time below)"),
        f"  wall seconds         mean {d['wall_seconds']['mean']:.1f} (process start to summary, evaluations included)",
        *([f"  airbench94_muon      {d['airbench94_muon_accuracy']:.4f} mean test accuracy, median "
            f"{d['airbench94_muon_seconds']:.3f} s, {len(d['airbench94_muon']['runs'])} runs in this call"]
          if "airbench94_muon" in d else []),
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
    parser.add_argument("--flags", default="", help="towerlab train flags after the preset's (one string)")
    parser.add_argument("--airbench", default=None, metavar="FILE",
                        help="airbench94_muon.py: run it first on the same card and judge against it")
    parser.add_argument("--airbench-runs", type=int, default=5, help="its runs after its warm-up")
    parser.add_argument("--data-dir", default=measure.default_data_dir(), help="folder with cifar10.npz")
    parser.add_argument("--out-dir", default=str(RESULTS / "gpu"), help="where the JSON goes")
    args = parser.parse_args(argv)
    seeds = args.seeds or BUDGETS[args.budget]["seeds"]

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    info = machine.describe()
    beside = airbench(args.airbench, args.data_dir, args.airbench_runs, log) if args.airbench else None
    if beside is not None:  # kept now, should towerlab's side not finish
        write_record(args.out_dir, f"airbench94_muon-{datetime.date.today():%Y-%m-%d}.json",
                     {"date": measure.now(), "machine": info, "airbench94_muon": beside, "figures": [
                         {"id": "airbench94_muon_seconds", "value": beside["airbench94_muon_seconds"],
                          "detail": {"runs": len(beside["runs"]), "median of": "its runs' time_seconds"}},
                         {"id": "airbench94_muon_accuracy", "value": beside["airbench94_muon_accuracy"],
                          "detail": {"runs": len(beside["runs"]), "mean of": "its runs' tta_val_acc"}}]})
    fig = figure(args.data_dir, seeds, args.budget, log, shlex.split(args.flags), beside)
    record = {"suite": "cifar94", "budget": args.budget, "date": measure.now(), "machine": info,
              "command": measure.shown(script_command(__file__, argv),
                                       data_dir=args.data_dir, out_dir=args.out_dir, airbench=args.airbench or ""),
              "figures": [fig]}
    written = write_record(args.out_dir, f"cifar94-{args.budget}-{datetime.date.today():%Y-%m-%d}.json", record)
    print(report(fig))
    log(f"wrote {written}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
