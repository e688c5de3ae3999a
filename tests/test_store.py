"""The SQLite store: schema, cache semantics, atomic writes, and `towerlab search show` text."""

import contextlib
import sqlite3
import subprocess
import sys

import pytest

from towerlab.config import SearchConfig
from towerlab.fields import to_dict
from towerlab.errors import UserError
from towerlab.search import Candidate, Outcome, format_search, genome_hash, load_space, run_search, serial
from towerlab.search.store.schema import SCHEMA_VERSION
from towerlab.search.store import Store

TCH = "tch"


def candidate(genome, generation=0, index=0):
    return Candidate(generation, index, genome, genome_hash(genome), 1234)


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "sub" / "search.db") as s:
        yield s


def new_search(store, seed=0):
    return store.records.begin_search("ga", to_dict(SearchConfig(sampler="ga", seed=seed)), load_space("mlp"), TCH)


def test_a_new_store_is_wal_with_foreign_keys_and_a_schema_version(store):
    db = sqlite3.connect(store.path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert store.db.raw.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert store.db.raw.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    with pytest.raises(sqlite3.IntegrityError):  # no evaluation without its search
        store.records.record(candidate({"a": 1}), Outcome.ok(0.5), TCH, search_id=99)


def test_the_stores_parts_see_only_the_backend_interface(store):
    """records and queue are parts over `database.Backend` alone: a test double that provides it (here one
    that counts what it is asked, over the store's own database) serves them as a backend does: what they
    write through it is the store's."""
    from towerlab.search.store.records import Records
    from towerlab.search.store.queue import TaskQueue

    class Counting:
        where = "a counting double"

        def __init__(self):
            self.reads = self.writes = 0

        def read(self, sql, args=()):
            self.reads += 1
            return store.db.read(sql, args)

        def write(self, work, *, lock=None):
            self.writes += 1
            return store.db.write(work, lock=lock)

        def open_schema(self, where, create, checked=False):
            store.db.open_schema(where, create, checked)

        def close(self):
            pass

    double = Counting()
    records, queue = Records(double, double.where), TaskQueue(double, double.where)
    sid = records.begin_search("ga", to_dict(SearchConfig(sampler="ga")), load_space("mlp"), TCH)
    assert double.writes == 1 and records.search(sid) == store.records.search(sid)
    assert queue.enqueue(sid, "train", [(candidate({"a": 1}), TCH)]) and double.writes == 2
    task = queue.claim("w", [sid], lease=30, max_attempts=3)
    assert task is not None and queue.complete(task, "w", Outcome.ok(0.5))[0]
    assert store.records.lookup(genome_hash({"a": 1}), TCH, sid).fitness == 0.5
    assert (double.reads, double.writes) == (1, 4)  # search(); begin, enqueue, claim, complete


def test_record_and_lookup(store):
    sid = new_search(store)
    genome = {"neurons": 64, "layers": 2}
    assert store.records.lookup(genome_hash(genome), TCH, sid) is None
    row = store.records.record(candidate(genome, 3, 7), Outcome.ok(0.91, val_loss=0.3, epochs=4, seconds=2.5,
                                                             worker="cuda:1"), TCH, sid)
    assert store.records.lookup(genome_hash(genome), TCH) == row == store.records.lookup(genome_hash(genome), TCH, sid)
    assert (row.genome, row.status, row.fitness, row.val_loss, row.epochs, row.seconds, row.worker) == \
        (genome, "ok", 0.91, 0.3, 4, 2.5, "cuda:1")
    assert (row.search_id, row.generation, row.index, row.seed, row.replicate) == (sid, 3, 7, 1234, 0)
    assert store.records.lookup(genome_hash(genome), "other config") is None
    # recording a key the search has already is a no-op that returns the row it has
    assert store.records.record(candidate(genome, 3, 7), Outcome.ok(0.5), TCH, sid) == row
    # another search (running at the same time) keeps its own row; the cache serves the oldest
    other = new_search(store, seed=1)
    mine = store.records.record(candidate(genome), Outcome.ok(0.5), TCH, other)
    assert mine.fitness == 0.5 and store.records.lookup(genome_hash(genome), TCH, other) == mine
    assert store.records.lookup(genome_hash(genome), TCH) == row == store.records.lookup(genome_hash(genome), TCH, other + 1)
    # a re-measure is a row of its own, served only as that replicate
    again = store.records.record(Candidate(3, -1, genome, genome_hash(genome), 99, None, 1), Outcome.ok(0.7), TCH, sid)
    assert store.records.lookup(genome_hash(genome), TCH, sid, replicate=1) == again != row
    assert store.records.lookup(genome_hash(genome), TCH, sid, replicate=2) is None


def test_an_evaluation_keeps_the_numerics_it_was_trained_with(store):
    sid = new_search(store)
    how = {"device": "AMD EPYC", "threads": 1, "precision": "fp32", "torch": "2.13.0"}
    row = store.records.record(candidate({"a": 1}), Outcome.ok(0.9, numerics=how), TCH, sid)
    assert row.numerics == how == store.records.lookup(genome_hash({"a": 1}), TCH).numerics
    assert store.records.record(candidate({"a": 2}), Outcome.ok(0.8), TCH, sid).numerics is None


def downgrade(path, version: int) -> None:
    """Make the store at `path` look as the towerlab of schema `version` (2 to 7) wrote it."""
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.executescript("ALTER TABLE evaluations DROP COLUMN continued; ALTER TABLE tasks DROP COLUMN starts")
        if version == 7:
            db.execute("PRAGMA user_version = 7")
            return
        db.executescript("ALTER TABLE searches DROP COLUMN leader; ALTER TABLE searches DROP COLUMN leader_until;"
                         "ALTER TABLE searches DROP COLUMN activity; ALTER TABLE generations DROP COLUMN proposed")
        if version <= 5:
            db.executescript("ALTER TABLE evaluations DROP COLUMN metrics; ALTER TABLE evaluations DROP COLUMN curve")
        if version <= 4:
            db.execute("ALTER TABLE evaluations DROP COLUMN provenance")
        if version <= 3:
            db.executescript("DROP TABLE tasks; DROP TABLE workers; DROP INDEX searches_token;"
                             "ALTER TABLE searches DROP COLUMN setup; ALTER TABLE searches DROP COLUMN token;"
                             "ALTER TABLE generations DROP COLUMN watermark")
        if version == 2:
            db.execute("ALTER TABLE evaluations DROP COLUMN numerics")
        db.execute(f"PRAGMA user_version = {version}")


def test_a_version_3_store_gains_the_queue_and_keeps_its_rows_and_searches(tmp_path):
    path = tmp_path / "search.db"
    with Store(path) as s:
        sid = new_search(s)
        s.records.begin_generation(sid, 0, [{"a": 1}], [genome_hash({"a": 1})])
        s.records.record(candidate({"a": 1}), Outcome.ok(0.9), TCH, sid)
    downgrade(path, 3)
    with Store(path) as s:
        assert s.records.search(sid).setup is None and s.records.generation(sid, 0).watermark is None
        assert s.records.lookup(genome_hash({"a": 1}), TCH).fitness == 0.9
        s.queue.enqueue(sid, "train", [(candidate({"b": 1}), TCH)])
        assert s.queue.claim("w", [sid], lease=30, max_attempts=3).candidate.genome == {"b": 1}
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8


def old_store(tmp_path, version: int) -> tuple:
    """A store of schema `version` (`downgrade`) holding one search and its row of genome {"a": 1}, fitness
    0.9: its path and the search's id."""
    path = tmp_path / "search.db"
    with Store(path) as s:
        sid = new_search(s)
        s.records.record(candidate({"a": 1}), Outcome.ok(0.9), TCH, sid)
    downgrade(path, version)
    return path, sid


def test_a_version_4_store_gains_provenance_and_keeps_its_rows(tmp_path):
    path, sid = old_store(tmp_path, 4)
    where = {"host": "a", "towerlab": "0.1.0", "torch": "2.13.0", "device": "cpu", "data": "sha256:1"}
    with Store(path) as s:
        assert (s.records.lookup(genome_hash({"a": 1}), TCH).fitness, s.records.lookup(genome_hash({"a": 1}), TCH).provenance) == (
            0.9, None)
        assert s.records.record(candidate({"b": 1}), Outcome.ok(0.5, provenance=where), TCH, sid).provenance == where
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8


def test_a_version_5_store_gains_metrics_and_keeps_its_rows(tmp_path):
    path, sid = old_store(tmp_path, 5)
    with Store(path) as s:
        old = s.records.lookup(genome_hash({"a": 1}), TCH)
        assert (old.fitness, old.metrics, old.curve) == (0.9, None, None)
        new = s.records.record(candidate({"b": 1}), Outcome.ok(-0.25, metrics={"loss": 0.25, "acc": None},
                                                               curve=[{"epoch": 1, "loss": 0.5}]), TCH, sid)
        assert (new.fitness, new.metrics, new.curve) == (-0.25, {"loss": 0.25, "acc": None}, [{"epoch": 1, "loss": 0.5}])
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8


def test_a_version_6_store_gains_its_leader_and_each_generation_s_inputs_and_keeps_its_rows(tmp_path):
    path, sid = old_store(tmp_path, 6)
    with Store(path) as s:
        assert s.records.lookup(genome_hash({"a": 1}), TCH).fitness == 0.9
        assert s.records.search(sid).leader is None and s.queue.leader(sid) is None
        assert s.queue.lead(sid, "w", 30) and s.queue.leader(sid) == "w" and not s.queue.lead(sid, "v", 30)
        row = s.records.begin_generation(sid, 0, [{"b": 1}], [genome_hash({"b": 1})], {"in_flight": []})
        assert row.proposed == {"in_flight": []}
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8


def test_a_version_7_store_gains_what_a_promotion_continues_and_charges_its_rows_whole(tmp_path):
    """Schema 8: a task says the epochs its training continues from, a row the epochs it did not train again
    (never more than its candidate could continue), and the epochs a search gave its trainings leave those out;
    a row written before is charged whole."""
    path, sid = old_store(tmp_path, 7)
    with Store(path) as s:
        assert s.records.lookup(genome_hash({"a": 1}), TCH).continued == 0
        promoted = Candidate(0, 1, {"b": 1}, genome_hash({"b": 1}), 1234, max_epochs=9, starts=3)
        s.queue.enqueue(sid, "train", [(promoted, "rung-9")])
        assert s.queue.claim("w", [sid], lease=30, max_attempts=3).candidate == promoted
        assert s.records.record(promoted, Outcome.ok(0.5, continued=3), "rung-9", sid).continued == 3
        too_much = Candidate(0, 2, {"c": 1}, genome_hash({"c": 1}), 1234, max_epochs=9, starts=3)
        assert s.records.record(too_much, Outcome.ok(0.5, continued=9), "rung-9", sid).continued == 3
        assert s.records.epochs_given(sid, 1, max_epochs=10) == 10 + (9 - 3) + (9 - 3)
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8


def test_a_version_2_store_gains_the_numerics_column_and_keeps_its_rows(tmp_path):
    path, sid = old_store(tmp_path, 2)
    with Store(path) as s:
        row = s.records.lookup(genome_hash({"a": 1}), TCH)
        assert (row.fitness, row.numerics) == (0.9, None)
        assert s.records.record(candidate({"b": 1}), Outcome.ok(0.5, numerics={"threads": 1}), TCH, sid).numerics == {
            "threads": 1}
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    db.close()


def test_failures_serve_only_the_search_that_made_them(store):
    first, second = new_search(store), new_search(store, seed=1)
    genome = {"neurons": 64}
    h = genome_hash(genome)
    failed = store.records.record(candidate(genome), Outcome.failed("CUDA out of memory"), TCH, first)
    assert store.records.lookup(h, TCH, first) == failed and failed.reason == "CUDA out of memory"
    assert store.records.lookup(h, TCH, second) is None and store.records.lookup(h, TCH) is None
    ok = store.records.record(candidate(genome), Outcome.ok(0.8), TCH, second)  # the later search retries
    assert store.records.lookup(h, TCH, second) == ok == store.records.lookup(h, TCH, 3)
    assert store.records.lookup(h, TCH, first) == failed  # the first search's history stays as it was


def test_test_accuracy_and_the_best_so_far(store):
    sid = new_search(store)
    genomes = [{"n": i} for i in range(4)]
    store.records.begin_generation(sid, 0, genomes, [genome_hash(g) for g in genomes])
    rows = [store.records.record(candidate(g), Outcome.ok(f), TCH, sid) for g, f in zip(genomes, [0.5, 0.9, 0.7, 0.9])]
    failed = store.records.record(candidate({"n": 9}), Outcome.failed("diverged"), TCH, sid)
    store.records.record(candidate({"n": 5}), Outcome.ok(0.99), "other", sid)
    top = store.records.search_top(sid, 3)
    assert [e.fitness for e in top] == [0.9, 0.9, 0.7] and top[0].genome_hash < top[1].genome_hash
    store.records.set_test_accuracy(rows[2].id, 0.68)
    assert store.records.lookup(genome_hash({"n": 2}), TCH).test_accuracy == 0.68
    with pytest.raises(KeyError):
        store.records.set_test_accuracy(failed.id, 0.1)


def test_a_write_interrupted_in_process_is_rolled_back(store):
    sid = new_search(store)
    def interrupted(tx):
        tx.run("UPDATE searches SET finished = 'x' WHERE id = ?", (sid,))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.db.write(interrupted)
    assert store.records.search(sid).finished is None
    store.records.finish_search(sid, {"evaluations": 0})  # the store still works
    assert store.records.search(sid).summary == {"evaluations": 0}


def test_a_process_killed_mid_transaction_leaves_no_row(tmp_path):
    path = tmp_path / "search.db"
    Store(path).close()
    code = ("import os, sys; from towerlab.search.store import Store; s = Store(sys.argv[1]);"
            "s.db.raw.execute('BEGIN IMMEDIATE');"
            "s.db.raw.execute(\"INSERT INTO searches (sampler, config, space, space_fingerprint, train_config_hash,"
            " created) VALUES ('grid', '{}', '{}', 'f', 't', 'now')\"); os._exit(9)")
    assert subprocess.run([sys.executable, "-c", code, str(path)]).returncode == 9
    with Store(path) as store:
        assert store.records.searches() == []


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "search.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(UserError, match=f"schema version {SCHEMA_VERSION + 1}, newer .* upgrade towerlab"):
        Store(path)


def test_missing_foreign_and_non_sqlite_files_are_refused(tmp_path):
    with pytest.raises(UserError, match="no search store at"):
        Store(tmp_path / "missing.db", create=False)
    with pytest.raises(UserError, match="no search store at"):
        format_search(tmp_path / "missing.db")
    text = tmp_path / "notes.db"
    text.write_text("these are not the tables you are looking for\n" * 100)
    with pytest.raises(UserError, match="not a towerlab search store"):
        Store(text)
    with pytest.raises(UserError, match="not a towerlab search store"):
        format_search(text)
    other = tmp_path / "other.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE photos (id INTEGER)")
    db.commit()
    db.close()
    with pytest.raises(UserError, match="SQLite file but not a towerlab search store"):
        Store(other)
    empty = tmp_path / "empty.db"
    empty.touch()
    with pytest.raises(UserError, match="holds no search yet: an empty database"):
        format_search(empty)
    assert empty.read_bytes() == b"" and text.read_text().startswith("these")  # refused files stay untouched


