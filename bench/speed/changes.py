"""Each speed change of issue 4, measured before/after in one process, the two sides alternating.

"Before" is the code as it was (kept here as reference implementations); "after" is towerlab's.
One thread, so the figure is per core and immune to the other core's noise. Run alone:

    python bench/speed/changes.py --json /tmp/changes.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.record import write_json
from towerlab.training.batches import crop_flip, epoch_salt, mix_seed
from towerlab.models import build_model
from towerlab.training.step import seed_dropout


def augment_indexing(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """towerlab's augment before this change: 4-way advanced indexing, then flip and where."""
    n, _, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), device=x.device, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), device=x.device, generator=generator)
    rows = (dy[:, None] + torch.arange(h, device=x.device)[None, :])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device)[None, :])[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    chan = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    out = padded[batch, chan, rows, cols]
    flip = torch.rand(n, device=x.device, generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(3), out)


def gather_pixels(images: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """out[k, :, i, j] = images[k, :, rows[k, i], cols[k, j]] as one `gather` (rows (n, h), cols (n, w)): the
    gather of that time, kept here with the code before (towerlab's own is private to training/batches.py)."""
    n, c = images.shape[:2]
    h, w = rows.shape[1], cols.shape[1]
    offsets = (rows[:, :, None] * images.shape[3] + cols[:, None, :]).view(n, 1, h * w)
    return images.reshape(n, c, -1).gather(2, offsets.expand(n, c, h * w)).view(n, c, h, w)


def augment_gather(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """towerlab's crop+flip before issue 38: one gather, dy, dx and the flip drawn from a generator
    that the step reseeded (a host value each step, which a captured step cannot take)."""
    n, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (n,), device=x.device, generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), device=x.device, generator=generator)
    flip = torch.rand(n, device=x.device, generator=generator) < 0.5
    j = torch.arange(w, device=x.device)
    cols = dx[:, None] + torch.where(flip[:, None], (w - 1) - j, j)
    rows = dy[:, None] + torch.arange(h, device=x.device)
    return gather_pixels(padded, rows, cols)


def fold_loss(worst: torch.Tensor, loss: torch.Tensor) -> None:
    """train()'s device-side watch for a NaN / inf loss: a running maximum, read at display steps."""
    torch.maximum(worst, loss.detach().float(), out=worst)


def lenet5_relu_then_pool() -> nn.Module:
    """LeNet-5 in the seeds' layer order (ReLU before each max-pool)."""
    model = build_model("lenet5", (1, 28, 28))
    f = model.features
    model.features = nn.Sequential(f[0], f[2], f[1], f[3], f[5], f[4], f[6])
    return model


def cifarnet_torch_lrn() -> nn.Module:
    """CifarNet with torch's LocalResponseNorm (avg_pool3d over the padded squares), ReLU before pool1."""
    model = build_model("cifarnet", (3, 32, 32))
    f = model.features
    lrn = lambda: nn.LocalResponseNorm(9, alpha=0.001, beta=0.75, k=1.0)  # noqa: E731 - a factory, named for the table
    model.features = nn.Sequential(f[0], f[2], f[1], lrn(), f[4], f[5], lrn(), f[7], f[8])
    return model


def train_step(model: nn.Module, batch: int, *, channels_last: bool = True, bf16: bool = True,
               optimizer: dict | None = None, watch: bool = False) -> Callable[[], None]:
    """One training step; `watch`: with train()'s device-side watch for a NaN / inf loss."""
    shape = (1, 28, 28) if model.features[0].in_channels == 1 else (3, 32, 32)
    x, y = torch.randn(batch, *shape), torch.randint(0, 10, (batch,))
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **(optimizer or {"fused": True}))
    worst = torch.zeros(()) if watch else None

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if worst is not None:
            fold_loss(worst, loss)

    return step


