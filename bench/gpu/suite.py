"""The GPU figures, measured on one H100 (2026-11-25) and one H200 (2026-11-26); their records are in
bench/results/gpu-*. `unavailable()` makes `--suite gpu` refuse to start without CUDA, and
`--dry-run` checks every command on a machine without one.

- lenet5 (mnist-fast) to 99.0% MNIST test accuracy, training seconds, graph step    target <= 0.25 s
- the same with the compiled step (mnist-fast's step on one GPU)                    target <= 0.25 s
- cifarnet to 80% CIFAR-10 test accuracy, training seconds     target <= 10 s
- --input resident vs feed vs queue, lenet5 batch 512          resident >= 3x feed
- --strategy ps vs ddp step time, one GPU                      reported
- --step graph and compiled vs eager, examples/s               reported
- search evaluations/min over 3 generations, 1, 2 or 4 per GPU, and where a worker's time goes  target >= 600
- whitenet (--preset cifar-94) to 94% CIFAR-10 test, 5 seeds    target mean >= 94% in <= 1.8 s (cifar94.py;
  with --airbench, in no more than airbench94_muon's seconds on the same card)
"""

from __future__ import annotations

from typing import Callable

from bench.gpu import cifar94
from bench.common import measure
from bench.common.measure import preset_flags
from bench.speed.suite import throughput

Log = Callable[[str], None]