def test_format_search_shows_generations_counts_and_top(tmp_path):
    space = load_space("mlp")

    def fit(c):
        if c.genome["activation"] == "sigmoid":
            return Outcome.failed("diverged")
        return Outcome.ok(0.5 + c.genome["neurons"] / 4096 + c.genome["layers"] / 100, seconds=1.25)

    with Store(tmp_path / "search.db") as store:
        result = run_search(SearchConfig(sampler="ga", population=8, generations=3, top=3, remeasure=2), space, serial(fit),
                            store, TCH)
        best = result.top[0]
        store.records.set_test_accuracy(store.records.lookup(best.genome_hash, TCH).id, 0.8765)
        text = format_search(store)
    assert text == format_search(tmp_path) == format_search(tmp_path / "search.db")
    with Store(tmp_path) as again:  # a folder means its search.db
        assert again.path == tmp_path / "search.db" and len(again.records.searches()) == 1
    assert ("search 1: ga over space mlp (model mlp, 672 genomes), seed 0, population 8, 3 generations, "
            "the crowned re-measured with 2 more seeds") in text
    for gen in result.history:
        s = gen.stats
        assert (f"{gen.generation + 1:>4} {s.evaluated:>9} {s.cached:>7} {s.failed:>6} {s.best:>7.4f} "
                f"{s.mean:>7.4f} {s.worst:>7.4f}") in text
    assert (f"{result.evaluations} evaluations, {result.cache_hits} cache hits, "
            f"{result.failures} failures") in text
    genome = " ".join(f"{k}={v}" for k, v in best.genome.items())
    assert f"     1 {best.fitness:>8.4f} {best.spread:>7.4f}     3   0.8765  {genome}" in text


