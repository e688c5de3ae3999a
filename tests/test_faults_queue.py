"""Hostile round 5 on the store as the queue (issue 60): workers in separate PID namespaces on one host
(real `unshare`), the store lost while a worker asks it for the top, a worker frozen inside a
PostgreSQL transaction (a real private server) or holding SQLite's write lock, the launcher's end after
its workers stopped, foreign tables, rows of the wrong form or with impossible numbers, the search
folder deleted or made immutable mid-search, a search id past 64 bits, a process whose clock lies
(faketime). Each held a defect: a healthy candidate recorded as failed, a wait without a bound, exit
status 0 on an unfinished search, a traceback or a bus error instead of one line."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from test_faults_search import wait_for
from util import ONE_CPU, SEARCH_BASE, reaped, replica_pids, run_cli, small_space_file, start_towerlab

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search import Candidate, Search, load_space
from towerlab.search.work.worker import MAX_ATTEMPTS
from towerlab.search.store import Store

# About 0.1 s a candidate: 1 epoch on 5,000 synthetic images, 1 thread (the same numbers on any worker).
BASE = [*SEARCH_BASE, "--seed", "5", "--top", "2"]
# Long enough that a worker can be caught at work: 3 epochs, 3 generations of 6.
LONGER = [*BASE, "--max-epochs", "3", "--population", "6", "--generations", "3"]


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> str:
    return small_space_file(tmp_path_factory.mktemp("space"))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, space) -> Path:
    """A finished search of 2 generations of 4 (its folder), copied and edited by the tests."""
    out = tmp_path_factory.mktemp("finished") / "search"
    done = run_cli("evolve", *BASE, "--population", "4", "--generations", "2", "--space", space, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def reopened(finished: Path, into: Path, *edits: tuple[str, tuple]) -> Path:
    """A copy of the finished search with its last training undone (its task open again, its row and
    its generation's result gone), then `edits` (SQL, arguments) made to its store: one task for a
    worker that joins it."""
    copy = into / "search"
    shutil.copytree(finished, copy)
    with contextlib.closing(sqlite3.connect(copy / "search.db")) as db, db:
        db.execute("UPDATE searches SET finished = NULL, summary = NULL")
        db.execute("DELETE FROM tasks WHERE kind = 'test'")
        task, genome_hash, generation = db.execute(
            "SELECT id, genome_hash, generation FROM tasks WHERE kind = 'train' ORDER BY id DESC LIMIT 1").fetchone()
        db.execute("UPDATE tasks SET state = 'open', worker = NULL, result = NULL WHERE id = ?", (task,))
        db.execute("DELETE FROM evaluations WHERE genome_hash = ?", (genome_hash,))
        db.execute("UPDATE generations SET complete = 0, results = NULL, stats = NULL WHERE generation = ?",
                   (generation,))
        for sql, args in edits:
            db.execute(sql.replace("{task}", str(task)), args)
    return copy


def one_line(done: subprocess.CompletedProcess, *fragments: str) -> None:
    errors = [line for line in done.stderr.splitlines() if line.startswith("towerlab: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    for fragment in fragments:
        assert fragment in errors[0], done.stderr


def evaluations(folder: Path) -> list[dict]:
    """The store's evaluations, read only (a read while the search starts must not make its file)."""
    with contextlib.closing(sqlite3.connect(f"file:{folder / 'search.db'}?mode=ro", uri=True)) as db:
        db.row_factory = sqlite3.Row
        return [dict(r) for r in db.execute("SELECT * FROM evaluations ORDER BY id")]


def new_search(target: str) -> int:
    cfg = SearchConfig(sampler="random", population=2, generations=1, max_epochs=1, seed=1)
    with Store(target) as store:
        return Search.resolve(cfg, load_space("mlp")).create(store, "tch", {"test": True}).id


def python(code: str, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """`code` in a fresh interpreter (after `prefix`: unshare, faketime), its output piped."""
    return subprocess.Popen([*prefix, sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE, text=True)


# -- 9, 13, 16: foreign tables, impossible numbers in a row, ids past 64 bits ---------------------------------


@pytest.mark.parametrize("table", ["tasks", "evaluations", "workers"])
def test_a_database_holding_a_table_of_towerlab_s_names_is_refused_in_one_line(postgres_url, table):
    import psycopg

    with psycopg.connect(postgres_url, autocommit=True) as db:
        db.execute(f"CREATE TABLE {table} (id INTEGER)")
    with pytest.raises(UserError, match=f"holds a table named {table} but no towerlab store"):
        Store(postgres_url)


@pytest.mark.slow
def test_a_task_row_with_an_impossible_budget_fails_that_candidate_alone(tmp_path, finished):
    """max_epochs = -5 in a task's row: the worker said "--epochs must be positive", a flag nobody passed,
    and exited, leaving the search unfinishable. Now that candidate fails with its reason, and the search
    ends."""
    folder = reopened(finished, tmp_path, ("UPDATE tasks SET max_epochs = -5 WHERE id = {task}", ()))
    done = run_cli("search", "worker", str(folder), *ONE_CPU)
    assert done.returncode == 0 and "--epochs" not in done.stderr, done.stderr
    failed = [e for e in evaluations(folder) if e["status"] == "failed"]
    assert len(failed) == 1 and "its task's row gives max_epochs = -5" in failed[0]["reason"], failed
    with Store(folder / "search.db") as store:
        assert store.records.searches()[0].finished is not None


@pytest.mark.parametrize("store", ["sqlite", "postgresql"])
def test_a_lease_that_runs_past_any_a_worker_grants_counts_as_lapsed(request, tmp_path, store):
    """A lease to the year 3000 (an edited row) held its task forever: every worker waited, `search show`
    listed it in progress."""
    target = str(tmp_path / "search.db") if store == "sqlite" else request.getfixturevalue("postgres_url")
    search_id = new_search(target)
    with Store(target) as store:
        store.queue.enqueue(search_id, "train", [(Candidate(0, 0, {"neurons": 16}, "a", 1, 1), "tch")])
        first = store.queue.claim("w1", [search_id], lease=30, max_attempts=MAX_ATTEMPTS)
        assert store.queue.claim("w2", [search_id], lease=30, max_attempts=MAX_ATTEMPTS) is None  # held
        store.db.write(lambda tx: tx.run("UPDATE tasks SET lease_until = ? WHERE id = ?", (32503680000.0, first.id)))
        second = store.queue.claim("w2", [search_id], lease=30, max_attempts=MAX_ATTEMPTS)
    assert second is not None and second.id == first.id and "its row was edited" in second.lost


def test_a_search_id_past_64_bits_is_no_such_search(tmp_path):
    new_search(str(tmp_path / "search.db"))
    done = run_cli("search", "worker", str(tmp_path / "search.db"), "--search", "99999999999999999999", *ONE_CPU)
    one_line(done, "holds no search 99999999999999999999")


# -- 10: rows of the wrong form -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("edit, named", [
    ("UPDATE searches SET config = '[1,2]'", "search 1's settings are a list"),
    ("UPDATE tasks SET genome = '[1,2,3]' WHERE id = {task}", "task {task}'s genome is a list"),
])
@pytest.mark.slow
def test_a_row_of_the_wrong_form_stops_every_worker_in_one_line(tmp_path, finished, edit, named):
    """It was a 90-line traceback in every worker process, then "4 worker processes died"."""
    folder = reopened(finished, tmp_path, (edit, ()))
    with contextlib.closing(sqlite3.connect(folder / "search.db")) as db:
        named = named.replace("{task}", str(db.execute("SELECT id FROM tasks WHERE state = 'open'").fetchone()[0]))
    done = run_cli("search", "worker", str(folder), "--device", "cpu", "--devices", "2")
    one_line(done, "holds a record of the wrong form", named)
    done = run_cli("search", "show", str(folder))
    one_line(done, "holds a record of the wrong form", named)


# -- 4, 5: a process frozen inside a transaction ----------------------------------------------------------------

FROZEN = """
import os, signal, sys
from towerlab.search.store import database, postgresql
postgresql.IDLE_IN_TRANSACTION = 2.0  # the server ends this session 2 s after it froze
from towerlab.search import Candidate
from towerlab.search.store import Store

frozen = []
one = database.Statements.one  # the transactions of a Database

def freezing(tx, sql, args=()):
    row = one(tx, sql, args)
    if sql.startswith("INSERT INTO tasks") and not frozen:
        frozen.append(True)
        print("frozen", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # inside the transaction, its row inserted, not committed
    return row

database.Statements.one = freezing
with Store(sys.argv[1]) as store:
    new = store.queue.enqueue(int(sys.argv[2]), "train", [(Candidate(0, 0, {"neurons": 16}, "a", 1, 1), "tch")])
    print(f"new {len(new)}", flush=True)
"""


def test_a_worker_frozen_inside_a_postgresql_transaction_stalls_the_others_only_for_a_bounded_time(postgres_url):
    """A worker stopped (SIGSTOP) between two statements of its enqueue transaction: another worker putting
    the same task on the queue waited on its lock without a limit (95 s, and counting). The server now ends
    the frozen session (idle in transaction), the other goes on, and the frozen one, continued, finds its
    work done: the task is there once."""
    search_id = new_search(postgres_url)
    frozen = python(FROZEN, postgres_url, str(search_id))
    store = Store(postgres_url)
    done: list = []
    other = threading.Thread(target=lambda: done.append(store.queue.enqueue(
        search_id, "train", [(Candidate(0, 0, {"neurons": 16}, "a", 1, 1), "tch")])), daemon=True)
    try:
        assert frozen.stdout.readline() == "frozen\n", frozen.stderr.read()
        other.start()
        other.join(timeout=120)
        assert done and len(done[0]) == 1, "the other worker still waits for the frozen one's lock"
    finally:
        os.kill(frozen.pid, signal.SIGCONT)  # (without the bound, the other goes on only now)
        out, err = frozen.communicate(timeout=120)
        other.join(timeout=120)
        store.close()
    assert frozen.returncode == 0 and out == "new 0\n", out + err
    assert "lost the search store's database" in err and "reached the search store's database" in err, err
    with Store(postgres_url) as store:
        assert len(store.queue.tasks(search_id)) == 1


def test_an_sqlite_store_locked_by_a_stopped_process_says_so(tmp_path, monkeypatch):
    """The same freeze on SQLite: a process stopped holding the write lock. The wait is bounded, and the
    line says what it is (it said "fix the disk (space, permissions)": the disk was fine)."""
    from towerlab.search.store import sqlite

    monkeypatch.setattr(sqlite, "SQLITE_BUSY", 0.5)
    monkeypatch.setenv("TOWERLAB_DB_RETRY_SECONDS", "1")
    target = str(tmp_path / "search.db")
    search_id = new_search(target)
    holder = python("""
        import os, signal, sqlite3, sys
        db = sqlite3.connect(sys.argv[1], isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        print("holding", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    """, target)
    try:
        assert holder.stdout.readline() == "holding\n"
        with Store(target) as store, pytest.raises(UserError) as refused:
            store.queue.enqueue(search_id, "train", [(Candidate(0, 0, {"neurons": 16}, "a", 1, 1), "tch")])
    finally:
        holder.kill()
        holder.communicate()
    text = str(refused.value)
    assert f"search store {target} is locked: another process has held its write lock" in text, text
    assert "disk" not in text and "still was after 1 s" in text


# -- 2: the store lost while a worker asks it ----------------------------------------------------------------


@pytest.mark.slow
def test_a_store_lost_while_a_worker_asks_it_stops_the_worker_and_fails_no_network(postgres_server, postgres_url,
                                                                                 monkeypatch):
    """The database goes away past the retry window just as a worker asks for the bar of its search's top
    (`Records.top_bar`, before the network trains): the store's error must stop the worker (its task goes
    back on the queue when its lease lapses), never become the network's failure (it was recorded failed,
    "lost the search store's database", where the network trains fine, when the training itself asked)."""
    from towerlab.search import Outcome
    from towerlab.search.store.records import Records
    from towerlab.search.work.worker import Worker, WorkerOptions

    monkeypatch.setenv("TOWERLAB_DB_RETRY_SECONDS", "1")
    search_id = new_search(postgres_url)
    asked = Records.top_bar
    trained = []

    def lost(self, *args):
        postgres_server.stop()
        return asked(self, *args)

    def train(assignment):
        trained.append(assignment)
        return Outcome.ok(0.5, epochs=1)

    monkeypatch.setattr(Records, "top_bar", lost)
    with Store(postgres_url) as store:
        try:
            with pytest.raises(UserError, match="lost the search store's database"):
                Worker(store, "w", "cpu", lambda search: train, WorkerOptions(search_ids=[search_id], lease=3.0)).run()
        finally:
            postgres_server.start()
    monkeypatch.setattr(Records, "top_bar", asked)
    with Store(postgres_url) as store:
        claimed = [t for t in store.queue.tasks(search_id) if t.state == "claimed"]
        assert trained == [] and store.records.evaluations(search_id) == [] and len(claimed) == 1
        # The same worker with a store that answers: it trains, every network scored as it enters the top.
        Worker(store, "w", "cpu", lambda search: train, WorkerOptions(search_ids=[search_id], lease=3.0)).run()
        assert trained and all(a.test_from is not None for a in trained)
        assert store.records.search(search_id).finished is not None


# -- 6: `search worker` never ends with 0 after its workers were stopped ---------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_search_worker_whose_workers_were_stopped_never_exits_0(tmp_path, finished, signum, status):
    """The workers end by a signal (their group's Ctrl-C, or SIGTERM to them alone) before the launcher
    looks again: it said "nothing left to do" and exited 0 (1 run in 2), as if the search were done."""
    folder = reopened(finished, tmp_path)
    log = tmp_path / "log"
    with reaped(start_towerlab("search", "worker", str(folder), "--wait", *ONE_CPU, log=log)) as job:
        wait_for(lambda: len(replica_pids(job.pid)) == 1, timeout=120, what="the worker")
        worker = replica_pids(job.pid)[0]
        with Store(folder / "search.db") as store:  # in the worker's loop (its stop handler in place)
            wait_for(lambda: any(w["pid"] == worker for w in store.queue.workers()), timeout=120, what="its join")
        os.kill(worker, signum)
        assert job.wait(timeout=120) == status, log.read_text()
    assert "nothing left to do" not in log.read_text()


# -- 1: PID namespaces -------------------------------------------------------------------------------------

UNSHARE = ("unshare", "--pid", "--fork", "--mount-proc")

HOLDER = """
import os, socket, sys
from towerlab.search.work.worker import Worker, WorkerOptions
from towerlab.search.store import Store

def trainer(search):
    def train(assignment):
        print("training", flush=True)
        sys.stdin.readline()  # until the test says
        from towerlab.search import Outcome
        return Outcome.ok(0.5, epochs=1)
    return train

with Store(sys.argv[1]) as store:
    name = f"{socket.gethostname()}:{os.getpid()}:cpu:holder"
    Worker(store, name, "cpu", trainer, WorkerOptions(search_ids=[int(sys.argv[2])])).run()
"""


def _unshare_works() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True)
    return None if done.returncode == 0 else f"unshare --pid --fork --mount-proc fails here: {done.stderr.strip()}"


