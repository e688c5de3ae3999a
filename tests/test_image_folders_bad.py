"""Every bad input of an image folder has its documented outcome (docs/data.md, "Bad input"): a skip
that is counted and reported, or one line on stderr with exit status 2 and nothing written; never a
traceback, never a class list that differs between splits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from PIL import Image

from image_folders import bomb, colour_folder, split_folder
from towerlab.cli import main
from towerlab.data import folders
from towerlab.data.folders import FolderOptions
from towerlab.data.load import load_dataset
from util import ONE_CPU

FAST = ["--no-progress", "--threads", "1", *ONE_CPU]


def train(tmp_path: Path, folder: Path, *more: str) -> int:
    return main(["train", "--model", "mlp", "--dataset", f"{folder}/", "--data-dir", str(tmp_path / "data"),
                 "--epochs", "1", "--batch-size", "8", *FAST, *more, "--out", str(tmp_path / "run")])


def refused(tmp_path: Path, capsys, folder: Path, *more: str, decoded: bool = False) -> str:
    """The one line a refused training says (after the lines of a decode that found the fault, where
    only decoding finds it); nothing was written: no run folder, no cache entry, no half-written cache."""
    assert train(tmp_path, folder, *more) == 2
    err = capsys.readouterr().err.strip().splitlines()
    if decoded:
        assert err[0].startswith("Reading the") and err[1].startswith("Decoding them"), err
        err = err[2:]
    assert len(err) == 1 and err[0].startswith("towerlab: error: "), err
    assert not (tmp_path / "run").exists()
    cache = tmp_path / "data" / folders.CACHE
    left = [p.name for p in cache.iterdir() if p.is_dir() and p.name != "index"] if cache.exists() else []
    assert left == []
    return err[0]


def skipped(tmp_path: Path, capsys, folder: Path) -> dict:
    """A training that skips files: it trains, and says how many it skipped and why, in a line and in
    its summary.json."""
    assert train(tmp_path, folder) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    source = json.loads((tmp_path / "run" / "summary.json").read_text())["data_source"]
    assert f"skipped {source['skipped']} file(s)" in err
    return source


def test_a_corrupt_a_truncated_and_a_non_image_file_are_skipped_and_counted(tmp_path, capsys):
    folder = colour_folder(tmp_path / "set", per_class=10)
    (folder / "red" / "garbage.jpg").write_bytes(b"this is no JPEG at all" * 10)
    whole = (folder / "green" / "000.png").read_bytes()
    (folder / "green" / "cut.png").write_bytes(whole[: len(whole) // 2])
    (folder / "blue" / "notes.txt").write_text("labels were checked by hand")
    source = skipped(tmp_path, capsys, folder)
    reasons = dict(source["skipped_files"])
    assert source["skipped"] == 3 and reasons["blue/notes.txt"] == "not an image file (.txt)"
    assert reasons["red/garbage.jpg"] == "not a JPEG, PNG, BMP, WebP or GIF image"
    assert reasons["green/cut.png"].startswith("corrupt or truncated")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["n_train"] + summary["n_val"] + summary["n_test"] == 30


def test_a_decompression_bomb_is_skipped_without_being_decoded(tmp_path, capsys):
    folder = colour_folder(tmp_path / "set", per_class=10)
    bomb(folder / "red" / "bomb.png")
    source = skipped(tmp_path, capsys, folder)
    assert source["skipped"] == 1 and "(a decompression bomb?)" in dict(source["skipped_files"])["red/bomb.png"]


def test_unreadable_files_are_skipped_and_counted(tmp_path, capsys):
    folder = colour_folder(tmp_path / "set", per_class=10)
    (folder / "red" / "gone.png").symlink_to(tmp_path / "nowhere.png")  # a broken link: cannot be opened
    locked = folder / "blue" / "locked.png"
    locked.write_bytes((folder / "blue" / "000.png").read_bytes())
    locked.chmod(0)  # unreadable, except to root (who reads it: then it is one image more)
    fifo = folder / "green" / "pipe.png"
    os.mkfifo(fifo)  # not a regular file: never opened (reading one would block)
    source = skipped(tmp_path, capsys, folder)
    reasons = dict(source["skipped_files"])
    assert reasons["red/gone.png"] == "unreadable (No such file or directory)"
    assert reasons["green/pipe.png"] == "not a regular file"
    if os.geteuid() != 0:
        assert reasons["blue/locked.png"].startswith("unreadable (Permission denied)")


def test_a_link_back_to_a_folder_above_is_a_loop_skipped_once(tmp_path, capsys):
    folder = colour_folder(tmp_path / "set", per_class=10)
    (folder / "red" / "more").mkdir()
    Image.open(folder / "red" / "000.png").save(folder / "red" / "more" / "deep.png")
    (folder / "red" / "more" / "again").symlink_to(folder / "red")  # red/more/again -> red: a loop
    (folder / "blue" / "self.png").symlink_to("self.png")  # a link to itself
    source = skipped(tmp_path, capsys, folder)
    reasons = dict(source["skipped_files"])
    assert reasons["red/more/again"] == "a link back to a folder it lies in (a loop)"
    assert reasons["blue/self.png"].startswith("unreadable (Too many levels of symbolic links")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["n_train"] + summary["n_val"] + summary["n_test"] == 31  # the nested image counts


def test_an_empty_class_folder_is_refused(tmp_path, capsys):
    folder = colour_folder(tmp_path / "set", per_class=10)
    (folder / "violet").mkdir()
    (folder / "violet" / "readme.txt").write_text("to do")
    assert "class folder" in refused(tmp_path, capsys, folder) and "violet holds no image" in \
        refused(tmp_path, capsys, folder)


def test_a_class_folder_none_of_whose_images_decodes_is_refused(tmp_path, capsys):
    folder = colour_folder(tmp_path / "set", per_class=10)
    for path in (folder / "red").iterdir():
        path.write_bytes(b"broken")
    line = refused(tmp_path, capsys, folder, decoded=True)
    assert "no image of class folder red can be decoded" in line and "not a JPEG" in line


def test_a_single_class_is_refused(tmp_path, capsys):
    folder = colour_folder(tmp_path / "set", per_class=10, classes={"only": (1, 2, 3)})
    assert "holds one class folder (only/): a classifier needs at least 2 classes" in refused(tmp_path, capsys, folder)


def test_a_test_class_that_train_lacks_is_refused(tmp_path, capsys):
    folder = split_folder(tmp_path / "set", {"train": 6, "test": 3})
    colour_folder(folder / "test", per_class=2, classes={"violet": (200, 0, 200)})
    line = refused(tmp_path, capsys, folder)
    assert "has class folder violet/ that" in line and "train lacks" in line


def test_a_test_folder_without_train_and_a_missing_folder_are_refused(tmp_path, capsys):
    colour_folder(tmp_path / "set" / "test", per_class=2)
    assert "holds test/ but no train/" in refused(tmp_path, capsys, tmp_path / "set")
    assert "not found" in refused(tmp_path, capsys, tmp_path / "nowhere")


def test_options_that_do_not_apply_are_refused(tmp_path, capsys):
    folder = split_folder(tmp_path / "set", {"train": 6, "test": 3})
    assert "has test/ of its own: leave --test-size out" in refused(tmp_path, capsys, folder, "--test-size", "0.3")
    assert main(["train", "--dataset", "mnist", "--image-size", "32x32", "--out", str(tmp_path / "run")]) == 2
    assert "say how an image folder" in capsys.readouterr().err


def test_a_data_folder_that_cannot_be_written_is_one_line(tmp_path, capsys):
    folder = colour_folder(tmp_path / "set", per_class=4)
    (tmp_path / "data").write_text("a file where the data folder should be")
    assert train(tmp_path, folder) == 2
    assert "cannot write the image cache" in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_hundred_thousand_tiny_files_decode(tmp_path):
    """100,000 files of 1 x 1 pixel: listed, hashed and decoded on every core (no process, file handle
    or argument per file), then reopened from the cache."""
    folder = tmp_path / "tiny"
    pixel = {}
    for name, value in (("dark", 10), ("light", 240)):
        (folder / name).mkdir(parents=True)
        Image.new("L", (1, 1), value).save(tmp_path / f"{name}.png")
        pixel[name] = (tmp_path / f"{name}.png").read_bytes()
    for i in range(100_000):
        name = "dark" if i % 2 else "light"
        (folder / name / f"{i:06d}.png").write_bytes(pixel[name])
    data = load_dataset(f"{folder}/", tmp_path / "data", val_size=5000, folder=FolderOptions(), log=lambda line: None)
    assert (data.n_train, data.n_val, data.n_test) == (75_000, 5_000, 20_000) and data.input_shape == (1, 1, 1)
    assert sorted(set(data.x_train.flatten().tolist())) == [10, 240]
    assert ((data.x_train.flatten() == 240) == (data.y_train == 1)).all()
