"""One training step on one GPU in each `--step` mode, timed with CUDA events, its kernels counted by
the profiler.

    python bench/gpu/step.py --json OUT.json        # needs CUDA

Each case is a preset's model and recipe at its batch size, on synthetic data of the data set's
shape (a step's time does not depend on the pixel values): towerlab's own steps, built as `train`
builds them (`eager.EagerSteps`, `program.StepProgram` prepared as a graph or compiled), driven through
epochs as the training loop drives them. After the warm-up, `--steps` steps between two CUDA events,
the median of `--rounds` such windows. Kernels per step: a profiler trace of 5 eager steps (of the
reference step and of the program run op by op), counted and divided by 5; a graph replays the
program's kernels with one launch. Compilation and recording are timed apart (`setup_s`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common import machine, measure
from bench.common.record import figure, script_command, write_record
from towerlab.training import step_kinds
from towerlab.models.preprocessing import Normalizer
from towerlab.training.batches import Batches
from towerlab.config import TrainConfig
from towerlab.data.load import load_dataset
from towerlab.data.synthetic import SyntheticOptions
from towerlab.distributed.group import Context
from towerlab.presets import apply_preset
from towerlab.training.network import build, fit_to_data, uses_channels_last

# (name, preset, batch, input shape): the steps of issue 38's targets.
CASES = [("lenet5-b512-mnist-fast", "mnist-fast", 512, (1, 28, 28)),
         ("lenet5-b256-mnist-fast", "mnist-fast", 256, (1, 28, 28)),
         ("whitenet-b1024-cifar-94", "cifar-94", 1024, (3, 32, 32))]
MODES = ("eager", "program", "graph", "compiled")


def config(preset: str, batch: int) -> TrainConfig:
    fields = apply_preset(preset, "cuda")
    fields.update(batch_size=batch, steps=10_000, dataset="synthetic")
    return replace(TrainConfig(), **{k: v for k, v in fields.items() if k in TrainConfig.__dataclass_fields__})


def make_steps(mode: str, cfg: TrainConfig, data, device: torch.device):
    ctx = Context(device=device)
    normalize = Normalizer(data.mean, data.std, device, uses_channels_last(cfg))
    batches = Batches(data.x_train, data.y_train, ctx, cfg.batch_size, cfg.seed, "resident", normalize,
                      augment_images=cfg.augment, translate=cfg.translate)
    module = build(cfg, data.input_shape, data.num_classes, ctx)
    fit_to_data(cfg, module, batches.x, normalize)
    module.train()
    started = time.perf_counter()
    steps = step_kinds.make_steps(mode, "ddp", module, cfg, ctx, batches, cfg.steps)
    steps.prepare(mode, 0, print)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps, time.perf_counter() - started


def forever(steps):
    """The training loop's walk through the steps, epoch after epoch."""
    for epoch in itertools.count():
        yield from steps.epoch(epoch, 0)


def events_ms(walk, steps: int, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            next(walk)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / steps)
    return out


def kernels_per_step(walk, steps: int = 5) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            next(walk)
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()) / steps


def measure_case(name: str, preset: str, batch: int, shape, args) -> dict:
    device = torch.device("cuda", 0)
    cfg = config(preset, batch)
    data = load_dataset("synthetic", val_size=0, log=lambda _: None,
                        synthetic=SyntheticOptions(shape=shape, train=batch * 60, test=10))
    torch.backends.cudnn.benchmark = True
    row = {"case": name, "model": cfg.model, "batch": batch, "optimizer": cfg.optimizer, "precision": cfg.precision,
           "schedule": cfg.schedule, "lookahead": cfg.lookahead, "augment": cfg.augment, "modes": {}}
    for mode in MODES:
        try:
            steps, setup = make_steps(mode, cfg, data, device)
        except Exception as exc:  # noqa: BLE001 - one mode's failure is a result, not the end
            row["modes"][mode] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
            print(f"{name} {mode}: {row['modes'][mode]['error']}", flush=True)
            continue
        walk = forever(steps)
        for _ in range(args.warmup):
            next(walk)
        ms = events_ms(walk, args.steps, args.rounds)
        entry = {"ms": statistics.median(ms), "rounds_ms": ms, "setup_s": setup, "ran_as": steps.mode}
        if mode in ("eager", "program"):
            entry["kernels_per_step"] = kernels_per_step(walk)
        row["modes"][mode] = entry
        print(f"{name} {mode} (ran as {steps.mode}): {entry['ms']:.3f} ms/step"
              + (f", {entry['kernels_per_step']:.0f} kernels" if "kernels_per_step" in entry else "")
              + f", setup {setup:.1f} s", flush=True)
        del walk, steps
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="the record's path")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=None, help="case names")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("step.py: needs CUDA", file=sys.stderr)
        return 2
    rows = [measure_case(*case, args) for case in CASES if args.only is None or case[0] in args.only]
    record = {"date": measure.now(), "machine": machine.describe(), "command": script_command(__file__, argv),
              "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": args.steps,
              "warmup": args.warmup, "rounds": args.rounds, "cases": rows,
              "figures": [figure(f"{row['case']}_{mode}_ms", entry.get("ms"), entry)
                          for row in rows for mode, entry in row["modes"].items()]}
    print(write_record(Path(args.json).parent, Path(args.json).name, record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
