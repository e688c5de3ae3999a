"""`towerlab search export DIR --optuna URL`: a pruned, re-measured search over a typed space written as
an Optuna study, loaded back with Optuna and compared trial by trial with its store. Fake fitness."""

import math
import subprocess
import sys

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
        best = store.lookup(result.top[0].genome_hash, TCH, result.search_id)
        store.set_test_accuracy(best.id, 0.8125)
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
        rows = store.evaluations(result.search_id)
    evaluations = [e for e in rows if e.replicate == 0]
    trials = study.get_trials(deepcopy=False)
    assert [t.user_attrs["genome_hash"] for t in trials] == list(dict.fromkeys(
        m.genome_hash for g in result.history for m in g.members))
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
    code = "import towerlab.search.export, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
