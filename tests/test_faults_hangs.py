"""A process that hangs (SIGSTOP) instead of dying, in every role: a training replica, the parameter
server and a search's worker. The launcher watches each training process's heartbeat: the job ends
within --timeout plus a few seconds with one line naming the rank that stopped answering, never a
traceback from the healthy ranks; a hung search worker stops renewing its lease, so another worker
takes its task and the search goes on. And a collective that times out (a peer slower than --timeout) ends
in one line, not in a gloo traceback and SIGABRT."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from towerlab.cli import main
from towerlab.distributed.group import peer_lost
from towerlab.distributed.launch import LaunchOptions, launch
from util import ONE_CPU, TINY, reaped, replica_pids, start_towerlab

TIMEOUT = 5  # seconds, the smallest --timeout


def wait_for(condition, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


TRAIN = ["train", *TINY, "--model", "mlp", "--epochs", "500", "--batch-size", "16", "--devices", "2", "--threads", "1"]
SEARCH = ["evolve", *ONE_CPU, "--dataset", "synthetic", "--devices", "2", "--threads", "1", "--population", "4",
          "--generations", "3", "--max-epochs", "1", "--val-size", "1000", "--no-progress"]


def stop_one(command: list[str], victim: int, started: str, tmp_path, wait: float) -> tuple[int, str, float]:
    """Start `command`, SIGSTOP the process of rank `victim` once `started` is in its folder; (exit
    status, log, seconds from the stop to the end)."""
    out = tmp_path / "job"
    log = tmp_path / "log"
    with reaped(start_towerlab(*command, "--timeout", str(TIMEOUT), "--out", str(out), log=log)) as job:
        wait_for(lambda: len(replica_pids(job.pid)) == 2 and (out / started).exists(), what="the job")
        time.sleep(1.0)  # at work, not starting up
        os.kill(replica_pids(job.pid)[victim], signal.SIGSTOP)
        stopped = time.monotonic()
        status = job.wait(timeout=wait)
    return status, log.read_text(), time.monotonic() - stopped


@pytest.mark.slow
@pytest.mark.parametrize("command, victim, named, started", [
    (TRAIN, 1, "replica rank 1 ", "checkpoint.pt"),
    ([*TRAIN, "--strategy", "ps"], 0, "replica rank 0, the parameter server,", "checkpoint.pt"),
], ids=["replica", "parameter-server"])
def test_a_stopped_process_ends_the_job_within_the_timeout_naming_it(command, victim, named, started, tmp_path):
    status, text, took = stop_one(command, victim, started, tmp_path, wait=TIMEOUT + 60)
    assert status == 1, text
    errors = [line for line in text.splitlines() if line.startswith("towerlab: error:")]
    assert len(errors) == 1 and named in errors[0] and "stopped answering" in errors[0], text
    assert "--resume" in errors[0] and "Traceback" not in text, text
    assert took < TIMEOUT + 30, took  # not the collective's timeout and a grace on top; no hang


def holds_a_task(out, pid: int) -> bool:
    """Whether the worker process `pid` holds a claimed task of the search in `out`."""
    with contextlib.closing(sqlite3.connect(f"file:{out / 'search.db'}?mode=ro", uri=True, timeout=5)) as db:
        workers = [w for (w,) in db.execute("SELECT worker FROM tasks WHERE state = 'claimed'")]
    return any(w.split(":")[1] == str(pid) for w in workers)  # host:pid:device


@pytest.mark.slow
def test_a_stopped_search_worker_loses_its_task_to_another_and_the_search_goes_on(tmp_path, monkeypatch):
    """A search worker that stops (SIGSTOP) stops renewing its lease: once it lapses, the other worker
    trains its task, and the search ends as usual; the stopped one is put away at the end."""
    monkeypatch.setenv("TOWERLAB_LEASE_SECONDS", "3")
    out, log = tmp_path / "job", tmp_path / "log"
    with reaped(start_towerlab(*SEARCH, "--generations", "6", "--out", str(out), log=log)) as job:
        wait_for(lambda: len(replica_pids(job.pid)) == 2 and (out / "config.json").exists(), what="the job")
        victim = replica_pids(job.pid)[1]
        wait_for(lambda: holds_a_task(out, victim), what="worker 1 training a candidate")
        os.kill(victim, signal.SIGSTOP)
        status = job.wait(timeout=300)
    text = log.read_text()
    assert status == 0, text
    assert "attempt 2 (the lease of worker" in text and "lapsed)" in text, text
    assert (tmp_path / "job" / "summary.json").exists() and "Traceback" not in text


# ----------------------------------------------------------------- a collective that times out

def _slow_peer(rank: int, world_size: int, store_path: str) -> None:
    """Rank 1 keeps beating but reaches the barrier only after rank 0's timeout has passed."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT),
                            store=dist.FileStore(store_path, world_size))
    if rank == 1:
        time.sleep(TIMEOUT + 3)
    dist.barrier()


def test_a_timed_out_collective_counts_as_a_lost_peer():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                        "1000ms for recv operation to complete")
    closed = RuntimeError("Application timeout caused pair closure")  # gloo's, from a backward on a stopped peer
    assert peer_lost(gloo) and peer_lost(closed)
    assert not peer_lost(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.slow
def test_a_peer_slower_than_the_timeout_ends_in_one_line_not_a_traceback(capfd):
    lines = []
    assert launch(_slow_peer, 2, options=LaunchOptions(grace=2.0, log=lines.append, timeout=60)) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SIGABRT" not in " ".join(lines), err
    assert len(lines) == 1 and "lost contact with the others" in lines[0] and "--timeout" in lines[0], lines


def test_a_tiny_timeout_is_refused_before_any_process_starts(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *TINY, "--devices", "2", "--timeout", "0.001", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--timeout must be between 5 seconds" in err and "--resume" not in err, err
    assert not out.exists()