def test_format_search_says_one_generation(tmp_path):
    with Store(tmp_path / "search.db") as store:
        run_search(SearchConfig(sampler="random", population=3, generations=1, remeasure=0), load_space("mlp"),
                   serial(lambda c: Outcome.ok(0.5)), store, TCH)
        assert "population 3, 1 generation;" in format_search(store)


def test_format_search_shows_an_interrupted_generation(tmp_path):
    def crash(candidates, record):
        if candidates[0].generation == 1:
            record(candidates[0], Outcome.ok(0.5))
            raise KeyboardInterrupt
        for c in candidates:
            record(c, Outcome.ok(0.25))

    with Store(tmp_path / "search.db") as store, pytest.raises(KeyboardInterrupt):
        run_search(SearchConfig(sampler="ga", population=6, generations=3), load_space("mlp"), crash, store, TCH)
    text = format_search(tmp_path)
    assert "not finished, and no worker is at it (continue it with `towerlab search run --resume DIR`" in text
    assert "   2 incomplete: 1 evaluation(s) recorded of 6 members" in text


def test_show_gives_a_running_search_its_live_counts_and_no_resume_hint(tmp_path):
    """It printed "0 evaluations, 0 cache hits, 0 failures, 0.0 s" and "resume it with --resume" while the
    search's workers trained it."""
    with Store(tmp_path / "search.db") as store:
        sid = new_search(store)
        genomes = [{"a": i} for i in range(4)]
        store.records.begin_generation(sid, 0, genomes, [genome_hash(g) for g in genomes])
        store.queue.enqueue(sid, "train", [(candidate(g), TCH) for g in genomes])
        for worker, fitness in (("w1", 0.75), ("w2", None)):
            task = store.queue.claim(worker, [sid], lease=30, max_attempts=3)
            outcome = Outcome.ok(fitness, worker=worker) if fitness else Outcome.failed("diverged", worker=worker)
            store.queue.complete(task, worker, outcome)
        store.queue.claim("w3", [sid], lease=30, max_attempts=3)
        text = format_search(store)
    assert "running" in text and "--resume" not in text and "0 evaluations" not in text, text
    assert "so far: 2 training(s) done (1 failed), 1 in progress (w3), 1 waiting; best validation accuracy so far " \
           "0.7500" in text, text


