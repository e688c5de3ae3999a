"""One training step on one GPU, timed with CUDA events, its kernels counted by the profiler: today's
eager step (towerlab's own `Strategy.step`) against the same arithmetic captured as one CUDA graph
(a hand-built step: forward, loss, backward, capturable optimizer, replayed with `torch.cuda.graph`).
The gap between the two is what issue 38's step program is for.

    python bench/step_gpu.py --json OUT.json        # needs CUDA

Each case: the model at a preset's settings, synthetic inputs of the data set's shape (timing does
not depend on the values), `--warmup` steps, then `--steps` timed steps between two CUDA events;
the median of `--rounds` such windows. Kernels per step: a profiler trace of 5 steps, CUDA kernels
counted and divided by 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace

import torch
import torch.nn.functional as F

from towerlab.config import TrainConfig
from towerlab.distributed import Context
from towerlab.models import build_model
from towerlab.presets import apply_preset
from towerlab.strategies import make_strategy

# (name, preset, batch, input shape): the step of issue 38's targets.
CASES = [("lenet5-b512-mnist-fast", "mnist-fast", 512, (1, 28, 28)),
         ("lenet5-b512-mnist-fast-fp32", "mnist-fast", 512, (1, 28, 28)),
         ("whitenet-b1024-cifar-94", "cifar-94", 1024, (3, 32, 32))]


def config(preset: str, batch: int, fp32: bool) -> TrainConfig:
    fields = apply_preset(preset, "cuda")
    fields.update(batch_size=batch, steps=10_000, epochs=1)
    if fp32:
        fields["precision"] = "fp32"
    return replace(TrainConfig(), **{k: v for k, v in fields.items() if k in TrainConfig.__dataclass_fields__})


def events_ms(step, steps: int, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / steps)
    return out


def kernels_per_step(step, steps: int = 5) -> float:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels) / steps


def towerlab_step(cfg: TrainConfig, shape, device):
    ctx = Context(device=device)
    torch.manual_seed(0)
    module = build_model(cfg.model, shape, 10, **cfg.model_options).to(device)
    if cfg.model == "whitenet":
        module = module.to(memory_format=torch.channels_last)
        module.fit_whitening(torch.randn(5000, *shape, device=device))
    module.train()
    strat = make_strategy("ddp", module, cfg, ctx, 10_000)
    x = torch.randn(cfg.batch_size, *shape, device=device)
    if cfg.model == "whitenet":
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (cfg.batch_size,), device=device)
    return lambda: strat.step(x, y), module


def graph_step(cfg: TrainConfig, shape, device):
    """The same model, loss and optimizer kind with capturable state, captured once as a CUDA graph."""
    torch.manual_seed(0)
    module = build_model(cfg.model, shape, 10, **cfg.model_options).to(device)
    if cfg.model == "whitenet":
        module = module.to(memory_format=torch.channels_last)
        module.fit_whitening(torch.randn(5000, *shape, device=device))
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    lr = torch.tensor(cfg.lr, device=device)
    if cfg.optimizer == "adam":
        opt = torch.optim.Adam(params, lr=lr, capturable=True, foreach=True)
    else:
        opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, foreach=True)
    x = torch.randn(cfg.batch_size, *shape, device=device)
    if cfg.model == "whitenet":
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (cfg.batch_size,), device=device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.precision == "bf16")

    def eager():
        with autocast:
            loss = F.cross_entropy(module(x), y, label_smoothing=cfg.label_smoothing)
        grads = torch.autograd.grad(loss, params)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eager()
    return graph.replay, eager


def measure_case(name: str, preset: str, batch: int, shape, args) -> dict:
    device = torch.device("cuda", 0)
    cfg = config(preset, batch, fp32=name.endswith("fp32"))
    row = {"case": name, "model": cfg.model, "batch": batch, "optimizer": cfg.optimizer,
           "precision": cfg.precision, "schedule": cfg.schedule, "lookahead": cfg.lookahead}
    torch.backends.cudnn.benchmark = True
    step, _ = towerlab_step(cfg, shape, device)
    for _ in range(args.warmup):
        step()
    ms = events_ms(step, args.steps, args.rounds)
    row["towerlab_eager"] = {"ms": statistics.median(ms), "rounds_ms": ms, "kernels_per_step": kernels_per_step(step)}
    replay, eager = graph_step(cfg, shape, device)
    for _ in range(args.warmup):
        replay()
    ms = events_ms(replay, args.steps, args.rounds)
    row["graph"] = {"ms": statistics.median(ms), "rounds_ms": ms, "kernels_per_step": kernels_per_step(eager)}
    ms = events_ms(eager, args.steps, args.rounds)
    row["graph_program_eager"] = {"ms": statistics.median(ms), "rounds_ms": ms}
    print(f"{name}: towerlab eager {row['towerlab_eager']['ms']:.3f} ms "
          f"({row['towerlab_eager']['kernels_per_step']:.0f} kernels), same program eager "
          f"{row['graph_program_eager']['ms']:.3f} ms, as one CUDA graph {row['graph']['ms']:.3f} ms "
          f"({row['graph']['kernels_per_step']:.0f} kernels)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_gpu: needs CUDA", file=sys.stderr)
        return 2
    rows = [measure_case(*case, args) for case in CASES]
    record = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": args.steps,
              "warmup": args.warmup, "rounds": args.rounds, "cases": rows}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