def test_workers_in_separate_pid_namespaces_never_free_each_others_live_tasks(tmp_path):
    """Containers on one host: a worker in one PID namespace holds a task; a `search worker` starting in
    another (its pids are another numbering) must not take the holder for dead. It reopened the live
    task ("ended without a word (its process is gone)"), and the finished result was dropped."""
    why = _unshare_works()
    if why is not None:
        pytest.skip(why)
    target = str(tmp_path / "search.db")
    search_id = new_search(target)
    # The holder is not the namespace's first processes (sh is 1, true 2): pid 3, which no process has in
    # the observer's namespace, where only sh (1) and python (2) run.
    holder = python(HOLDER, target, str(search_id),
                    prefix=(*UNSHARE, "sh", "-c", '/bin/true; "$0" "$@"; :'))
    try:
        assert holder.stdout.readline() == "training\n", holder.stderr.read()
        observer = subprocess.run(
            [*UNSHARE, "sh", "-c", '"$0" "$@"; :', sys.executable, "-c",
             "import sys; from towerlab.search.work.worker import release_the_dead; from towerlab.search.store import Store;"
             " print(release_the_dead(Store(sys.argv[1], create=False)))", target],
            capture_output=True, text=True, timeout=120)
        assert observer.returncode == 0 and observer.stdout == "0\n", observer.stdout + observer.stderr
        with Store(target) as store:
            held = [t for t in store.queue.tasks(search_id) if t.state == "claimed"]
            assert len(held) == 1 and held[0].worker.split(":")[1] == "3" and held[0].lost is None
            names = [w["id"] for w in store.queue.workers()]
            assert len(names) == 1 and names[0].endswith(":cpu:holder")
    finally:
        holder.communicate("go\n" * 10, timeout=120)
    assert holder.returncode == 0, holder.stderr
    with Store(target) as store:
        assert store.records.search(search_id).finished is not None
        assert all(t.attempts == 1 and t.lost is None for t in store.queue.tasks(search_id))  # nothing trained twice
        assert [e.status for e in store.records.evaluations(search_id)] == ["ok", "ok"]


