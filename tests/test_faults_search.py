"""Fault injection into real searches (`towerlab evolve` on synthetic data): the job's process or a
worker killed mid-generation, SIGTERM and Ctrl-C, torchrun's restarts. Every evaluation that finished
is kept (its row in the store is untouched), none is trained twice (the store's row count equals
an uninterrupted search's), the ones in flight are redone, and the final history equals an
uninterrupted search with the same seed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from util import ONE_CPU, reaped, replica_pids, run_cli, start_towerlab

from towerlab.distributed.signals import alive


SPACE = """
model = "mlp"
[genes]
neurons = [16, 32, 64]
layers = [1, 2]
activation = ["relu", "tanh", "sigmoid"]
optimizer = ["adam", "sgd"]
"""
# Each candidate: 3 epochs on 5,000 synthetic images, about half a second; 1 thread per process, so
# that one worker and two workers do the very same arithmetic.
BASE = [*ONE_CPU, "--dataset", "synthetic", "--val-size", "1000", "--max-epochs", "3", "--patience", "3", "--threads", "1",
        "--no-progress", "--population", "6", "--generations", "3", "--seed", "5", "--top", "2"]


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("space") / "space.toml"
    path.write_text(SPACE)
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, space):
    out = tmp_path_factory.mktemp("reference") / "evo"
    done = run_cli("evolve", *BASE, "--space", space, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def rows(out: Path) -> list[dict]:
    """The store's evaluations, read while the search may still be writing (WAL allows it)."""
    path = out / "search.db"
    if not path.exists():
        return []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            db.row_factory = sqlite3.Row
            return [dict(r) for r in db.execute("SELECT * FROM evaluations ORDER BY id")]
        finally:
            db.close()
    except sqlite3.OperationalError:  # not created yet
        return []


def history(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    return {"stats": [{k: v for k, v in s.items() if "seconds" not in k} for s in summary["generation_stats"]],
            "top": [(t["genome"], t["val_accuracy"], t["test_accuracy"]) for t in summary["top"]],
            "counts": (summary["evaluations"], summary["cache_hits"], summary["failures"], summary["generations"])}


def wait_for(condition, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def busy(pid: int, window: float = 0.15) -> bool:
    """Whether `pid` computes (a worker trains only inside a claimed task; waiting, it sleeps)."""
    def cpu() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    before = cpu()
    time.sleep(window)
    return cpu() - before > window / 4  # waiting costs ~1% of a core; training, a core (or its share)


def in_generation_1(out: Path) -> bool:
    return any(r["generation"] == 1 for r in rows(out))


def assert_nothing_lost_or_repeated(out: Path, reference: Path, kept: list[dict]) -> None:
    """The resumed search ends as the reference did; the rows made before the fault are untouched;
    and the store holds exactly as many evaluations (so the kept ones were not trained again)."""
    assert history(out) == history(reference)
    final = rows(out)
    by_id = {r["id"]: r for r in final}
    for row in kept:  # same row: same fitness, same finished_at, not redone (the top ones gain a test accuracy)
        assert {**by_id[row["id"]], "test_accuracy": None} == {**row, "test_accuracy": None}
    assert len(final) == len(rows(reference))
    fitness = {(r["genome_hash"], r["replicate"]): r["fitness"] for r in final}  # re-measures included
    assert fitness == {(r["genome_hash"], r["replicate"]): r["fitness"] for r in rows(reference)}


def resume(out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    done = run_cli("evolve", "--resume", str(out), *extra, env=env)
    assert done.returncode == 0, done.stderr
    return done


# --------------------------------------------------------------------------- one process

@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGKILL, -signal.SIGKILL)],
                         ids=["SIGTERM", "SIGKILL"])
