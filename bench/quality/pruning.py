"""Early pruning against the unpruned genetic search, at the original's budget (population 20, 10
generations, up to 10 epochs with patience 5, the mlp space): how much training time the pruned
search (`--min-epochs 1 --prune-factor 3`: rungs of 1, 3 and 10 epochs) needs to reach the best
validation accuracy the unpruned one found, and where each ends.

    python bench/quality/pruning.py                          # MNIST, seeds 0-2 (1.1-1.5 h a seed on 2 CPU cores)
    python bench/quality/pruning.py --dataset cifar10 --seeds 0   # CIFAR-10 (2.2 h unpruned here, 0.6 h pruned)
    python bench/quality/pruning.py --smoke                  # synthetic data, 2 generations: the plumbing (~2 min)
    python bench/quality/pruning.py --prune-places new --reuse   # the pruned side with places over the new only
    python bench/quality/pruning.py --sampler tpe --reuse        # the pruned side under the default sampler
    python bench/quality/pruning.py --sampler tpe --no-pruning --reuse   # tpe unpruned: the sampler's share
    python bench/quality/pruning.py --dataset cifar10 --sampler tpe --no-pruning --seeds 0 \
        --unpruned-from bench/results/quality/pruning/pruning-tpe-cifar10-2026-11-23.json   # the GA side read back
    python bench/quality/pruning.py --dataset cifar10 --seeds 0 --generations 20 \
        --unpruned-from bench/results/quality/pruning/pruning-cifar10-2026-11-23.json   # the pruned GA, 20 generations

Both searches run as real `towerlab evolve` jobs with the same seed, 2 CPU workers x 1 thread, each
network measured once (--remeasure 0) so that the two differ by the pruning alone. Training time
is the sum of every training's seconds in the order they finished (worker-seconds: every rung
counted), read from each search's store; the best at a time counts only trainings of the full
--max-epochs. Each side's pick (its best network, measured once in the search) is then trained
again with `--retrain` fresh seeds (10000, 10001, ...) exactly as the search trained it, so that a
lead is a network's and not a lucky seed's; the result is kept beside the run (bench-retrain.json)
for `--reuse`. Writes bench/results/quality/pruning/pruning-<dataset>-<date>.json (pruning-new-... with
`--prune-places new`, pruning-tpe-... with `--sampler tpe`: the pruned side as `towerlab search run
--sampler tpe` with the same population, against the same unpruned GA; each such pruned side has its
own folders, and `--reuse` keeps the unpruned ones). `--no-pruning` runs that second side at the
same budget without pruning (folders `<dataset>-unpruned-<sampler>-s<seed>`, record
pruning-unpruned-<sampler>-...; its "pruned" entries are then that search's): a difference between the
unpruned GA and the pruned sampler is then split into the sampler's share and the pruning's.
`--unpruned-from RECORD` takes the unpruned GA of each seed from a record this script wrote (its
curve, figures, noise and retrained pick, where the record has them) instead of running it again:
hours saved on CIFAR-10, at the price of comparing two days' clocks. `--generations N` gives the
second side N generations (folders and record named `...-g<N>-...`) while the GA keeps the budget's
10: a pruned generation costs a fraction of an unpruned one, so within the target's third of the
GA's training it can search longer; a search's history does not depend on its number of
generations, so its first 10 are those of the 10-generation run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import figure
from bench.quality import search_runs
from bench.quality.search_runs import (TRAINING_SETTINGS, best_by, best_so_far, mean_sd, pct, permutation_p, retrain, seconds_to_reach,
                         waiting)

BUDGET = {"population": 20, "generations": 10, "max_epochs": 10, "patience": 5}
PRUNING = {"min_epochs": 1, "prune_factor": 3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--smoke", action="store_true", help="synthetic data, population 6, 2 generations, 1 seed")
    parser.add_argument("--prune-places", choices=("all", "new"), default="all",
                        help="the pruned search's --prune-places")
    parser.add_argument("--sampler", choices=("ga", "tpe", "random"), default="ga",
                        help="the pruned search's sampler (the unpruned side is the original's: the ga)")
    parser.add_argument("--no-pruning", action="store_true",
                        help="the second side at the same budget without pruning: --sampler alone")
    parser.add_argument("--retrain", type=int, default=3,
                        help="fresh seeds each side's pick is trained again with (0: none)")
    parser.add_argument("--unpruned-from", type=Path, metavar="RECORD",
                        help="read the unpruned GA of each seed from this record of an earlier run of this script")
    parser.add_argument("--generations", type=int, metavar="N",
                        help="the second side's generations (default: the budget's): a pruned generation costs less "
                             "training, so the same training buys more of them")
    search_runs.add_run_arguments(parser)
    args = parser.parse_args(argv)
    if args.no_pruning and (args.sampler == "ga" or args.prune_places != "all"):
        parser.error("--no-pruning runs another sampler unpruned beside the unpruned GA: name --sampler, "
                     "not --prune-places")
    budget = dict(BUDGET)
    if args.smoke:
        args.dataset, args.seeds = "synthetic", args.seeds[:1]
        budget.update(population=6, generations=2, max_epochs=3, patience=3)
        args.retrain = min(args.retrain, 2)
    if args.generations is not None and args.generations < 1:
        parser.error(f"--generations {args.generations}: a search has at least 1 generation")
    recorded = _recorded_unpruned(parser, args.unpruned_from, args.dataset, budget, args.seeds) if args.unpruned_from else {}
    common = {"space": "mlp", "dataset": args.dataset, **budget, "remeasure": 0, "top": 1,
              "device": "cpu", "devices": args.devices, "threads": args.threads}
    runs_dir = search_runs.runs_dir(args, "pruning-runs")
    pruning, pruned = ({}, "unpruned") if args.no_pruning else (dict(PRUNING), "pruned")
    one, two = ("ga", args.sampler) if args.no_pruning else ("unpruned", "pruned")  # the sides, as printed
    shown = {"unpruned": one, "pruned": two}
    if args.prune_places == "new":
        pruning["prune_places"], pruned = "new", pruned + "-new"
    ga = args.sampler == "ga"
    if not ga:
        pruning["sampler"], pruned = args.sampler, pruned + "-" + args.sampler
    if args.generations not in (None, budget["generations"]):  # replaces the budget's in the second side's flags
        pruning["generations"], pruned = args.generations, pruned + f"-g{args.generations}"
    pruned_command = ["evolve"] if ga else ["search", "run"]
    retrain_seeds = search_runs.fresh_seeds(args.retrain)
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine.describe(), "dataset": args.dataset,
              "budget": budget, "pruning": pruning, "retrain_seeds": retrain_seeds, "seeds": []}
    if recorded:
        record["unpruned_from"] = {"record": args.unpruned_from.name, "date": recorded["date"]}
        print(f"the unpruned GA read from {args.unpruned_from} (measured {recorded['date']}): "
              f"ratios against it compare two runs' clocks", flush=True)
    for seed in args.seeds:
        sides = {"unpruned": recorded["sides"][seed]} if recorded else {}
        for name, command, settings, folder in (("unpruned", ["evolve"], common, "unpruned"),
                                                ("pruned", pruned_command, {**common, **pruning}, pruned)):
            if name in sides:
                continue
            print(f"== {folder}, seed {seed}", flush=True)
            out = runs_dir / f"{args.dataset}-{folder}-s{seed}"
            run = search_runs.run_search(command, [*measure.flags(settings), "--seed", str(seed)], out,
                                         args.data_dir, reuse=args.reuse)
            curve = best_so_far(run["records"], budget["max_epochs"])
            s = run["summary"]
            search = json.loads((out / "config.json").read_text())["search"]
            again = (retrain(s["best_genome"], {k: search[k] for k in TRAINING_SETTINGS}, retrain_seeds,
                             args.data_dir, processes=args.devices, threads=args.threads,
                             cache=out / "bench-retrain.json") if retrain_seeds else [])
            sides[name] = {"command": run["command"], "best": curve[-1][1] if curve else None, "curve": curve,
                           "trained_to_the_end": curve[-1][2] if curve else 0,  # distinct networks, full epochs
                           "train_seconds": s["train_seconds"], "trainings": s["trainings"],
                           "evaluations": s["evaluations"], "wall_seconds": run["wall_seconds"], "parts": run["parts"],
                           "waiting": waiting(run["records"]),
                           "best_test_accuracy": s["best_test_accuracy"], "best_genome": s["best_genome"],
                           # the pick trained again with fresh seeds: is its lead a network's or a seed's?
                           **_retrained(again)}
        target = sides["unpruned"]["best"]
        reached = {name: seconds_to_reach(side["curve"], target) for name, side in sides.items()}
        # "the same best within noise": one binomial standard error of an accuracy on the validation set
        if recorded:
            noise = recorded["noise"][seed]
        else:
            config = runs_dir / f"{args.dataset}-unpruned-s{seed}" / "config.json"
            val_size = json.loads(config.read_text())["search"]["val_size"]
            noise = math.sqrt(target * (1 - target) / val_size)
        near = {name: seconds_to_reach(side["curve"], target - noise) for name, side in sides.items()}
        # the same budget: where the unpruned search stood when it had trained as long as the pruned one in all
        level = best_by(sides["unpruned"]["curve"], sides["pruned"]["train_seconds"])
        row = {"seed": seed, "target": target, "seconds_to_target": reached,
               "ratio": reached["pruned"] / reached["unpruned"] if reached["pruned"] is not None else None,
               "noise": noise, "seconds_to_within_noise": near,
               "ratio_within_noise": near["pruned"] / near["unpruned"] if near["pruned"] is not None else None,
               # against what the unpruned search costs at this budget: a user cannot know when it found its best
               "within_noise_of_unpruned_training": (near["pruned"] / sides["unpruned"]["train_seconds"]
                                                     if near["pruned"] is not None else None),
               "unpruned_best_at_pruned_training": level,
               "retrained_val_difference": _difference(sides, "retrained_val"),
               "retrained_test_difference": _difference(sides, "retrained_test"),
               "retrained_val_p": permutation_p(sides["pruned"]["retrained_val"]["values"],
                                                sides["unpruned"]["retrained_val"]["values"]),
               **{name: {k: v for k, v in side.items() if k != "curve"} for name, side in sides.items()},
               "curves": {name: side["curve"] for name, side in sides.items()}}
        record["seeds"].append(row)
        print(f"   {one} best {target:.4f} {_after(reached['unpruned'])} "
              f"({sides['unpruned']['train_seconds']:.0f} s in all, {sides['unpruned']['trained_to_the_end']} "
              f"networks trained to the end); {two} best {sides['pruned']['best']:.4f} "
              f"({sides['pruned']['trained_to_the_end']} trained to the end), "
              f"the {one} best reached "
              f"{_after(reached['pruned'])} ({sides['pruned']['train_seconds']:.0f} s in all); within noise "
              f"(>= {target - noise:.4f}): {one} {_after(near['unpruned'])}, {two} {_after(near['pruned'])}; "
              f"the {one} best after {sides['pruned']['train_seconds']:.0f} s of training: "
              f"{'-' if level is None else f'{level:.4f}'}",
              flush=True)
        for name, side in sides.items():
            if side["waiting"] is None:  # read from a record older than the waiting figures
                continue
            print(f"   {shown[name]}: {side['train_seconds']:.0f} s of training in {side['wall_seconds']:.0f} s wall on "
                  f"{side['waiting']['workers']} workers; they waited {side['waiting']['inside_generations']:.0f} worker-s "
                  f"inside generations, {side['waiting']['between_generations']:.0f} between them", flush=True)
        if retrain_seeds:
            print(f"   the picks trained again with seeds {retrain_seeds}: {one} {sides['unpruned']['best_genome']} "
                  f"{pct(sides['unpruned']['retrained_val'])} (test {pct(sides['unpruned']['retrained_test'])}); "
                  f"{two} {sides['pruned']['best_genome']} {pct(sides['pruned']['retrained_val'])} "
                  f"(test {pct(sides['pruned']['retrained_test'])}); p = {row['retrained_val_p']}", flush=True)
    ratios = [r["ratio"] for r in record["seeds"] if r["ratio"] is not None]
    noisy = [r["ratio_within_noise"] for r in record["seeds"] if r["ratio_within_noise"] is not None]
    of_all = [r["within_noise_of_unpruned_training"] for r in record["seeds"]
              if r["within_noise_of_unpruned_training"] is not None]
    record["summary"] = {
        "ratio_median": statistics.median(ratios) if ratios else None,
        "reached": f"{len(ratios)} of {len(record['seeds'])}",
        "ratio_within_noise_median": statistics.median(noisy) if noisy else None,
        "reached_within_noise": f"{len(noisy)} of {len(record['seeds'])}",
        "within_noise_of_unpruned_training_median": statistics.median(of_all) if of_all else None,
        "best_unpruned": mean_sd([r["unpruned"]["best"] for r in record["seeds"]]),
        "best_pruned": mean_sd([r["pruned"]["best"] for r in record["seeds"]]),
        "unpruned_best_at_pruned_training": mean_sd([r["unpruned_best_at_pruned_training"] for r in record["seeds"]]),
        "train_seconds_ratio": mean_sd([r["pruned"]["train_seconds"] / r["unpruned"]["train_seconds"]
                                        for r in record["seeds"]]),
        "retrained_val_difference": mean_sd([r["retrained_val_difference"] for r in record["seeds"]]),
        "retrained_test_difference": mean_sd([r["retrained_test_difference"] for r in record["seeds"]]),
    }
    summary = record["summary"]
    print(f"\n| {args.dataset} | best {one} | best {two} | {one} best after the {two} search's training "
          f"| training time to the {one} best, {two} / "
          f"{one} (median) | reached | the same within noise | reached | the same within noise, against the "
          f"{one} search's training in all (median) | all training, {two} / {one} | the picks retrained, "
          f"{two} - {one}, validation (test) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {len(record['seeds'])} seed(s) | {pct(summary['best_unpruned'])} | {pct(summary['best_pruned'])} | "
          f"{pct(summary['unpruned_best_at_pruned_training'])} | "
          f"{_times(summary['ratio_median'])} | {summary['reached']} | "
          f"{_times(summary['ratio_within_noise_median'])} | "
          f"{summary['reached_within_noise']} | {_times(summary['within_noise_of_unpruned_training_median'])} | "
          f"{summary['train_seconds_ratio']['mean']:.2f}x | {_points(summary['retrained_val_difference'])} "
          f"({_points(summary['retrained_test_difference'])}) |")
    record["figures"] = figures(summary)
    kind = "pruning" + (f"-{pruned}" if args.no_pruning else pruned.removeprefix("pruned"))
    search_runs.save(search_runs.records_dir(args, "pruning"), kind, args.dataset, record)
    return 0


def figures(summary: dict) -> list[dict]:
    """The summary's figures: each mean over the seeds (its spread in the detail), each median (how many
    seeds reached it)."""
    spread = ("best_unpruned", "best_pruned", "unpruned_best_at_pruned_training", "train_seconds_ratio",
              "retrained_val_difference", "retrained_test_difference")
    return [figure(key, summary[key]["mean"], summary[key]) for key in spread] + [
        figure("ratio_median", summary["ratio_median"], {"reached": summary["reached"]}),
        figure("ratio_within_noise_median", summary["ratio_within_noise_median"],
               {"reached": summary["reached_within_noise"]}),
        figure("within_noise_of_unpruned_training_median", summary["within_noise_of_unpruned_training_median"])]


def _recorded_unpruned(parser: argparse.ArgumentParser, path: Path, dataset: str, budget: dict,
                       seeds: list[int]) -> dict:
    """The unpruned GA's side of each of `seeds` as an earlier run of this script recorded it in `path`
    (fields its older records lack are empty), with its noise and the record's date; a record of
    another dataset or budget, or one without a seed asked for, is refused before anything runs."""
    try:
        text = path.read_text()
    except OSError as e:
        parser.error(f"--unpruned-from {path}: cannot be read ({e.strerror})")
    try:
        record = json.loads(text)
        rows = {row["seed"]: row for row in record["seeds"]}
        if (record["dataset"], record["budget"]) != (dataset, budget):
            parser.error(f"--unpruned-from {path}: its unpruned GA ran on {record['dataset']} with "
                         f"{record['budget']}, not on {dataset} with {budget}")
    except (ValueError, KeyError, TypeError) as e:
        parser.error(f"--unpruned-from {path}: not a record of bench/quality/pruning.py ({e!r})")
    if missing := [seed for seed in seeds if seed not in rows]:
        parser.error(f"--unpruned-from {path}: no seed {', '.join(map(str, missing))} in it "
                     f"(it has {', '.join(map(str, sorted(rows)))})")
    sides = {}
    for seed in seeds:
        side = dict(rows[seed]["unpruned"], curve=rows[seed]["curves"]["unpruned"])
        side.setdefault("waiting", None)
        side.setdefault("best_genome", None)
        side.update(_retrained(side.get("retrained", [])))
        sides[seed] = side
    return {"date": record["date"], "sides": sides, "noise": {seed: rows[seed]["noise"] for seed in seeds}}


def _retrained(again: list[dict]) -> dict:
    """A pick's retrainings with their validation and test accuracy, mean +- sd."""
    return {"retrained": again, "retrained_val": mean_sd([r["val_accuracy"] for r in again]),
            "retrained_test": mean_sd([r["test_accuracy"] for r in again])}


def _after(seconds: float | None) -> str:
    return "never" if seconds is None else f"after {seconds:.0f} s of training"


def _difference(sides: dict, figure: str) -> float | None:
    """The pruned pick's mean over its retrainings less the unpruned pick's (None without both)."""
    pruned, unpruned = sides["pruned"][figure]["mean"], sides["unpruned"][figure]["mean"]
    return None if pruned is None or unpruned is None else pruned - unpruned


def _points(stat: dict) -> str:
    """A difference of accuracies in percentage points, mean +- sd over seeds."""
    if stat["mean"] is None:
        return "-"
    return f"{100 * stat['mean']:+.2f}" + (f" +- {100 * stat['sd']:.2f}" if stat["sd"] is not None else "")


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


if __name__ == "__main__":
    raise SystemExit(main())
