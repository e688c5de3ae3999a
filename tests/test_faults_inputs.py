"""Hostile input files and output paths for the commands that read (issue 41): `predict` reads its
images as training reads its data (a truncated .npz, a header claiming a huge array, a zip bomb:
one line, nothing allocated); a named pipe given for any input file is refused instead of blocking
forever; a command that only reads never writes over one of its inputs or a run's files; and
`--out` at a folder that is not a run does not suggest resuming it."""

from __future__ import annotations

import io
import os
import resource
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from towerlab.cli import main
from towerlab.search import Store
from util import TINY, run_cli


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("inputs") / "run"
    assert main(["train", *TINY, "--model", "mlp", "--model-opt", "neurons=16", "--model-opt", "layers=1",
                 "--steps", "2", "--out", str(out)]) == 0
    return out


def one_line(err: str, fragment: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("towerlab: error: ") and fragment in lines[0], err


def npz_claiming(path: Path, shape: tuple[int, ...], declared: int | None = None) -> Path:
    """An .npz whose x.npy header claims `shape` (uint8) over 100 real bytes; `declared`: the
    uncompressed size its zip directory claims (patched in, as a zip bomb's would read)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": "|u1", "fortran_order": False, "shape": shape})
    header = buffer.getvalue()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("x.npy", header + bytes(100))
    if declared is not None:
        raw = bytearray(path.read_bytes())
        local, central = raw.index(b"PK\x03\x04"), raw.index(b"PK\x01\x02")
        raw[local + 22:local + 26] = raw[central + 24:central + 28] = struct.pack("<I", len(header) + declared)
        path.write_bytes(bytes(raw))
    return path


def limited_memory(gib: int = 4):
    """For a subprocess: its address space capped at `gib` GiB, as `ulimit -v` does."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (gib * 2**30, gib * 2**30))
    return limit


@pytest.mark.parametrize("command", ["predict", "evaluate"])
def test_a_model_file_asking_for_a_huge_network_is_one_line(command, run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    record = torch.load(copy / "model.pt", weights_only=True)
    record["options"] = {**record["options"], "layers": 10**8}  # a 100-million-layer mlp in 250 KB
    torch.save(record, copy / "model.pt")
    np.savez(tmp_path / "x.npz", x=np.zeros((3, 28, 28), np.uint8))
    args = [str(copy), str(tmp_path / "x.npz")] if command == "predict" else [str(copy)]
    result = subprocess.run([sys.executable, "-m", "towerlab", command, *args], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120, preexec_fn=limited_memory())
    assert result.returncode == 2
    one_line(result.stderr, "layers must be at most 1000, got 100000000")


@pytest.mark.parametrize("command", ["predict", "evaluate"])
@pytest.mark.parametrize("case, fragment", [
    ("expanded", "tensor net.1.weight claims 15,680,000,000 elements over 4 bytes (an expanded view, not weights)"),
    ("sparse", "holds a sparse_coo tensor (net.1.weight)"),
])
@pytest.mark.slow
def test_a_model_file_whose_tensors_are_not_dense_weights_is_one_line(command, case, fragment, run, tmp_path):
    """issue 50: 3 KB of stride-0 views claiming neurons=20000000 passed the shape check, then the network
    was built for real (63 GB); a sparse tensor was a traceback from load_state_dict."""
    from towerlab.models import build_model

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    record = torch.load(copy / "model.pt", weights_only=True)
    if case == "expanded":
        record["options"] = {**record["options"], "neurons": 20_000_000}
        with torch.device("meta"):
            skeleton = build_model("mlp", tuple(record["input_shape"]), record["num_classes"], **record["options"])
        record["state_dict"] = {k: torch.zeros(1).expand(*v.shape) for k, v in skeleton.state_dict().items()}
    else:
        record["state_dict"] = {k: v.to_sparse() if v.dim() == 2 else v for k, v in record["state_dict"].items()}
    torch.save(record, copy / "model.pt")
    np.savez(tmp_path / "x.npz", x=np.zeros((3, 28, 28), np.uint8))
    args = [str(copy), str(tmp_path / "x.npz")] if command == "predict" else [str(copy)]
    result = subprocess.run([sys.executable, "-m", "towerlab", command, *args], capture_output=True, text=True,
                            cwd=tmp_path, timeout=120, preexec_fn=limited_memory())
    assert result.returncode == 2
    one_line(result.stderr, fragment)
    assert not list(tmp_path.glob("*predictions*"))


@pytest.mark.parametrize("case, fragment", [
    ("truncated", "not a readable .npz"),
    ("huge header", "header claims (10000000, 10000000, 1000000)"),
    ("zip bomb", "header claims (3221225472,)"),
])
def test_predict_reads_images_with_the_bounded_reader(case, fragment, run, tmp_path, capsys):
    path = tmp_path / "images.npz"
    if case == "truncated":
        np.savez(path, x=np.zeros((50, 28, 28), np.uint8))
        path.write_bytes(path.read_bytes()[:20000])
    elif case == "huge header":  # 336 bytes that would have numpy allocate 90.9 TiB
        npz_claiming(path, (10**7, 10**7, 10**6))
    else:  # its zip directory vouches for the 3 GiB the header claims; its data is 100 bytes
        npz_claiming(path, (3 * 2**30,), declared=3 * 2**30)
    assert main(["predict", str(run), str(path), "--out", str(tmp_path / "p.npz")]) == 2
    one_line(capsys.readouterr().err, fragment)
    assert not (tmp_path / "p.npz").exists()


@pytest.mark.parametrize("args", [
    ["predict", "{run}", "{fifo}"],  # the images
    ["predict", "{fifo}", "{images}"],  # the model
    ["evaluate", "{fifo}"],
    ["train", "--config", "{fifo}", *TINY, "--steps", "1", "--out", "{tmp}/never"],
    ["grid", "--space", "{fifo}", "--dataset", "synthetic", "--out", "{tmp}/never"],
])
def test_a_named_pipe_is_refused_instead_of_blocking(args, run, tmp_path):
    fifo = tmp_path / "pipe.npz"
    os.mkfifo(fifo)
    np.savez(tmp_path / "images.npz", x=np.zeros((3, 28, 28), np.uint8))
    result = run_cli(*(a.format(run=run, fifo=fifo, images=tmp_path / "images.npz", tmp=tmp_path) for a in args),
                     cwd=tmp_path, timeout=120)
    assert result.returncode == 2
    one_line(result.stderr, f"{fifo} is not a regular file")
    assert not (tmp_path / "never").exists()


def test_predict_never_writes_over_its_inputs_or_the_runs_files(run, tmp_path, capsys):
    images = tmp_path / "x.npz"
    np.savez(images, x=np.zeros((3, 28, 28), np.uint8))
    kept = {p: p.read_bytes() for p in (images, run / "model.pt", run / "summary.json")}
    for out in (images, run / "model.pt", run / "summary.json", tmp_path / "link.npz"):
        if out.name == "link.npz":
            out.symlink_to(images)  # the same file by another name
        assert main(["predict", str(run), str(images), "--out", str(out)]) == 2
        one_line(capsys.readouterr().err, "write to another path")
    assert {p: p.read_bytes() for p in kept} == kept
    assert main(["predict", str(run), str(images), "--out", str(run / "predictions.npz")]) == 0  # a new file there
    assert (run / "predictions.npz").is_file()
    elsewhere = tmp_path / "downloads"  # a model.pt outside a run: its neighbours are nobody's inputs
    elsewhere.mkdir()
    shutil.copy(run / "model.pt", elsewhere / "model.pt")
    (elsewhere / "old.npz").write_bytes(b"old")
    assert main(["predict", str(elsewhere / "model.pt"), str(images), "--out", str(elsewhere / "old.npz")]) == 0
    with np.load(elsewhere / "old.npz") as written:
        assert written["predictions"].shape == (3,)


def test_search_show_never_plots_over_the_store_or_the_search_files(tmp_path, capsys):
    folder = tmp_path / "search"
    folder.mkdir()
    with Store(folder / "search.db"):
        pass
    (folder / "config.json").write_text("{}")
    kept = {p: p.read_bytes() for p in folder.iterdir()}
    for path, plot in ((folder, folder / "search.db"), (folder, folder / "config.json"),
                       (folder / "search.db", folder / "search.db")):
        assert main(["search", "show", str(path), "--plot", str(plot)]) == 2
        one_line(capsys.readouterr().err, f"--plot {plot}")
    assert {p: p.read_bytes() for p in folder.iterdir()} == kept


def test_out_at_a_folder_that_is_not_a_run_does_not_suggest_resume(run, tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"jpeg")
    assert main(["train", *TINY, "--steps", "1", "--out", str(folder)]) == 2
    err = capsys.readouterr().err
    one_line(err, "is not a towerlab run")
    assert "--resume" not in err and sorted(p.name for p in folder.iterdir()) == ["holiday.jpg"]
    assert main(["train", *TINY, "--steps", "1", "--out", str(run)]) == 2  # a run: resuming it is the advice
    one_line(capsys.readouterr().err, f"continue that run with --resume {run}")
