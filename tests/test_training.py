"""Training end to end: the invariant of synchronous data parallelism for both strategies, the
input modes, resume, interruption, a dying replica, the run's record."""

import json
import os
import signal
import time

import pytest

from towerlab.cli import main
from towerlab.models.files import load_model
from util import (ONE_CPU, RESUMABLE, TINY, TINY_DATA, interrupt, max_difference, metrics, replica_pids, run_cli, start_towerlab,
                  summary, weights)

STEPS = ["--model", "lenet5", "--steps", "6"]  # no dropout: the replicas' arithmetic is comparable


@pytest.mark.parametrize("devices", ["1", "2"])
def test_the_setup_is_checked_once_per_run(devices, tmp_path, monkeypatch):
    """check_setup (the model built on the meta device, a module of yours tried on two images, the
    batch size) runs once per run: in the launcher before its workers start, else in the one process
    that trains; neither the workers (forked here: they would count) nor the loop check again."""
    import towerlab.jobs.train

    calls = tmp_path / "calls"
    check_setup = towerlab.jobs.train.check_setup

    def counted(*args, **kwargs):
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        return check_setup(*args, **kwargs)

    monkeypatch.setattr(towerlab.jobs.train, "check_setup", counted)
    args = [*TINY_DATA, "--device", "cpu", "--devices", devices, "--threads", "1", "--model", "mlp", "--steps", "2"]
    assert main(["train", *args, "--out", str(tmp_path / "run")]) == 0
    assert len(calls.read_text().split()) == 1


@pytest.fixture(scope="module")
def one_replica_double_batch(tmp_path_factory):
    out = tmp_path_factory.mktemp("inv") / "one"
    assert main(["train", *TINY, *STEPS, "--batch-size", "64", "--out", str(out)]) == 0
    return weights(out)


@pytest.mark.parametrize("strategy", ["ddp", "ps"])
def test_two_replicas_end_with_the_parameters_of_one_replica_with_twice_the_batch(
        strategy, one_replica_double_batch, tmp_path):
    out = tmp_path / strategy
    assert main(["train", *TINY, *STEPS, "--batch-size", "32", "--devices", "2", "--strategy", strategy,
                 "--out", str(out)]) == 0
    assert max_difference(weights(out), one_replica_double_batch) < 1e-5
    record = summary(out)
    assert (record["world_size"], record["global_batch_size"], record["steps"]) == (2, 64, 6)
    assert record["strategy"] == strategy


def test_parameter_server_alone_equals_all_reduce_alone(one_replica_double_batch, tmp_path):
    assert main(["train", *TINY, *STEPS, "--batch-size", "64", "--strategy", "ps", "--out", str(tmp_path / "ps")]) == 0
    assert max_difference(weights(tmp_path / "ps"), one_replica_double_batch) < 1e-6


def test_parameters_really_change_during_training(one_replica_double_batch, tmp_path):
    # Guards the invariant tests against comparing two untrained models.
    assert main(["train", *TINY, "--model", "lenet5", "--steps", "1", "--batch-size", "64",
                 "--out", str(tmp_path / "short")]) == 0
    assert max_difference(weights(tmp_path / "short"), one_replica_double_batch) > 1e-3


def test_input_modes_compute_the_same_numbers(one_replica_double_batch, tmp_path):
    for mode in ("feed", "queue"):
        out = tmp_path / mode
        assert main(["train", *TINY, *STEPS, "--batch-size", "64", "--input", mode, "--out", str(out)]) == 0
        assert max_difference(weights(out), one_replica_double_batch) == 0.0


def test_interrupted_then_resumed_equals_uninterrupted(tmp_path, monkeypatch):
    args = [*RESUMABLE, *ONE_CPU]
    assert main(["train", *args, "--out", str(tmp_path / "whole")]) == 0
    interrupt(args, tmp_path / "cut", monkeypatch)
    assert main(["train", "--resume", str(tmp_path / "cut")]) == 0

    assert max_difference(weights(tmp_path / "cut"), weights(tmp_path / "whole")) == 0.0
    whole, cut = summary(tmp_path / "whole"), summary(tmp_path / "cut")
    assert cut["test_accuracy"] == whole["test_accuracy"] and cut["steps"] == whole["steps"] == 45
    # The resumed record reads as if never interrupted: one line per epoch, in order.
    assert [m["epoch"] for m in metrics(tmp_path / "cut") if m["kind"] == "epoch"] == [1, 2, 3]


def test_resume_refuses_changed_hyperparameters_and_finished_runs_stay_put(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, *STEPS, "--batch-size", "64", "--out", str(out)]) == 0
    assert main(["train", "--resume", str(out), "--lr", "0.1"]) == 2
    assert "--lr differ" in capsys.readouterr().err
    assert main(["train", *TINY, *STEPS, "--out", str(out)]) == 2
    assert "already holds files" in capsys.readouterr().err


