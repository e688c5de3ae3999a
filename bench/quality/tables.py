"""The search-quality family's tables (docs/benchmarks.md), each number read from its record."""

from __future__ import annotations

from bench.common.tables import Cell, Ref, Table, lookup


def _samplers(record: str) -> Table:
    methods = lookup(record, "methods")
    return Table(
        ("method", "best @10", "best @20", "best @40", "its pick, retrained", "trainings", "cache hits", "p vs random (best, pick)"),
        tuple(
            (f"`{m}`",) + tuple(Ref(record, f"methods/{m}/best_at/{k}", "pct_sd") for k in ("10", "20", "40"))
            + (Ref(record, f"methods/{m}/pick_retrained", "pct_sd"), Ref(record, f"methods/{m}/trainings/mean", "num"),
               Ref(record, f"methods/{m}/cache_hits/mean", "num"),
               (Ref(record, f"methods/{m}/p_vs_random/best", "p"), ", ", Ref(record, f"methods/{m}/p_vs_random/pick_retrained", "p")))
            for m in methods
        ),
    )


HEADLINE_SEARCH = Table(
    ("search", "best validation accuracy", "its test accuracy", "evaluations / cache hits", "wall time"),
    tuple(
        (title, Ref(rec, f"searches/{ds}/best_val_accuracy", "pct"), Ref(rec, f"searches/{ds}/best_test_accuracy", "pct"),
         (Ref(rec, f"searches/{ds}/evaluations", "int"), " / ", Ref(rec, f"searches/{ds}/cache_hits", "int")),
         Ref(rec, f"searches/{ds}/wall_seconds", "s0"))
        for title, rec, ds in (
            ("MNIST, up to 3 epochs a candidate", "quality/search-cpu-2026-11-22.json", "mnist"),
            ("CIFAR-10, up to 3 epochs", "quality/search-cpu-2026-11-22.json", "cifar10"),
            ("CIFAR-10, up to 10 epochs", "quality/search-cpu-long-2026-11-22.json", "cifar10"),
        )
    ),
)

def _pruning_row(side: str, record: str, seed: int) -> tuple[Cell, ...]:
    dataset = lookup(record, "dataset")
    at = f"seeds/{seed}"
    return (
        f"{'MNIST' if dataset == 'mnist' else 'CIFAR-10'} seed {seed}", side,
        Ref(record, f"{at}/unpruned/best", "pct"), Ref(record, f"{at}/pruned/best", "pct"),
        Ref(record, f"{at}/pruned/train_seconds", "x", over=f"{at}/unpruned/train_seconds"),
        Ref(record, f"{at}/within_noise_of_unpruned_training", "x", none="never"),
    )


def _pruning_rows(side: str, records: tuple[tuple[str, tuple[int, ...]], ...]) -> tuple[tuple[Cell, ...], ...]:
    return tuple(_pruning_row(side, record, seed) for record, seeds in records for seed in seeds)


PRUNING = Table(
    ("data set, seed", "pruned search", "unpruned GA's best", "pruned search's best", "its training in all, over the GA's",
     "training to within noise of the GA's best, over the GA's training in all"),
    _pruning_rows("GA, 10 generations", (
        ("quality/pruning/pruning-mnist-2026-11-23.json", (0, 1, 2)), ("quality/pruning/pruning-mnist-seed3-2026-11-24.json", (3,)),
        ("quality/pruning/pruning-mnist-seed4-2026-11-24.json", (4,)), ("quality/pruning/pruning-mnist-seed5-2026-11-24.json", (5,)),
        ("quality/pruning/pruning-cifar10-2026-11-23.json", (0, 1)),
    )) + _pruning_rows("GA, 20 generations", (
        ("quality/pruning/pruning-g20-mnist-seed4-2026-11-25.json", (4,)), ("quality/pruning/pruning-g20-mnist-seed6-2026-11-25.json", (6,)),
        ("quality/pruning/pruning-g20-mnist-seed7-2026-11-25.json", (7,)), ("quality/pruning/pruning-g20-cifar10-2026-11-25.json", (0,)),
        ("quality/pruning/pruning-g20-cifar10-seed1-2026-11-25.json", (1,)),
    )) + _pruning_rows("TPE", (
        ("quality/pruning/pruning-tpe-mnist-2026-11-23.json", (0, 1, 2)), ("quality/pruning/pruning-tpe-mnist-seed3-2026-11-24.json", (3,)),
        ("quality/pruning/pruning-tpe-mnist-seed4-2026-11-24.json", (4,)), ("quality/pruning/pruning-tpe-mnist-seed5-2026-11-24.json", (5,)),
        ("quality/pruning/pruning-tpe-mnist-seed6-2026-11-25.json", (6,)), ("quality/pruning/pruning-tpe-mnist-seed7-2026-11-25.json", (7,)),
        ("quality/pruning/pruning-tpe-cifar10-2026-11-23.json", (0, 1)),
    )) + _pruning_rows("GA, `--prune-places new`", (
        ("quality/pruning/pruning-new-mnist-2026-11-23.json", (0, 1, 2)), ("quality/pruning/pruning-new-cifar10-2026-11-23.json", (0,)),
    )),
)

