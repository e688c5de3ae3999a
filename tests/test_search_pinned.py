"""Every sampler's search is pinned to the exact history its store holds (tests/fixtures/pinned_histories.json):
one small search each of tpe, ga, grid and random, and a pruned one, on a fake fitness, played in one
process (`run_search` with a serial trainer) and by a worker through the queue (`worker.Worker`), must
store the very generations (members, results, statistics), evaluations (genome, seed, rung, replicate,
status, fitness and loss as stored) and summary that the fixture holds. A change to the search's code
that is meant to change no result (a refactoring) keeps this test passing unchanged.

The fixture was written by this file run as a script (`python tests/test_search_pinned.py`), before the
search package was reorganised (issue 58); its TPE case again when TPE's proposals became a function of
each generation's inputs (issue 72: a study built afresh for each, seeded from the generation's number),
under Optuna 5.1.0; its pruned case again when the pruner's judge came (issue 73: a rung is pruned at only
where the search's own earlier generations show it ranks as the last does, so its first generations train
every member to the end). TPE's proposals are Optuna's: its case runs under the Optuna version the fixture was
written with (CI installs it: constraints.txt), and says so where another is installed."""

from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path

import pytest

from towerlab.config import SearchConfig
from towerlab.search import Candidate, Outcome, Search, load_space, run_search, serial
from towerlab.search.work.worker import Worker, WorkerOptions
from towerlab.search.store import Store
from towerlab.upgrades import upgrade_search_config

FIXTURE = Path(__file__).parent / "fixtures" / "pinned_histories.json"
# Lists, an int range and a log float range; the sigmoid networks fail (a failure is part of a history).
SPACE = load_space(json.dumps({"model": "mlp", "genes": {
    "neurons": [16, 32, 64], "layers": {"low": 1, "high": 3}, "activation": ["relu", "tanh", "sigmoid"],
    "lr": {"low": 0.001, "high": 0.1, "log": True}}}))
GRID_SPACE = load_space(json.dumps({"model": "mlp", "genes": {
    "neurons": [16, 32, 64], "layers": {"low": 1, "high": 3}, "activation": ["relu", "tanh", "sigmoid"]}}))
SEARCHES = {
    "tpe": (SearchConfig(sampler="tpe", population=4, generations=4, max_epochs=3, remeasure=1, top=2, seed=4),
            SPACE),
    "ga": (SearchConfig(sampler="ga", population=6, generations=4, max_epochs=3, remeasure=1, top=2, seed=3,
                        elite=2), SPACE),
    "grid": (SearchConfig(sampler="grid", limit=12, max_epochs=3, remeasure=2, top=3, seed=6), GRID_SPACE),
    "random": (SearchConfig(sampler="random", population=5, generations=4, max_evaluations=17, max_epochs=3,
                            top=3, seed=5), SPACE),
    "ga-pruned": (SearchConfig(sampler="ga", population=8, generations=3, max_epochs=9, min_epochs=1,
                               prune_places="new", remeasure=1, top=2, seed=7, elite=2), SPACE),
}
TCH = "pinned-train-config"


def fitness(c: Candidate) -> Outcome:
    """Deterministic in the candidate (genome, seed, epochs), so the same whoever trains it. Its curve climbs
    by 0.01 an epoch to its result: it ranks as the last epoch does, and the pruner's judge prunes by it."""
    if c.genome["activation"] == "sigmoid":
        return Outcome.failed("loss became NaN", epochs=1, seconds=0.25)
    r = random.Random(f"{c.genome_hash}/{c.seed}/{c.max_epochs}")
    value, epochs = round(0.5 + 0.4 * r.random() + 0.01 * (c.max_epochs or 0), 6), c.max_epochs or 1
    return Outcome.ok(value, val_loss=round(r.random(), 6), epochs=epochs, seconds=0.125 * epochs,
                      curve=[{"epoch": e, "val_accuracy": round(value - 0.01 * (epochs - e), 6)}
                             for e in range(1, epochs + 1)])