def optimizer_step(model_name: str, kind: dict) -> Callable[[], None]:
    model = build_model(model_name, (1, 28, 28) if model_name == "lenet5" else (3, 32, 32))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, **kind)
    return opt.step


def augment_call(fn: Callable, batch: int) -> Callable[[], None]:
    x = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    return lambda: fn(x, g)


def augment_reseeded(batch: int) -> Callable[[], None]:
    """The eager step's crop+flip before issue 38: the generator reseeded per step, then `augment_gather`."""
    x = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8)
    g = torch.Generator()
    step = iter(range(10**9))
    return lambda: augment_gather(x, g.manual_seed(mix_seed(0, 0, 0, next(step))))


def augment_hashed(batch: int) -> Callable[[], None]:
    """Now: each example's crop and flip hashed from its index and the epoch's salt."""
    x = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8)
    index = torch.randperm(50_000)[:batch]
    salt = epoch_salt(0, 0)
    return lambda: crop_flip(x, index, salt)


def mlp_step(seed: Callable[[int], object], watched: bool = False) -> Callable[[], None]:
    """A search candidate's step (the mlp space's 256 x 2 with dropout, batch 128, Adam), its dropout
    reseeded from the step number first, as train() does (`watched` as `train_step`'s `watch`)."""
    model = build_model("mlp", (1, 28, 28), layers=2, neurons=256)
    x, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    step = iter(range(10**9))
    worst = torch.zeros(()) if watched else None

    def run() -> None:
        seed(next(step))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if worst is not None:
            fold_loss(worst, loss)

    return run


def seconds_per_call(fn: Callable[[], None], calls: int) -> float:
    fn()  # warm-up: first-call allocations, oneDNN primitive creation
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def ab(before: Callable[[], Callable[[], None]], after: Callable[[], Callable[[], None]], calls: int,
       rounds: int) -> dict:
    """Alternate before/after `rounds` times; ms per call of each, and the speed-up per round."""
    times: dict[str, list[float]] = {"before": [], "after": []}
    for _ in range(rounds):
        for side, make in (("before", before), ("after", after)):
            torch.manual_seed(0)
            times[side].append(seconds_per_call(make(), calls) * 1e3)
    speedups = [b / a for b, a in zip(times["before"], times["after"])]
    return {"before_ms": statistics.median(times["before"]), "after_ms": statistics.median(times["after"]),
            "speedup": statistics.median(speedups), "speedup_per_round": [round(s, 3) for s in speedups],
            "samples_ms": {k: [round(v, 3) for v in vs] for k, vs in times.items()}}


