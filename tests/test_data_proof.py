"""Issue 65's data side: a dataset's proof is of the arrays a training reads (never a cache answering for
bytes it did not read), an image folder's cache entry is checked before it is trusted, a full disk is one
line, and an image folder is read as its content says (links, swapped files, EXIF orientation)."""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL
import pytest
import torch
from PIL import Image

from image_folders import colour_folder, coloured
from towerlab.cli import main
from towerlab.data import folder_decode, readers
from towerlab.data.digest import content_digest
from towerlab.data.folder_files import list_folder
from towerlab.data.folders import FolderOptions
from towerlab.data.load import load_dataset
from towerlab.errors import UserError
from util import ONE_CPU

FAST = ["--no-progress", "--threads", "1", *ONE_CPU]


def load(folder: Path, data_dir: Path, log=lambda line: None, **options):
    return load_dataset(f"{folder}/", data_dir, 3, folder=FolderOptions(**options), log=log)


def arrays_npz(path: Path, changed_label: bool = False) -> Path:
    """An .npz of 200 + 50 random images; `changed_label`: one training label other (the same size)."""
    rng = np.random.default_rng(0)
    arrays = {"x_train": rng.integers(0, 256, (200, 8, 8), dtype=np.uint8), "y_train": rng.integers(0, 4, 200),
              "x_test": rng.integers(0, 256, (50, 8, 8), dtype=np.uint8), "y_test": rng.integers(0, 4, 50)}
    arrays["y_train"][:4] = np.arange(4)  # every class present
    if changed_label:
        arrays["y_train"][7] = (arrays["y_train"][7] + 1) % 4
    np.savez(path, **arrays)
    return path


# ------------------------------------------------------------------------------- the data's digest

def test_a_same_size_file_with_its_time_put_back_has_the_digest_of_its_new_arrays(tmp_path, monkeypatch):
    """Defect 1: a cache keyed by path, size and time answered with the old file's digest."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = arrays_npz(tmp_path / "set.npz")
    first = content_digest(load_dataset(str(path), val_size=10))
    before = path.stat()
    arrays_npz(path, changed_label=True)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # touch -r, cp -p, rsync -a
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns
    assert content_digest(load_dataset(str(path), val_size=10)) != first


def test_a_file_replaced_between_its_read_and_its_digest_poisons_nothing(tmp_path, monkeypatch):
    """Defect 2: the file was stat'ed after it was read, and the new file's key kept the old data's digest."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = arrays_npz(tmp_path / "set.npz")
    read = load_dataset(str(path), val_size=10)
    shutil.copy(arrays_npz(tmp_path / "other.npz", changed_label=True), path)  # replaced after the read
    old = content_digest(read)
    assert content_digest(load_dataset(str(path), val_size=10)) != old