# The figures issue 64 measured for each anchor (mean regret at 25%, 50%, 100% of the budget), beside ours.
_LCBENCH_ISSUE = {"random": "0.281, 0.221, 0.189", "tpe": "0.197, 0.146, 0.124", "tpe-hyperband": "0.267, 0.246, 0.217",
                  "tpe-sha": "0.502, 0.485, 0.461", "gp": "0.079, 0.026, 0.014", "dehb": "0.282, 0.216, 0.166",
                  "ga": "0.316, 0.237, 0.147", "towerlab-tpe": "0.224, 0.163, 0.134 (Optuna's TPE asked 4 at a time)"}


def _lcbench(record: str, issue: bool) -> Table:
    """A bench/quality/lcbench.py record's arms: regret at 25/50/100%, runs, trainings, CPU and wall time (and, on the
    10 open tasks, the figures issue 64 gave)."""
    head = ("method", "regret at 25%", "at 50%", "at 100%", "runs", "trainings a run", "CPU s proposing, a run",
            "wall s a run")
    return Table(
        head + (("issue 64's figures",) if issue else ()),
        tuple(
            (lookup(record, f"arms/{arm}/what"),)
            + tuple(Ref(record, f"arms/{arm}/points/{p}", "r3") for p in ("0.25", "0.5", "1.0"))
            + (Ref(record, f"arms/{arm}/runs", "int"), Ref(record, f"arms/{arm}/trainings", "num"),
               Ref(record, f"arms/{arm}/sampler_seconds", "num", none="in its workers"),
               Ref(record, f"arms/{arm}/wall_seconds", "s0"))
            + ((_LCBENCH_ISSUE.get(arm, ""),) if issue else ())
            for arm in lookup(record, "arms")
        ),
    )


def _rbv2(record: str) -> Table:
    """A bench/quality/rbv2_xgboost.py record's arms: regret at 25/50/100% of its 150 trainings, runs and their
    seeds, CPU and wall time."""
    return Table(
        ("method", "regret at 25%", "at 50%", "at 100%", "runs", "seeds", "CPU s proposing, a run", "wall s a run"),
        tuple(
            (lookup(record, f"arms/{arm}/what"),)
            + tuple(Ref(record, f"arms/{arm}/points/{p}", "r3") for p in ("0.25", "0.5", "1.0"))
            + (Ref(record, f"arms/{arm}/runs", "int"),
               ", ".join(lookup(record, f"arms/{arm}/per_seed/1.0")),
               Ref(record, f"arms/{arm}/sampler_seconds", "num", none="in its workers"),
               Ref(record, f"arms/{arm}/wall_seconds", "s0"))
            for arm in lookup(record, "arms")
        ),
    )


def _lcbench_parallel(record: str) -> Table:
    """A bench/quality/lcbench_parallel.py record's arms: regret at 25/50/100% (its standard error), runs,
    trainings and wall time a run, and for towerlab's default the trainings in flight when it proposed."""
    def regret(arm: str, p: str) -> Cell:
        return (Ref(record, f"arms/{arm}/points/{p}", "r3"), " ± ",
                Ref(record, f"arms/{arm}/standard_error/{p}", "r3"))

    return Table(
        ("method", "workers", "regret at 25%", "at 50%", "at 100%", "runs", "trainings a run", "wall s a run",
         "in flight at a proposal"),
        tuple(
            (lookup(record, f"arms/{arm}/what"),
             "any" if lookup(record, f"arms/{arm}/workers") == 0 else Ref(record, f"arms/{arm}/workers", "int"))
            + tuple(regret(arm, p) for p in ("0.25", "0.5", "1.0"))
            + (Ref(record, f"arms/{arm}/runs", "int"), Ref(record, f"arms/{arm}/trainings", "num"),
               Ref(record, f"arms/{arm}/wall_seconds", "s0"),
               Ref(record, f"arms/{arm}/in_flight_at_proposal", "num") if arm.startswith("towerlab") else "")
            for arm in lookup(record, "arms")
        ),
    )


TABLES: dict[str, Table] = {
    "samplers-mnist": _samplers("quality/samplers-mnist-2026-11-22.json"),
    "samplers-cifar10": _samplers("quality/samplers-cifar10-2026-11-23.json"),
    "search-headline": HEADLINE_SEARCH,
    "pruning": PRUNING,
    "lcbench": _lcbench("quality/lcbench-2026-11-28.json", issue=True),
    "lcbench-held-out": _lcbench("quality/lcbench-held-out-2026-11-28.json", issue=False),
    "lcbench-default": _lcbench("quality/lcbench-default-2026-12-07.json", issue=False),
    "lcbench-default-held-out": _lcbench("quality/lcbench-held-out-2026-12-07.json", issue=False),
    "lcbench-anchors": _lcbench("quality/lcbench-anchors-2026-12-08.json", issue=False),
    "lcbench-pruned": _lcbench("quality/lcbench-pruned-continued-2026-12-07.json", issue=False),
    "lcbench-pruned-async": _lcbench("quality/lcbench-pruned-async-2026-12-07.json", issue=False),
    "lcbench-pruned-better-half": _lcbench("quality/lcbench-pruned-better-half-2026-12-07.json", issue=False),
    "lcbench-pruned-held-out": _lcbench("quality/lcbench-pruned-held-out-2026-12-07.json", issue=False),
    "rbv2": _rbv2("quality/rbv2-xgboost-2026-12-08.json"),
    "lcbench-parallel": _lcbench_parallel("quality/lcbench-parallel-2026-12-06-b.json"),
}
