"""What a command writes, against a hostile file system (issue 50): a planted `.towerlab.lock` link
is never followed, an output path that exists and is not a regular file (a device, a named pipe,
a socket) is refused before anything is written, and `predict --out FOLDER/` writes into that
folder."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest

from towerlab.cli import main
from towerlab.jobs.folder import LOCK_NAME
from towerlab.search import Store
from util import TINY

GRID = ["grid", "--dataset", "synthetic", "--device", "cpu", "--devices", "1", "--limit", "1", "--max-epochs", "1",
        "--no-progress"]


def one_line(err: str, fragment: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("towerlab: error: ") and fragment in lines[0], err


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("outputs") / "run"
    assert main(["train", *TINY, "--model", "mlp", "--model-opt", "neurons=16", "--model-opt", "layers=1",
                 "--steps", "2", "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("command", [["train", *TINY, "--steps", "1"], GRID])
@pytest.mark.parametrize("target_exists", [True, False])
def test_a_planted_lock_link_is_never_followed(command, target_exists, tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    if target_exists:
        victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)  # the only thing in the folder: not a new, empty folder
    assert main([*command, "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, f"holds {LOCK_NAME}, which is a symbolic link")
    assert (victim.read_text() == "precious") if target_exists else not victim.exists()
    assert os.listdir(out) == [LOCK_NAME] and (out / LOCK_NAME).is_symlink()


def test_a_lock_that_is_a_pipe_or_a_second_name_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / LOCK_NAME)
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, "which is not a regular file")
    (out / LOCK_NAME).unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.link(victim, out / LOCK_NAME)
    assert main(["train", *TINY, "--steps", "1", "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, "hard link")
    assert victim.read_text() == "precious"


def special_file(path: Path, kind: str) -> Path:
    """A named pipe, a socket, or a link to a device at `path`."""
    if kind == "pipe":
        os.mkfifo(path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()  # the socket file stays
    else:
        path.symlink_to(os.devnull)
    return path


@pytest.mark.parametrize("kind", ["pipe", "device"])
def test_an_output_that_is_a_pipe_or_a_device_is_refused_before_anything_is_written(kind, run, tmp_path, capsys):
    np.savez(tmp_path / "x.npz", x=np.zeros((3, 28, 28), np.uint8))
    out = special_file(tmp_path / "p.npz", kind)
    assert main(["predict", str(run), str(tmp_path / "x.npz"), "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, f"--out {out} is not a regular file")
    search = tmp_path / "search"
    search.mkdir()
    with Store(search / "search.db"):
        pass
    plot = special_file(tmp_path / "plot.png", kind)
    assert main(["search", "show", str(search), "--plot", str(plot)]) == 2
    one_line(capsys.readouterr().err, f"--plot {plot} is not a regular file")
    store = special_file(tmp_path / "store.db", kind)
    assert main([*GRID, "--store", str(store), "--out", str(tmp_path / "grid")]) == 2
    one_line(capsys.readouterr().err, f"--store {store} is not a regular file")
    assert not (tmp_path / "grid").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == \
        ["p.npz", "plot.png", "search", "store.db", "x.npz"]
    assert all(not p.is_file() for p in (out, plot, store)) and (kind == "pipe") == out.is_fifo()


def test_a_socket_as_an_output_is_refused(run, tmp_path, capsys):
    out = tmp_path / "s.npz"
    if len(str(out)) > 100:  # an AF_UNIX address holds at most 108 bytes
        pytest.skip("the temporary folder's path is too long for a socket")
    special_file(out, "socket")
    np.savez(tmp_path / "x.npz", x=np.zeros((3, 28, 28), np.uint8))
    assert main(["predict", str(run), str(tmp_path / "x.npz"), "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, "is not a regular file")
    assert out.is_socket()


def test_a_pipe_among_a_runs_files_is_refused_before_a_resume_writes(run, tmp_path, capsys):
    copy = tmp_path / "run"
    copy.mkdir()
    for name in ("config.json", "checkpoint.pt"):
        (copy / name).write_bytes((run / name).read_bytes())
    os.mkfifo(copy / "metrics.jsonl")  # a resume would append to it (and block), or replace it
    before = sorted(os.listdir(copy))
    assert main(["train", "--resume", str(copy)]) == 2
    one_line(capsys.readouterr().err, "holds metrics.jsonl, which is not a regular file")
    assert sorted(os.listdir(copy)) == before and (copy / "metrics.jsonl").is_fifo()


def test_the_atomic_writer_never_replaces_a_pipe(tmp_path):
    from towerlab import atomic
    from towerlab.errors import UserError

    os.mkfifo(tmp_path / "f")
    with pytest.raises(UserError, match="is not a regular file"):
        atomic.write_json(tmp_path / "f", {})
    assert (tmp_path / "f").is_fifo() and os.listdir(tmp_path) == ["f"]


def test_predict_out_a_folder_writes_into_that_folder(run, tmp_path, capsys):
    """issue 50: `--out dir/` wrote a file named dir."""
    np.savez(tmp_path / "x.npz", x=np.zeros((3, 28, 28), np.uint8))
    (tmp_path / "results").mkdir()
    for out in (f"{tmp_path / 'results'}/", str(tmp_path / "results")):
        assert main(["predict", str(run), str(tmp_path / "x.npz"), "--out", out]) == 0
        assert f"-> {tmp_path / 'results' / 'x-predictions.npz'}" in capsys.readouterr().out
        assert os.listdir(tmp_path / "results") == ["x-predictions.npz"]
    assert main(["predict", str(run), str(tmp_path / "x.npz"), "--out", f"{tmp_path / 'missing'}/"]) == 2
    one_line(capsys.readouterr().err, "names a folder that does not exist")
    assert not (tmp_path / "missing").exists()