def test_a_reader_that_gives_other_arrays_gives_another_digest(tmp_path, monkeypatch):
    """Defect 4: a changed reader (images inverted) with a warm cache kept the digest of the files."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = arrays_npz(tmp_path / "set.npz")
    first = content_digest(load_dataset(str(path), val_size=10))
    read_npz = readers.read_npz

    def inverted(*args, **kwargs):
        arrays = read_npz(*args, **kwargs)
        return {**arrays, "x_train": 255 - arrays["x_train"]}

    monkeypatch.setattr(readers, "read_npz", inverted)
    assert content_digest(load_dataset(str(path), val_size=10)) != first


def test_the_digest_is_of_every_byte_the_split_and_shape_and_not_of_the_validation_cut(monkeypatch):
    """What the digest covers: one pixel or label changed, another shape of the same bytes, or a test
    image moved to training changes it; the validation cut does not; pieces hashed on several threads
    give the digest of one."""
    from towerlab.data import digest
    from towerlab.data.load import from_arrays

    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 256, (300, 6, 6), dtype=np.uint8), rng.integers(0, 3, 300)
    x_test, y_test = rng.integers(0, 256, (40, 6, 6), dtype=np.uint8), rng.integers(0, 3, 40)
    first = content_digest(from_arrays((x, y), test=(x_test, y_test), val_size=30))
    assert content_digest(from_arrays((x, y), test=(x_test, y_test), val_size=100)) == first
    pixel, label = x.copy(), y.copy()
    pixel[299, 5, 5] ^= 1
    label[0] = (label[0] + 1) % 3
    others = [from_arrays((pixel, y), test=(x_test, y_test), val_size=30),
              from_arrays((x, label), test=(x_test, y_test), val_size=30),
              from_arrays((x.reshape(300, 4, 9), y), test=(x_test.reshape(40, 4, 9), y_test), val_size=30),
              from_arrays((np.concatenate([x, x_test[:1]]), np.concatenate([y, y_test[:1]])),
                          test=(x_test[1:], y_test[1:]), val_size=30)]
    assert len({first, *(content_digest(d) for d in others)}) == 5
    monkeypatch.setattr(digest, "PIECE", 1000)  # 11 pieces of the images, hashed on every core
    many = content_digest(from_arrays((x, y), test=(x_test, y_test), val_size=30))
    monkeypatch.setattr(digest, "cores", lambda: 1)
    assert content_digest(from_arrays((x, y), test=(x_test, y_test), val_size=30)) == many != first


# --------------------------------------------------------------------------- an image folder's cache

def test_another_decoder_decodes_into_another_entry_and_leaves_this_one(tmp_path, monkeypatch):
    """Defect 4: a folder decoded by another decoder landed in the same cache entry, and the search's
    decoder then trained on its pixels."""
    folder, data_dir = colour_folder(tmp_path / "set", per_class=6), tmp_path / "data"
    first = load(folder, data_dir)
    pixels = first.x_train.clone()
    decode = folder_decode.decode
    key = getattr(folder_decode, "decoder_key", None)
    said: list[str] = []
    with monkeypatch.context() as patch:
        patch.setattr(PIL, "__version__", "0.0-another")  # another Pillow, another decoder
        patch.setattr(folder_decode, "decode", lambda *args: 255 - decode(*args))
        if key is not None:
            key.cache_clear()
        other = load(folder, data_dir, log=said.append)
    if key is not None:
        key.cache_clear()
    assert any(line.startswith("Decoding") for line in said) and other.source["cache"] != first.source["cache"]
    assert torch.equal(other.x_train, 255 - pixels)
    said.clear()
    again = load(folder, data_dir, log=said.append)
    assert torch.equal(again.x_train, pixels) and not any(line.startswith("Decoding") for line in said)


def test_a_folder_changed_between_its_read_and_its_decode_leaves_no_entry(tmp_path, monkeypatch):
    """Defect 6: pass 2 decoded bytes other than those pass 1 hashed, into the entry named by pass 1's."""
    folder, data_dir = colour_folder(tmp_path / "set", per_class=6), tmp_path / "data"
    scan = folder_decode.scan

    def then_edited(items):
        found = scan(items)
        Image.fromarray(coloured(np.random.default_rng(5), (0, 0, 0), (12, 10))).save(folder / "red" / "002.png")
        return found

    monkeypatch.setattr(folder_decode, "scan", then_edited)
    with pytest.raises(UserError, match=r"red/002.png changed while .* was being decoded: run again"):
        load(folder, data_dir)
    assert [p.name for p in (data_dir / "image-cache").iterdir() if p.suffix != ".lock" and p.name != "index"] == []