def stored(store: Store, search_id: int) -> dict:
    """What a search's store holds of its history: its settings, every generation, every evaluation
    (sorted: workers write them in any order) and its summary, without clocks and workers' names."""
    row = store.records.search(search_id)
    assert row is not None and row.summary is not None, "the search finished"
    evaluations = sorted(
        [e.generation, e.index, e.replicate, e.max_epochs, e.genome_hash, e.genome, e.train_config_hash, e.seed,
         e.status, e.fitness, e.val_loss, e.epochs, e.seconds, e.reason] for e in store.records.evaluations(search_id))
    return {
        "config": row.config,
        "generations": [{"generation": g.generation, "members": g.members, "results": g.results,
                         "stats": {k: v for k, v in g.stats.items() if k != "seconds"}, "complete": g.complete}
                        for g in store.records.generations(search_id)],
        "evaluations": evaluations,
        "summary": {k: v for k, v in row.summary.items() if k != "seconds"},
    }


def in_one_process(path: Path, name: str) -> dict:
    cfg, space = SEARCHES[name]
    with Store(path) as store:
        result = run_search(cfg, space, serial(fitness), store, TCH)
        return stored(store, result.search_id)


def through_the_queue(path: Path, name: str) -> dict:
    cfg, space = SEARCHES[name]

    def trainer(search):
        def train(assignment):
            outcome = fitness(assignment.candidate)
            return dataclasses.replace(outcome, test_accuracy=0.75) if assignment.tests(outcome.fitness) else outcome
        return train

    with Store(path) as store:
        search_id = Search.resolve(cfg, space).create(store, TCH, {"test": True}).id
        Worker(store, "w", "cpu", trainer, WorkerOptions(search_ids=[search_id], lease=30.0)).run()
        return stored(store, search_id)


def _pinned() -> dict:
    return json.loads(FIXTURE.read_text())


def _pinned_search(name: str) -> dict:
    """The pinned search `name`, its settings as a store reads them today (settings added since the fixture
    was written, at the values it ran with: `upgrade_search_config`); its history as it was written."""
    pinned = _pinned()["searches"][name]
    return {**pinned, "config": upgrade_search_config(pinned["config"], pinned["config"]["sampler"])}


def _optuna_version() -> str:
    import optuna

    return optuna.__version__


def _skip_another_optuna(name: str) -> None:
    if name == "tpe" and _optuna_version() != _pinned()["optuna"]:
        pytest.skip(f"TPE's history is Optuna's: pinned under Optuna {_pinned()['optuna']}, "
                    f"this is {_optuna_version()}")


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_a_search_in_one_process_stores_its_pinned_history(tmp_path, name):
    _skip_another_optuna(name)
    assert in_one_process(tmp_path / "s.db", name) == _pinned_search(name)


@pytest.mark.parametrize("name", sorted(SEARCHES))
def test_a_search_through_the_queue_stores_its_pinned_history(tmp_path, name):
    _skip_another_optuna(name)
    assert through_the_queue(tmp_path / "s.db", name) == _pinned_search(name)


def test_the_pinned_histories_hold_what_they_pin():
    pinned = _pinned()["searches"]
    assert sorted(pinned) == sorted(SEARCHES)
    for name, history in pinned.items():
        stats = [g["stats"] for g in history["generations"]]
        assert all(g["complete"] for g in history["generations"]), name
        assert sum(s["failed"] for s in stats) > 0, f"{name}: a failure is part of the history"
        assert len(history["summary"]["top"]) == SEARCHES[name][0].top, name
    # re-measures, a pruned search's rungs, a budget that cuts a generation
    assert any(e[2] > 0 for e in pinned["ga"]["evaluations"])
    assert {e[3] for e in pinned["ga-pruned"]["evaluations"]} == {1, 3, 9}
    assert sum(g["stats"]["evaluated"] for g in pinned["random"]["generations"]) == 17


if __name__ == "__main__":  # writes the fixture (see the module's docstring)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        searches = {name: in_one_process(Path(folder) / f"{name}.db", name) for name in sorted(SEARCHES)}
    FIXTURE.write_text(json.dumps({"optuna": _optuna_version(), "searches": searches}, indent=1, sort_keys=True)
                       + "\n")
    print(f"wrote {FIXTURE}", file=sys.stderr)