def test_a_search_stopped_mid_generation_resumes_to_the_uninterrupted_history(tmp_path, space, reference,
                                                                               signum, status):
    out = tmp_path / "evo"
    log = tmp_path / "log"
    job = start_towerlab("evolve", *BASE, "--space", space, "--out", str(out), log=log)
    wait_for(lambda: in_generation_1(out), what="generation 1")
    os.kill(job.pid, signum)
    sent = time.time()
    assert job.wait(timeout=60) == status, log.read_text()
    assert time.time() - sent < 30
    assert "Traceback" not in log.read_text()
    kept = rows(out)
    assert kept and not (out / "summary.json").exists()
    with sqlite3.connect(out / "search.db") as db:  # stopped before its end: a generation begun and not done at most
        # (the signal may land between two generations: the GA begins one once the one before is crowned)
        begun, done = db.execute("SELECT COUNT(*), SUM(complete) FROM generations").fetchone()
        assert done < 3 and begun - done <= 1
    resume(out)
    assert_nothing_lost_or_repeated(out, reference, kept)


# --------------------------------------------------------------------------- two workers

@pytest.mark.slow
def test_a_killed_search_job_leaves_its_search_to_a_joined_worker_and_resume_writes_the_record(
        tmp_path, space, reference, monkeypatch):
    """The process that started the search is killed (its own worker with it): a worker that joined
    from elsewhere takes over the lost task once its lease lapses and finishes the search; `--resume`
    then trains nothing and writes the record of the uninterrupted search."""
    monkeypatch.setenv("TOWERLAB_LEASE_SECONDS", "3")
    out = tmp_path / "evo"
    job = start_towerlab("evolve", *BASE, "--space", space, "--out", str(out), log=tmp_path / "log")
    wait_for(lambda: (out / "config.json").exists(), what="the search in its store")
    with reaped(start_towerlab("search", "worker", str(out), *ONE_CPU, log=tmp_path / "worker.log")) as worker:
        wait_for(lambda: in_generation_1(out), what="generation 1")
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
        time.sleep(0.5)  # its worker dies with it (the parent-death signal)
        with sqlite3.connect(out / "search.db") as db:  # the tasks its worker held, if any, within the 3 s lease
            held = db.execute("SELECT w.pid FROM tasks t JOIN workers w ON w.id = t.worker "
                              "WHERE t.state = 'claimed'").fetchall()
        lost = [pid for (pid,) in held if not alive(pid)]
        assert worker.wait(timeout=240) == 0, (tmp_path / "worker.log").read_text()
    text = (tmp_path / "worker.log").read_text()
    assert "Traceback" not in text, text
    # The killed worker may have been between two tasks (these take a fraction of a second), or between two
    # generations: then nothing lapses. The next test kills a worker while it holds a task.
    assert not lost or ("lease of worker" in text and "lapsed" in text), text
    assert not (out / "summary.json").exists()
    trained = len(rows(out))
    resume(out)
    assert len(rows(out)) == trained == len(rows(reference))  # nothing trained twice, nothing by the resume
    assert history(out) == history(reference)


@pytest.mark.slow
def test_a_killed_worker_hands_its_candidate_on_and_the_search_finishes(tmp_path, space, reference):
    handed_on = []
    # A busy worker almost always holds a claimed task, but on a loaded machine its task may end
    # between the look and the kill: then nothing is handed on, and the kill is tried again.
    for attempt in range(3):
        out = tmp_path / f"evo{attempt}"
        log = tmp_path / f"log{attempt}"
        job = start_towerlab("evolve", *BASE, "--space", space, "--devices", "2", "--out", str(out), log=log)
        wait_for(lambda: len({r["worker"] for r in rows(out)}) == 2, what="a result of each worker")
        workers = replica_pids(job.pid)
        try:
            wait_for(lambda: busy(workers[1]), what="worker 1 training a candidate")  # it holds a claimed task
            os.kill(workers[1], signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):  # on a loaded machine, the search ended before the look
            assert job.wait(timeout=120) == 0, log.read_text()
            text = log.read_text()
            handed_on.append(False)
            continue
        status = job.wait(timeout=120)
        text = log.read_text()
        assert status == 0, text
        assert f"(pid {workers[1]}) was killed by SIGKILL; starting another in its place" in text, text
        assert history(out) == history(reference)
        assert len(rows(out)) == len(rows(reference))
        handed_on.append(re.search(rf":{workers[1]}:cpu:\w+ was killed by SIGKILL while training; its task is back "
                                   "on the queue", text) is not None)
        if handed_on[-1]:
            break
    assert any(handed_on), text


