"""Your own data: `--dataset PATH.npz` with any image size and number of classes, for train and the search."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from towerlab.data import load
from towerlab.data.digest import content_digest
from towerlab.cli import main
from towerlab.config import SearchConfig, TrainConfig
from towerlab.errors import UserError
from towerlab.objective.candidate import train_config_hash
from towerlab.models.files import load_model
from util import ONE_CPU


def colour_classes(path, n_train=600, n_test=200, seed=0, classes=3, side=12):
    """`classes` classes of side x side RGB images (channels last), each class brightening its own
    channel mix: learnable in one epoch, and a shape no built-in dataset has."""
    rng = np.random.default_rng(seed)
    mix = rng.uniform(0, 1, (classes, 3))

    def make(n):
        y = rng.integers(0, classes, n)
        x = rng.normal(60, 25, (n, side, side, 3)) + 150 * mix[y][:, None, None, :]
        return np.clip(x, 0, 255).astype(np.uint8), y.astype(np.int64)

    (x_train, y_train), (x_test, y_test) = make(n_train), make(n_test)
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path


def test_a_custom_npz_loads_with_its_shape_classes_and_digest(tmp_path):
    path = colour_classes(tmp_path / "colours.npz", classes=4, side=10)
    ds = load.load_dataset(str(path), val_size=100)
    assert ds.input_shape == (3, 10, 10) and ds.num_classes == 4
    assert (ds.n_train, ds.n_val, ds.n_test) == (500, 100, 200)
    assert ds.source["format"] == "npz" and ds.source["files"] == [str(path)]
    assert ds.source["note"] == "custom: 4 classes, images 3x10x10"
    with np.load(path) as raw:  # channels last on disk, channels first in towerlab, nothing reordered
        assert torch.equal(ds.x_test, torch.from_numpy(raw["x_test"].transpose(0, 3, 1, 2).copy()))
    assert content_digest(ds) == content_digest(load.load_dataset(str(path), val_size=50))  # the arrays' digest


def test_the_config_stores_an_absolute_path_and_labels_folders_by_the_stem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(dataset="mine.NPZ")
    assert cfg.dataset == os.path.join(str(tmp_path), "mine.NPZ")
    assert TrainConfig(dataset=cfg.dataset).dataset == cfg.dataset  # idempotent: resume rebuilds it
    with pytest.raises(UserError, match="or give the path of your own .npz"):
        TrainConfig(dataset="mnist.csv")


@pytest.mark.parametrize("change, message", [
    (dict(y_train=np.zeros(600, np.int64), y_test=np.zeros(200, np.int64)), "at least 2 classes"),
    (dict(y_test=np.full(200, 1000)), r"labels range 1000\.\.1000, expected 0\.\.999"),
    (dict(y_test=-np.ones(200, np.int64)), "labels range"),
    (dict(x_test=np.zeros((200, 3, 12, 12), np.uint8)), "channels last"),
    (dict(x_test=np.zeros((200, 12, 12, 3), np.float32)), "expected uint8"),
    (dict(x_test=np.zeros((200, 10, 10, 3), np.uint8)), "train images are .* but test images are"),
])
def test_a_bad_custom_npz_is_one_clear_error(tmp_path, change, message):
    path = colour_classes(tmp_path / "bad.npz")
    with np.load(path) as raw:
        arrays = {**dict(raw), **change}
    np.savez(path, **arrays)
    with pytest.raises(UserError, match=message):
        load.load_dataset(str(path), val_size=100)


def test_a_missing_custom_file_exits_2_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere.npz"
    assert main(["train", "--dataset", str(missing), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"dataset file {missing} not found" in err[0]
    assert not (tmp_path / "run").exists()


def test_train_on_a_custom_npz_end_to_end(tmp_path, capsys):
    path = colour_classes(tmp_path / "colours.npz")
    out = tmp_path / "run"
    assert main(["train", "--model", "lenet5", "--dataset", str(path), "--val-size", "100", "--batch-size", "50",
                 "--epochs", "2", "--no-progress", "--threads", "1", *ONE_CPU, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == str(path) and summary["n_train"] == 500 and summary["n_test"] == 200
    assert summary["test_accuracy"] >= 0.9  # nearest class mean gets ~100% on this set
    model, record = load_model(out / "model.pt")
    assert record["input_shape"] == [3, 12, 12] and record["num_classes"] == 3
    assert model(torch.zeros(2, 3, 12, 12)).shape == (2, 3)


def test_a_search_on_a_custom_npz_and_its_cache_follow_the_files_content(tmp_path, capsys):
    path = colour_classes(tmp_path / "colours.npz")
    before = train_config_hash(SearchConfig(dataset=str(path)), "cpu", 1,
                               data_digest=content_digest(load.load_dataset(str(path), val_size=100)))
    args = ["grid", "--space", "mlp", "--dataset", str(path), "--val-size", "100", "--limit", "2", "--top", "1",
            "--max-epochs", "1", "--no-progress", "--threads", "1", *ONE_CPU]
    assert main([*args, "--out", str(tmp_path / "grid")]) == 0
    summary = json.loads((tmp_path / "grid" / "summary.json").read_text())
    assert summary["evaluations"] == 2 and summary["failures"] == 0 and summary["best_val_accuracy"] >= 0.5
    assert "colours" in (tmp_path / "grid" / "best.json").read_text()
    colour_classes(path, seed=1)  # the same path, other images: cached fitnesses no longer apply
    assert train_config_hash(SearchConfig(dataset=str(path)), "cpu", 1,
                             data_digest=content_digest(load.load_dataset(str(path), val_size=100))) != before