def test_run_record_has_the_stable_fields_and_a_loadable_model(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--model", "lenet5", "--epochs", "2", "--batch-size", "64",
                 "--display-step", "5", "--out", str(out)]) == 0
    record = summary(out)
    stable = ["dataset", "data_source", "n_train", "n_val", "n_test", "model", "strategy", "input", "world_size",
              "device_type", "batch_size_per_replica", "global_batch_size", "epochs", "steps", "train_seconds",
              "examples_per_sec", "val_accuracy", "test_accuracy", "seed", "torch_version", "setup_seconds",
              "test_seconds", "wall_seconds"]
    assert not [k for k in stable if k not in record]
    assert 0 < record["test_seconds"] < record["wall_seconds"] - record["train_seconds"]  # the test pass, apart
    assert (record["n_train"], record["n_val"], record["n_test"]) == (1500, 500, 333)
    assert record["steps"] == 2 * (1500 // 64) and record["epochs"] == 2.0
    assert record["test_accuracy"] > 0.5  # learnable synthetic data, well above chance (0.1)
    assert record["examples_per_sec"] > 0
    lines = metrics(out)
    assert [m["step"] for m in lines if m["kind"] == "step"] == list(range(5, 2 * 23 + 1, 5))
    assert len([m for m in lines if m["kind"] == "epoch"]) == 2
    config = json.loads((out / "config.json").read_text())
    assert config["train"]["model"] == "lenet5" and config["run"]["devices"] == 1
    model, saved = load_model(out / "model.pt")
    assert saved["config"]["batch_size"] == 64
    assert sum(p.numel() for p in model.parameters()) > 0


def test_patience_stops_early_and_keeps_the_best_epoch(tmp_path):
    out = tmp_path / "run"
    # A learning rate this high makes validation loss worse after the first epochs.
    assert main(["train", *TINY, "--model", "mlp", "--optimizer", "sgd", "--lr", "3.0", "--epochs", "30",
                 "--patience", "2", "--batch-size", "64", "--out", str(out)]) == 0
    record = summary(out)
    epochs = [m for m in metrics(out) if m["kind"] == "epoch"]
    assert record["stopped"] == "patience" and len(epochs) < 30
    best = min(epochs, key=lambda m: m["val_loss"])
    assert record["best_epoch"] == best["epoch"] and record["val_accuracy"] == best["val_accuracy"]
    assert len(epochs) == best["epoch"] + 2


def test_target_accuracy_stops_as_soon_as_reached(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--model", "lenet5", "--epochs", "20", "--batch-size", "32",
                 "--target-accuracy", "0.6", "--eval-every", "10", "--out", str(out)]) == 0
    record = summary(out)
    assert record["stopped"] == "target_accuracy"
    assert record["val_accuracy"] >= 0.6
    assert record["steps"] < 20 * (1500 // 32) and record["steps"] % 10 == 0


@pytest.mark.slow
def test_sigint_to_two_replicas_saves_and_resume_equals_uninterrupted(tmp_path):
    args = [*TINY, "--synthetic-train", "6000", "--model", "lenet5", "--epochs", "3", "--batch-size", "16",
            "--devices", "2"]
    whole = run_cli("train", *args, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    job = start_towerlab("train", *args, "--out", str(tmp_path / "cut"), log=tmp_path / "cut.log")
    deadline = time.time() + 120
    while not (tmp_path / "cut" / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    assert job.wait(timeout=60) == 130, (tmp_path / "cut.log").read_text()
    assert "checkpoint saved" in (tmp_path / "cut.log").read_text()
    resumed = run_cli("train", "--resume", str(tmp_path / "cut"))
    assert resumed.returncode == 0, resumed.stderr
    assert max_difference(weights(tmp_path / "cut"), weights(tmp_path / "whole")) < 1e-6


@pytest.mark.slow
def test_a_killed_replica_ends_the_job_quickly_naming_the_rank(tmp_path):
    out = tmp_path / "run"
    job = start_towerlab("train", *TINY, "--synthetic-train", "6000", "--model", "lenet5", "--epochs", "50",
                         "--batch-size", "16", "--devices", "2", "--out", str(out), log=tmp_path / "log")
    deadline = time.time() + 120
    while not (out / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.2)
    replicas = replica_pids(job.pid)
    assert len(replicas) == 2
    os.kill(replicas[1], signal.SIGKILL)
    killed_at = time.time()
    status = job.wait(timeout=60)
    assert time.time() - killed_at < 60
    log = (tmp_path / "log").read_text()
    assert status == 1 and "replica rank 1" in log and "SIGKILL" in log, log
    assert "Traceback" not in log
    state = __import__("towerlab.training.checkpoint", fromlist=["load"]).load(out / "checkpoint.pt")
    assert state["step"] > 0