def test_show_says_when_a_search_s_rows_come_from_more_than_one_provenance(tmp_path):
    here = {"host": "a", "towerlab": "0.1.0", "torch": "2.13.0", "code": "sha256:c0de", "device": "cpu",
            "data": "sha256:da7a"}
    with Store(tmp_path / "search.db") as store:
        sid = new_search(store)
        store.records.record(candidate({"a": 1}), Outcome.ok(0.5, provenance=here), TCH, sid)
        store.records.record(candidate({"a": 2}), Outcome.ok(0.5, provenance=here), TCH, sid)
        assert "provenance" not in format_search(store)  # one provenance: nothing to say
        store.records.record(candidate({"a": 3}), Outcome.ok(0.5, provenance={**here, "host": "b", "data": "sha256:bad"}),
                     TCH, sid)
        store.records.record(candidate({"a": 4}), Outcome.ok(0.5), TCH, sid)  # written before rows recorded it
        text = format_search(store)
    assert ("its rows come from 3 provenances, which differ in data, host: 2 from data da7a, host a; 1 from data "
            "bad, host b; 1 from no record of it (rows written before towerlab kept one, or failed when their workers "
            "were lost)") in text, text


def test_show_names_no_worker_as_training_a_task_another_worker_took_over(tmp_path):
    """Issue 65, defect 22: a worker killed with SIGKILL was shown training the member that another worker
    trained since its lease lapsed."""
    with Store(tmp_path / "search.db") as store:
        sid = new_search(store)
        store.records.begin_generation(sid, 0, [{"a": 1}], [genome_hash({"a": 1})])
        store.queue.enqueue(sid, "train", [(candidate({"a": 1}), TCH)])
        for worker in ("w1", "w2"):
            store.queue.join(worker, "host", 1, "cpu")
        store.queue.claim("w1", [sid], lease=-1, max_attempts=3)  # its lease lapsed at once: killed
        store.queue.claim("w2", [sid], lease=30, max_attempts=3)
        text = format_search(store)
    assert "  w1: holds no task (its last went to another worker)\n  w2: training search 1, generation 1, member 0" \
        in text, text


