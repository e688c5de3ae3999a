"""What train and search jobs share: one live job per output folder, provenance, and no process
outliving its launcher."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from towerlab.cli import main
from towerlab.distributed.signals import alive
from towerlab.jobs.folder import LOCK_NAME, OutputFolder
from towerlab.jobs.provenance import code_version
from util import TINY, replica_pids, start_towerlab

HOLD = "import sys, time; from towerlab.jobs.folder import OutputFolder; f = OutputFolder(sys.argv[1]); f.claim(); " \
       "print('held', flush=True); time.sleep(60)"


def _holder(out: Path) -> subprocess.Popen:
    """Another process that owns `out` as a live job does."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("command", [
    ["train", *TINY, "--steps", "2"],
    ["grid", "--dataset", "synthetic", "--device", "cpu", "--devices", "1", "--limit", "1", "--max-epochs", "1"],
])
def test_a_second_job_on_a_folder_in_use_is_refused_in_one_line(command, tmp_path, capsys):
    out = tmp_path / "run"
    holder = _holder(out)
    try:
        assert main([*command, "--no-progress", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is in use by another towerlab job" in err and str(holder.pid) in err
        assert os.listdir(out) == [LOCK_NAME]  # the live job's folder is left as it was
    finally:
        holder.kill()
        holder.wait()
    # The lock died with its holder: the folder is free again, and the run leaves no lock file behind.
    assert main([*command, "--no-progress", "--out", str(out)]) == 0
    assert LOCK_NAME not in os.listdir(out) and (out / "summary.json").is_file()


@pytest.mark.parametrize("command", [
    ["train", *TINY, "--steps", "2"],
    ["grid", "--dataset", "synthetic", "--device", "cpu", "--devices", "1", "--limit", "1", "--max-epochs", "1"],
])
def test_a_resume_while_the_job_is_live_is_refused(command, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*command, "--no-progress", "--out", str(out)]) == 0
    holder = _holder(out)
    try:
        assert main([command[0], "--resume", str(out)]) == 2
        assert "is in use by another towerlab job" in capsys.readouterr().err
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("where, fragment", [("file", "is a file"), ("under-file", "cannot create output folder")])
def test_an_out_that_is_or_lies_under_a_file_is_refused(where, fragment, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = blocker if where == "file" else blocker / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and blocker.read_text() == "not a folder"


def test_a_refused_job_leaves_no_folder_and_a_kept_folder_stays(tmp_path):
    out = tmp_path / "new" / "run"
    assert main(["train", *TINY, "--batch-size", "100000", "--out", str(out)]) == 2
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with OutputFolder(kept):
        pass
    assert kept.is_dir() and os.listdir(kept) == []


def test_config_json_records_the_code_version(tmp_path):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["code"] == code_version()
    if config["code"] is not None:  # a git checkout: the commit is 40 hex digits
        assert len(config["code"]["git_commit"]) == 40 and isinstance(config["code"]["dirty"], bool)
    assert config["run"]["devices"] == 1 and config["run"]["device"] == "cpu"  # recorded as resolved


@pytest.mark.slow
@pytest.mark.parametrize("command", [["train", *TINY, "--epochs", "200", "--devices", "2"],
                                     ["evolve", "--dataset", "synthetic", "--device", "cpu", "--devices", "2",
                                      "--population", "40", "--generations", "50", "--max-epochs", "5"]])
def test_replicas_and_workers_die_with_a_killed_launcher(command, tmp_path):
    out = tmp_path / "run"
    job = start_towerlab(*command, "--threads", "1", "--no-progress", "--out", str(out), log=tmp_path / "log")
    deadline = time.monotonic() + 60
    while len(replica_pids(job.pid)) < 2 or not (out / "config.json").exists():
        assert job.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()
        time.sleep(0.2)
    workers = replica_pids(job.pid)
    rendezvous = list(Path(tempfile.gettempdir()).glob(f"towerlab-rdzv-{job.pid}-*"))
    assert len(rendezvous) == 1
    os.kill(job.pid, signal.SIGKILL)
    job.wait()
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in workers):
        assert time.monotonic() < deadline, "a worker outlived its launcher by 10 s"
        time.sleep(0.2)
    # The folder is free at once, and the next launch sweeps the dead launcher's rendezvous folder.
    with OutputFolder(out, must_exist=True):
        pass
    assert main(["train", *TINY, "--steps", "2", "--devices", "2", "--out", str(tmp_path / "next")]) == 0
    assert not rendezvous[0].exists()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def test_a_process_is_alive_until_it_ends_even_when_nobody_reaps_it():
    """signals.alive, which frees a dead worker's task at once and sweeps a dead launcher's rendezvous
    folder: an ended child that no one has waited for yet (a zombie, as under an init that does not
    reap) is dead; a running process, this one, is alive."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(child) and os.waitpid(child, os.WNOHANG)[0] == child  # it was a zombie until now
    finally:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)
    assert alive(os.getpid()) and not alive(child)
