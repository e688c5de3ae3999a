"""Fault injection into real training jobs: a replica SIGKILLed mid-epoch (both strategies), the
same kill survived without a human under torchrun --max-restarts, SIGTERM to the launcher only
and to a single process, a full disk while checkpointing. Every case ends with the parameters of
an uninterrupted run: nothing is lost but the work in flight.

The jobs are tiny (an MLP on synthetic data, 2 CPU processes) but long enough in steps (20 epochs
of 78 steps) that a fault lands mid-run, after the first checkpoint.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from towerlab.training import checkpoint
from towerlab.jobs import train_resume
from towerlab.settings import read_run_config
from towerlab.cli import main
from towerlab.fields import replace
from towerlab.distributed.group import Context
from towerlab.errors import UserError
from towerlab.training.loop import STOP_CHECK_EVERY
from util import TINY, max_difference, metrics, reaped, replica_pids, run_cli, start_towerlab, summary, weights


# 2,500 training images: 78 steps of 2 x 16 per epoch; 780 steps in all, a few seconds.
JOB = [*TINY, "--synthetic-train", "3000", "--model", "mlp", "--model-opt", "layers=1", "--model-opt", "neurons=32",
       "--epochs", "10", "--batch-size", "16"]
STEPS_PER_EPOCH, EPOCHS = 78, 10
EXACT = 1e-6  # the SIGINT test's bound; in practice resumed runs match bit for bit


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 2-replica runs, one per strategy, computed once."""
    runs = {}

    def get(strategy: str):
        if strategy not in runs:
            out = tmp_path_factory.mktemp("reference") / strategy
            done = run_cli("train", *JOB, "--devices", "2", "--strategy", strategy, "--out", str(out))
            assert done.returncode == 0, done.stderr
            runs[strategy] = weights(out)
        return runs[strategy]

    return get


def wait_for(condition, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def assert_resumes_to(out: Path, expected: dict, *extra: str) -> subprocess.CompletedProcess:
    resumed = run_cli("train", "--resume", str(out), *extra)
    assert resumed.returncode == 0, resumed.stderr
    assert max_difference(weights(out), expected) < EXACT
    record = summary(out)
    assert record["steps"] == STEPS_PER_EPOCH * EPOCHS
    # The record reads as if never interrupted: each epoch once, in order.
    assert [m["epoch"] for m in metrics(out) if m["kind"] == "epoch"] == list(range(1, EPOCHS + 1))
    return resumed


def last_good_step(out: Path) -> int:
    warnings = []
    state = checkpoint.load(out / "checkpoint.pt", log=warnings.append)
    assert state["world_size"] == 2
    return state["step"]


# ------------------------------------------------------------------------- a replica is killed

@pytest.mark.slow
@pytest.mark.parametrize("strategy, victim", [("ddp", 1), ("ps", 0)])  # ps: the parameter server itself
def test_killed_replica_fails_fast_naming_it_and_resume_equals_uninterrupted(tmp_path, reference, strategy, victim):
    out = tmp_path / "run"
    log = tmp_path / "log"
    job = start_towerlab("train", *JOB, "--devices", "2", "--strategy", strategy, "--out", str(out), log=log)
    wait_for(lambda: (out / "checkpoint.pt").exists(), what="the first checkpoint")
    time.sleep(0.3)  # into the next epoch
    replicas = replica_pids(job.pid)
    assert len(replicas) == 2
    os.kill(replicas[victim], signal.SIGKILL)
    killed_at = time.time()
    status = job.wait(timeout=60)
    assert time.time() - killed_at < 60
    text = log.read_text()
    assert status == 1, text
    assert f"replica rank {victim}" in text and "SIGKILL" in text and "--resume" in text, text
    assert "Traceback" not in text, text
    step = last_good_step(out)  # the last good checkpoint is intact and loads
    assert 0 < step < STEPS_PER_EPOCH * EPOCHS and step % STEPS_PER_EPOCH == 0
    assert not (out / "summary.json").exists()
    assert_resumes_to(out, reference(strategy))


# -------------------------------------------------------------------- torchrun --max-restarts

def torchrun_workers(agent: int) -> dict[int, int]:
    """rank -> pid of torchrun's workers (children of the agent whose environment names a RANK)."""
    found = {}
    for task in Path(f"/proc/{agent}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                raw = Path(f"/proc/{child}/environ").read_bytes().decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError):
                continue
            env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
            if "RANK" in env and "TORCHELASTIC_RESTART_COUNT" in env:
                found[int(env["RANK"])] = int(child)
    return found


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_resumes_to_the_uninterrupted_result(tmp_path, reference):
    out = tmp_path / "run"
    log = tmp_path / "log"
    with open(log, "w") as sink:
        agent = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "--max-restarts", "1", "--monitor-interval", "0.2", "-m", "towerlab", "train", *JOB, "--out", str(out)],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        with reaped(agent):
            wait_for(lambda: (out / "checkpoint.pt").exists(), what="the first checkpoint")
            time.sleep(0.3)
            workers = torchrun_workers(agent.pid)
            assert sorted(workers) == [0, 1], workers
            os.kill(workers[1], signal.SIGKILL)
            status = agent.wait(timeout=240)
    text = log.read_text()
    assert status == 0, text
    assert "torchrun restart 1: continuing from the checkpoint of step" in text, text
    assert max_difference(weights(out), reference("ddp")) < EXACT
    assert summary(out)["steps"] == STEPS_PER_EPOCH * EPOCHS and summary(out)["world_size"] == 2
    assert [m["epoch"] for m in metrics(out) if m["kind"] == "epoch"] == list(range(1, EPOCHS + 1))
    config = json.loads((out / "config.json").read_text())
    assert config["torchelastic_run_id"]  # what tells a restart of this job from an older folder


def test_a_torchrun_restart_resumes_only_its_own_folder(tmp_path, monkeypatch):
    """The restart decision itself, for each kind of folder a restarted worker may find."""
    out = tmp_path / "run"
    assert main(["train", *TINY, "--model", "mlp", "--steps", "3", "--out", str(out)]) == 0
    cfg, run = read_run_config(out)
    run = replace(run, resume=None)
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500",
                        "TORCHELASTIC_RUN_ID": "this-job", "TORCHELASTIC_RESTART_COUNT": "1"}.items():
        monkeypatch.setenv(name, value)

    def decide(config=cfg):
        return train_resume.decide_start(config, run, Context(), out)

    def stored_run_id(run_id):
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "torchelastic_run_id": run_id}))

    stored_run_id("another-job")  # an older run in the same folder: refused as without torchrun
    with pytest.raises(UserError, match="already holds files"):
        decide()
    stored_run_id("this-job")
    assert decide()["step"] == 3  # this job's own folder: continue from its checkpoint
    with pytest.raises(UserError, match="already holds files"):
        decide(replace(cfg, lr=0.5))  # same job id but other settings: not this run
    for name in ("checkpoint.pt", "checkpoint.pt.prev"):
        (out / name).unlink(missing_ok=True)
    assert decide() is None  # restarted before the first checkpoint: start over in the folder
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(UserError, match="already holds files"):
        decide()  # a first attempt never takes over an existing folder