def damage(entry: Path, how: str) -> None:
    if how == "inverted":
        x = np.load(entry / "x.npy", mmap_mode="r+")
        x[:] = 255 - x
        x.flush()
    elif how == "rows":
        meta = json.loads((entry / "meta.json").read_text())
        meta["blocks"]["train"] = 100_000
        (entry / "meta.json").write_text(json.dumps(meta))
    elif how == "labels":
        y = np.load(entry / "y.npy", mmap_mode="r+")
        y[0] = 7
        y.flush()
    elif how == "truncated":
        with open(entry / "x.npy", "r+b") as stream:
            stream.truncate(os.path.getsize(entry / "x.npy") // 2)
    elif how == "meta_fifo":
        (entry / "meta.json").unlink()
        os.mkfifo(entry / "meta.json")


@pytest.mark.parametrize("how", ["inverted", "rows", "labels", "truncated", "meta_fifo"])
def test_a_cache_entry_edited_or_damaged_is_decoded_again_with_one_line(tmp_path, how):
    """Defect 8: inverted pixels trained silently, meta.json's counts were believed, labels out of range and
    a truncated x.npy ended in tracebacks."""
    folder, data_dir = colour_folder(tmp_path / "set", per_class=6), tmp_path / "data"
    first = load(folder, data_dir)
    pixels, labels, digest = first.x_train.clone(), first.y_train.clone(), content_digest(first)
    del first
    damage(data_dir / "image-cache" / Path(load(folder, data_dir).source["cache"]).name, how)
    said: list[str] = []
    again = load(folder, data_dir, log=said.append)
    assert torch.equal(again.x_train, pixels) and torch.equal(again.y_train, labels) and content_digest(again) == digest
    damaged = [line for line in said if "is damaged" in line]
    assert len(damaged) == 1 and "decoding" in damaged[0] and any(line.startswith("Decoding") for line in said)


def test_stats_of_another_entry_or_damaged_are_computed_again(tmp_path):
    """stats.json beside an entry holds the channel statistics of its cuts: trusted only for the arrays it was
    computed from, and only where its own checksum holds."""
    folder, data_dir = colour_folder(tmp_path / "set", per_class=6), tmp_path / "data"
    first = load(folder, data_dir)
    stats = Path(first.source["cache"]) / "stats.json"
    known = json.loads(stats.read_text())
    cut = next(iter(known["cuts"]))
    known["cuts"][cut]["mean"] = [0.0, 0.0, 0.0]
    stats.write_text(json.dumps(known))
    assert load(folder, data_dir).mean == first.mean


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """Defect 11: a decode on a small file system died of a bus error (exit 135) and left its .tmp folder;
    a file-size limit ended in a traceback. Before a decode the free space is checked; the blocks are
    reserved, so a disk that fills meanwhile is an OSError here, never a bus error in the map; the
    leftovers of a killed decode are removed by the next."""
    folder, data_dir = colour_folder(tmp_path / "set", per_class=6), tmp_path / "data"
    cache = data_dir / "image-cache"
    entry = Path(load(folder, data_dir).source["cache"])
    shutil.rmtree(entry)
    leftover = cache / f".{entry.name}.tmp-424242"  # a decode killed halfway
    (leftover / "x-all.npy").parent.mkdir(parents=True)
    (leftover / "x-all.npy").write_bytes(b"\0" * 100)
    with monkeypatch.context() as patch:
        patch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
        with pytest.raises(UserError, match=r"needs 0.0 MiB in .*image-cache, whose disk has 0.0 MiB free"):
            load(folder, data_dir)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(os, "posix_fallocate", full)
        with pytest.raises(UserError, match=r"cannot write the image cache entry .* \(No space left on device\)"):
            load(folder, data_dir)
    assert [p.name for p in cache.iterdir() if p.suffix != ".lock" and p.name != "index"] == []
    assert load(folder, data_dir).source["cache"] == str(entry)


def test_a_file_size_limit_is_one_line_exit_2_and_no_tmp(tmp_path):
    """Defect 8's `ulimit -f`: the decode's files would pass the limit: refused before anything is written."""
    folder, data_dir = colour_folder(tmp_path / "set", per_class=6, size=(64, 64)), tmp_path / "data"
    limit = 40_000  # bytes: the cache of 18 images of 64x64x3 is 221,184

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = subprocess.run([sys.executable, "-m", "towerlab", "train", "--model", "mlp", "--dataset", f"{folder}/",
                           "--data-dir", str(data_dir), "--epochs", "1", "--batch-size", "4", *FAST, "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=300, preexec_fn=limited)
    assert done.returncode == 2, done.stderr[-2000:]
    err = done.stderr.strip().splitlines()
    assert err[-1].startswith("towerlab: error: ") and "ulimit -f" in err[-1] and "Traceback" not in done.stderr
    assert not [p for p in (data_dir / "image-cache").iterdir() if p.name.startswith(".")]


# -------------------------------------------------------------------------- an image folder's files

@pytest.mark.parametrize("split", [False, True])
def test_a_link_in_a_class_folder_back_to_the_image_folder_is_a_loop(tmp_path, split):
    """Defect 10: the link was followed (loop detection began at the class folder), and the other classes'
    images were trained under this class's label."""
    root = tmp_path / "set"
    classes = colour_folder(root / "train" if split else root, per_class=4)
    os.symlink(root, classes / "red" / "back")
    if split:
        os.symlink(classes, classes / "blue" / "split")
    listing = list_folder(root)
    assert [len(rows) for _, _, rows in listing.found] == [4, 4, 4]
    loops = sorted(path for path, why in listing.skipped if "a loop" in why)
    prefix = "train/" if split else ""
    assert loops == sorted([f"{prefix}red/back", *([f"{prefix}blue/split"] if split else [])])


def test_same_size_images_swapped_between_classes_with_their_times_put_back_are_read_again(tmp_path):
    """Defect 12: a folder was recognised by its files' paths, sizes and times, so the swap was not seen."""
    folder, data_dir = colour_folder(tmp_path / "set", per_class=6, suffix=".bmp"), tmp_path / "data"
    first = load(folder, data_dir)
    digest = content_digest(first)
    red, blue = folder / "red" / "000.bmp", folder / "blue" / "000.bmp"
    times = [(p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in (red, blue)]
    red_bytes, blue_bytes = red.read_bytes(), blue.read_bytes()
    assert len(red_bytes) == len(blue_bytes)
    red.write_bytes(blue_bytes)
    blue.write_bytes(red_bytes)
    for path, ns in zip((red, blue), times):
        os.utime(path, ns=ns)
    said: list[str] = []
    swapped = load(folder, data_dir, log=said.append)
    assert swapped.source["content"] != first.source["content"] and content_digest(swapped) != digest
    assert any(line.startswith("Decoding") for line in said)


def sideways(path: Path, orientation: int = 6) -> Path:
    """A JPEG stored 20 wide and 10 high, its left half black and its right half white, tagged to be turned
    (6: a quarter turn clockwise, as phones tag a photo taken upright: its left half then shows on top)."""
    stored = np.zeros((10, 20, 3), np.uint8)
    stored[:, 10:] = 255
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(stored).save(path, exif=exif, quality=95)
    return path


def test_a_photo_tagged_to_be_turned_trains_and_predicts_turned(tmp_path):
    """Defect 13: EXIF orientation was ignored, so a phone's photos trained and predicted sideways."""
    image = folder_decode.decode(str(sideways(tmp_path / "a.jpg")), (20, 10), 3)
    assert image.shape == (3, 20, 10)
    assert image[:, :8].mean() < 30 and image[:, 12:].mean() > 225  # the black half on top
    for name in ("up", "down"):
        (tmp_path / "set" / name).mkdir(parents=True)
        for k in range(3):
            sideways(tmp_path / "set" / name / f"{k}.jpg", orientation=6 if name == "up" else 8)
    data = load(tmp_path / "set", tmp_path / "data", test_size=0.0)
    assert data.input_shape == (3, 20, 10)  # the folder's common size is the turned one
    x = torch.cat([data.x_train, data.x_val]).float()
    y = torch.cat([data.y_train, data.y_val])
    assert x[y == 1][:, :, :8].mean() < 30 < 225 < x[y == 1][:, :, 12:].mean()  # "up": black on top
    assert x[y == 0][:, :, :8].mean() > 225 > 30 > x[y == 0][:, :, 12:].mean()  # "down": white on top
    assert np.array_equal(folder_decode.decode_many([str(tmp_path / "a.jpg")], (20, 10), 3)[0], image)  # predict's


# ------------------------------------------------------------------------------ a newcomer's photos

def test_the_default_batch_size_is_fitted_to_a_few_photos_and_a_typed_one_is_not(tmp_path, capsys):
    """Defect 17: the README's `towerlab train --model cnn --dataset ~/photos/ --epochs 5` was refused on a
    folder of 150 photos (--batch-size 512 is more than the training examples)."""
    folder = colour_folder(tmp_path / "photos", per_class=50, size=(32, 32), suffix=".jpg")
    args = ["train", "--model", "cnn", "--dataset", f"{folder}/", "--data-dir", str(tmp_path / "data"), "--epochs", "1",
            *FAST]
    assert main([*args, "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    line = ("towerlab: the default --batch-size 512 x 1 replica(s) is more than the 96 training examples: training "
            "with --batch-size 16 (give --batch-size to choose)")
    assert line in err.splitlines()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["batch_size"] == 16
    assert main([*args, "--batch-size", "512", "--out", str(tmp_path / "typed")]) == 2
    assert "--batch-size 512 x 1 replica(s) is more than the 96 training examples" in capsys.readouterr().err
    assert main([*args, "--batch-size", "64", "--out", str(tmp_path / "fits")]) == 0
    assert "the default --batch-size" not in capsys.readouterr().err


def test_names_with_escape_codes_and_newlines_are_printed_escaped(tmp_path, capsys):
    """Defect 14 (predict, evaluate): a class folder's name with a terminal's escape codes or a newline was
    printed raw."""
    hostile = "red\x1b[2J\nnew"
    folder = colour_folder(tmp_path / "set", per_class=10, classes={"blue": (40, 40, 200), hostile: (200, 40, 40)})
    out = tmp_path / "run"
    assert main(["train", "--model", "mlp", "--dataset", f"{folder}/", "--data-dir", str(tmp_path / "data"),
                 "--epochs", "3", "--batch-size", "4", *FAST, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["predict", str(out), str(folder / hostile / "000.png")]) == 0
    printed = capsys.readouterr()
    assert "\x1b" not in printed.out + printed.err and len(printed.out.strip().splitlines()) == 1
    shown = str(folder / hostile / "000.png").replace("\x1b", "\\x1b").replace("\n", "\\n")
    assert printed.out.split("\t")[:2] == [shown, "red\\x1b[2J\\nnew"]
    assert main(["evaluate", str(out)]) == 0
    printed = capsys.readouterr()
    assert "\x1b" not in printed.out + printed.err and "  red\\x1b[2J\\nnew  accuracy" in printed.out
    from towerlab.report import printable

    assert printable("café\tx\\y\udcff") == "café\\tx\\\\y\\xff"
