"""Degenerate data and diverging training never end as a success: a constant channel (std 0) is
normalised without dividing by zero; a loss that becomes NaN or infinite stops the run with one line
naming the step and the likely cause (exit 2, no summary.json or model.pt, no NaN in any record); in
a search such a candidate fails with that reason, and a search in which every candidate failed is
not a success either."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from test_faults_values import strict
from towerlab.cli import main
from towerlab.data.load import channel_stats, load_dataset
from util import ONE_CPU, TINY, weights


def degenerate(path, case: str):
    """3-class RGB images whose third channel is constant ("constant-channel"), or a set whose
    images are all one and the same ("all-equal")."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 700)
    if case == "all-equal":
        x = np.full((700, 12, 12, 3), 77, np.uint8)
    else:
        x = np.clip(rng.normal(60, 20, (700, 12, 12, 3)) + 120 * np.eye(3)[y][:, None, None, :], 0, 255).astype(np.uint8)
        x[..., 2] = 200
    np.savez(path, x_train=x[:600], y_train=y[:600], x_test=x[600:], y_test=y[600:])
    return path


def test_a_constant_channel_is_normalised_without_dividing_by_zero(tmp_path):
    mean, std = channel_stats(np.stack([np.zeros((4, 4), np.uint8), np.full((4, 4), 255, np.uint8)])[None])
    assert mean == (0.0, 1.0) and std == (1.0, 1.0)  # constant channels: scale 1, centred to zeros
    ds = load_dataset(str(degenerate(tmp_path / "d.npz", "constant-channel")), val_size=100)
    assert ds.std[2] == 1.0 and 0 < ds.std[0] < 1


@pytest.mark.parametrize("case", ["constant-channel", "all-equal"])
def test_training_on_degenerate_data_stays_finite(case, tmp_path):
    data = degenerate(tmp_path / f"{case}.npz", case)
    out = tmp_path / "run"
    assert main(["train", "--model", "lenet5", "--dataset", str(data), "--val-size", "100", "--batch-size", "50",
                 "--epochs", "2", "--no-progress", "--threads", "1", *ONE_CPU, "--out", str(out)]) == 0
    assert all(torch.isfinite(w).all() for w in weights(out).values())
    record = json.loads((out / "summary.json").read_text())
    assert 0 <= record["test_accuracy"] <= 1 and np.isfinite(record["val_loss"])
    if case == "constant-channel":
        assert record["test_accuracy"] > 0.9  # the other two channels still tell the classes apart


DIVERGING = ["--model", "mlp", "--optimizer", "sgd", "--lr", "1e6", "--epochs", "2", "--batch-size", "100"]


@pytest.mark.parametrize("display", ["1", "1000"])  # caught at a display step / at the end of the epoch
def test_a_diverging_training_fails_in_one_line_naming_the_step(display, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, *DIVERGING, "--display-step", display, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "training diverged: the training loss became NaN or infinite" in err, err
    # (step 1 is checked on its own: its loss, on the initial weights, is finite)
    assert ("at step " if display == "1" else "between steps 2 and ") in err and "--lr 1e+06" in err, err
    assert not (out / "summary.json").exists() and not (out / "model.pt").exists()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        strict(line)  # no bare NaN in the record


@pytest.mark.slow
def test_two_replicas_agree_that_training_diverged(tmp_path, capfd):
    out = tmp_path / "run"
    assert main(["train", *TINY, *DIVERGING, "--devices", "2", "--out", str(out)]) == 2
    err = capfd.readouterr().err  # the replicas' processes write to the file descriptor
    assert err.count("towerlab: error:") == 1 and "training diverged" in err, err
    assert "Traceback" not in err and not (out / "summary.json").exists()


def test_a_search_whose_every_candidate_diverges_is_not_a_success(tmp_path, capsys):
    space = tmp_path / "space.toml"
    space.write_text('model = "mlp"\n[genes]\nneurons = [16, 32]\nlayers = [1]\nactivation = ["relu"]\n'
                     'optimizer = ["sgd"]\nlr = [1e6]\n')
    out = tmp_path / "grid"
    assert main(["grid", "--space", str(space), "--dataset", "synthetic", "--val-size", "500", "--max-epochs", "1",
                 "--threads", "1", "--no-progress", *ONE_CPU, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "all 2 candidates failed (the first: training diverged" in err, err
    record = strict((out / "summary.json").read_text())
    assert record["failures"] == 2 and record["best_genome"] is None


class NotFinite(torch.nn.Module):
    """A network whose output is NaN from its first forward, whatever the learning rate."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(28 * 28, 10)

    def forward(self, x):
        return self.fc(x.flatten(1)) * float("nan")


def test_a_model_whose_output_is_nan_from_the_first_step_is_not_blamed_on_the_learning_rate(tmp_path):
    from towerlab import api
    from towerlab.training.divergence import Diverged

    out = tmp_path / "run"
    with pytest.raises(Diverged) as caught:
        api.train(NotFinite(), "synthetic", synthetic_train=2000, val_size=500, steps=20, display_step=1000,
                  device="cpu", devices=1, threads=1, progress=False, out=str(out))
    message = str(caught.value)
    assert "the model's output is not finite" in message and "first step" in message, message
    assert "lr" not in message.replace("learning rate is not the cause", "")
    assert not (out / "summary.json").exists() and not (out / "model.pt").exists()
