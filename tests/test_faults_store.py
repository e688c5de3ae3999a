"""The search store under sharing and damage (issue 10, points 8 and 9): two searches on one store
at once, and two processes continuing one search at once, lose nothing and collide nowhere; a
damaged search.db is one line and exit status 2, naming the file and what to do."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from towerlab.cli import main
from towerlab.config import SearchConfig
from towerlab.search import Outcome, Store, load_space, run_search, serial

from util import SEARCH_BASE, run_cli, small_space_file

TCH = "tch"
SPACE = load_space("mlp")


def fitness(candidate):
    if candidate.genome["activation"] == "sigmoid":
        return Outcome.failed("diverged")
    return Outcome.ok(int(candidate.genome_hash[:8], 16) / 16**8 + (candidate.seed % 100) / 1e4, seconds=0.1)


def meeting(barrier: threading.Barrier):
    """An evaluator that trains its first batch only once the other search has looked its batch up
    too: both then train the same genomes and record them one after the other."""
    first = []

    def evaluate(candidates, record):
        if not first:
            first.append(True)
            barrier.wait(timeout=30)
        serial(fitness)(candidates, record)

    return evaluate


def in_threads(*jobs):
    results, errors = [None] * len(jobs), []

    def run(i, job):
        try:
            results[i] = job()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def search(path, cfg, evaluate=None, **kw):
    with Store(path) as store:
        return run_search(cfg, SPACE, evaluate or serial(fitness), store, TCH, **kw)


def test_two_searches_on_one_store_at_once_each_keep_what_they_trained(tmp_path):
    cfg = SearchConfig(sampler="ga", population=8, generations=1, remeasure=0, seed=2)
    alone = search(tmp_path / "alone.db", cfg)
    barrier = threading.Barrier(2)
    shared = tmp_path / "shared.db"
    Store(shared).close()
    # both look their generation up before either records: both train the same 8 genomes and record
    # them one after the other (before: sqlite3.IntegrityError, and the second's training was lost)
    a, b = in_threads(*[lambda: search(shared, cfg, meeting(barrier))] * 2)
    assert a == b == alone and {a.search_id, b.search_id} == {1, 2}
    with Store(shared) as store:
        rows = store.records.evaluations()
        assert len(rows) == 2 * alone.trainings == 16 and len(store.records.evaluations(1)) == 8
        later = run_search(cfg, SPACE, serial(fitness), store, TCH)  # a third search: served the oldest rows
    assert later.evaluations == later.failures == alone.failures == 1  # only the failure is retried
    assert [(m.genome, m.fitness) for m in later.history[0].members] == \
        [(m.genome, m.fitness) for m in alone.history[0].members]


def test_two_processes_continuing_one_search_at_once_agree_and_lose_nothing(tmp_path):
    CFG = SearchConfig(sampler="ga", population=8, generations=3, remeasure=1, seed=2)
    reference = search(tmp_path / "ref.db", CFG)

    def crash(candidates, record):
        if candidates[0].generation == 1:
            raise KeyboardInterrupt
        serial(fitness)(candidates, record)

    with pytest.raises(KeyboardInterrupt):
        search(tmp_path / "s.db", CFG, crash)
    barrier = threading.Barrier(2)
    one, two = in_threads(*[lambda: search(tmp_path / "s.db", CFG, meeting(barrier), resume=True)] * 2)
    assert one == two == reference
    with Store(tmp_path / "s.db") as store:  # one row per key: the second recording of each was a no-op
        assert len(store.records.evaluations()) == reference.trainings
        assert store.records.searches()[0].finished


# ------------------------------------------------------------------------- the command line

BASE = SEARCH_BASE


@pytest.fixture()
def space_file(tmp_path):
    return small_space_file(tmp_path)


@pytest.mark.slow
def test_two_grid_jobs_sharing_a_store_at_once_both_succeed(tmp_path, space_file):
    store = tmp_path / "shared.db"
    args = [sys.executable, "-m", "towerlab", "grid", *BASE, "--space", space_file, "--store", str(store),
            "--remeasure", "0"]
    jobs = [subprocess.Popen([*args, "--out", str(tmp_path / name)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for name in ("a", "b")]
    outputs = [job.communicate(timeout=300) for job in jobs]
    for job, (out, err) in zip(jobs, outputs):
        assert job.returncode == 0 and "Traceback" not in err, err
    summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("a", "b")]
    assert all(s["evaluations"] + s["cache_hits"] == 12 for s in summaries)
    with Store(store) as db:
        rows = db.records.evaluations()
    assert len(rows) == sum(s["evaluations"] for s in summaries)  # every training kept


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) >= 4 * page
    if how == "zeroed page":
        data[2 * page:3 * page] = bytes(page)
    else:
        data[3 * page:3 * page + 500] = os.urandom(500)  # a page header and its cell pointers
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def finished_search(tmp_path_factory):
    folder = tmp_path_factory.mktemp("search")
    out = folder / "evo"
    assert main(["evolve", *BASE, "--space", small_space_file(folder), "--population", "6", "--generations", "3",
                 "--out", str(out)]) == 0
    with sqlite3.connect(out / "search.db") as db:
        assert db.execute("PRAGMA page_count").fetchone()[0] >= 4
    return out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["zeroed page", "random bytes"])
def test_a_damaged_store_is_one_line_naming_the_file(tmp_path, finished_search, how):
    out = tmp_path / "evo"
    out.mkdir()
    for name in ("config.json", "search.db"):
        (out / name).write_bytes((finished_search / name).read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["store"] = str(out / "search.db")
    (out / "config.json").write_text(json.dumps(config))
    damage(out / "search.db", how)
    for args in (["evolve", "--resume", str(out)], ["search", "show", str(out)], ["search", "show", str(out), "--csv"]):
        done = run_cli(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
        assert f"search store {out / 'search.db'} is damaged" in done.stderr
        assert "restore it from a copy" in done.stderr and ".recover" in done.stderr


@pytest.mark.parametrize("edit, fragment", [
    ("UPDATE searches SET config = '[]'", "search 1's settings are a list"),
    ("UPDATE searches SET config = json_remove(config, '$.max_epochs')", "search 1: it lacks max_epochs"),
    ("UPDATE searches SET space = '\"x\"'", "search 1: str, not an object"),
    ("UPDATE searches SET summary = '{\"top\": [3]}'", "search 1's summary: item 0: int, not an object"),
    ("UPDATE generations SET stats = '[]'", "generation 1 of search 1: list, not an object"),
    ("UPDATE evaluations SET genome = '[1]'", "evaluation 1: its genome or numerics are not an object"),
])
def test_valid_json_of_the_wrong_form_in_a_store_is_one_line(edit, fragment, tmp_path, finished_search, capsys):
    """issue 50: a store holding valid JSON of another form than towerlab writes (an edited store) made
    `search show` and `search export` end in a TypeError, KeyError or AttributeError traceback."""
    optuna = pytest.importorskip("optuna")
    store = tmp_path / "search.db"
    store.write_bytes((finished_search / "search.db").read_bytes())
    with sqlite3.connect(store) as db:
        db.execute(edit)
    commands = [["search", "show", str(store)], ["search", "show", str(store), "--csv"],
                ["search", "export", str(store), "--optuna", f"sqlite:///{tmp_path / 'study.db'}"]]
    statuses = []
    for args in commands:
        statuses.append(main(args))
        err = capsys.readouterr().err
        if statuses[-1] != 0:  # (a command that never reads the edited record succeeds)
            assert statuses[-1] == 2 and err.count("\n") == 1, err
            assert f"search store {store} holds a record of the wrong form ({fragment}" in err
    assert 2 in statuses and (tmp_path / "study.db").exists() == (statuses[-1] == 0)
    assert optuna is not None
