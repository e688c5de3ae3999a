"""A pruned search without --population runs asynchronously (issues 72 and 73): one candidate a generation, each
rung decided as its result comes in, against the trainings at that rung of the generations complete before
the first one in flight when it was proposed (as its store records), so that a promotion never waits for a
generation and every process decides it alike. Fake trainings that report their learning curve, on Worker
threads and in one process."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time

import pytest

from towerlab.config import SearchConfig
from towerlab.search import Outcome, Search, Store, load_space, run_search, serial
from towerlab.search.history import rank_key
from towerlab.search.rounds import Rounds
from test_search_async import workers
from util import Ahead, Stopped

SPACE = load_space(json.dumps({"model": "objective", "genes": {"x": {"low": 0.0, "high": 1.0},
                                                                "y": {"low": 0.0, "high": 1.0}}}))
TCH = "async-pruned-train-config"


def accuracy(genome: dict, epoch: int) -> float:
    """Grows with the epochs, and ranks at every epoch as at the last: the judge prunes at rungs 1 and 3."""
    return (1 - (genome["x"] - 0.3) ** 2 - (genome["y"] - 0.7) ** 2) * (1 - 0.5 / epoch)


def fit(candidate) -> Outcome:
    epochs = candidate.max_epochs
    curve = [{"epoch": e, "val_accuracy": accuracy(candidate.genome, e)} for e in range(1, epochs + 1)]
    return Outcome.ok(accuracy(candidate.genome, epochs), epochs=epochs, seconds=0.01, curve=curve)


def cfg(sampler: str = "random", **changes) -> SearchConfig:
    return SearchConfig(**{"sampler": sampler, "max_evaluations": 40, "min_epochs": 1, "max_epochs": 9,
                           "prune_factor": 3, "remeasure": 0, "top": 2, "seed": 2, **changes})


def promotions_follow_the_recorded_peers(store: Store, search_id: int) -> tuple[int, int]:
    """Check every rung the search decided against the rule, from what its store records alone; return how
    many trainings below the last rung went on, and how many stopped there."""
    generations = store.records.generations(search_id)
    assert all(len(g.members) == 1 and g.proposed is not None for g in generations)
    before = {g.generation: min([*g.proposed["in_flight"], g.generation]) for g in generations}
    rows = [r for r in store.records.evaluations(search_id) if r.replicate == 0]
    went_on = stopped = 0
    for row in rows:
        if row.max_epochs == 9:
            continue
        peers = [p for p in rows if p.generation < before[row.generation] and p.max_epochs == row.max_epochs
                 and p.status == "ok"]
        ranked = sorted([*peers, row], key=lambda r: rank_key(r.genome, r.fitness))
        promoted = ranked.index(row) < math.ceil(len(ranked) / 3)
        on = any(r.generation == row.generation and r.max_epochs > row.max_epochs for r in rows)
        assert on == promoted, (row.generation, row.max_epochs, ranked.index(row), len(ranked))
        went_on, stopped = went_on + on, stopped + (not on)
    return went_on, stopped


def test_a_pruned_default_search_keeps_every_worker_busy_and_promotes_as_results_come_in(tmp_path):
    """Six workers train up to six candidates at once (in generations of 2, a pruned default search kept at
    most 4 trainings of first rungs going, and each rung's promotions waited for its generation), and every
    promotion is the rule's on the recorded inputs: its rank among the trainings at its rung of the
    generations complete before it, the best third going on."""
    search = Search.resolve(cfg(), SPACE)
    assert search.asynchronous and search.shape.population == 1
    with Store(tmp_path / "s.db") as store:
        search = search.create(store, TCH, {"test": False})
    lock, running, most = threading.Lock(), [0], [0]

    def trainer(_search):
        def train(assignment):
            with lock:
                running[0] += 1
                most[0] = max(most[0], running[0])
            time.sleep(0.2 + 0.05 * (assignment.candidate.seed % 3))  # results come back out of order
            with lock:
                running[0] -= 1
            return fit(assignment.candidate)
        return train

    workers(tmp_path / "s.db", search.id, [f"w{i}" for i in range(6)], trainer)
    assert most[0] >= 5
    with Store(tmp_path / "s.db") as store:
        assert store.records.search(search.id).finished is not None
        assert len(store.records.generations(search.id)) == 40
        assert max(len(g.proposed["in_flight"]) for g in store.records.generations(search.id)) >= 4
        went_on, stopped = promotions_follow_the_recorded_peers(store, search.id)
    assert went_on > 0 and stopped > 0  # the first ones, judged on nothing yet, train to the end; later, pruned


def test_in_one_process_the_model_told_of_its_pruned_candidates_proposes_better_ones(tmp_path):
    """Nothing in flight: each generation is proposed from all those before it. The Gaussian process reads complete
    trials alone: told a pruned candidate as complete at its score at its rung, its later proposals go on to the last
    rung (told nothing of them, 2 of this search's 30 model proposals did: the others proposed beside pruned
    ones, and were pruned in turn). Trainings that report no curve: the judge probes the rungs first."""
    def scored(candidate):
        return dataclasses.replace(fit(candidate), curve=None)

    with Store(tmp_path / "s.db") as store:
        result = run_search(cfg("gp", seed=1), SPACE, serial(scored), store, TCH)
        assert result.evaluations == 40
        generations = store.records.generations(result.search_id)
    assert all(g.proposed["in_flight"] == [] and len(g.members) == 1 for g in generations)
    last = {g.generation: g.final_results[0]["fitness"] for g in generations if g.final_results[0]["rung"] == 2}
    assert sum(g >= 10 for g in last) >= 15 and max(last.values()) >= 0.94


def test_a_resumed_climb_queues_the_next_rung_its_stopped_process_had_decided(tmp_path):
    """A process stops once a candidate's first rung is recorded and promoted, before its next rung is queued
    (the window is the leader's whole look at the store, not a moment): whoever plays the search next queues
    that rung as it begins the generation, continuing from the first (it waited for a training nobody would
    ever start)."""
    def stopping(candidate):
        if candidate.max_epochs == 3 and candidate.generation >= 10:
            raise Stopped(candidate.generation)
        return fit(candidate)

    search = Search.resolve(cfg(max_evaluations=30), SPACE)
    with Store(tmp_path / "s.db") as store:
        search = search.create(store, TCH, {"test": False})
        with pytest.raises(Stopped) as stopped:
            search.run(store, serial(stopping))
        stopped_at = stopped.value.args[0]
        ahead = Ahead()
        rounds = Rounds(store, search.id, search.cfg, search.ladder, ahead, search.goal, asynchronous=True)
        for g in range(stopped_at + 1):
            rounds.begin(g, [])
    assert [(c.generation, c.max_epochs, c.starts) for c in ahead.queued] == [(stopped_at, 3, 1)]
