"""Two machines, tested as two: two torchrun agents on this machine, `--nnodes 2 --node-rank 0|1`
with one process each and a rendezvous on 127.0.0.1, behave as two nodes (each agent hosts or
joins the rendezvous over TCP, and its worker knows only its own node). Training and a search over
them equal the same job with 2 local processes; an agent lost mid-run (its worker and itself
killed) ends the other in one line, and both restarted with --resume reach the uninterrupted result.

Every process uses 1 thread, so that the two nodes and the two local processes do the very same
arithmetic: the results are compared exactly.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import towerlab
from test_faults_search import history, rows
from test_faults_training import torchrun_workers, wait_for
from util import max_difference, metrics, run_cli, summary, weights

pytestmark = pytest.mark.slow

# 2,500 training images, 10 epochs of 78 steps of 2 x 16: long enough that a kill lands mid-run.
TIMEOUT = 20  # --timeout: seconds a rank waits for a lost peer
JOB = ["--dataset", "synthetic", "--synthetic-train", "3000", "--val-size", "500", "--display-step", "1000",
       "--no-progress", "--device", "cpu", "--threads", "1", "--model", "mlp", "--model-opt", "layers=1",
       "--model-opt", "neurons=32", "--epochs", "10", "--batch-size", "16", "--timeout", str(TIMEOUT)]
STEPS = 78 * 10
SPACE = 'model = "mlp"\n[genes]\nneurons = [16, 32, 64]\nlayers = [1, 2]\nactivation = ["relu", "tanh"]\n'
SEARCH = ["search", "run", "--sampler", "random", "--dataset", "synthetic", "--val-size", "500", "--max-epochs", "1",
          "--threads", "1", "--no-progress", "--device", "cpu", "--population", "4", "--generations", "1",
          "--seed", "5", "--top", "1", "--remeasure", "0"]
# What differs between two equal jobs: when and where things ran.
CIRCUMSTANTIAL = ("out", "examples_per_sec", "train_seconds", "wall_seconds", "setup_seconds", "test_seconds")
# A traceback through towerlab's own source names a file of the package's folder, wherever the
# repository lies and whatever its folder is called (torchrun's own frames, under a virtual
# environment inside a clone named towerlab, must not count).
OURS = re.compile("|".join(re.escape(f'File "{folder}{os.sep}')
                           for folder in {str(Path(towerlab.__file__).parent),
                                          str(Path(towerlab.__file__).resolve().parent)}))
# What towerlab prints on rank 0 (the banner, its epochs, its last lines).
SPOKEN = ("towerlab:", "Epoch ", "Done:", "Wrote ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def two_nodes(args: list[str], logs: Path):
    """Two torchrun agents of one process each, as node 0 and node 1 of one job; whatever still
    runs when the block ends (a failed assertion included) is killed, torchrun's workers too (they
    run in sessions of their own)."""
    port = free_port()
    agents = []
    try:
        for node in (0, 1):
            with open(logs / f"node{node}.log", "w") as log:
                agents.append(subprocess.Popen(
                    [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                     "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                     "--monitor-interval", "0.2", "-m", "towerlab", *args],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        yield agents
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_node(agent)
            agent.wait()


def kill_node(agent: subprocess.Popen, how: signal.Signals = signal.SIGKILL) -> None:
    """A machine lost: its workers and its agent die at once (SIGKILL), nothing says goodbye; or
    they freeze (SIGSTOP), as behind a cut network, where no connection is ever reset."""
    for pid in torchrun_workers(agent.pid).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, how)
    os.killpg(agent.pid, how)


def finish(agents: list[subprocess.Popen], logs: Path) -> None:
    for node, agent in enumerate(agents):
        assert agent.wait(timeout=300) == 0, (logs / f"node{node}.log").read_text()[-3000:]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The training job with 2 local processes, uninterrupted."""
    out = tmp_path_factory.mktemp("reference") / "run"
    done = run_cli("train", *JOB, "--devices", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def test_training_over_two_nodes_equals_two_local_processes(tmp_path, reference):
    out = tmp_path / "run"
    with two_nodes(["train", *JOB, "--out", str(out)], tmp_path) as agents:
        finish(agents, tmp_path)
    assert max_difference(weights(out), weights(reference)) == 0.0
    two, local = summary(out), summary(reference)
    assert (two["world_size"], two["steps"], two["global_batch_size"]) == (2, STEPS, 32)
    assert {k: v for k, v in two.items() if k not in CIRCUMSTANTIAL} == \
        {k: v for k, v in local.items() if k not in CIRCUMSTANTIAL}
    # Only rank 0 (node 0) speaks: node 1's agent prints nothing of towerlab's.
    spoken = (tmp_path / "node0.log").read_text().splitlines()
    assert len([line for line in spoken if line.startswith(SPOKEN)]) == 13, spoken  # banner, 10 epochs, 2 last
    heard = (tmp_path / "node1.log").read_text().splitlines()
    assert not [line for line in heard if line.startswith(SPOKEN)], heard


def test_a_search_over_two_nodes_equals_two_local_workers(tmp_path):
    (tmp_path / "space.toml").write_text(SPACE)
    search = [*SEARCH, "--space", str(tmp_path / "space.toml")]
    local = run_cli(*search, "--devices", "2", "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    with two_nodes([*search, "--out", str(tmp_path / "two")], tmp_path) as agents:
        finish(agents, tmp_path)
    assert history(tmp_path / "two") == history(tmp_path / "local")
    # The same rows: every candidate has the same genome, seed and fitness, whichever rank trained it
    # (rows are numbered as results land, so they are matched by candidate).
    when_and_where = ("id", "seconds", "finished_at", "worker")
    two, one = (sorted(({k: v for k, v in row.items() if k not in when_and_where} for row in rows(tmp_path / name)),
                       key=lambda row: (row["generation"], row["idx"], row["replicate"]))
                for name in ("two", "local"))
    assert two == one and len(two) == 4 and sum(row["test_accuracy"] is not None for row in two) == 1  # the top one
    assert len({row["worker"] for row in rows(tmp_path / "two")}) == 2  # host:pid:device, one per node


def holds_a_task(out: Path, pids: list[int]) -> bool:
    """Whether a worker of these processes (host:pid:device) holds a claimed task of the search in `out`."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{out / 'search.db'}?mode=ro", uri=True, timeout=5)) as db:
            held = [w for (w,) in db.execute("SELECT worker FROM tasks WHERE state = 'claimed'")]
    except sqlite3.OperationalError:  # not created yet
        return False
    return any(w.split(":")[1] in {str(p) for p in pids} for w in held)


def write_locked(db: Path) -> bool:
    """Whether a process holds the SQLite store's write lock (a write of its own cannot begin)."""
    with contextlib.closing(sqlite3.connect(db, timeout=0, isolation_level=None)) as connection:
        try:
            connection.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError:
            return True
        connection.execute("ROLLBACK")
        return False


def freeze_between_writes(agent: subprocess.Popen, db: Path) -> None:
    """Freeze a node while it trains, not while it writes: a process frozen holding an SQLite file's
    write lock stops every writer of that file (SQLite's design, docs/faults.md; share a PostgreSQL
    store across machines), which is another test's case. Frozen mid-write, it is thawed and frozen
    again a moment later."""
    for _ in range(100):
        kill_node(agent, signal.SIGSTOP)
        if not write_locked(db):
            return
        kill_node(agent, signal.SIGCONT)
        time.sleep(0.05)
    pytest.fail("node 1 held the store's write lock at each of 100 freezes")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_node_lost_mid_search_costs_only_its_candidate(how, tmp_path, monkeypatch):
    """A search's ranks need each other only to agree on the search: node 1 lost (killed, or frozen)
    while it trains a candidate, node 0 trains that candidate once its lease lapses and finishes the
    search, with the history of two local workers."""
    (tmp_path / "space.toml").write_text(SPACE)
    search = [*SEARCH, "--space", str(tmp_path / "space.toml"), "--generations", "3"]
    local = run_cli(*search, "--devices", "2", "--out", str(tmp_path / "local"))
    assert local.returncode == 0, local.stderr
    out = tmp_path / "two"
    monkeypatch.setenv("TOWERLAB_LEASE_SECONDS", "3")  # inherited by both agents and their workers
    with two_nodes([*search, "--out", str(out)], tmp_path) as agents:
        wait_for(lambda: holds_a_task(out, list(torchrun_workers(agents[1].pid).values())), timeout=240,
                 what="node 1 training a candidate")
        if how == signal.SIGSTOP:
            freeze_between_writes(agents[1], out / "search.db")
        else:
            kill_node(agents[1], how)
        # The record, written by rank 0 once the search is finished. (torchrun's agent then waits for
        # the lost node at its exit barrier, 300 s by default, before it ends: not towerlab's.)
        wait_for(lambda: (out / "summary.json").exists() or agents[0].poll() is not None, timeout=300,
                 what="the search's record")
    text = (tmp_path / "node0.log").read_text()
    assert "lapsed" in text and "Traceback" not in text, text
    assert history(out) == history(tmp_path / "local")


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_node_ends_the_other_in_one_line_and_both_resume_to_the_uninterrupted_run(how, tmp_path, reference):
    out = tmp_path / "run"
    with two_nodes(["train", *JOB, "--out", str(out)], tmp_path) as agents:
        wait_for(lambda: (out / "checkpoint.pt").exists(), timeout=240, what="the first checkpoint")
        kill_node(agents[1], how)
        # A hang guard, not a timing: a killed node's connections reset at once, a frozen one is
        # given up after --timeout; torchrun's agent then reports and exits.
        status = agents[0].wait(timeout=TIMEOUT + 60)
    text = (tmp_path / "node0.log").read_text()
    assert status == 1, text
    ours = [line for line in text.splitlines() if line.startswith("towerlab: error")]
    assert len(ours) == 1 and "another process of the job is gone" in ours[0], text
    assert not OURS.search(text), text  # torchrun's report, never a traceback of ours
    assert not (out / "summary.json").exists()

    with two_nodes(["train", "--resume", str(out)], tmp_path) as agents:
        finish(agents, tmp_path)
    assert max_difference(weights(out), weights(reference)) == 0.0
    assert summary(out)["steps"] == STEPS and summary(out)["world_size"] == 2
    assert [m["epoch"] for m in metrics(out) if m["kind"] == "epoch"] == list(range(1, 11))
