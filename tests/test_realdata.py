"""Real MNIST (../shared/data/mnist.npz or $TOWERLAB_DATA); skipped cleanly where it is absent."""

import pytest

from towerlab.cli import main
from util import real_data_dir, summary

DATA = real_data_dir()
pytestmark = [pytest.mark.realdata, pytest.mark.slow,
              pytest.mark.skipif(DATA is None, reason="no mnist.npz in $TOWERLAB_DATA or ../shared/data")]


def test_lenet5_on_two_replicas_reaches_98_5_percent_on_mnist(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--data-dir", str(DATA), "--no-download", "--model", "lenet5", "--devices", "2",
                 "--epochs", "3", "--batch-size", "64", "--lr", "0.004", "--schedule", "onecycle",
                 "--display-step", "1000", "--no-progress", "--out", str(out)]) == 0
    record = summary(out)
    assert record["data_source"]["format"] == "npz" and not record["data_fallback"]
    assert (record["n_train"], record["n_val"], record["n_test"]) == (55000, 5000, 10000)
    assert record["world_size"] == 2 and record["global_batch_size"] == 128
    assert record["test_accuracy"] >= 0.985