def test_a_worker_waiting_for_work_is_not_called_silent(tmp_path):
    """Defect 22: an idle `--wait` worker read as "silent for 144 s": only a claim told the store it lived."""
    from towerlab.search.work.worker import Worker, WorkerOptions

    class Enough(Exception):
        pass

    ages = []

    def check_stop():
        if not ages:  # idle for long already
            store.db.write(lambda tx: tx.run("UPDATE workers SET seen = seen - 144"))
        ages.append({w["id"]: w["age"] for w in store.queue.workers()})
        if len(ages) == 6:
            raise Enough

    with Store(tmp_path / "search.db") as store:
        worker = Worker(store, "w1", "cpu", lambda search: None, WorkerOptions(wait=True, lease=0.03,
                                                                              check_stop=check_stop))
        with pytest.raises(Enough):
            worker.run()
    assert ages[0]["w1"] >= 144 and ages[-1]["w1"] < 60, ages


def test_show_escapes_the_names_it_prints(tmp_path):
    """Defect 14: a worker's name and host (a host name is the machine's word) with a terminal's escape codes
    and a newline were printed raw by `search show`."""
    evil = "evil\x1b]0;owned\x07\nhost"
    here = {"host": evil, "towerlab": "0.1.0", "torch": "2.13.0", "code": "sha256:c0de", "device": "cpu"}
    with Store(tmp_path / "search.db") as store:
        sid = new_search(store)
        store.records.record(candidate({"a": 1}), Outcome.ok(0.5, provenance=here), TCH, sid)
        store.records.record(candidate({"a": 2}), Outcome.ok(0.5, provenance={**here, "host": "b"}), TCH, sid)
        store.records.begin_generation(sid, 1, [{"a": 3}], [genome_hash({"a": 3})])
        store.queue.enqueue(sid, "train", [(candidate({"a": 3}, generation=1), TCH)])
        store.queue.join(f"{evil}:1:cpu:t", evil, 1, "cpu")
        store.queue.claim(f"{evil}:1:cpu:t", [sid], lease=30, max_attempts=3)
        text = format_search(store)
    assert "\x1b" not in text and "\x07" not in text and "\nhost" not in text, text
    assert "1 in progress (evil\\x1b]0;owned\\x07\\nhost:1:cpu:t)" in text
    assert "  evil\\x1b]0;owned\\x07\\nhost:1:cpu:t: training search 1, generation 2, member 0" in text
    assert "1 from host evil\\x1b]0;owned\\x07\\nhost; 1 from host b" in text