# ------------------------------------------------------------------------- SIGTERM and Ctrl-C

@pytest.mark.slow
def test_sigterm_to_the_launcher_alone_saves_exits_143_and_resumes(tmp_path, reference):
    out = tmp_path / "run"
    log = tmp_path / "log"
    job = start_towerlab("train", *JOB, "--devices", "2", "--out", str(out), log=log)
    wait_for(lambda: (out / "checkpoint.pt").exists(), what="the first checkpoint")
    time.sleep(0.3)
    os.kill(job.pid, signal.SIGTERM)  # the launcher's pid only, as `kill PID` or a scheduler would
    sent = time.time()
    status = job.wait(timeout=60)
    stopped_in = time.time() - sent
    text = log.read_text()
    assert status == 143, text
    assert stopped_in < 30, stopped_in
    assert "checkpoint saved" in text and "Traceback" not in text, text
    step = last_good_step(out)
    assert 0 < step < STEPS_PER_EPOCH * EPOCHS and step % STOP_CHECK_EVERY == 0  # saved where the ranks stopped
    assert_resumes_to(out, reference("ddp"))


# One process: one thread (two threads make tiny steps ~15x slower on a 2-core machine).
ALONE = [*JOB, "--epochs", "8", "--threads", "1"]


@pytest.mark.slow
def test_sigterm_to_a_single_process_saves_exits_143_and_resumes(tmp_path):
    whole = tmp_path / "whole"
    assert main(["train", *ALONE, "--out", str(whole)]) == 0
    out = tmp_path / "run"
    log = tmp_path / "log"
    job = start_towerlab("train", *ALONE, "--out", str(out), log=log)
    wait_for(lambda: (out / "checkpoint.pt").exists(), what="the first checkpoint")
    time.sleep(0.2)
    os.kill(job.pid, signal.SIGTERM)
    sent = time.time()
    status = job.wait(timeout=60)
    assert status == 143 and time.time() - sent < 30, log.read_text()
    assert "checkpoint saved" in log.read_text()
    state = checkpoint.load(out / "checkpoint.pt")
    assert 0 < state["step"] < 2 * STEPS_PER_EPOCH * 8  # 1 replica: 156 steps per epoch
    resumed = run_cli("train", "--resume", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert max_difference(weights(out), weights(whole)) < EXACT


# ----------------------------------------------------------------- a full disk while saving

@pytest.mark.slow
def test_a_full_disk_while_checkpointing_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """ENOSPC injected where the data reaches the disk (fsync), on the third checkpoint: the job stops
    with exit 2 and one line, the second checkpoint stays loadable, nothing torn or temporary is left,
    and --resume (disk freed) ends where an uninterrupted run ends."""
    args = [*JOB, "--epochs", "4", "--threads", "1"]
    whole = tmp_path / "whole"
    assert main(["train", *args, "--out", str(whole)]) == 0
    out = tmp_path / "run"
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if ".checkpoint.pt.new" in name:
            calls.append(name)
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    capsys.readouterr()
    assert main(["train", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "previous version is intact" in err and err.count("\n") == 1, err
    monkeypatch.undo()
    assert checkpoint.load(out / "checkpoint.pt")["step"] == 2 * 2 * STEPS_PER_EPOCH
    assert checkpoint.load(out / "checkpoint.pt.prev")["step"] == 2 * STEPS_PER_EPOCH
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "checkpoint.pt.prev", "config.json",
                                                    "metrics.jsonl"]
    assert main(["train", "--resume", str(out)]) == 0
    assert max_difference(weights(out), weights(whole)) < EXACT
