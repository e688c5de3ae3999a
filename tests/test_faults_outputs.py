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
from towerlab.jobs.common import LOCK_NAME
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