def test_a_dead_worker_of_this_namespace_is_still_freed_at_once(tmp_path):
    """What `release_the_dead` is for: a worker of this host and namespace whose process is gone."""
    from towerlab.search.work.worker import pid_space, release_the_dead, worker_name

    target = str(tmp_path / "search.db")
    search_id = new_search(target)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    name = worker_name("cpu", pid, "gone")
    with Store(target) as store:
        store.queue.enqueue(search_id, "train", [(Candidate(0, 0, {"neurons": 16}, "a", 1, 1), "tch")])
        store.queue.join(name, pid_space(), pid, "cpu")
        assert store.queue.claim(name, [search_id], lease=30, max_attempts=MAX_ATTEMPTS) is not None
        assert release_the_dead(store) == 1
        assert [t.state for t in store.queue.tasks(search_id)] == ["open"]


# -- 11, 12: the search's folder deleted or made immutable mid-search ---------------------------------------


def _first_evaluation(folder: Path) -> bool:
    try:
        return len(evaluations(folder)) > 0
    except sqlite3.Error:  # not made yet
        return False


@pytest.mark.slow
def test_the_search_folder_deleted_mid_search_is_one_line_for_the_job_and_a_joined_worker(tmp_path, space):
    """`rm -rf` of the folder: the job ended with a FileNotFoundError traceback, and a worker that had
    joined finished the search into the deleted file and exited 0 without a word."""
    out = tmp_path / "search"
    # generations enough to outlast the joining worker's start (the folder goes long before they are trained)
    with reaped(start_towerlab("search", "run", *LONGER, "--generations", "20", "--space", space, "--out", str(out),
                               log=tmp_path / "job.log")) as job:
        wait_for(lambda: _first_evaluation(out), timeout=180, what="the first evaluation")
        with reaped(start_towerlab("search", "worker", str(out), *ONE_CPU, log=tmp_path / "worker.log")) as worker:
            with Store(out / "search.db") as store:
                wait_for(lambda: len(store.queue.workers()) == 2, timeout=120, what="the joined worker")
            shutil.rmtree(out)
            assert job.wait(timeout=120) == 2, (tmp_path / "job.log").read_text()
            assert worker.wait(timeout=120) == 2, (tmp_path / "worker.log").read_text()
    for log in ("job.log", "worker.log"):
        text = (tmp_path / log).read_text()
        assert "Traceback" not in text and text.count("towerlab: error:") == 1, text
        assert "was deleted while" in text, text


