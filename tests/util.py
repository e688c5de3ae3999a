"""Helpers shared by the tests (plain functions; pytest fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# One CPU process, whatever the machine has (a later --devices 2 means two CPU processes over gloo).
ONE_CPU = ["--device", "cpu", "--devices", "1"]
# A small search space, and search settings that train it in seconds on synthetic data.
SMALL_SPACE = """
model = "mlp"
[genes]
neurons = [16, 32, 64]
layers = [1, 2]
activation = ["relu", "tanh"]
"""
SEARCH_BASE = ["--dataset", "synthetic", "--val-size", "1000", "--max-epochs", "1", "--threads", "1",
               "--no-progress", "--device", "cpu", "--devices", "1"]


def small_space_file(folder: Path) -> str:
    path = folder / "space.toml"
    path.write_text(SMALL_SPACE)
    return str(path)

# A tiny learnable problem: 2,000 synthetic 28x28 images, 500 of them for validation.
TINY_DATA = ["--dataset", "synthetic", "--synthetic-train", "2000", "--val-size", "500", "--display-step", "1000",
             "--no-progress"]
TINY = [*TINY_DATA, *ONE_CPU]
# One process on the first GPU (tests marked gpu).
ONE_GPU = ["--device", "cuda", "--devices", "1"]


def real_data_dir(file: str = "mnist.npz") -> Path | None:
    """The folder holding the real `file` (mnist.npz, cifar10.npz), if any: $TOWERLAB_DATA, else
    ../shared/data."""
    for candidate in (os.environ.get("TOWERLAB_DATA"), SHARED_DATA):
        if candidate and (Path(candidate) / file).exists():
            return Path(candidate)
    return None


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None,
             ) -> subprocess.CompletedProcess:
    """Run the real command line in a fresh interpreter."""
    return subprocess.run([sys.executable, "-m", "towerlab", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env={**os.environ, **(env or {})})


def start_towerlab(*args: str, log: Path) -> subprocess.Popen:
    """Start the command line in its own process group (as a terminal job would be)."""
    out = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "towerlab", *args], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def search_rows(out: Path) -> list[tuple]:
    """Every training a search stored, as what decides a history: (generation, index, replicate,
    genome, seed, status, validation accuracy, validation loss), in that order."""
    with contextlib.closing(sqlite3.connect(out / "search.db")) as db:
        return sorted(db.execute("SELECT generation, idx, replicate, genome, seed, status, fitness, val_loss"
                                 " FROM evaluations"))


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)["state_dict"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def replica_pids(pid: int) -> list[int]:
    """The worker processes `pid` started, in rank order (Linux /proc): spawned ones run
    multiprocessing's spawn_main, forked ones the launcher's own command line; multiprocessing's
    resource tracker is neither."""
    try:
        own = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue  # a thread that ended meanwhile
        for child in children:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in cmdline or cmdline == own:
                found.append(int(child))
    return sorted(found)


class StopAtRead:
    """A stand-in for the Ctrl-C handler (jobs.train.StopFlag): reports SIGINT from its n-th read on (one
    read per step). Set `reads_before_stop` on the class before the run."""

    reads_before_stop = 0

    def __init__(self):
        self.reads = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @property
    def signum(self):
        self.reads += 1
        return int(signal.SIGINT) if self.reads >= self.reads_before_stop else 0


@contextlib.contextmanager
def reaped(job: subprocess.Popen):
    """Kill `job`'s whole process group if it still runs when the block ends (a failed wait or
    assertion included), so that no test leaves processes behind."""
    try:
        yield job
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


# Dropout, augmentation and a one-cycle schedule, 3 epochs of 15 steps: every source of state a
# resume must restore (add the device flags).
RESUMABLE = [*TINY_DATA, "--model", "mlp", "--model-opt", "layers=2", "--model-opt", "neurons=64", "--augment",
             "--schedule", "onecycle", "--lr", "0.005", "--epochs", "3", "--batch-size", "100"]


def interrupt(args: list[str], out: Path, monkeypatch) -> None:
    """`towerlab train *args` into `out`, stopped by a Ctrl-C mid-way through the second epoch of
    RESUMABLE (at step 23): it exits 130 with a checkpoint and no summary."""
    import towerlab.jobs.train
    from towerlab.cli import main

    StopAtRead.reads_before_stop = 23
    with monkeypatch.context() as patch:
        patch.setattr(towerlab.jobs.train, "StopFlag", StopAtRead)
        assert main(["train", *args, "--out", str(out)]) == 130
    assert not (out / "summary.json").exists()


class Stopped(BaseException):
    """Not a failed training: the process that plays the search stops (a test's stand-in for a kill)."""


class Ahead:
    """A trainer that takes work ahead (`Prefetching`) and keeps the candidates it was given, in order."""

    def __init__(self):
        self.queued = []

    def __call__(self, candidates, record):
        raise AssertionError("it only takes work ahead")

    def prefetch(self, candidates, train_config_hash):
        self.queued += candidates
