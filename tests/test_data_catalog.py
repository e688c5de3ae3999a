"""The dataset catalog: a dataset added as its files plus one registry entry trains by name like a built-in."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest
import torch

from towerlab.cli import main
from towerlab.config import SearchConfig, TrainConfig
from towerlab.catalog import datasets
from towerlab.data import locate, readers
from towerlab.data.load import load_dataset
from towerlab.errors import UserError
from towerlab.models.files import load_model
from util import ONE_CPU


def stripes(n, seed, classes=3, side=12):
    """`classes` classes of side x side RGB images, each brightening its own channel mix: learnable in
    a few steps, and a shape and class count no built-in dataset has."""
    rng = np.random.default_rng(seed)
    mix = np.random.default_rng(0).uniform(0, 1, (classes, 3))
    y = rng.integers(0, classes, n)
    x = rng.normal(60, 25, (n, side, side, 3)) + 150 * mix[y][:, None, None, :]
    return np.clip(x, 0, 255).astype(np.uint8), y.astype(np.int64)


@pytest.fixture
def stripes_dataset(tmp_path, monkeypatch):
    """The documented way: the dataset's file in the data folder, and one `register` call."""
    (x_train, y_train), (x_test, y_test) = stripes(600, 1), stripes(200, 2)
    np.savez(tmp_path / "stripes.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    monkeypatch.setattr(datasets, "CATALOG", dict(datasets.CATALOG))  # the registration ends with the test
    datasets.register(datasets.Entry("stripes", (3, 12, 12), 3, (datasets.Files("npz", "stripes.npz"),)))
    return tmp_path


def test_a_registered_dataset_trains_by_name_through_the_cli(stripes_dataset, capsys):
    out = stripes_dataset / "run"
    assert main(["train", "--model", "lenet5", "--dataset", "stripes", "--data-dir", str(stripes_dataset),
                 "--val-size", "100", "--batch-size", "50", "--epochs", "2", "--no-progress", "--threads", "1",
                 *ONE_CPU, "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "stripes" and (summary["n_train"], summary["n_test"]) == (500, 200)
    assert summary["test_accuracy"] >= 0.9  # nearest class mean gets ~100% on this set
    model, record = load_model(out / "model.pt")
    assert record["input_shape"] == [3, 12, 12] and record["num_classes"] == 3
    assert model(torch.zeros(2, 3, 12, 12)).shape == (2, 3)


def test_a_registered_dataset_is_a_name_like_the_built_in_ones(stripes_dataset, capsys):
    assert TrainConfig(dataset="stripes").dataset == "stripes" == SearchConfig(dataset="stripes").dataset
    rows = {row["name"]: row for row in locate.dataset_info(stripes_dataset)}
    assert rows["stripes"]["found"] and rows["stripes"]["where"] == str(stripes_dataset / "stripes.npz")
    assert main(["data", "info", "--data-dir", str(stripes_dataset)]) == 0
    assert any(line.split()[:3] == ["stripes", "found", "npz"] for line in capsys.readouterr().out.splitlines())
    assert main(["data", "fetch", "stripes", "--data-dir", str(stripes_dataset)]) == 2
    assert "nothing to download for dataset 'stripes': downloadable ones are mnist, fashion-mnist, cifar10" \
        in capsys.readouterr().err
    (stripes_dataset / "stripes.npz").unlink()
    with pytest.raises(UserError, match=r"^stripes not found \(looked for stripes.npz in .*\): run `towerlab data "
                                        r"fetch stripes` or pass --data-dir DIR holding the files$"):
        load_dataset("stripes", stripes_dataset, download=False)


def test_an_entry_s_class_count_and_shape_bound_what_its_files_may_hold(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets, "CATALOG", dict(datasets.CATALOG))
    datasets.register(datasets.Entry("digits16", (1, 16, 16), 4, (datasets.Files("idx", "digits16"),)))
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.integers(0, 256, (20, 16, 16), dtype=np.uint8), "y_train": np.arange(20) % 4,
              "x_test": rng.integers(0, 256, (8, 16, 16), dtype=np.uint8), "y_test": np.arange(8) % 4}
    folder = tmp_path / "digits16"
    folder.mkdir()

    def write(labels_of_test):
        for key, name in zip(("x_train", "y_train", "x_test", "y_test"), readers.IDX_FILES):
            a = (labels_of_test if key == "y_test" else arrays[key]).astype(np.uint8)
            blob = bytes([0, 0, 8, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()
            (folder / f"{name}.gz").write_bytes(gzip.compress(blob))

    write(arrays["y_test"])
    ds = load_dataset("digits16", tmp_path, val_size=5, download=False)
    assert ds.input_shape == (1, 16, 16) and ds.num_classes == 4 and (ds.n_train, ds.n_val, ds.n_test) == (15, 5, 8)
    assert ds.source["format"] == "idx" and ds.y_test.tolist() == arrays["y_test"].tolist()
    write(np.full(8, 4))
    with pytest.raises(UserError, match=r"labels range 4\.\.4, expected 0\.\.3"):
        load_dataset("digits16", tmp_path, val_size=5, download=False)


@pytest.mark.parametrize("entry, message", [
    (lambda: datasets.Entry("mnist", (1, 28, 28), 10), "already in the catalog"),
    (lambda: datasets.Entry("mine.npz", (1, 28, 28), 10), "taken by paths of your own .npz"),
    (lambda: datasets.Entry("gif", (1, 28, 28), 10, (datasets.Files("gif", "x.gif"),)), "unknown file format 'gif'"),
    (lambda: datasets.Entry("one", (1, 28, 28), 1), "at least 2 classes"),
])
def test_a_bad_entry_is_refused_with_one_clear_line(entry, message, monkeypatch):
    monkeypatch.setattr(datasets, "CATALOG", dict(datasets.CATALOG))
    with pytest.raises(UserError, match=message):
        datasets.register(entry())
    assert list(datasets.CATALOG) == ["mnist", "fashion-mnist", "cifar10", "synthetic"]


def test_the_built_in_entries():
    assert datasets.names() == ("mnist", "fashion-mnist", "cifar10", "synthetic")
    assert datasets.downloadable() == ("mnist", "fashion-mnist", "cifar10")
    assert {name: (e.shape, e.classes) for name, e in datasets.CATALOG.items()} == {
        "mnist": ((1, 28, 28), 10), "fashion-mnist": ((1, 28, 28), 10), "cifar10": ((3, 32, 32), 10),
        "synthetic": (None, 10)}
    # What fetch downloads is what the lookup then finds: the IDX sets' folder is one the entry lists.
    for name in ("mnist", "fashion-mnist"):
        entry = datasets.entry(name)
        assert datasets.Files("idx", entry.source.subdir) in entry.files
    assert [name for name, e in datasets.CATALOG.items() if e.fallback] == ["mnist"]
