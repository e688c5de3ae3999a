"""`towerlab search export DIR --optuna URL`: a pruned, re-measured search over a typed space written as
an Optuna study, loaded back with Optuna and compared trial by trial with its store. Fake fitness."""

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest

from towerlab.cli import main
from towerlab.config import SearchConfig
from towerlab.search import Outcome, Store, load_space, run_search, serial

optuna = pytest.importorskip("optuna")

SPACE = ('{"model": "mlp", "genes": {"neurons": {"low": 8, "high": 512, "log": true}, '
         '"lr": {"low": 1e-4, "high": 0.1, "log": true}, "activation": ["relu", "tanh", "sigmoid"]}}')
CFG = SearchConfig(space=SPACE, sampler="tpe", population=4, generations=3, min_epochs=1, max_epochs=9,
                   remeasure=2, top=2, seed=3)
TCH = "export-train-config"
pytestmark = pytest.mark.usefixtures("every_rung_ranks")  # pruned at every rung from the first generation


def fitness(candidate):
    g = candidate.genome
    if g["activation"] == "sigmoid":
        return Outcome.failed("loss became NaN", epochs=1, seconds=0.5)
    learned = 1 - math.exp(-candidate.max_epochs / 3)
    return Outcome.ok(learned * (0.6 + math.log(g["neurons"]) / 30 - abs(math.log10(g["lr"]) + 2.5) / 20)
                      + (candidate.seed % 100) / 1e4, val_loss=0.5, epochs=candidate.max_epochs, seconds=0.1)


@pytest.fixture
def searched(tmp_path):
    folder = tmp_path / "my-search"
    with Store(folder) as store:
        result = run_search(CFG, load_space(SPACE), serial(fitness), store, TCH)
        best = store.records.lookup(result.top[0].genome_hash, TCH, result.search_id)
        store.records.set_test_accuracy(best.id, 0.8125)
    return folder, result


def test_the_exported_study_holds_every_genome_as_the_store_does(tmp_path, searched, capsys):
    folder, result = searched
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert main(["search", "export", str(folder), "--optuna", url]) == 0
    assert capsys.readouterr().out.startswith("study my-search: ")

    study = optuna.load_study(study_name="my-search", storage=url)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    assert study.user_attrs["towerlab_search"]["sampler"] == "tpe"
    with Store(folder) as store:
        rows = store.records.evaluations(result.search_id)
    evaluations = [e for e in rows if e.replicate == 0]
    trials = study.get_trials(deepcopy=False)
    assert [t.user_attrs["genome_hash"] for t in trials] == list(dict.fromkeys(
        m.genome_hash for g in result.history for m in g.members))
    # numbered from 1, as the console and `search show --csv` number them (it was 0)
    assert [t.user_attrs["generation"] for t in trials] == [next(
        g.stats.generation + 1 for g in result.history if t.user_attrs["genome_hash"] in
        {m.genome_hash for m in g.members}) for t in trials] and trials[0].user_attrs["generation"] == 1
    assert {t.user_attrs["genome_hash"] for t in trials} == {e.genome_hash for e in evaluations}
    states = {s: sum(t.state == s for t in trials) for s in optuna.trial.TrialState}
    ts = optuna.trial.TrialState
    assert states[ts.COMPLETE] >= 1 and states[ts.PRUNED] >= 1 and states[ts.FAIL] >= 1  # the fixture covers all
    for trial in trials:
        h = trial.user_attrs["genome_hash"]
        mine = sorted((e for e in evaluations if e.genome_hash == h), key=lambda e: e.max_epochs)
        top = mine[-1]
        assert trial.params == top.genome  # floats bit for bit: == on floats is exact
        assert all(type(trial.params[k]) is type(v) for k, v in top.genome.items())
        assert trial.distributions == {"neurons": optuna.distributions.IntDistribution(8, 512, log=True),
                                       "lr": optuna.distributions.FloatDistribution(1e-4, 0.1, log=True),
                                       "activation": optuna.distributions.CategoricalDistribution(
                                           ("relu", "tanh", "sigmoid"))}
        assert trial.intermediate_values == {e.max_epochs: e.fitness for e in mine if e.status == "ok"}
        if top.status != "ok":
            assert trial.state == ts.FAIL and trial.value is None and trial.user_attrs["reason"] == top.reason
            continue
        assert trial.value == top.fitness
        assert trial.state == (ts.COMPLETE if top.max_epochs == 9 else ts.PRUNED)
        again = sorted((e for e in rows if e.genome_hash == h and e.replicate > 0 and e.max_epochs == top.max_epochs),
                       key=lambda e: e.replicate)
        assert trial.user_attrs["seeds"] == [top.seed] + [e.seed for e in again]
        assert trial.user_attrs["val_accuracies"] == [top.fitness] + [e.fitness for e in again]
        assert trial.user_attrs.get("test_accuracy") == top.test_accuracy
    crowned = [t for t in trials if t.user_attrs["genome_hash"] == result.top[0].genome_hash][0]
    assert crowned.user_attrs["test_accuracy"] == 0.8125 and len(crowned.user_attrs["seeds"]) == 3
    best = max((t for t in trials if t.state == ts.COMPLETE), key=lambda t: t.value)
    assert best.value == study.best_value


