"""Networks of the mlp space trained again with fresh seeds, exactly as a search trains a candidate:
how far apart two searches' picks really are once each is measured more than once.

    python bench/quality/retrain.py --dataset cifar10 neurons=1024,layers=3,activation=elu,optimizer=adagrad \\
        neurons=768,layers=2,activation=elu,optimizer=adagrad        # 3 seeds each, up to 10 epochs

Each genome is trained with seeds 10000, 10001, ... (`--seeds` of them) by towerlab's own
`train_candidate` under the search settings given here (the defaults are `bench/quality/pruning.py`'s:
up to 10 epochs, patience 5, 5,000 validation images), on 2 CPU processes x 1 thread. Prints each
genome's validation and test accuracy, mean +- sd, and the permutation p of each against the first;
writes bench/results/quality/retrain-<dataset>-<date>.json. `--reuse` takes the genomes that record already
holds (same settings, seeds and threads) from it and trains only the others.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine
from bench.common.record import figure
from bench.quality import search_runs
from bench.quality.search_runs import mean_sd, pct, permutation_p, retrain


def genome(text: str) -> dict:
    """`neurons=1024,layers=3,activation=elu,optimizer=adagrad` as a genome (whole numbers as ints)."""
    pairs = [item.partition("=") for item in text.split(",")]
    if not pairs or any(not key or not sep or not value for key, sep, value in pairs):
        raise argparse.ArgumentTypeError(f"{text!r} is not gene=value,gene=value,...")
    return {key: int(value) if value.isdigit() else value for key, _, value in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("genomes", nargs="+", type=genome, help="gene=value,... (the first is the reference)")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--val-size", type=int, default=5000)
    parser.add_argument("--max-epochs", type=int, default=10)
    parser.add_argument("--patience", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=None, help="None: the search's default for the data set")
    parser.add_argument("--seeds", type=int, default=3, help="fresh seeds each genome is trained with")
    search_runs.add_run_arguments(parser)
    args = parser.parse_args(argv)
    settings = {"dataset": args.dataset, "val_size": args.val_size, "max_epochs": args.max_epochs,
                "patience": args.patience, "batch_size": args.batch_size}
    seeds = search_runs.fresh_seeds(args.seeds)
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine.describe(), "settings": settings,
              "seeds": seeds, "threads": args.threads, "genomes": []}
    path = search_runs.records_dir(args) / search_runs.record_name("retrain", args.dataset)
    kept = _kept(path, record) if args.reuse else {}
    for pick in args.genomes:
        runs = kept.get(_key(pick)) or retrain(pick, settings, seeds, args.data_dir, processes=args.devices,
                                               threads=args.threads)
        val = mean_sd([r["val_accuracy"] for r in runs])
        entry = {"genome": pick, "runs": runs, "val": val, "test": mean_sd([r["test_accuracy"] for r in runs]),
                 "val_p_against_the_first": (permutation_p(val["values"], record["genomes"][0]["val"]["values"])
                                             if record["genomes"] else None)}
        record["genomes"].append(entry)
        print(f"{pick}: validation {pct(entry['val'])}, test {pct(entry['test'])}, "
              f"p against the first {entry['val_p_against_the_first']}", flush=True)
    record["figures"] = [figure(f"val_accuracy[{_shown(entry['genome'])}]", entry["val"]["mean"],
                                {"val": entry["val"], "test": entry["test"],
                                 "val_p_against_the_first": entry["val_p_against_the_first"]})
                         for entry in record["genomes"]]
    search_runs.save(search_runs.records_dir(args), "retrain", args.dataset, record)
    return 0


def _shown(pick: dict) -> str:
    return ",".join(f"{gene}={value}" for gene, value in pick.items())


def _key(pick: dict) -> str:
    return json.dumps(pick, sort_keys=True)


def _kept(path: Path, record: dict) -> dict:
    """The retrainings today's record at `path` holds for the same settings, seeds and threads as
    `record`, by genome."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    if any(old.get(k) != record[k] for k in ("settings", "seeds", "threads")):
        return {}
    return {_key(entry["genome"]): entry["runs"] for entry in old["genomes"]}


if __name__ == "__main__":
    raise SystemExit(main())