def unavailable() -> str | None:
    """Why the GPU suite cannot run here, or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False; this torch is " + torch.__version__ + ")"
    return None


def _tta(figure_id: str, preset: str, target: float, limit: float, title: str, data_dir: str, repeats: int,
         quick: bool, log: Log, **options: object) -> dict:
    """Training seconds of `preset` (with `options`, TrainConfig or RunConfig fields) on one GPU until
    its final test accuracy; repeated over seeds."""
    def run(r: int) -> dict:
        extra = {"steps": 100} if quick else {}  # about one epoch
        sample = measure.towerlab(preset_flags(preset, seed=r, **extra, **options), data_dir)
        s = sample["summary"]
        sample["reached"] = s["test_accuracy"] is not None and s["test_accuracy"] >= target
        sample.update(value=s["train_seconds"] if sample["reached"] else None, unit="s")
        return sample

    log(f"[{figure_id}] towerlab --preset {preset} on one GPU, to {target:.0%} test accuracy")
    samples = measure.alternate({"towerlab": run}, repeats, log, quiet=False)
    seconds = measure.median([s["value"] for s in samples["towerlab"]])
    return {"id": figure_id, "title": title, "target": f"<= {limit:g} s", "target_value": limit,
            "value": seconds, "unit": "s", "tta": True,
            "met": None if quick or seconds is None else seconds <= limit,
            "detail": {"target_accuracy": target, "reached": [s["reached"] for s in samples["towerlab"]],
                       "test_accuracy": [s["summary"]["test_accuracy"] for s in samples["towerlab"]],
                       # warm-up and compilation before the clock (not in the training seconds)
                       "setup_seconds": [s["summary"].get("setup_seconds") for s in samples["towerlab"]]},
            "samples": samples}


def lenet5_tta(data_dir: str, repeats: int, quick: bool, log: Log) -> dict:
    return _tta("lenet5_tta_gpu", "mnist-fast", 0.99, 0.25, "lenet5 to 99.0% MNIST test accuracy, "
                "training seconds, one GPU", data_dir, repeats, quick, log)


def lenet5_tta_compiled(data_dir: str, repeats: int, quick: bool, log: Log) -> dict:
    return _tta("lenet5_tta_compiled_gpu", "mnist-fast", 0.99, 0.25, "lenet5 to 99.0% MNIST test accuracy, "
                "training seconds, one GPU, --step compiled", data_dir, repeats, quick, log, step="compiled")


def cifarnet_tta(data_dir: str, repeats: int, quick: bool, log: Log) -> dict:
    return _tta("cifarnet_tta_gpu", "cifar-fast", 0.80, 10.0, "cifarnet to 80% CIFAR-10 test accuracy, "
                "training seconds, one GPU", data_dir, repeats, quick, log)


def input_modes(data_dir: str, repeats: int, quick: bool, log: Log) -> dict:
    log("[input_modes_gpu] lenet5 batch 512: resident vs feed vs queue")
    # The eager step on every side: feed and queue cannot take the graph, and the figure is the data path's.
    sides = {m: throughput("lenet5", "mnist", 512, 1, 60000 if quick else 300000, data_dir, input_mode=m,
                           threads=None, step="eager") for m in ("resident", "feed", "queue")}
    samples = measure.alternate(sides, repeats, log, quiet=False)
    rounds = measure.usable_rounds(samples)
    ratio = measure.ratio_stats(samples, "resident", "feed", rounds)
    return {"id": "input_modes_gpu", "title": "--input resident vs feed, lenet5 batch 512, examples/s (GPU)",
            "target": ">= 3x", "target_value": 3.0, "value": ratio["median"], "unit": "x",
            "met": None if quick or ratio["median"] is None else ratio["median"] >= 3.0,
            "detail": {"examples_per_sec": {m: measure.median(measure.values(samples, m, rounds)) for m in sides},
                       "queue_over_feed": measure.ratio_stats(samples, "queue", "feed", rounds)},
            "samples": samples}


def ps_vs_ddp(data_dir: str, repeats: int, quick: bool, log: Log) -> list[dict]:
    figures = []
    for model, dataset, batch in (("lenet5", "mnist", 512), ("cifarnet", "cifar10", 512)):
        log(f"[ps_vs_ddp_gpu] {model} batch {batch}, one GPU: ddp vs ps (master copy on the CPU)")
        sides = {s: throughput(model, dataset, batch, 1, 30000 if quick else 150000, data_dir, strategy=s,
                               threads=None, step="eager") for s in ("ddp", "ps")}  # ps runs eager only
        samples = measure.alternate(sides, repeats, log, quiet=False)
        rounds = measure.usable_rounds(samples)
        ratio = measure.ratio_stats(samples, "ddp", "ps", rounds)
        figures.append({"id": f"ps_vs_ddp_gpu_{model}", "title": f"--strategy ps / ddp step time, {model} "
                        f"batch {batch}, one GPU", "target": "reported", "target_value": None,
                        "value": ratio["median"], "unit": "x", "met": None,
                        "detail": {"step_ms": {s: measure.median([x["step_ms"] for x in samples[s]]) for s in sides}},
                        "samples": samples})
    return figures


def step_modes(data_dir: str, repeats: int, quick: bool, log: Log) -> list[dict]:
    """--step graph and compiled against eager, steady-state examples/s (recording and compiling
    fall in the warm-up, before the clock)."""
    figures = []
    for model, dataset, batch in (("lenet5", "mnist", 512), ("cifarnet", "cifar10", 512)):
        log(f"[step_gpu] {model} batch {batch}: --step eager vs graph vs compiled")
        sides = {mode: throughput(model, dataset, batch, 1, 60000 if quick else 300000, data_dir, threads=None,
                                  step=mode) for mode in ("eager", "graph", "compiled")}
        samples = measure.alternate(sides, repeats, log, quiet=False)
        rounds = measure.usable_rounds(samples)
        figures.append({"id": f"step_gpu_{model}", "title": f"--step graph / eager examples/s, {model} batch "
                        f"{batch}, one GPU", "target": "reported", "target_value": None,
                        "value": measure.ratio_stats(samples, "graph", "eager", rounds)["median"], "unit": "x",
                        "met": None, "detail": {"compiled_over_eager": measure.ratio_stats(samples, "compiled", "eager",
                                                                                         rounds)},
                        "samples": samples})
    return figures


# The sides of the search figure: workers per GPU, and the step its candidates train with.
SEARCH_SIDES = {"per_device1": (1, "auto"), "per_device2": (2, "auto"), "per_device4": (4, "auto")}


def search_rate(search: dict) -> float:
    """Evaluations a minute over every generation of a search (the first one's start-up in it)."""
    stats = search["summary"]["generation_stats"]
    return 60.0 * sum(g["evaluated"] for g in stats) / sum(g["seconds"] for g in stats)


def search_workers(data_dir: str, repeats: int, quick: bool, log: Log) -> dict:
    """Search evaluations per minute on one GPU over a whole search (3 generations of the mlp space on
    MNIST, one epoch each), with 1, 2 and 4 candidates training at once on the GPU: the default
    `--workers-per-device` is read from these. Each side's workers' time split into its parts
    (bench/common/worker_times.py: start, data, store, build, setup, training, evaluation, idle), in all and
    per trained candidate."""
    population, generations = (8, 2) if quick else (24, 3)
    common = measure.flags({"space": "mlp", "dataset": "mnist", "population": population,
                            "generations": generations, "max_epochs": 1, "devices": 1, "top": 1, "remeasure": 0})

    def side(per_device: int, step: str) -> Callable[[int], dict]:
        def run(r: int) -> dict:
            args = [*common, "--workers-per-device", str(per_device), "--step", step, "--seed", str(r)]
            sample = measure.towerlab_search(args, data_dir)
            sample.update(value=search_rate(sample), unit="evaluations/min")
            return sample
        return run

    log(f"[search_gpu] mlp space on MNIST, population {population}, {generations} generations: "
        f"{', '.join(SEARCH_SIDES)}, one GPU")
    samples = measure.alternate({name: side(*how) for name, how in SEARCH_SIDES.items()}, repeats, log,
                                quiet=False)
    rounds = measure.usable_rounds(samples)
    rates = {name: measure.median(measure.values(samples, name, rounds)) for name in SEARCH_SIDES}
    for name in SEARCH_SIDES:
        spent = samples[name][-1]["worker_time"]
        log(f"  {name}, a candidate's share of its workers' time: " + ", ".join(
            f"{part} {seconds * 1000:.0f} ms" for part, seconds in spent["per_candidate"].items()
            if seconds is not None))
    best = max((name for name in rates if rates[name] is not None and SEARCH_SIDES[name][1] == "auto"),
               key=lambda name: rates[name])
    return {"id": "search_rate_gpu", "title": "search evaluations/min over a whole search (mlp, MNIST, 1 epoch), "
            "one GPU, the best --workers-per-device", "target": ">= 600", "target_value": 600.0,
            "value": rates[best], "unit": "evaluations/min",
            "met": None if quick or rates[best] is None else rates[best] >= 600.0,
            "detail": {"evaluations_per_min": rates, "best_workers_per_device": SEARCH_SIDES[best][0],
                       "per_device4_over_1": measure.ratio_stats(samples, "per_device4", "per_device1", rounds),
                       "worker_time": {name: samples[name][-1]["worker_time"] for name in SEARCH_SIDES},
                       "worker_time_is": "each side's last round: its workers' seconds by part, summed, per "
                                         "trained candidate and as shares of their wall time (bench/"
                                         "common/worker_times.py)",
                       "rounds_used": rounds, "population": population, "generations": generations,
                       "rate": "evaluations of every generation over the generations' seconds (the first one's "
                               "start-up in it; the final test retraining out)"},
            "samples": samples}


def cifar94_tta(data_dir: str, repeats: int, quick: bool, log: Log) -> dict:
    """cifar94.py's figure: seeds 0..4 (at least --repeats), or one 1-epoch run with --quick."""
    budget = "quick" if quick else "full"
    seeds = cifar94.BUDGETS[budget]["seeds"] if quick else max(repeats, cifar94.BUDGETS[budget]["seeds"])
    return cifar94.figure(data_dir, seeds, budget, log)


FIGURES = {"lenet5_tta": lenet5_tta, "lenet5_tta_compiled": lenet5_tta_compiled, "cifarnet_tta": cifarnet_tta, "input_modes": input_modes,
           "ps_vs_ddp": ps_vs_ddp, "step": step_modes, "search": search_workers, "cifar94": cifar94_tta}
# The data sets each figure group reads (bench/speed/run.py asks only for these).
NEEDS = {"lenet5_tta": ("mnist",), "lenet5_tta_compiled": ("mnist",), "cifarnet_tta": ("cifar10",), "input_modes": ("mnist",),
         "ps_vs_ddp": ("mnist", "cifar10"), "step": ("mnist", "cifar10"), "search": ("mnist",),
         "cifar94": ("cifar10",)}
