"""A search in a real PostgreSQL database (a private server: tests/postgres.py), through the command
line: workers that join late take work at once; a worker killed mid-candidate, or every worker, costs
only the tasks in flight; the server restarted mid-search loses nothing; a server out of reach at the
start is one line; a password never reaches a record; two searches share one store. Every search
ends with the rows of the same search run alone on SQLite (1 thread per candidate, so the numbers
are the same whoever trains them)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from test_faults_search import history, wait_for
from towerlab.errors import UserError
from towerlab.search.store.postgresql import SCHEMA_LOCK, PostgreSQL, open_postgresql
from towerlab.search.store.schema import SCHEMA_VERSION, create_tables
from towerlab.search.store import Store
from util import ONE_CPU, reaped, replica_pids, run_cli, start_towerlab

pytestmark = pytest.mark.slow

SEARCH = ["search", "run", "--sampler", "tpe", "--dataset", "synthetic", "--val-size", "1000", "--max-epochs", "3",
          "--threads", "1", "--no-progress", "--population", "4", "--generations", "6", "--seed", "3",
          "--remeasure", "1", "--top", "2", *ONE_CPU]
# 72 networks: TPE proposes new ones for long enough that a worker joining late finds work.
SPACE = """
model = "mlp"
[genes]
neurons = [16, 32, 64, 128]
layers = [1, 2, 3]
activation = ["relu", "tanh", "sigmoid"]
optimizer = ["adam", "sgd"]
"""


def decisive(target) -> list[tuple]:
    """What decides a history: (generation, index, replicate, genome, seed, status, fitness) of every row."""
    with Store(target, create=False) as store:
        return sorted((e.generation, e.index, e.replicate, e.genome_hash, e.seed, e.status, e.fitness)
                      for e in store.records.evaluations())


def trained(url: str, generation: int = 0) -> int:
    """Evaluations the store holds of generations from `generation` on (0 while it has no tables)."""
    try:
        with Store(url, create=False) as store:
            return sum(e.generation >= generation for e in store.records.evaluations())
    except Exception:  # noqa: BLE001 - not created yet
        return 0


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("space") / "space.toml"
    path.write_text(SPACE)
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, space) -> Path:
    out = tmp_path_factory.mktemp("reference") / "search"
    done = run_cli(*SEARCH, "--space", space, "--out", str(out))
    assert done.returncode == 0, done.stderr
    return out


def test_a_worker_that_joins_late_takes_work_and_the_search_ends_as_alone(tmp_path, space, reference, postgres_url):
    out = tmp_path / "search"
    with reaped(start_towerlab(*SEARCH, "--space", space, "--store", postgres_url, "--out", str(out),
                               log=tmp_path / "log")) as job:
        wait_for(lambda: trained(postgres_url, 1) > 0, timeout=180, what="generation 2")
        worker = start_towerlab("search", "worker", postgres_url, *ONE_CPU, log=tmp_path / "worker.log")
        with reaped(worker):
            assert job.wait(timeout=300) == 0, (tmp_path / "log").read_text()
            assert worker.wait(timeout=60) == 0, (tmp_path / "worker.log").read_text()
    assert decisive(postgres_url) == decisive(reference / "search.db")
    assert history(out) == history(reference)
    with Store(postgres_url) as store:
        by = {e.worker.split(":")[1] for e in store.records.evaluations()}
    assert len(by) == 2, by  # the job's worker and the joined one both trained
    text = (tmp_path / "worker.log").read_text()
    assert "joining its 1 unfinished search(es)" in text and "nothing left to do" in text, text


def test_a_killed_worker_costs_only_its_task_and_every_worker_killed_costs_nothing(
        tmp_path, space, reference, postgres_url, monkeypatch):
    """A joined worker is killed mid-candidate (its lease lapses: the job's worker trains it); then the
    job itself and its worker are killed, one worker started alone finishes the search, and `--resume`
    writes the record without training anything."""
    monkeypatch.setenv("TOWERLAB_LEASE_SECONDS", "3")
    out = tmp_path / "search"
    job = start_towerlab(*SEARCH, "--space", space, "--store", postgres_url, "--out", str(out), log=tmp_path / "log")
    wait_for(lambda: trained(postgres_url) > 0, timeout=180, what="the first evaluation")
    with reaped(job), reaped(start_towerlab("search", "worker", postgres_url, *ONE_CPU,
                                            log=tmp_path / "w1.log")) as joined:
        wait_for(lambda: len(replica_pids(joined.pid)) == 1, timeout=180, what="the joined worker")
        victim = replica_pids(joined.pid)[0]
        wait_for(lambda: holds_a_task(postgres_url, victim), timeout=180, what="the joined worker training")
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: trained(postgres_url, 2) > 0, timeout=180, what="generation 3")
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    assert not (out / "summary.json").exists()
    with reaped(start_towerlab("search", "worker", postgres_url, *ONE_CPU, log=tmp_path / "w2.log")) as last:
        assert last.wait(timeout=300) == 0, (tmp_path / "w2.log").read_text()
    before = decisive(postgres_url)
    done = run_cli("search", "run", "--resume", str(out), "--store", postgres_url)
    assert done.returncode == 0, done.stderr
    assert decisive(postgres_url) == before == decisive(reference / "search.db")
    assert history(out) == history(reference)


def holds_a_task(url: str, pid: int) -> bool:
    with Store(url, create=False) as store:
        return any(t.state == "claimed" and (t.worker or "").split(":")[1] == str(pid)
                   for s in store.records.searches() for t in store.queue.tasks(s.id))


def test_the_database_restarted_mid_search_loses_nothing(tmp_path, space, reference, postgres_server, postgres_url):
    out = tmp_path / "search"
    with reaped(start_towerlab(*SEARCH, "--space", space, "--store", postgres_url, "--out", str(out),
                               log=tmp_path / "log")) as job:
        wait_for(lambda: trained(postgres_url, 1) > 0, timeout=180, what="generation 2")
        postgres_server.stop()
        time.sleep(3)
        postgres_server.start()
        assert job.wait(timeout=300) == 0, (tmp_path / "log").read_text()
    text = (tmp_path / "log").read_text()
    assert "lost the search store's database" in text and "reached the search store's database" in text, text
    assert "Traceback" not in text
    assert decisive(postgres_url) == decisive(reference / "search.db")
    assert history(out) == history(reference)


def test_a_database_out_of_reach_at_the_start_is_one_line(tmp_path, space, postgres_server):
    away = f"postgresql://postgres@127.0.0.1:{postgres_server.port}/no_such_database"
    done = run_cli(*SEARCH, "--space", space, "--store", away, "--out", str(tmp_path / "search"))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot reach the search store's database" in done.stderr and "no_such_database" in done.stderr
    assert not (tmp_path / "search").exists()
    done = run_cli("search", "worker", away, *ONE_CPU)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr


def test_a_password_is_never_printed_or_recorded(tmp_path, space, postgres_url):
    secret = postgres_url.replace("postgres@", "postgres:s3cret-pw@")  # the test server trusts any password
    out = tmp_path / "search"
    done = run_cli(*SEARCH, "--space", space, "--generations", "1", "--store", secret, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "s3cret-pw" not in done.stdout + done.stderr
    for path in out.iterdir():
        if path.suffix in (".json", ".jsonl"):
            assert "s3cret-pw" not in path.read_text(), path
    config = json.loads((out / "config.json").read_text())
    assert config["store"] == config["search"]["store"] == postgres_url.replace("postgres@", "postgres:***@")
    with Store(postgres_url) as store:
        assert "s3cret-pw" not in json.dumps([row.config for row in store.records.searches()])
    # A resume finds the password where the URL came from: $TOWERLAB_STORE.
    done = run_cli("search", "run", "--resume", str(out), "--generations", "2", env={"TOWERLAB_STORE": secret})
    assert done.returncode == 0 and "s3cret-pw" not in done.stdout + done.stderr, done.stderr


def test_two_searches_share_one_store_at_once(tmp_path, space, postgres_url):
    """Two searches of the same space run at once: each finishes with its own history; a genome one of
    them trained before the other's generation began is served to the other from the cache."""
    jobs = [start_towerlab(*SEARCH, "--space", space, "--seed", str(seed), "--store", postgres_url,
                           "--out", str(tmp_path / f"s{seed}"), log=tmp_path / f"log{seed}") for seed in (1, 2)]
    for seed, job in zip((1, 2), jobs):
        with reaped(job):
            assert job.wait(timeout=300) == 0, (tmp_path / f"log{seed}").read_text()
    with Store(postgres_url) as store:
        searches = store.records.searches()
        assert [s.finished is not None for s in searches] == [True, True]
        for search in searches:
            for gen in store.records.generations(search.id):
                for member in gen.results:
                    row = store.records.lookup(member["genome_hash"], search.train_config_hash, search.id)
                    assert row.search_id == search.id or row.id <= gen.watermark
    done = run_cli("search", "show", postgres_url)
    assert done.returncode == 0 and done.stdout.count("finished") == 2, done.stdout


def test_a_session_that_waited_for_the_schema_lock_finds_the_tables_made_meanwhile(postgres_url):
    """Two processes opening one new database at once: the one that waited for the schema lock finds the
    tables the other made meanwhile, though its session had looked for them (and found none) before."""
    first, late = PostgreSQL(postgres_url), PostgreSQL(postgres_url)
    opened: list = []

    def make(tx):  # what the first process does under the lock, while the late one waits for it
        waiting = threading.Thread(target=lambda: opened.append(_opened(late, postgres_url)))
        waiting.start()
        time.sleep(1.0)  # the late one has looked, found nothing, and waits for the lock
        create_tables(tx)
        tx.run("CREATE TABLE towerlab_schema (version INTEGER NOT NULL)")
        tx.run("INSERT INTO towerlab_schema (version) VALUES (?)", (SCHEMA_VERSION,))
        return waiting

    try:
        first.write(make, lock=SCHEMA_LOCK).join(timeout=30)
        assert opened == ["ok"]  # it said: "holds a table named searches but no towerlab store"
    finally:
        first.close()
        late.close()


def _opened(db, url):
    try:
        open_postgresql(db, url, create=True)
    except UserError as e:
        return str(e)
    return "ok"


def test_show_export_and_resume_of_a_folder_find_the_password_where_libpq_does(tmp_path, space, postgres_server,
                                                                                  monkeypatch):
    """A search started with the password in its URL (config.json keeps `:***@`): `search show DIR`,
    `search export DIR` and `search run --resume DIR` failed with "password authentication failed",
    since the stars were taken for the password; they now find it in $PGPASSWORD, and in ~/.pgpass.
    The password typed on the command line gets one warning line, and is never printed."""
    password = "pw-Zqv1/Xjw2#"  # '/' and '#' spelled out in the URL, as users type them
    url = postgres_server.password_database(password)
    monkeypatch.delenv("TOWERLAB_STORE", raising=False)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    typed = url.replace("@", f":{password}@", 1)
    out = tmp_path / "search"
    done = run_cli(*SEARCH, "--space", space, "--generations", "1", "--store", typed, "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "is visible to every user of this machine" in done.stderr and "Zqv1" not in done.stdout + done.stderr
    assert json.loads((out / "config.json").read_text())["store"] == url.replace("@", ":***@", 1)
    home = tmp_path / "home"
    home.mkdir()
    pgpass = home / ".pgpass"
    pgpass.write_text(f"127.0.0.1:{postgres_server.port}:*:*:{password.replace(':', chr(92) + ':')}\n")
    pgpass.chmod(0o600)
    none = run_cli("search", "show", str(out), env={"HOME": str(tmp_path)})
    assert none.returncode == 2 and "password" in none.stderr and none.stderr.count("\n") == 1, none.stderr
    for where in ({"PGPASSWORD": password}, {"HOME": str(home)}):
        shown = run_cli("search", "show", str(out), env=where)
        assert shown.returncode == 0 and "finished" in shown.stdout, shown.stderr
        study = tmp_path / f"study-{len(where['HOME']) if 'HOME' in where else 0}.db"
        exported = run_cli("search", "export", str(out), "--optuna", f"sqlite:///{study}", env=where)
        assert exported.returncode == 0 and "trials" in exported.stdout, exported.stderr
        for result in (shown, exported):
            assert "Zqv1" not in result.stdout + result.stderr and "warning" not in result.stderr
    generations = 1
    for where in ({"PGPASSWORD": password}, {"HOME": str(home)}):
        generations += 1
        resumed = run_cli("search", "run", "--resume", str(out), "--generations", str(generations), env=where)
        assert resumed.returncode == 0, resumed.stderr
        assert "Zqv1" not in resumed.stdout + resumed.stderr and "warning: the password" not in resumed.stderr
    with Store(with_password_of(url, password), create=False) as store:
        assert [g.complete for g in store.records.generations(1)] == [True, True, True]


def with_password_of(url: str, password: str) -> str:
    from urllib.parse import quote

    return url.replace("@", f":{quote(password, safe='')}@", 1)


def test_a_worker_waits_on_an_empty_database_then_trains_a_search_started_later(tmp_path, space, reference,
                                                                               postgres_url):
    """`search worker URL --wait` on a database that no search has used exited 2 ("holds no search store"):
    a cluster's workers that start before the search died at once. It waits, joins the search once it
    starts, says what it trains, task by task, and what it did when it leaves."""
    with reaped(start_towerlab("search", "worker", postgres_url, "--wait", *ONE_CPU,
                               log=tmp_path / "worker.log")) as worker:
        wait_for(lambda: "waiting for a search to start" in (tmp_path / "worker.log").read_text(), timeout=120,
                 what="the worker to wait")
        assert worker.poll() is None
        out = tmp_path / "search"
        with reaped(start_towerlab(*SEARCH, "--space", space, "--store", postgres_url, "--out", str(out),
                                   log=tmp_path / "log")) as job:
            assert job.wait(timeout=300) == 0, (tmp_path / "log").read_text()
        assert worker.poll() is None  # --wait: it stays for the searches to come
        os.killpg(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=60) == 143
    assert decisive(postgres_url) == decisive(reference / "search.db")
    with Store(postgres_url) as store:
        assert len({e.worker for e in store.records.evaluations()}) == 2  # the search's own worker, and the one that waited
    text = (tmp_path / "worker.log").read_text()
    told = [line for line in text.splitlines() if ": search 1, generation " in line]
    assert told and all(re.search(r"(validation|test) accuracy 0\.\d{4}.* in \d+\.\d s$", line) for line in told), text
    assert re.search(rf"leaving after {len(told)} task\(s\) \(0 failed\) of search\(es\) 1: ", text), text


def test_a_worker_with_other_data_is_refused_and_the_search_ends_as_on_sqlite(tmp_path, postgres_url, monkeypatch):
    """A worker whose mnist.npz differs from the search's in one training label trained 3 candidates into
    the search, scoring 0.5 where the data gives 0.96. It is refused in one line naming the data, exits 2
    (it joined nothing), trains nothing, and the search ends with the rows of the same search on SQLite."""
    from test_search_provenance import SEARCH as MNIST_SEARCH, SPACE as MLP_SPACE, mnist_files

    data = mnist_files(tmp_path / "data")
    monkeypatch.setenv("TOWERLAB_DATA", str(data))
    (tmp_path / "space.toml").write_text(MLP_SPACE)
    search = [*MNIST_SEARCH, "--space", str(tmp_path / "space.toml")]
    done = run_cli(*search, "--out", str(tmp_path / "reference"))
    assert done.returncode == 0, done.stderr
    job = start_towerlab(*search, "--store", postgres_url, "--out", str(tmp_path / "search"), log=tmp_path / "log")
    with reaped(job):  # stopped after its first evaluation: the search waits for workers, unfinished
        wait_for(lambda: trained(postgres_url) > 0, timeout=180, what="the first evaluation")
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
    before = decisive(postgres_url)
    other = run_cli("search", "worker", postgres_url, *ONE_CPU,
                    env={"TOWERLAB_DATA": str(mnist_files(tmp_path / "other", changed_label=True))})
    lines = other.stderr.splitlines()
    assert other.returncode == 2 and len(lines) == 2, other.stderr
    assert lines[1].startswith("towerlab: error: worker ") and "joined no search of" in lines[1]
    assert "search 1: its data differ: mnist here (npz, " in lines[1] and "other/mnist.npz" in lines[1], lines
    assert decisive(postgres_url) == before
    done = run_cli("search", "worker", postgres_url, *ONE_CPU)  # the search's data: it finishes the search
    assert done.returncode == 0, done.stderr
    assert decisive(postgres_url) == decisive(tmp_path / "reference" / "search.db")


def old_postgresql_store(url: str, version: int, dropped: tuple[str, ...]) -> tuple[int, dict]:
    """A store at `url` holding one search and its row (fitness 0.5), made to look as towerlab of schema
    `version` wrote it (its `dropped` columns of evaluations dropped, and schema 7's and 8's): the search's id
    and the row's genome."""
    import psycopg

    from towerlab.config import SearchConfig
    from towerlab.fields import to_dict
    from towerlab.search import Candidate, Outcome, genome_hash, load_space

    with Store(url) as store:
        sid = store.records.begin_search("random", to_dict(SearchConfig()), load_space("mlp"), "tch", {"device": "cpu"})
        genome = {"neurons": 64, "layers": 1, "activation": "relu", "optimizer": "adam"}
        store.records.record(Candidate(0, 0, genome, genome_hash(genome), 1), Outcome.ok(0.5, worker="w"), "tch", sid)
    with psycopg.connect(url, autocommit=True) as db:
        for table, column in (("searches", "leader"), ("searches", "leader_until"), ("searches", "activity"),
                              ("generations", "proposed"), ("evaluations", "continued"), ("tasks", "starts"),
                              *(("evaluations", column) for column in dropped)):
            db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        db.execute(f"UPDATE towerlab_schema SET version = {version}")
    return sid, genome


def test_a_postgresql_store_of_schema_4_gains_provenance_and_keeps_its_rows(postgres_url):
    """A store made before each evaluation recorded its provenance (schema 4) is migrated when opened,
    once, under the schema lock; its rows stay, without provenance."""
    import psycopg

    from towerlab.search import Candidate, Outcome, genome_hash

    sid, genome = old_postgresql_store(postgres_url, 4, ("metrics", "curve", "provenance"))
    with Store(postgres_url, create=False) as store, Store(postgres_url, create=False):
        [row] = store.records.evaluations()
        assert (row.fitness, row.provenance) == (0.5, None)
        where = {"host": "h"}
        genome = {**genome, "neurons": 32}
        again = store.records.record(Candidate(0, 1, genome, genome_hash(genome), 2), Outcome.ok(0.6, provenance=where),
                                     "tch", sid)
        assert again.provenance == where
    with psycopg.connect(postgres_url) as db:
        assert db.execute("SELECT version FROM towerlab_schema").fetchall() == [(SCHEMA_VERSION,)] == [(8,)]


def test_a_schema_5_store_gains_an_objective_s_metrics_and_keeps_its_rows(postgres_url):
    """A store made before an objective's metrics (schema 5) is migrated when opened, under the schema lock;
    its rows stay, without metrics."""
    import psycopg

    from towerlab.search import Candidate, Outcome, genome_hash

    sid, genome = old_postgresql_store(postgres_url, 5, ("metrics", "curve"))
    with Store(postgres_url, create=False) as store, Store(postgres_url, create=False):
        [row] = store.records.evaluations()
        assert (row.fitness, row.metrics, row.curve) == (0.5, None, None)
        genome = {**genome, "neurons": 32}
        again = store.records.record(Candidate(0, 1, genome, genome_hash(genome), 2),
                                     Outcome.ok(-0.2, metrics={"loss": 0.2}, curve=[{"epoch": 1, "loss": 0.3}]),
                                     "tch", sid)
        assert (again.metrics, again.curve) == ({"loss": 0.2}, [{"epoch": 1, "loss": 0.3}])
    with psycopg.connect(postgres_url) as db:
        assert db.execute("SELECT version FROM towerlab_schema").fetchall() == [(8,)]
