"""towerlab's samplers side by side on one budget (issue 12's table, with towerlab's own samplers):
the mlp space on MNIST, every candidate one epoch at batch 128, 40 distinct trainings per run,
several seeds per method; the best validation accuracy after 10, 20 and 40 trainings, and each
run's pick (its winner) trained again with fresh seeds.

    python bench/quality/samplers.py                                  # the table: 6 seeds, 6 methods (~2.5 h, 2 cores)
    python bench/quality/samplers.py --dataset cifar10                # the same on CIFAR-10 (~2.5 h)
    python bench/quality/samplers.py --smoke                          # synthetic data, tiny budget: the plumbing (~2 min)
    python bench/quality/samplers.py --methods tpe-typed-lr tpe-listed-lr --seeds 0 1 2 --record typed-genes
                                  # issue 40: a learning-rate gene as a log range or as a list (~40 min)

Each run is a real `towerlab evolve` / `towerlab search run` on 2 CPU workers x 1 thread; its
figures come from its own store. Every method's pick is retrained with the same fresh seeds
(10000, 10001, ...) by the very function the search trains candidates with.
Re-measures (the noise-aware crowning) are extra trainings outside the 40; the table counts every
training. Writes bench/results/quality/samplers-<dataset>-<date>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import figure
from bench.quality import search_runs
from bench.quality.search_runs import best_at, best_so_far, mean_sd, pct, permutation_p, retrain

# name -> (command, settings): every method gets the same budget in distinct trainings.
METHODS = {
    "ga-p10": (["evolve"], {"population": 10, "remeasure": 0}),  # the GA as it was: each network measured once
    "ga-p10-remeasure": (["evolve"], {"population": 10, "remeasure": 2}),  # the elite and the pick by 3 seeds
    "ga-p20": (["evolve"], {"population": 20, "remeasure": 0}),
    "random": (["search", "run"], {"sampler": "random", "population": 2, "remeasure": 0}),
    "tpe": (["search", "run"], {"sampler": "tpe", "population": 2, "remeasure": 0}),
    "tpe-remeasure": (["search", "run"], {"sampler": "tpe", "population": 2, "remeasure": 2}),
}
# Issue 40's question: the mlp space with a learning-rate gene, as typed ranges (TPE gets Optuna's
# int and float distributions, log-uniform) or as today's lists (TPE treats each gene as categorical).
_MLP_GENES = {"activation": ["relu", "elu", "tanh", "sigmoid"],
              "optimizer": ["rmsprop", "adam", "sgd", "adagrad", "adadelta", "adamax", "nadam"]}
TYPED_SPACE = json.dumps({"model": "mlp", "genes": {
    "neurons": {"low": 64, "high": 1024, "log": True}, "layers": {"low": 1, "high": 4}, **_MLP_GENES,
    "lr": {"low": 1e-4, "high": 0.1, "log": True}}})
LISTED_SPACE = json.dumps({"model": "mlp", "genes": {
    "neurons": [64, 128, 256, 512, 768, 1024], "layers": [1, 2, 3, 4], **_MLP_GENES,
    "lr": [0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1]}})
METHODS["tpe-typed-lr"] = (["search", "run"], {"sampler": "tpe", "population": 2, "remeasure": 0,
                                               "space": TYPED_SPACE})
METHODS["tpe-listed-lr"] = (["search", "run"], {"sampler": "tpe", "population": 2, "remeasure": 0,
                                                "space": LISTED_SPACE})
BASELINE = "random"  # what the permutation tests compare with


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--methods", nargs="*", default=list(METHODS)[:6], choices=list(METHODS),
                        help="default: the six of issue 12's table; tpe-typed-lr and tpe-listed-lr: issue 40's")
    parser.add_argument("--record", default="samplers", help="the record's name: RECORD-DATASET-DATE.json")
    parser.add_argument("--seeds", nargs="*", type=int, default=list(range(6)))
    parser.add_argument("--budget", type=int, default=40, help="distinct trainings per run")
    parser.add_argument("--retrain", type=int, default=3, help="fresh seeds each pick is trained again with")
    parser.add_argument("--smoke", action="store_true", help="synthetic data, budget 6, 2 seeds, 1 retrain")
    search_runs.add_run_arguments(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.dataset, args.budget, args.seeds, args.retrain = "synthetic", 6, args.seeds[:2], 1
    val_size = 1000 if args.dataset == "synthetic" else 5000
    marks = [k for k in (10, 20, 40) if k < args.budget] + [args.budget]
    common = measure.flags({"space": "mlp", "dataset": args.dataset, "val_size": val_size, "max_epochs": 1,
                            "batch_size": 128, "max_evaluations": args.budget, "generations": 100 * args.budget,
                            "top": 1, "device": "cpu", "devices": args.devices, "threads": args.threads})
    retrain_seeds = search_runs.fresh_seeds(args.retrain)
    settings_of_candidates = {"dataset": args.dataset, "val_size": val_size, "max_epochs": 1, "batch_size": 128}
    runs_dir = search_runs.runs_dir(args, "sampler-runs")
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine.describe(), "dataset": args.dataset,
              "budget": args.budget, "retrain_seeds": retrain_seeds, "methods": {}}
    for name in args.methods:
        command, settings = METHODS[name]
        runs = []
        for seed in args.seeds:
            print(f"== {name}, seed {seed}", flush=True)
            run = search_runs.run_search(command, [*common, *measure.flags(settings), "--seed", str(seed)],
                                         runs_dir / f"{args.dataset}-{name}-s{seed}", args.data_dir,
                                         reuse=args.reuse)
            curve = best_so_far(run["records"])
            pick = run["summary"]["best_genome"]
            again = [r["val_accuracy"] for r in retrain(pick, settings_of_candidates, retrain_seeds, args.data_dir,
                                                         processes=args.devices, threads=args.threads)]
            s = run["summary"]
            runs.append({"seed": seed, "command": run["command"], "best_at": {k: best_at(curve, k) for k in marks},
                         "pick": pick, "pick_val_accuracy": s["best_val_accuracy"],
                         "pick_retrained": again, "pick_retrained_mean": mean_sd(again)["mean"],
                         "evaluations": s["evaluations"], "cache_hits": s["cache_hits"], "trainings": s["trainings"],
                         "train_seconds": s["train_seconds"], "wall_seconds": run["wall_seconds"],
                         "parts": run["parts"], "generations": s["generations"]})
            print(f"   best@{args.budget} {runs[-1]['best_at'][args.budget]:.4f}, pick {pick} retrained "
                  f"{runs[-1]['pick_retrained_mean']:.4f}; {s['trainings']} trainings, "
                  f"{s['cache_hits']} cache hits, {run['wall_seconds'] / 60:.1f} min", flush=True)
        record["methods"][name] = {
            "runs": runs,
            "best_at": {k: mean_sd([r["best_at"][k] for r in runs]) for k in marks},
            "pick_retrained": mean_sd([r["pick_retrained_mean"] for r in runs]),
            "trainings": mean_sd([r["trainings"] for r in runs]),
            "cache_hits": mean_sd([r["cache_hits"] for r in runs]),
            "wall_seconds": mean_sd([r["wall_seconds"] for r in runs]),
        }
    if BASELINE in record["methods"]:
        base = record["methods"][BASELINE]
        for name, method in record["methods"].items():
            method["p_vs_random"] = {
                "best": permutation_p(method["best_at"][args.budget]["values"], base["best_at"][args.budget]["values"]),
                "pick_retrained": permutation_p(method["pick_retrained"]["values"], base["pick_retrained"]["values"])}
    print(f"\n| method | {' | '.join(f'best @{k}' for k in marks)} | its pick, retrained ({args.retrain} seeds) | "
          f"trainings | cache hits | p vs random (best, pick) |")
    print("| --- |" + " --- |" * (len(marks) + 4))
    for name, m in record["methods"].items():
        p = m.get("p_vs_random", {})
        print(f"| {name} | {' | '.join(pct(m['best_at'][k]) for k in marks)} | {pct(m['pick_retrained'])} | "
              f"{m['trainings']['mean']:.1f} | {m['cache_hits']['mean']:.1f} | {p.get('best')}, {p.get('pick_retrained')} |")
    record["figures"] = figures(record["methods"], args.budget)
    search_runs.save(search_runs.records_dir(args), args.record, args.dataset, record)
    return 0


def figures(methods: dict, budget: int) -> list[dict]:
    """Each method's best at the whole budget and its pick retrained (means over the seeds; the spread
    and the p-value against random search in the detail)."""
    out = []
    for name, m in methods.items():
        p = m.get("p_vs_random", {})
        out.append(figure(f"best_{name}", m["best_at"][budget]["mean"], {**m["best_at"][budget], "evaluations": budget,
                                                                          "p_vs_random": p.get("best")}))
        out.append(figure(f"pick_retrained_{name}", m["pick_retrained"]["mean"],
                          {**m["pick_retrained"], "p_vs_random": p.get("pick_retrained")}))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
