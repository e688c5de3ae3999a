"""Setup apart from training (issues 9 and 38): the warm-up steps that compile or record a step (or,
on a GPU, let cuDNN pick its algorithms) run before the clock starts, are undone exactly, and are reported as
setup_seconds, never inside train_seconds; the run's wall time is reported beside them."""

import re

import pytest

import towerlab.training.program
import towerlab.training.loop
from towerlab.training.checkpoint import load as load_checkpoint
from towerlab.cli import main
from util import ONE_CPU, RESUMABLE, TINY, interrupt, max_difference, run_cli, summary, weights

LENET = ["--model", "lenet5", "--steps", "6", "--batch-size", "64"]
# Every kind of state a step changes, and that the warm-up must put back: BatchNorm statistics, a
# Nesterov momentum buffer, a linear schedule, BatchNorm biases on their own learning rate, Lookahead's
# slow weights (pulled at warm-up step 2); augmentation drawn per example.
WHITENET = ["--model", "whitenet", "--synthetic-shape", "3x16x16", "--model-opt", "width1=8", "--model-opt",
            "width2=16", "--model-opt", "width3=16", "--model-opt", "depth=1", "--optimizer", "sgd", "--lr", "0.2",
            "--momentum", "0.85", "--nesterov", "--weight-decay", "0.001", "--norm-lr-scale", "64",
            "--schedule", "linear", "--lookahead", "2", "--augment", "--translate", "2", "--steps", "8",
            "--batch-size", "32"]


def always_warm_up(monkeypatch):
    """Warm up as a compiled or CUDA run does, here with the plain CPU step, whose arithmetic is the
    same with or without the warm-up: what is left differing is what the warm-up failed to undo."""
    monkeypatch.setattr(towerlab.training.loop, "warms_up", lambda device, mode: True)


@pytest.fixture(scope="module")
def eager_lenet(tmp_path_factory):
    out = tmp_path_factory.mktemp("eager") / "run"
    assert main(["train", *TINY, *LENET, "--out", str(out)]) == 0
    return out


def final_line(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("Done: "))


def test_an_eager_cpu_run_spends_no_setup_and_reports_its_wall_time(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, *LENET, "--out", str(out)]) == 0
    record = summary(out)
    # 0.0, not null: nothing was warmed up, so nothing was spent on it.
    assert record["setup_seconds"] == 0.0
    assert record["wall_seconds"] >= record["train_seconds"] > 0
    printed = capsys.readouterr().out
    assert "Setup:" not in printed
    done = final_line(printed)
    assert "setup 0.0 s" in done and f"wall {record['wall_seconds']:.1f} s" in done


@pytest.mark.parametrize("case", ["whitenet-ddp", "whitenet-ps", "mlp-queue"])
def test_the_warm_up_is_undone_exactly(case, tmp_path, capsys, monkeypatch):
    model, variant = case.split("-")
    # mlp: dropout (seeded per step), a one-cycle schedule, crop+flip drawn per example, and the
    # queue's thread, which must stop when the warm-up leaves its batches early.
    args = [*TINY, *WHITENET] if model == "whitenet" else [*RESUMABLE, *ONE_CPU, "--steps", "8", "--input", "queue"]
    if variant == "ps":
        args += ["--strategy", "ps"]
    assert main(["train", *args, "--out", str(tmp_path / "plain")]) == 0
    always_warm_up(monkeypatch)
    capsys.readouterr()
    assert main(["train", *args, "--out", str(tmp_path / "warm")]) == 0
    assert "(3 warm-up steps, undone)" in capsys.readouterr().out
    assert max_difference(weights(tmp_path / "warm"), weights(tmp_path / "plain")) == 0.0
    plain, warm = summary(tmp_path / "plain"), summary(tmp_path / "warm")
    assert warm["test_accuracy"] == plain["test_accuracy"] and warm["steps"] == plain["steps"] == 8
    assert warm["setup_seconds"] > 0 and plain["setup_seconds"] == 0.0