def test_export_refuses_a_taken_study_name_and_a_bad_storage_in_one_line(tmp_path, searched, capsys):
    folder, _ = searched
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert main(["search", "export", str(folder), "--optuna", url]) == 0
    capsys.readouterr()
    assert main(["search", "export", str(folder), "--optuna", url]) == 2
    err = capsys.readouterr().err
    assert "already holds a study 'my-search': pass another --study-name" in err and err.count("\n") == 1
    assert len(optuna.load_study(study_name="my-search", storage=url).trials) > 0
    assert main(["search", "export", str(folder), "--optuna", url, "--study-name", "again"]) == 0
    assert capsys.readouterr().out.startswith("study again: ")
    assert main(["search", "export", str(folder), "--optuna", "nosuchdb://x"]) == 2
    err = capsys.readouterr().err
    assert "cannot open the Optuna storage 'nosuchdb://x'" in err and err.count("\n") == 1
    assert main(["search", "export", str(tmp_path / "none"), "--optuna", url]) == 2
    assert "no search store at" in capsys.readouterr().err


def test_the_export_never_imports_torch():
    code = "import towerlab.search.views.export, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///", "sqlite:///:memory:", "sqlite:///file:x?mode=memory&uri=true"])
def test_an_export_into_memory_is_refused_as_it_saves_nothing(url, searched, capsys):
    """issue 50: these reported success, and the study was gone with the process."""
    folder, _ = searched
    assert main(["search", "export", str(folder), "--optuna", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--optuna {url}: an SQLite database in memory is gone when the export ends" in err


def test_an_export_into_its_own_store_or_a_pipe_is_refused_before_anything_is_written(tmp_path, searched, capsys):
    """issue 50: `--optuna sqlite:///S/search.db` wrote Optuna's tables into the store it was reading."""
    import os

    store, _ = searched  # (the store's file itself)
    kept = store.read_bytes()
    os.symlink(store, tmp_path / "alias.db")
    for url in (f"sqlite:///{store}", f"sqlite:///{tmp_path / 'alias.db'}"):
        assert main(["search", "export", str(store), "--optuna", url]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is the search store this command reads" in err
    assert store.read_bytes() == kept
    folder = store
    os.mkfifo(tmp_path / "pipe.db")
    assert main(["search", "export", str(folder), "--optuna", f"sqlite:///{tmp_path / 'pipe.db'}"]) == 2
    assert "is not a regular file" in capsys.readouterr().err and (tmp_path / "pipe.db").is_fifo()


def test_an_export_that_fails_midway_leaves_nothing_and_a_retry_succeeds(tmp_path, searched, capsys, monkeypatch):
    """issue 50: on a full disk the export was a traceback, and the empty study it had begun made a retry
    say the storage "already holds a study"."""
    import sqlite3

    folder, _ = searched
    url = f"sqlite:///{tmp_path / 'study.db'}"
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    optuna.create_study(storage=shared, study_name="someone-elses")
    real = optuna.study.Study.add_trials

    def full(self, trials):
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as exc:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from exc

    monkeypatch.setattr(optuna.study.Study, "add_trials", full)
    for target in (url, shared):
        assert main(["search", "export", str(folder), "--optuna", target]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "could not write the studies to the Optuna storage" in err
        assert "OperationalError: database or disk is full; nothing was written" in err
    assert not (tmp_path / "study.db").exists()  # the file it made is gone
    assert [s.study_name for s in optuna.get_all_study_summaries(shared)] == ["someone-elses"]
    monkeypatch.setattr(optuna.study.Study, "add_trials", real)
    for target in (url, shared):
        assert main(["search", "export", str(folder), "--optuna", target]) == 0
        assert capsys.readouterr().out.startswith("study my-search: ")


@pytest.mark.slow
def test_a_real_full_disk_under_an_export_leaves_no_file(tmp_path, searched):
    folder, _ = searched
    empty = tmp_path / "empty.db"
    optuna.storages.get_storage(f"sqlite:///{empty}")  # the tables alone: a little less than the export needs
    limit = empty.stat().st_size + 1024
    code = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            "from towerlab.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    done = subprocess.run([sys.executable, "-c", code, "search", "export", str(folder), "--optuna",
                           f"sqlite:///{tmp_path / 'study.db'}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert not list(tmp_path.glob("study.db*"))


def test_an_export_from_a_folder_whose_name_is_not_utf8(tmp_path, capsys):
    """issue 50: the default study name (the folder's) held bytes that are no UTF-8: a traceback."""
    import os

    folder = Path(os.fsdecode(bytes(tmp_path) + b"/s\xff"))
    with Store(folder) as store:
        run_search(CFG, load_space(SPACE), serial(fitness), store, TCH)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    assert main(["search", "export", str(folder), "--optuna", url]) == 0
    assert capsys.readouterr().out.startswith("study s\ufffd: ")
    assert [s.study_name for s in optuna.get_all_study_summaries(url)] == ["s\ufffd"]


def test_follow_keeps_a_study_in_step_with_a_running_search(tmp_path, monkeypatch):
    """--follow, as optuna-dashboard reads it: the study gets each generation's genomes as it completes,
    and ends with the trials an export of the finished search makes (params, values, states), its
    progress and its crowned top in the study's attributes."""
    import threading
    import time

    from towerlab.search import Search
    from towerlab.search.views import export as export_module
    from towerlab.search.views.export import export_optuna
    from towerlab.search.work.worker import Worker, WorkerOptions

    monkeypatch.setattr(export_module, "FOLLOW_EVERY", 0.05)
    cfg = SearchConfig(space=SPACE, sampler="random", population=4, generations=4, max_epochs=3, remeasure=0, top=2,
                       seed=5)
    path = tmp_path / "search.db"
    with Store(path) as store:
        search_id = Search.resolve(cfg, load_space(SPACE)).create(store, TCH, {"test": True}).id

    def slow(search):
        def train(assignment):
            time.sleep(0.05)
            outcome = fitness(assignment.candidate)
            return dataclasses.replace(outcome, test_accuracy=0.75) if assignment.tests(outcome.fitness) else outcome
        return train

    def work():
        with Store(path) as store:
            Worker(store, "w", "cpu", slow, WorkerOptions(search_ids=[search_id])).run()

    looks = []
    worker = threading.Thread(target=work)
    with Store(path) as store:
        worker.start()
        export_optuna(store, f"sqlite:///{tmp_path / 'followed.db'}", "live", follow=looks.append)
        worker.join()
        export_optuna(store, f"sqlite:///{tmp_path / 'after.db'}", "after")
    assert len(looks) >= 2  # the first export, then at least one look that added trials
    followed = optuna.load_study(study_name="live", storage=f"sqlite:///{tmp_path / 'followed.db'}")
    after = optuna.load_study(study_name="after", storage=f"sqlite:///{tmp_path / 'after.db'}")

    def key(trials):
        return sorted((sorted(t.params.items()), t.value, t.state.name) for t in trials)

    assert len(followed.trials) == 16 and key(followed.trials) == key(after.trials)
    assert followed.user_attrs["towerlab_progress"]["generations_complete"] == 4
    assert followed.user_attrs["towerlab_progress"]["finished"] is not None
    assert [t["test_accuracy"] for t in followed.user_attrs["towerlab_top"]] == [0.75, 0.75]
