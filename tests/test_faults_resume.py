"""What a resume may change and what it may not: run options that change the arithmetic (device,
replicas, strategy, threads, step) are refused; the others are proven not to change a number;
data files replaced under an interrupted run are noticed; and an interrupted job says how to
continue, naming its folder."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import signal
import sqlite3
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch

import towerlab.jobs.search.workers
import towerlab.jobs.train
from test_custom_dataset import colour_classes
from towerlab.cli import main
from towerlab.config import RunConfig
from util import ONE_CPU, TINY, StopAtRead, max_difference, summary, weights

# lenet5 (channels-last, fused Adam) with dropout-free steps: 15 steps per epoch, 45 in all.
ARGS = [*TINY, "--model", "lenet5", "--epochs", "3", "--batch-size", "100", "--threads", "1"]


def interrupt(module, monkeypatch, args: list[str], reads: int = 20) -> int:
    """`main(args)` with a Ctrl-C after `reads` steps (`module`: towerlab.jobs.train)."""
    monkeypatch.setattr(StopAtRead, "reads_before_stop", reads)
    monkeypatch.setattr(module, "StopFlag", StopAtRead)
    try:
        return main(args)
    finally:
        monkeypatch.undo()


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(["train", *ARGS, "--out", str(out)]) == 0
    return weights(out)


def test_every_run_option_is_either_kept_or_free_on_resume():
    """A new RunConfig field must say what a resume does with it (config's `resume` metadata);
    --preset, --out and --resume themselves are handled by the command line."""
    unclassified = [f.name for f in fields(RunConfig)
                    if f.metadata.get("resume") not in ("keep", "free") and f.name not in ("preset", "out", "resume")]
    assert unclassified == []


@pytest.mark.parametrize("flag", [["--strategy", "ps"], ["--threads", "2"], ["--step", "compiled"], ["--devices", "2"],
                                  ["--device", "cuda"]])
def test_a_resume_refuses_options_that_change_the_arithmetic(flag, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert interrupt(towerlab.jobs.train, monkeypatch, ["train", *ARGS, "--out", str(out)]) == 130
    before = (out / "checkpoint.pt").read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device cuda: refused as a change, not as absent
    assert main(["train", "--resume", str(out), *flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"was trained with {flag[0]}" in err, err
    assert (out / "checkpoint.pt").read_bytes() == before and not (out / "summary.json").exists()


def test_a_resume_with_every_free_option_changed_equals_the_uninterrupted_run(whole, tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert interrupt(towerlab.jobs.train, monkeypatch, ["train", *ARGS, "--out", str(out)]) == 130
    free = ["--input", "feed", "--display-step", "7", "--timeout", "60", "--no-progress", "--no-download",
            "--data-dir", str(tmp_path), "--allow-changed-data",
            *(["--tensorboard"] if importlib.util.find_spec("tensorboard") else [])]
    assert main(["train", "--resume", str(out), *free]) == 0
    assert max_difference(weights(out), whole) == 0.0
    assert main(["train", "--resume", str(tmp_path / "run2")]) == 2  # (and a resume still needs its folder)


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(whole, tmp_path, capsys):
    """issue 50: a training killed (or out of disk) before its first checkpoint left config.json and
    metrics.jsonl, and no command took the folder: --resume said "nothing to resume", a new run "use
    --resume". Now --resume starts the recorded run over, to the uninterrupted run's numbers."""
    out = tmp_path / "run"
    assert main(["train", *ARGS, "--out", str(out)]) == 0
    for name in ("checkpoint.pt", "checkpoint.pt.prev", "model.pt", "summary.json"):
        (out / name).unlink(missing_ok=True)
    (out / "metrics.jsonl").write_text((out / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    capsys.readouterr()
    assert main(["train", *ARGS, "--out", str(out)]) == 2  # a new run in its folder: resume it
    assert f"continue that run with --resume {out}" in capsys.readouterr().err
    assert main(["train", "--resume", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"towerlab: {out} holds no checkpoint yet (the run stopped before its first): starting it over from " \
           "step 0 with its recorded settings" in err
    assert max_difference(weights(out), whole) == 0.0
    assert summary(out)["steps"] == 45


def test_a_finished_run_without_its_checkpoint_is_not_started_over(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    for name in ("checkpoint.pt", "checkpoint.pt.prev"):
        (out / name).unlink(missing_ok=True)
    kept = (out / "model.pt").read_bytes()
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 2
    assert "nothing to resume" in capsys.readouterr().err and (out / "model.pt").read_bytes() == kept


# -------------------------------------------------------------------------------- changed data

def test_a_custom_file_replaced_under_a_resume_is_refused_or_recorded(tmp_path, monkeypatch, capsys):
    data = colour_classes(tmp_path / "colours.npz")
    args = ["train", "--model", "mlp", "--dataset", str(data), "--val-size", "100", "--batch-size", "50", "--epochs", "3",
            "--no-progress", "--threads", "1", *ONE_CPU]
    out = tmp_path / "run"
    assert interrupt(towerlab.jobs.train, monkeypatch, [*args, "--out", str(out)], reads=12) == 130
    started_on = json.loads((out / "config.json").read_text())["data_digest"]
    assert started_on.startswith("sha256:") and len(started_on) == 71
    colour_classes(data, seed=1)  # the same path, other images
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the data changed since this run started" in err and str(data) in err, err
    assert "--allow-changed-data" in err and not (out / "summary.json").exists()
    assert main(["train", "--resume", str(out), "--allow-changed-data"]) == 0
    assert "warning: the data changed since this run started" in capsys.readouterr().err
    record = summary(out)
    assert record["data_digest_at_start"] == started_on and record["data_digest"] != started_on


def fake_mnist(folder, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(exist_ok=True)
    np.savez(folder / "mnist.npz", x_train=rng.integers(0, 256, (700, 28, 28), dtype=np.uint8),
             y_train=rng.integers(0, 10, 700), x_test=rng.integers(0, 256, (100, 28, 28), dtype=np.uint8),
             y_test=rng.integers(0, 10, 100))


def test_a_built_in_dataset_moved_resumes_and_replaced_is_refused(tmp_path, monkeypatch, capsys):
    fake_mnist(tmp_path / "data")
    out = tmp_path / "run"
    args = ["train", "--model", "mlp", "--data-dir", str(tmp_path / "data"), "--no-download", "--val-size", "100",
            "--batch-size", "50", "--epochs", "2", "--no-progress", "--threads", "1", *ONE_CPU, "--out", str(out)]
    assert interrupt(towerlab.jobs.train, monkeypatch, args, reads=8) == 130
    shutil.copytree(tmp_path / "data", tmp_path / "moved")  # the same files elsewhere: the same data
    fake_mnist(tmp_path / "data", seed=1)
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 2
    assert "the data changed since this run started" in capsys.readouterr().err
    assert main(["train", "--resume", str(out), "--data-dir", str(tmp_path / "moved")]) == 0
    assert "data_digest_at_start" not in summary(out)


# ---------------------------------------------------------------------------- how to continue

def test_an_interrupted_training_names_the_resume_command(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert interrupt(towerlab.jobs.train, monkeypatch, ["train", *ARGS, "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert "Interrupted at step 20: checkpoint saved" in captured.out
    assert captured.err == f"towerlab: interrupted. Continue from the last checkpoint with: towerlab train --resume " \
                           f"{out}\n"


@pytest.mark.parametrize("reads, where", [(20, "step 20 of 45 (5 of 15 steps into epoch 2)"),
                                          (15, "step 15 of 45 (the end of epoch 1)")])
def test_a_resumed_run_says_on_its_first_line_where_it_resumes_from(reads, where, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert interrupt(towerlab.jobs.train, monkeypatch, ["train", *ARGS, "--out", str(out)], reads=reads) == 130
    fresh = capsys.readouterr().out.splitlines()[0]
    assert fresh.startswith("towerlab: lenet5 on synthetic (1500 train / 500 val / 333 test)")
    assert main(["train", "--resume", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"towerlab: resuming from {where}: {fresh[len('towerlab: '):]}"
    assert lines[-1] == f"Wrote {out / 'summary.json'} and {out / 'model.pt'}"


SPACE_ARGS = ["evolve", "--dataset", "synthetic", "--val-size", "500", "--population", "3", "--generations", "1",
              "--max-epochs", "1", "--top", "1", "--threads", "1", "--no-progress", *ONE_CPU]


class StopAfterTwo(StopAtRead):
    """A Ctrl-C in a search's worker as soon as the store holds two evaluations (the worker reads the
    flag at every step of a training and at every look for work)."""

    store: Path = Path("search.db")

    @property
    def signum(self):
        with contextlib.closing(sqlite3.connect(self.store)) as db:
            done = db.execute("SELECT COUNT(*) FROM evaluations").fetchone()[0]
        return int(signal.SIGINT) if done >= 2 else 0


def interrupt_search(monkeypatch, out: Path, args: list[str]) -> int:
    """`main(args)`, the search in `out`, with a Ctrl-C in its worker once two evaluations are in."""
    monkeypatch.setattr(StopAfterTwo, "store", out / "search.db")
    monkeypatch.setattr(towerlab.jobs.search.workers, "StopFlag", StopAfterTwo)
    try:
        return main(args)
    finally:
        monkeypatch.undo()


def test_an_interrupted_search_says_what_it_kept_and_how_to_continue(tmp_path, monkeypatch, capsys):
    out = tmp_path / "evo"
    assert interrupt_search(monkeypatch, out, [*SPACE_ARGS, "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert f"Interrupted: the 2 evaluation(s) finished since this start are kept in {out / 'search.db'}" \
        in captured.out, captured.out
    assert captured.err == f"towerlab: interrupted. Continue the search with: towerlab evolve --resume {out}\n"
    assert main(["evolve", "--resume", str(out)]) == 0


def test_allow_changed_data_is_for_a_resume_only(tmp_path, capsys):
    """On a new run it would mean nothing, and recorded in config.json it would let every later
    resume through; it is refused instead."""
    assert main(["train", *ARGS, "--allow-changed-data", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-changed-data goes with --resume only" in err, err
    assert not (tmp_path / "run").exists()


def test_a_search_resume_keeps_the_threads_its_candidates_were_trained_with(tmp_path, monkeypatch, capsys):
    out = tmp_path / "evo"
    assert interrupt_search(monkeypatch, out, [*SPACE_ARGS, "--out", str(out)]) == 130
    assert json.loads((out / "config.json").read_text())["run"]["threads"] == 1
    before = (out / "search.db").read_bytes()
    capsys.readouterr()
    assert main(["evolve", "--resume", str(out), "--threads", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was trained with --threads 1" in err, err
    assert (out / "search.db").read_bytes() == before and not (out / "summary.json").exists()