def test_a_worker_s_lines_escape_its_name(tmp_path):
    """Defect 14: a worker's lines name it by its host's name, which was printed raw."""
    from towerlab.search.work.worker import Worker, WorkerOptions

    def refuse(search):
        raise UserError("not this one")

    with Store(tmp_path / "search.db") as store:
        new_search(store)
        worker = Worker(store, "evil\x1b[2J\nhost:1:cpu:t", "cpu", refuse, WorkerOptions(speaks=True))
        with pytest.raises(UserError) as refused:
            worker.run()
    assert str(refused.value).startswith("worker evil\\x1b[2J\\nhost:1:cpu:t joined no search of "), refused.value


def test_a_crew_worker_opens_the_store_without_reading_every_page_again(tmp_path):
    """`PRAGMA quick_check` reads the whole file (0.3 s at 100,000 trainings): the process that opens a store checks
    it; a crew's worker process, whose parent opened and checked it (`checked`), does not again."""
    from towerlab.search.store.sqlite import SQLite

    with Store(tmp_path / "search.db"):
        pass
    said: list[str] = []

    def traced(where):
        db = SQLite(where)
        db.raw.set_trace_callback(said.append)
        return db

    for checked in (False, True):
        said.clear()
        with Store(tmp_path / "search.db", create=False, backend=traced, checked=checked) as store:
            assert store.records.unfinished_searches() == []
        assert any("quick_check" in s for s in said) is not checked