def changes(quick: bool) -> list[dict]:
    """(name, what, before, after, calls) for every change; cheap enough for the CPU suite."""
    lenet = lambda: build_model("lenet5", (1, 28, 28))  # noqa: E731 - a factory, named for the table
    cifar = lambda: build_model("cifarnet", (3, 32, 32))  # noqa: E731 - a factory, named for the table
    steps_lenet, steps_cifar = (5, 1) if quick else (30, 4)
    return [
        ("channels_last_lenet5", "LeNet-5 train step, batch 256, bf16: NCHW -> channels_last",
         lambda: train_step(lenet(), 256, channels_last=False), lambda: train_step(lenet(), 256), steps_lenet),
        ("channels_last_cifarnet", "CifarNet train step, batch 128, bf16: NCHW -> channels_last",
         lambda: train_step(cifar(), 128, channels_last=False), lambda: train_step(cifar(), 128), steps_cifar),
        ("bf16_lenet5", "LeNet-5 train step, batch 256, channels_last: fp32 -> bf16 autocast (AMX)",
         lambda: train_step(lenet(), 256, bf16=False), lambda: train_step(lenet(), 256), steps_lenet),
        ("bf16_cifarnet", "CifarNet train step, batch 128, channels_last: fp32 -> bf16 autocast (AMX)",
         lambda: train_step(cifar(), 128, bf16=False), lambda: train_step(cifar(), 128), steps_cifar),
        ("lrn_cifarnet", "CifarNet train step, batch 128, cl+bf16: torch LocalResponseNorm -> band-matrix LRN",
         lambda: train_step(cifarnet_torch_lrn(), 128), lambda: train_step(cifar(), 128), steps_cifar),
        ("lrn_cifarnet_fp32", "CifarNet train step, batch 128, NCHW fp32 (the old default): torch LRN -> ours",
         lambda: train_step(cifarnet_torch_lrn(), 128, channels_last=False, bf16=False),
         lambda: train_step(cifar(), 128, channels_last=False, bf16=False), steps_cifar),
        ("pool_before_relu_lenet5", "LeNet-5 train step, batch 256, cl+bf16: ReLU->pool -> pool->ReLU",
         lambda: train_step(lenet5_relu_then_pool(), 256), lambda: train_step(lenet(), 256), steps_lenet),
        ("fused_adam_lenet5", "Adam step, LeNet-5 parameters: foreach -> fused",
         lambda: optimizer_step("lenet5", {"foreach": True}), lambda: optimizer_step("lenet5", {"fused": True}),
         10 * steps_lenet),
        ("fused_adam_cifarnet", "Adam step, CifarNet parameters: foreach -> fused",
         lambda: optimizer_step("cifarnet", {"foreach": True}), lambda: optimizer_step("cifarnet", {"fused": True}),
         10 * steps_lenet),
        ("foreach_vs_loop_adam_cifarnet", "Adam step, CifarNet parameters: for-loop (torch's CPU default) -> foreach",
         lambda: optimizer_step("cifarnet", {"foreach": False}), lambda: optimizer_step("cifarnet", {"foreach": True}),
         10 * steps_lenet),
        ("augment_gather", "CIFAR-10 crop+flip of 512 uint8 images: advanced indexing -> one gather",
         lambda: augment_call(augment_indexing, 512), lambda: augment_call(augment_gather, 512), 10 * steps_lenet),
        ("dropout_seed_mlp", "MLP 256x2 train step, batch 128: per-step torch.manual_seed -> the device's generator",
         lambda: mlp_step(torch.manual_seed), lambda: mlp_step(lambda s: seed_dropout(torch.device("cpu"), s)),
         20 * steps_lenet),
        ("divergence_watch_lenet5", "LeNet-5 train step, batch 256, cl+bf16: without -> with the NaN / inf loss watch",
         lambda: train_step(lenet(), 256), lambda: train_step(lenet(), 256, watch=True), steps_lenet),
        ("divergence_watch_mlp", "MLP 256x2 train step, batch 128: without -> with the NaN / inf loss watch",
         lambda: mlp_step(lambda s: seed_dropout(torch.device("cpu"), s)),
         lambda: mlp_step(lambda s: seed_dropout(torch.device("cpu"), s), watched=True), 20 * steps_lenet),
        ("augment_hashed", "CIFAR-10 crop+flip of 512 uint8 images: a reseeded generator -> hashed per-example words",
         lambda: augment_reseeded(512), lambda: augment_hashed(512), 10 * steps_lenet),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here (default: print them)")
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds (a smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="before/after rounds (default: 5; quick: 1)")
    parser.add_argument("--only", nargs="*", default=None, help="measure only these changes (by id)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = args.rounds or (1 if args.quick else 5)
    results = []
    for name, what, before, after, calls in changes(args.quick):
        if args.only is not None and name not in args.only:
            continue
        row = {"id": name, "what": what, "calls": calls, "rounds": rounds, **ab(before, after, calls, rounds)}
        print(f"{name:32s} {row['before_ms']:9.3f} ms -> {row['after_ms']:9.3f} ms  x{row['speedup']:.2f}",
              file=sys.stderr, flush=True)
        results.append(row)
    if args.json:
        write_json(args.json, {"threads": 1, "results": results})
    else:
        print(json.dumps({"threads": 1, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