def _chattr(flag: str, *paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["chattr", flag, *map(str, paths)], capture_output=True, text=True)


@pytest.mark.slow
def test_an_immutable_store_mid_search_is_one_line_and_resume_ends_as_uninterrupted(tmp_path, space):
    """`chattr +i` on search.db, -wal and -shm: the job died of a bus error (SIGBUS, exit 135, no word) in
    SQLite's mapped shared memory. Now one line and exit 2; made writable again, `--resume` ends with the
    uninterrupted history."""
    probe = tmp_path / "probe"
    probe.touch()
    if os.geteuid() != 0 or shutil.which("chattr") is None or _chattr("+i", probe).returncode != 0:
        pytest.skip("chattr +i needs root and a filesystem with the immutable flag (ext4, xfs, btrfs)")
    _chattr("-i", probe)
    reference = tmp_path / "reference"
    done = run_cli("search", "run", *LONGER, "--space", space, "--out", str(reference))
    assert done.returncode == 0, done.stderr
    out = tmp_path / "search"
    files = [out / "search.db", out / "search.db-wal", out / "search.db-shm"]
    with reaped(start_towerlab("search", "run", *LONGER, "--space", space, "--out", str(out),
                               log=tmp_path / "job.log")) as job:
        wait_for(lambda: _first_evaluation(out) and all(f.exists() for f in files), timeout=180,
                 what="the first evaluation")
        try:
            assert _chattr("+i", *files).returncode == 0
            status = job.wait(timeout=120)
        finally:
            _chattr("-i", *files)
    text = (tmp_path / "job.log").read_text()
    assert status == 2 and "Traceback" not in text and text.count("towerlab: error:") == 1, text
    assert "is no longer writable (made immutable or read-only while in use)" in text, text
    done = run_cli("search", "run", "--resume", str(out))
    assert done.returncode == 0, done.stderr
    assert (_history(out), _decisive(out)) == (_history(reference), _decisive(reference))


