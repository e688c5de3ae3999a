"""Several one-epoch mlp candidates trained in one step (bench/gpu/stacked.py) against the same
trainings one after another as a search worker runs them (the graph step on one GPU), and how many
candidates of the search's mlp space could share a step.

    python bench/gpu/stacked_mlps.py --out-dir DIR        # on a GPU: 1, 4 and 16 networks, MNIST, one epoch
    python bench/gpu/stacked_mlps.py --dry-run            # seconds on a CPU: tiny synthetic data, 1 and 2 networks

Each side trains the same K networks (the mlp space's 2 x 512 relu shape, seeds 0..K-1, the space's
optimizers in turn at their default rates, dropout 0.2, batch 128, as the search's candidates): one by
one with `train` (the worker's call: a graph recorded per network, validation scored), or all at once
with `train_stacked` (run op by op: its dropout masks are drawn per network and step on the host's
orders, which a CUDA graph cannot take yet). The figure: wall seconds per candidate, build and
evaluation included, and the training seconds alone. The space's stacks: among 24 genomes drawn at
random from the mlp space (a first generation), how many distinct shapes (neurons, layers, activation),
over 2,000 draws. Writes DIR/stacked-mlps-DATE.json.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import RESULTS, figure, script_command, write_record

OPTIMIZERS = ("rmsprop", "adam", "sgd", "adagrad", "adadelta", "adamax", "nadam")  # the mlp space's


def space_stacks(draws: int = 2000, members: int = 24, seed: int = 0) -> dict:
    """Shapes per random generation of the mlp space: the stacks its candidates would form."""
    import numpy as np

    from towerlab.search.space import BUILTIN_SPACES

    genes = BUILTIN_SPACES["mlp"].genes
    rng = np.random.default_rng(seed)
    counts = []
    for _ in range(draws):
        shapes = {tuple(str(rng.choice(list(genes[g]))) for g in ("neurons", "layers", "activation"))
                  for _ in range(members)}
        counts.append(len(shapes))
    return {"members": members, "draws": draws, "shapes_mean": statistics.fmean(counts),
            "candidates_per_stack": members / statistics.fmean(counts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=measure.default_data_dir(), help="folder with mnist.npz")
    parser.add_argument("--out-dir", default=str(RESULTS / "gpu"), help="where the JSON goes")
    parser.add_argument("--dry-run", action="store_true", help="tiny synthetic data on a CPU: checks, no figure")
    args = parser.parse_args(argv)

    import torch

    from towerlab.config import RunConfig, TrainConfig
    from towerlab.distributed.group import Context
    from towerlab.jobs.train import train_data
    from towerlab.training.loop import LoopOptions, train
    from bench.gpu.stacked import train_stacked

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    base = TrainConfig(model="mlp", model_options={"layers": 2, "neurons": 512, "activation": "relu"},
                       dataset="mnist", batch_size=128, epochs=1)
    sizes = (1, 4, 16)
    if args.dry_run:
        base = replace(base, dataset="synthetic", synthetic_train=1000, val_size=200, model_options={
            "layers": 2, "neurons": 16, "activation": "relu"})
        sizes = (1, 2)
    data = train_data(base, RunConfig(data_dir=args.data_dir), download=False, log=lambda _: None).to(device)
    ctx = Context(device=device)
    from towerlab.training.optim import DEFAULT_LR

    def cfgs(k: int) -> list[TrainConfig]:
        return [replace(base, seed=i, optimizer=o, lr=DEFAULT_LR[o]) for i, o in zip(range(k), itertools.cycle(OPTIMIZERS))]

    def synced() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    train(cfgs(1)[0], ctx, data, LoopOptions(test=False, setup_apart=False))  # CUDA, cuBLAS and the first graph: once
    sides: dict[str, dict] = {}
    for k in sizes:
        started = synced()
        alone = [train(cfg, ctx, data, LoopOptions(test=False, setup_apart=False)) for cfg in cfgs(k)]
        one_by_one = synced() - started
        started = synced()
        stacked = train_stacked(cfgs(k), data, ctx)
        together = synced() - started
        sides[f"k{k}"] = {
            "networks": k,
            "one_by_one": {"seconds_per_candidate": one_by_one / k,
                           "train_seconds_per_candidate": sum(r.train_seconds for r in alone) / k,
                           "step": alone[0].step_mode, "val_accuracy": [r.val_accuracy for r in alone]},
            "stacked": {"seconds_per_candidate": together / k, "train_seconds_per_candidate": stacked[0].train_seconds / k,
                        "val_accuracy": [r.val_accuracy for r in stacked]}}
        print(f"  {k} network(s): one by one {one_by_one / k:.3f} s a candidate ({alone[0].step_mode} step), "
              f"stacked {together / k:.3f} s", file=sys.stderr, flush=True)
    stacks = space_stacks()
    print(f"  mlp space: {stacks['shapes_mean']:.1f} shapes among {stacks['members']} random genomes, "
          f"{stacks['candidates_per_stack']:.2f} candidates a stack", file=sys.stderr, flush=True)
    record = {"suite": "stacked-mlps", "date": measure.now(), "machine": machine.describe(), "dry_run": args.dry_run,
              "command": measure.shown(script_command(__file__, argv),
                                       data_dir=args.data_dir, out_dir=args.out_dir),
              "device": str(device), "sides": sides, "mlp_space_stacks": stacks,
              "what": "wall seconds per candidate of K one-epoch mlp trainings (2 x 512, relu, dropout 0.2, batch "
                      "128): one by one as a search worker trains them (the graph step on one GPU, a graph recorded "
                      "per network), and all K in one stacked step (op by op); validation scored on both sides",
              "figures": [*(figure(f"one_by_one_over_stacked_{name}", side["one_by_one"]["seconds_per_candidate"]
                                   / side["stacked"]["seconds_per_candidate"], side) for name, side in sides.items()),
                          figure("mlp_space_candidates_per_stack", stacks["candidates_per_stack"], stacks)]}
    written = write_record(args.out_dir, f"stacked-mlps-{datetime.date.today():%Y-%m-%d}.json", record)
    print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