@pytest.mark.parametrize("lease", ["soon", "1e300", "nan"])
def test_a_bad_lease_setting_is_refused_before_any_worker_starts(tmp_path, space, lease):
    """1e300 was taken: every task then printed an OverflowError from its lease thread, and its row could
    never be claimed again."""
    done = run_cli("evolve", *BASE, "--space", space, "--devices", "2", "--out", str(tmp_path / "evo"),
                   env={"TOWERLAB_LEASE_SECONDS": lease})
    assert done.returncode == 2 and f"TOWERLAB_LEASE_SECONDS={lease!r}" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and not (tmp_path / "evo").exists()


@pytest.mark.slow
def test_ctrl_c_stops_a_two_worker_search_within_seconds_and_resume_loses_nothing(tmp_path, space, reference):
    out = tmp_path / "evo"
    log = tmp_path / "log"
    job = start_towerlab("evolve", *BASE, "--space", space, "--devices", "2", "--out", str(out), log=log)
    wait_for(lambda: in_generation_1(out), what="generation 1")
    os.killpg(job.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: every process of the job
    sent = time.time()
    status = job.wait(timeout=60)
    text = log.read_text()
    assert status == 130 and time.time() - sent < 15, text
    assert "Traceback" not in text, text
    kept = rows(out)
    resume(out)
    assert_nothing_lost_or_repeated(out, reference, kept)


@pytest.mark.slow
def test_torchrun_restarts_a_search_whose_worker_died_and_it_ends_as_uninterrupted(tmp_path, space, reference):
    out = tmp_path / "evo"
    log = tmp_path / "log"
    with open(log, "w") as sink:
        agent = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "--max-restarts", "1", "--monitor-interval", "0.2", "-m", "towerlab", "evolve", *BASE,
             "--space", space, "--out", str(out)], stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        with reaped(agent):
            wait_for(lambda: in_generation_1(out), what="generation 1")
            kept = rows(out)
            from test_faults_training import torchrun_workers

            os.kill(torchrun_workers(agent.pid)[1], signal.SIGKILL)
            status = agent.wait(timeout=240)
    assert status == 0, log.read_text()
    assert "towerlab evolve" in log.read_text()
    assert_nothing_lost_or_repeated(out, reference, kept)


@pytest.mark.slow
def test_a_candidate_too_deep_to_build_fails_and_the_grid_goes_on(tmp_path):
    """issue 41: 50,000 mlp layers once crashed the coordinator (SIGSEGV, in the cost estimate's
    FLOP count, after minutes); now such a genome is refused before anything is built, its
    evaluations are recorded as failed with the reason, and the other genomes are trained."""
    from towerlab.search import evaluation_records

    space = tmp_path / "space.toml"
    space.write_text('model = "mlp"\n[genes]\nneurons = [1, 2]\nlayers = [1, 50000]\n')
    out = tmp_path / "grid"
    result = run_cli("grid", *ONE_CPU, "--space", str(space), "--dataset", "synthetic", "--val-size", "500",
                     "--max-epochs", "1", "--threads", "1", "--no-progress", "--out", str(out), timeout=180)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["evaluations"], summary["failures"]) == (4, 2)
    records = evaluation_records(out / "search.db")
    failed = sorted((r["genome"]["neurons"], r["reason"]) for r in records if r["status"] == "failed")
    assert failed == [(n, "UserError: model option layers must be at most 1000, got 50000") for n in (1, 2)]
    assert {(r["genome"]["layers"], r["genome"]["neurons"]) for r in records if r["status"] == "ok"} == {(1, 1), (1, 2)}