def _history(out: Path) -> list:
    import json

    summary = json.loads((out / "summary.json").read_text())
    return [summary["top"][i]["genome"] for i in range(len(summary["top"]))] + [
        {k: v for k, v in s.items() if "seconds" not in k} for s in summary["generation_stats"]]


def _decisive(out: Path) -> list[tuple]:
    return sorted((e["generation"], e["idx"], e["replicate"], e["genome_hash"], e["seed"], e["status"], e["fitness"])
                  for e in evaluations(out))


# -- 15: one clock for a store ------------------------------------------------------------------------------


def test_a_process_whose_clock_lies_keeps_to_the_sqlite_store_s_clock(tmp_path):
    """A worker under `faketime +1d` saw every lease lapsed and took over live tasks, and dated a search's
    end before its start: SQLite's `julianday('now')` is the calling process's clock. The store's clock is
    now the machine's kernel's, which no process shifts for itself."""
    if shutil.which("faketime") is None:
        pytest.skip("no faketime here (apt-get install faketime)")
    target = str(tmp_path / "search.db")
    search_id = new_search(target)
    with Store(target) as store:
        store.queue.enqueue(search_id, "train", [(Candidate(0, 0, {"neurons": 16}, "a", 1, 1), "tch")])
        assert store.queue.claim("w1", [search_id], lease=30, max_attempts=MAX_ATTEMPTS) is not None
    skewed = python("""
        import sys, time
        from towerlab.search.store import Store
        print(time.time() > 86000 + float(sys.argv[3]), flush=True)  # this process's clock is a day ahead
        with Store(sys.argv[1]) as store:
            print(store.queue.claim("w2", [int(sys.argv[2])], lease=30, max_attempts=3) is None)
            store.records.finish_search(int(sys.argv[2]), {"top": []})
    """, target, str(search_id), str(time.time()), prefix=("faketime", "-f", "+1d"))
    out, err = skewed.communicate(timeout=120)
    assert skewed.returncode == 0 and out == "True\nTrue\n", out + err  # the live task stays w1's
    with Store(target) as store:
        row = store.records.search(search_id)
        assert row.created <= row.finished < time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() + 3600))
