"""Where a 2-process CPU step's time goes: towerlab's `--strategy ddp` step, the same step with
DDP's all-reduce switched off (`no_sync`: computation only), and gloo's all-reduce of the gradient
alone with both processes otherwise idle. 2 processes x 1 thread, alternating; a step's time is the
slower rank's.

    python bench/speed/ddp_overhead.py --json /tmp/ddp_overhead.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.record import write_json
from towerlab.config import TrainConfig
from towerlab.distributed.group import session
from towerlab.distributed.launch import launch

CASES = [("lenet5", "mnist", 128), ("lenet5", "mnist", 512), ("cifarnet", "cifar10", 128)]


def _cycle(batches):
    epoch = 0
    while True:
        yield from batches.epoch(epoch)
        epoch += 1


def _timed(ctx, fn, n: int) -> float:
    dist.barrier()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    took = torch.tensor([(time.perf_counter() - started) / n * 1e3])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return took.item()


def _worker(rank: int, world_size: int, store: str, data_dir: str, scale: float, rounds: int, out: str) -> None:
    from towerlab.data.load import load_dataset
    from towerlab.training.step_kinds import make_steps
    from towerlab.training.loop import make_batches
    from towerlab.training.network import build

    torch.set_num_threads(1)
    results = []
    with session(rank=rank, world_size=world_size, store_path=store) as ctx:
        for model, dataset, batch in CASES:
            data = load_dataset(dataset, data_dir, 5000)
            cfg = TrainConfig(model=model, dataset=dataset, batch_size=batch, precision="bf16")
            batches = make_batches(cfg, ctx, data, "resident")
            steps = make_steps("eager", "ddp", build(cfg, data.input_shape, data.num_classes, ctx), cfg, ctx, batches,
                               10**6)
            strat = steps.strat
            source = _cycle(batches)
            grads = torch.zeros(sum(p.numel() for p in strat.module.parameters()))
            n = max(3, int(scale * (8192 if model == "lenet5" else 256) / batch))

            def ddp() -> None:
                steps.step(*next(source))

            def compute_only() -> None:
                with strat.model.no_sync():
                    steps.step(*next(source))

            for _ in range(3):
                ddp()
            times: dict[str, list[float]] = {"ddp_step": [], "no_sync_step": [], "allreduce_alone": []}
            for _ in range(rounds):
                times["ddp_step"].append(_timed(ctx, ddp, n))
                times["no_sync_step"].append(_timed(ctx, compute_only, n))
                times["allreduce_alone"].append(_timed(ctx, lambda: dist.all_reduce(grads), 4 * n))
            ms = {k: statistics.median(v) for k, v in times.items()}
            results.append({"model": model, "batch_per_replica": batch, "gradient_kb": grads.numel() * 4 // 1024,
                            "steps_per_round": n, "ms": ms,
                            "communication_ms": ms["ddp_step"] - ms["no_sync_step"],
                            "communication_share": 1 - ms["no_sync_step"] / ms["ddp_step"],
                            "samples_ms": {k: [round(x, 3) for x in v] for k, v in times.items()}})
    if rank == 0:
        write_json(out, results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("TOWERLAB_DATA", "../shared/data"))
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run)")
    args = parser.parse_args(argv)
    scale, rounds = (0.25, 1) if args.quick else (1.0, 5)
    status = launch(_worker, 2, (args.data_dir, scale, rounds, args.json))
    if status:
        return status
    for row in json.loads(Path(args.json).read_text()):
        ms = row["ms"]
        print(f"{row['model']:8s} 2 x {row['batch_per_replica']:<4d} step {ms['ddp_step']:8.2f} ms = compute "
              f"{ms['no_sync_step']:8.2f} ms + communication {row['communication_ms']:6.2f} ms "
              f"({row['communication_share']:.0%}); all-reduce of {row['gradient_kb']} KB alone "
              f"{ms['allreduce_alone']:.2f} ms", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