def test_a_resumed_run_warms_up_again_and_equals_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    args = [*RESUMABLE, *ONE_CPU]
    assert main(["train", *args, "--out", str(tmp_path / "whole")]) == 0
    always_warm_up(monkeypatch)
    interrupt(args, tmp_path / "cut", monkeypatch)
    spent = load_checkpoint(tmp_path / "cut" / "checkpoint.pt")["setup_seconds"]
    assert spent > 0
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0
    assert "(3 warm-up steps, undone)" in capsys.readouterr().out
    assert max_difference(weights(tmp_path / "cut"), weights(tmp_path / "whole")) == 0.0
    assert summary(tmp_path / "cut")["setup_seconds"] > spent  # both attempts' setup


@pytest.mark.slow
def test_a_compiled_run_equals_the_eager_run_with_its_compilation_apart(eager_lenet, tmp_path, capsys, monkeypatch):
    out = tmp_path / "compiled"
    monkeypatch.setitem(towerlab.training.program.COMPILE_OPTIONS, "cpu", {"backend": "aot_eager"})  # inductor: a minute
    assert main(["train", *TINY, *LENET, "--step", "compiled", "--out", str(out)]) == 0
    # The step program's update against torch.optim's fused Adam: float32 rounding apart.
    assert max_difference(weights(out), weights(eager_lenet)) < 1e-5
    record = summary(out)
    assert record["setup_seconds"] > 0 and record["step"] == "compiled"
    # Disjoint intervals of the same run: compilation counted in train_seconds too would exceed it.
    assert record["setup_seconds"] + record["train_seconds"] <= record["wall_seconds"]
    assert record["examples_per_sec"] == pytest.approx(6 * 64 / record["train_seconds"])
    printed = capsys.readouterr().out
    assert printed.index("(3 warm-up steps, undone)") < printed.index("Validation Loss=")
    assert f"setup {record['setup_seconds']:.1f} s" in final_line(printed)


@pytest.mark.slow
def test_a_step_that_cannot_be_compiled_falls_back_with_one_line(eager_lenet, tmp_path):
    # A machine without a C++ compiler: inductor cannot build its CPU kernels. A fresh cache, so no
    # kernel of an earlier run is found ready-made.
    env = {"CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    done = run_cli("train", *TINY, *LENET, "--step", "compiled", "--out", str(tmp_path / "run"), env=env)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stdout.splitlines() if "--step compiled failed" in line]
    assert len(warnings) == 1 and warnings[0].endswith("training with the step program uncaptured"), done.stdout
    assert re.search(r"C\+\+ compiler", warnings[0]), warnings[0]
    assert "Traceback" not in done.stderr
    assert max_difference(weights(tmp_path / "run"), weights(eager_lenet)) < 1e-5
    record = summary(tmp_path / "run")
    assert record["setup_seconds"] > 0 and record["step"] == "program"


def test_a_search_candidate_spends_no_warm_up_steps(monkeypatch):
    """A candidate's setup is reported nowhere, so on a GPU it would only cost time: none is spent."""
    import torch

    from towerlab.config import SearchConfig
    from towerlab.data.load import load_dataset
    from towerlab.data.synthetic import SyntheticOptions
    from towerlab.objective.candidate import train_candidate
    from towerlab.training.eager import EagerSteps

    always_warm_up(monkeypatch)
    calls = []
    monkeypatch.setattr(EagerSteps, "warm_up", lambda *a: calls.append(a))
    data = load_dataset("synthetic", val_size=200, synthetic=SyntheticOptions(train=1200))
    outcome, result = train_candidate(SearchConfig(dataset="synthetic", val_size=200, max_epochs=1), "mlp",
                                      {"layers": 1, "neurons": 16}, 3, data, torch.device("cpu"))
    assert outcome.status == "ok" and result.setup_seconds == 0.0 and calls == []
