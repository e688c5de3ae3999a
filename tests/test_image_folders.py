"""Your own images as they lie on disk: `--dataset PATH/` (class folders, or train/ val/ test/), decoded
once into a cache keyed by the folder's content, class names out (config.json, model.pt, predict,
evaluate), and the same numbers as the .npz of the same images."""

from __future__ import annotations

import csv
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from image_folders import COLOURS, colour_folder, coloured, npz_as_folder, split_folder
from towerlab import api
from towerlab.cli import main
from towerlab.config import SearchConfig, TrainConfig
from towerlab.data import folders
from towerlab.data.folder_cache import stratified_order
from towerlab.data.digest import content_digest
from towerlab.data.folders import FolderOptions
from towerlab.data.load import load_dataset
from towerlab.errors import UserError
from towerlab.objective.candidate import train_config_hash
from towerlab.models.files import load_model
from util import ONE_CPU, real_data_dir

FAST = ["--no-progress", "--threads", "1", *ONE_CPU]


def load(folder: Path, data_dir: Path, val_size: int = 5000, log=print, **options):
    return load_dataset(f"{folder}/", data_dir, val_size, folder=FolderOptions(**options), log=log)


def test_three_class_folders_of_jpegs_train_and_predict_names_a_class(tmp_path, capsys):
    folder = colour_folder(tmp_path / "photos", per_class=30, size=(20, 16), suffix=".jpg")
    out = tmp_path / "run"
    assert main(["train", "--model", "cnn", "--dataset", f"{folder}/", "--data-dir", str(tmp_path / "data"),
                 "--epochs", "3", "--batch-size", "16", *FAST, "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["class_names"] == ["blue", "green", "red"] and config["train"]["dataset"] == f"{folder}/"
    model, record = load_model(out)
    assert record["class_names"] == ["blue", "green", "red"] and model.class_names == ("blue", "green", "red")
    assert record["input_shape"] == [3, 20, 16]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["n_train"], summary["n_val"], summary["n_test"]) == (58, 14, 18)  # 90: 18 test, 14 val
    assert summary["test_accuracy"] >= 0.9
    capsys.readouterr()
    image = folder / "red" / "007.jpg"
    assert main(["predict", str(out), str(image)]) == 0
    said = capsys.readouterr()
    printed = said.out.strip().splitlines()
    assert said.err == f"Predicted 1 image -> {out / 'predictions' / '007-predictions.csv'}\n"  # not "1 images"
    assert printed[0].split("\t")[:2] == [str(image), "red"]
    assert not (folder / "red" / "007-predictions.csv").exists()  # never where it would become training data
    with open(out / "predictions" / "007-predictions.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert rows[0]["class"] == "red" and float(rows[0]["probability"]) == pytest.approx(float(printed[0].split("\t")[2]),
                                                                                         abs=1e-4)
    assert set(rows[0]) == {"path", "class", "probability", "p_blue", "p_green", "p_red"}


def test_predict_takes_files_and_folders_and_writes_json_on_request(tmp_path, capsys):
    folder = colour_folder(tmp_path / "train", per_class=20)
    run = api.train(model="mlp", data=f"{folder}/", data_dir=str(tmp_path / "data"), epochs=3, batch_size=8,
                    device="cpu", devices=1, threads=1, progress=False, out=str(tmp_path / "run"))
    assert run.model.class_names == ("blue", "green", "red")
    new = colour_folder(tmp_path / "new", per_class=3, seed=5)
    (new / "blue" / "notes.txt").write_text("not an image")
    out = tmp_path / "labels.json"
    assert main(["predict", str(run.out), str(new / "green" / "000.png"), f"{new}/", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["classes"] == ["blue", "green", "red"] and len(written["predictions"]) == 1 + 9
    assert [p["class"] for p in written["predictions"][1:]] == ["blue"] * 3 + ["green"] * 3 + ["red"] * 3
    assert written["skipped"] == [[str(new / "blue" / "notes.txt"), "not an image file (.txt)"]]
    assert "skipped 1 file(s)" in capsys.readouterr().err


def test_evaluate_prints_each_class_accuracy_by_name_and_maps_another_folders_classes_by_name(tmp_path, capsys):
    folder = colour_folder(tmp_path / "train", per_class=20)
    data = str(tmp_path / "data")
    assert main(["train", "--model", "mlp", "--dataset", f"{folder}/", "--data-dir", data, "--epochs", "3",
                 "--batch-size", "8", *FAST, "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(the run recorded" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["blue", "green", "red"]
    # Another folder with two of the classes, under a train/ and test/ layout: its test/ is scored, by name.
    other = split_folder(tmp_path / "other", {"train": 2, "test": 4}, classes={k: COLOURS[k] for k in ("green", "red")})
    result = api.evaluate(tmp_path / "run", f"{other}/", data_dir=data)
    assert [(row["class"], row["n"]) for row in result["per_class"]] == [("green", 4), ("red", 4)]
    assert result["accuracy"] == 1.0
    colour_folder(tmp_path / "odd", per_class=2, classes={"green": (0, 200, 0), "violet": (200, 0, 200)})
    with pytest.raises(UserError, match="has class violet, which the model was not trained on"):
        api.evaluate(tmp_path / "run", f"{tmp_path / 'odd'}/", data_dir=data)


def test_train_val_and_test_folders_are_the_splits_and_classes_are_train_s_sorted(tmp_path):
    folder = split_folder(tmp_path / "set", {"train": 6, "val": 2, "test": 3})
    data = load(folder, tmp_path / "data", val_size=1)
    assert (data.n_train, data.n_val, data.n_test) == (18, 6, 9)  # val/ replaces --val-size
    assert data.class_names == ("blue", "green", "red") and data.num_classes == 3
    assert data.y_train.tolist() == [0, 1, 2] * 6  # file-name order, the class breaking ties
    assert data.source["note"] == "image folder: 3 classes, images 3x12x10; test: test/; val: val/"
    with pytest.raises(UserError, match="has test/ of its own: leave --test-size out"):
        load(folder, tmp_path / "data", test_size=0.3)


def test_a_folder_of_class_folders_is_split_stratified_by_test_size_and_val_size(tmp_path):
    folder = colour_folder(tmp_path / "set", per_class=40, grey=True,
                           classes={"a": (0, 0, 0), "b": (90, 90, 90), "c": (180, 180, 180), "d": (250, 250, 250)})
    for name in ("c", "d"):  # an unbalanced set: 40, 40, 20, 20
        for path in sorted((folder / name).iterdir())[20:]:
            path.unlink()
    data = load(folder, tmp_path / "data", val_size=15, test_size=0.25)
    assert (data.n_train, data.n_val, data.n_test) == (75, 15, 30)
    for split, n in (("y_test", 30), ("y_val", 15)):
        counts = Counter(getattr(data, split).tolist())
        for label, share in enumerate((1 / 3, 1 / 3, 1 / 6, 1 / 6)):
            assert abs(counts[label] - n * share) <= 1, (split, counts)
    assert data.input_shape == (1, 12, 10)  # every image grey: one channel
    again = load(folder, tmp_path / "data", val_size=15, test_size=0.25)
    assert torch.equal(again.x_test, data.x_test) and torch.equal(again.y_train, data.y_train)
    clipped = load(folder, tmp_path / "data", val_size=5000, test_size=0.25)  # at most a fifth of the 90 left
    assert (clipped.n_train, clipped.n_val) == (72, 18) and "--val-size 5000 is more than a fifth" in \
        clipped.source["note"]


def test_every_suffix_of_the_stratified_order_holds_each_class_within_one_image():
    labels = np.repeat(np.arange(5), [50, 30, 10, 7, 3])
    order = stratified_order(labels)
    assert sorted(order.tolist()) == list(range(100))
    for k in range(1, 101):
        counts = np.bincount(labels[order[-k:]], minlength=5)
        assert np.all(np.abs(counts - k * np.bincount(labels) / 100) <= 1), (k, counts)


def test_the_cache_is_keyed_by_content_reopened_without_decoding_and_decoded_again_when_edited(tmp_path):
    folder = colour_folder(tmp_path / "set", per_class=6)
    data_dir = tmp_path / "data"
    said: list[str] = []
    first = load(folder, data_dir, val_size=3, log=said.append)
    assert any(line.startswith("Decoding") for line in said)
    key = first.source["content"]
    assert key.startswith("sha256:")
    said.clear()
    again = load(folder, data_dir, val_size=3, log=said.append)
    assert said == [f"Reading the 18 images of {folder}"] and torch.equal(again.x_train, first.x_train)
    assert again.source == first.source and content_digest(again) == content_digest(first)
    os.utime(folder / "red" / "001.png", ns=(1, 1))  # touched, not changed: read and hashed, no decode
    assert load(folder, data_dir, val_size=3, log=said.append).source["content"] == key
    assert not any(line.startswith("Decoding") for line in said)
    moved = folder.rename(tmp_path / "moved")
    said.clear()
    assert load(moved, data_dir, val_size=3, log=said.append).source["content"] == key
    assert not any(line.startswith("Decoding") for line in said)
    Image.fromarray(coloured(np.random.default_rng(9), (0, 0, 0), (12, 10))).save(moved / "red" / "001.png")
    edited = load(moved, data_dir, val_size=3, log=said.append)
    assert edited.source["content"] != key and any(line.startswith("Decoding") for line in said)
    assert sorted(p.name for p in (data_dir / folders.CACHE).iterdir() if not p.name.startswith(".")
                  and p.suffix != ".lock") == sorted(Path(s).name for s in (first.source["cache"],
                                                                             edited.source["cache"]))


def test_a_folder_edited_in_place_leaves_no_cache_of_its_earlier_content(tmp_path):
    """Each edit of a folder decoded it again into a new entry and kept the old one: a folder that grows
    by a few images a day left a full copy of itself in the cache each time."""
    folder = colour_folder(tmp_path / "set", per_class=6)
    data_dir = tmp_path / "data"
    first = load(folder, data_dir, val_size=3, log=lambda line: None)
    larger = load(folder, data_dir, val_size=3, log=lambda line: None, image_size=(16, 16))
    other = load(colour_folder(tmp_path / "other", per_class=5), data_dir, val_size=3, log=lambda line: None)
    Image.fromarray(coloured(np.random.default_rng(9), (0, 0, 0), (12, 10))).save(folder / "red" / "001.png")
    said: list[str] = []
    edited = load(folder, data_dir, val_size=3, log=said.append)
    entries = sorted(p.name for p in (data_dir / folders.CACHE).iterdir() if not p.name.startswith("."))
    assert entries == sorted([Path(other.source["cache"]).name, Path(other.source["cache"]).name + ".lock",
                              Path(edited.source["cache"]).name, Path(edited.source["cache"]).name + ".lock"])
    removed = [line for line in said if line.startswith("Removed")]
    assert sorted(line.split()[1] for line in removed) == sorted([first.source["cache"], larger.source["cache"]])
    assert all(line.endswith(f"the cache of an earlier content of {folder}") for line in removed)


def test_formats_channels_and_the_resize_rule(tmp_path):
    folder = tmp_path / "set"
    rng = np.random.default_rng(0)
    (folder / "a").mkdir(parents=True)
    (folder / "b").mkdir()
    square = coloured(rng, (100, 150, 200), (8, 8))
    Image.fromarray(square).save(folder / "a" / "0.png")
    Image.fromarray(square).save(folder / "a" / "1.bmp")
    Image.fromarray(square).save(folder / "a" / "2.webp", lossless=True)
    Image.fromarray(square[:, :, 0]).save(folder / "a" / "3.png")  # grey: its value in R, G and B
    Image.fromarray(np.dstack([square, np.zeros((8, 8), np.uint8)])).save(folder / "b" / "4.png")  # alpha dropped
    frames = [Image.fromarray(square), Image.fromarray(255 - square)]
    frames[0].save(folder / "b" / "5.gif", save_all=True, append_images=frames[1:])
    wide = coloured(rng, (10, 20, 30), (8, 16))
    Image.fromarray(wide).save(folder / "b" / "6.png")  # 2:1: scaled to cover 8x8 (it is already 8 high), cropped
    flat = np.full((8, 8, 3), (90, 140, 210), np.uint8)
    Image.fromarray(flat).save(folder / "b" / "7.jpg", quality=95)
    data = load(folder, tmp_path / "data", val_size=0, test_size=0.0)
    assert data.input_shape == (3, 8, 8) and data.n_train == 8  # the most common size, 8x8
    by_name = dict(zip(["0.png", "1.bmp", "2.webp", "3.png", "4.png", "5.gif", "6.png", "7.jpg"],
                       (data.x_train[k].numpy() for k in _file_order(data))))
    chw = square.transpose(2, 0, 1)
    for name in ("0.png", "1.bmp", "2.webp", "4.png"):  # the target size: taken pixel for pixel
        assert np.array_equal(by_name[name], chw), name
    assert np.array_equal(by_name["3.png"], np.repeat(square[None, :, :, 0], 3, 0))
    gif = by_name["5.gif"].astype(int)  # its first frame (a GIF's palette rounds colours), not its second
    assert np.abs(gif - chw).mean() < 8 < np.abs(gif - (255 - chw)).mean()
    assert np.array_equal(by_name["6.png"], wide[:, 4:12].transpose(2, 0, 1))
    assert np.abs(by_name["7.jpg"].astype(int) - flat.transpose(2, 0, 1)).max() <= 3  # JPEG: lossy
    small = load(folder, tmp_path / "data", val_size=0, test_size=0.0, image_size=(4, 4))
    assert small.input_shape == (3, 4, 4)
    with pytest.raises(UserError, match="--image-size must look like 64x64"):
        TrainConfig(dataset=f"{folder}/", image_size="4x0")
    with pytest.raises(UserError, match="say how an image folder"):
        TrainConfig(dataset="mnist", image_size="28x28")


def _file_order(data) -> list[int]:
    """The rows of the 8 files of the formats test (classes a, b: 4 each), in file-name order: a folder
    without val/ and test/ keeps its images in the stratified order of their labels."""
    assert json.loads((Path(data.source["cache"]) / "meta.json").read_text())["stratified"]
    order = stratified_order(np.array([0, 0, 0, 0, 1, 1, 1, 1])).tolist()
    return [order.index(k) for k in range(8)]


def test_a_large_common_size_gives_way_to_the_stated_default(tmp_path):
    folder = colour_folder(tmp_path / "set", per_class=2, size=(130, 40))
    assert load(folder, tmp_path / "data", val_size=0).input_shape == (3, *folders.DEFAULT_SIZE)


def test_released_pages_leave_the_process_and_the_data_stays_readable(tmp_path):
    folder = colour_folder(tmp_path / "set", per_class=400, size=(64, 64))
    data = load(folder, tmp_path / "data", val_size=0, test_size=0.0)
    before = data.x_train.sum(dtype=torch.int64)  # every page of the cache mapped in
    mapped = _rss_file_kb()
    folders.release_pages(data.x_train.data_ptr())
    assert mapped - _rss_file_kb() >= 0.8 * data.x_train.numel() / 1024  # the ~4.7 MB of the cache gone from RSS
    assert data.x_train.sum(dtype=torch.int64) == before
    folders.release_pages(torch.zeros(3).data_ptr())  # memory of no cache: nothing happens


def _rss_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    pytest.skip("no RssFile in /proc/self/status")


def test_a_png_folder_of_an_npz_trains_to_the_npzs_parameters(tmp_path):
    """Identical numbers: the folder's train/, val/ and test/ are the .npz's splits, image for image."""
    rng = np.random.default_rng(3)
    x = np.clip(rng.normal(120, 60, (300, 10, 10, 3)), 0, 255).astype(np.uint8)
    y = rng.integers(0, 3, 300)
    x[np.arange(300), :, :, y] = 250  # learnable
    _same_parameters(tmp_path, x[:240], y[:240], x[240:], y[240:], ("a", "b", "c"), val=40,
                     flags=["--model", "cnn", "--batch-size", "20", "--epochs", "2"])


@pytest.mark.realdata
@pytest.mark.slow
def test_cifar10_as_png_files_trains_to_the_parameters_of_cifar10_npz(tmp_path):
    where = real_data_dir("cifar10.npz")
    if where is None:
        pytest.skip("no cifar10.npz in $TOWERLAB_DATA or ../shared/data")
    with np.load(where / "cifar10.npz") as raw:
        x_train, y_train = raw["x_train"][:1200], raw["y_train"].reshape(-1)[:1200]
        x_test, y_test = raw["x_test"][:300], raw["y_test"].reshape(-1)[:300]
    names = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
    _same_parameters(tmp_path, x_train, y_train, x_test, y_test, names, val=200,
                     flags=["--model", "lenet5", "--batch-size", "50", "--epochs", "1"])


def _same_parameters(tmp_path: Path, x_train, y_train, x_test, y_test, names, val: int, flags: list[str]) -> None:
    np.savez(tmp_path / "set.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    folder = tmp_path / "set"
    cut = len(x_train) - val  # the .npz's validation: its last `val` training images, as val/
    npz_as_folder(x_train[:cut], y_train[:cut], folder / "train", names)
    npz_as_folder(x_train[cut:], y_train[cut:], folder / "val", names, start=cut)
    npz_as_folder(x_test, y_test, folder / "test", names)
    states = {}
    for name, dataset in (("npz", str(tmp_path / "set.npz")), ("folder", f"{folder}/")):
        assert main(["train", *flags, "--dataset", dataset, "--val-size", str(val), "--data-dir", str(tmp_path / "d"),
                     "--seed", "7", *FAST, "--out", str(tmp_path / name)]) == 0
        states[name] = load_model(tmp_path / name)[1]["state_dict"]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        states[name + " numbers"] = (summary["val_loss"], summary["test_loss"], summary["n_train"])
    assert states["npz"].keys() == states["folder"].keys()
    for key in states["npz"]:
        assert torch.equal(states["npz"][key], states["folder"][key]), key
    assert states["npz numbers"] == states["folder numbers"]


def test_a_search_on_a_folder_is_keyed_by_its_content_and_a_joining_worker_checks_it(tmp_path):
    from towerlab.config import RunConfig
    from towerlab.jobs.search.workers import Objectives
    from towerlab.objective.kind import Here
    from towerlab.search import Search, Store

    folder = colour_folder(tmp_path / "set", per_class=20)
    data = str(tmp_path / "data")
    args = ["grid", "--space", "mlp", "--dataset", f"{folder}/", "--data-dir", data, "--val-size", "10", "--limit",
            "2", "--top", "1", "--max-epochs", "1", "--batch-size", "8", "--image-size", "8x8", *FAST]
    assert main([*args, "--out", str(tmp_path / "grid")]) == 0
    summary = json.loads((tmp_path / "grid" / "summary.json").read_text())
    assert summary["evaluations"] == 2 and summary["failures"] == 0
    assert "--image-size 8x8" in json.loads((tmp_path / "grid" / "best.json").read_text())["command"]
    cfg = SearchConfig(dataset=f"{folder}/", image_size="8x8", batch_size=8)
    digest = content_digest(load(folder, tmp_path / "data", image_size=(8, 8)))
    hashes = {train_config_hash(cfg, "cpu", 1, data_digest=digest)}
    nine = content_digest(load(folder, tmp_path / "data", image_size=(9, 9)))
    hashes.add(train_config_hash(SearchConfig(dataset=f"{folder}/", image_size="9x9", batch_size=8), "cpu", 1,
                                 data_digest=nine))
    with Store(tmp_path / "grid" / "search.db", create=False) as store:
        search = Search.open(store, 1)
        here = Here(torch.device("cpu"), run=RunConfig(device="cpu", data_dir=data))  # no stop needed to join
        assert callable(Objectives(here).objective(search))
        Image.fromarray(coloured(np.random.default_rng(9), (0, 0, 0), (12, 10))).save(folder / "red" / "001.png")
        with pytest.raises(UserError, match="its data differ") as refused:
            Objectives(here).objective(search)
        assert "folder" in str(refused.value)
    hashes.add(train_config_hash(cfg, "cpu", 1, data_digest=content_digest(load(folder, tmp_path / "data",
                                                                                 image_size=(8, 8)))))
    assert len(hashes) == 3


def test_a_folder_too_large_for_the_gpu_is_read_batch_by_batch(tmp_path, monkeypatch, capsys):
    """--input resident stays where the data fits; a cache over half the GPU's free memory is read
    through the queue instead (the GPU's free memory stood in for: this runs on a CPU)."""
    from towerlab.config import RunConfig
    from towerlab.distributed.group import Context
    from towerlab.jobs.train import TrainJob

    data = load(colour_folder(tmp_path / "set", per_class=10), tmp_path / "data")
    job = TrainJob(out=tmp_path / "run", cfg=TrainConfig(dataset=data.name), run=RunConfig(), started=0.0)
    gpu = Context(device=torch.device("cuda", 0))
    nbytes = sum(getattr(data, f"x_{split}").nbytes for split in ("train", "val", "test"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * nbytes, 4 * nbytes))
    assert job.fitted_to(data, gpu) is job
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2 * nbytes - 2, 4 * nbytes))
    assert job.fitted_to(data, gpu).run.input == "queue" and "--input queue" in capsys.readouterr().err
    assert job.fitted_to(data, Context()) is job  # a CPU reads the map as it is: nothing to copy


def test_a_resume_refuses_a_folder_edited_since_the_run_started(tmp_path, monkeypatch, capsys):
    import towerlab.jobs.train
    from util import StopAtRead

    folder = colour_folder(tmp_path / "set", per_class=20)
    out = tmp_path / "run"
    monkeypatch.setattr(StopAtRead, "reads_before_stop", 8)
    with monkeypatch.context() as patch:
        patch.setattr(towerlab.jobs.train, "StopFlag", StopAtRead)
        assert main(["train", "--model", "mlp", "--dataset", f"{folder}/", "--data-dir", str(tmp_path / "data"),
                     "--epochs", "3", "--batch-size", "8", *FAST, "--out", str(out)]) == 130
    started_on = json.loads((out / "config.json").read_text())["data_digest"]
    assert started_on == content_digest(load(folder, tmp_path / "data", val_size=5000))
    Image.fromarray(coloured(np.random.default_rng(9), (0, 0, 0), (12, 10))).save(folder / "red" / "001.png")
    capsys.readouterr()
    assert main(["train", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"the data changed since this run started ({folder}/ now holds arrays of digest " in err
    assert not (out / "summary.json").exists()
