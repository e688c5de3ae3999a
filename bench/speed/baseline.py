"""The yardstick: the plain PyTorch MNIST loop users write first, with towerlab's LeNet-5.

Textbook on purpose: float images normalised up front, `TensorDataset` + `DataLoader(shuffle=True)`,
Adam 1e-3, batch 128, `loss.item()` every step, the whole test set scored after each epoch. It
trains on all 60,000 training images (no validation split) and stops after the first epoch whose
test accuracy reaches `--target`.

Timing: `train_seconds` counts the training loops only (the same thing towerlab's `train_seconds`
counts); `wall_seconds` adds the per-epoch test evaluations.

    python bench/speed/baseline.py --data-dir ../shared/data --epochs 15 --json /tmp/baseline.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":  # run as a file (python bench/FAMILY/SCRIPT.py): bench.* from the repository
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from bench.common.record import write_json
from towerlab.models import build_model

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # the values every MNIST tutorial hard-codes


def load_mnist(data_dir: str | os.PathLike) -> tuple[torch.Tensor, ...]:
    """Float (N, 1, 28, 28) images normalised up front, and int64 labels."""
    with np.load(Path(data_dir) / "mnist.npz") as arrays:
        def images(key: str) -> torch.Tensor:
            x = torch.from_numpy(arrays[key]).float().div_(255.0).unsqueeze(1)
            return (x - MNIST_MEAN) / MNIST_STD

        return (images("x_train"), torch.from_numpy(arrays["y_train"]).long(),
                images("x_test"), torch.from_numpy(arrays["y_test"]).long())


def test_accuracy(model: torch.nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
            total += y.numel()
    model.train()
    return correct / total


def run(data_dir: str | os.PathLike, *, epochs: int = 15, target: float | None = 0.99, seed: int = 0,
        batch_size: int = 128, lr: float = 1e-3, log=print) -> dict:
    """Train until the test accuracy reaches `target` (or for `epochs`); the per-epoch record."""
    x_train, y_train, x_test, y_test = load_mnist(data_dir)
    torch.manual_seed(seed)
    model = build_model("lenet5", (1, 28, 28))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    train_loader = DataLoader(TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True)
    test_loader = DataLoader(TensorDataset(x_test, y_test), batch_size=1000)
    history = []
    train_seconds = wall_seconds = 0.0
    reached = None
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        seen = 0
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            running_loss = loss.item()  # what every tutorial does each step (a host sync on GPUs)
            seen += y.numel()
        trained = time.perf_counter()
        accuracy = test_accuracy(model, test_loader)
        train_seconds += trained - started
        wall_seconds += time.perf_counter() - started
        history.append({"epoch": epoch, "train_seconds": train_seconds, "wall_seconds": wall_seconds,
                        "test_accuracy": accuracy, "examples_per_sec": seen / (trained - started),
                        "last_loss": running_loss})
        log(f"baseline epoch {epoch}: test accuracy {accuracy:.4f}, training {train_seconds:.1f} s, "
            f"{seen / (trained - started):.0f} examples/s")
        if target is not None and accuracy >= target and reached is None:
            reached = history[-1]
            break
    return {"history": history, "target": target, "reached": reached is not None,
            "train_seconds_to_target": reached["train_seconds"] if reached else None,
            "wall_seconds_to_target": reached["wall_seconds"] if reached else None,
            "epochs_to_target": reached["epoch"] if reached else None,
            "test_accuracy": history[-1]["test_accuracy"], "threads": torch.get_num_threads(),
            "examples_per_sec": float(np.median([h["examples_per_sec"] for h in history]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=os.environ.get("TOWERLAB_DATA", "../shared/data"),
                        help="folder holding mnist.npz (default: $TOWERLAB_DATA, else ../shared/data)")
    parser.add_argument("--epochs", type=int, default=15, help="epochs at most (default: 15)")
    parser.add_argument("--target", type=float, default=0.99,
                        help="stop after the first epoch with this test accuracy (default: 0.99; 0: never)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init and the shuffle (default: 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    record = run(args.data_dir, epochs=args.epochs, target=args.target or None, seed=args.seed,
                 log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        write_json(args.json, record)
    else:
        print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
