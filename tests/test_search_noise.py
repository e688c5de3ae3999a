"""Noise-aware crowning: the elite and the final top are re-measured with fresh seeds and ranked
by their mean, recorded as re-measures in the store, replayed exactly on resume. Fake fitness."""

from collections import Counter

import numpy as np
import pytest

from towerlab.config import SearchConfig
from towerlab.search import Outcome, Store, load_space, rank_key, remeasure_seed, run_search, serial

TCH = "tch"


def noisy(candidate):
    """A small signal in the genome under a large seed noise: one seed can make any genome look best."""
    g = candidate.genome
    signal = g["neurons"] / 1024 / 50 + (g["activation"] == "relu") / 100
    noise = np.random.default_rng(candidate.seed).random() / 10
    return Outcome.ok(0.8 + signal + noise, epochs=1, seconds=1.0)


class Counting:
    def __init__(self, fitness=noisy):
        self.fitness, self.calls = fitness, Counter()

    def __call__(self, candidate):
        self.calls[candidate.genome_hash, candidate.replicate] += 1
        return self.fitness(candidate)


def GA(**settings):
    return SearchConfig(**{"sampler": "ga", "population": 8, "generations": 5, "remeasure": 2, "seed": 3,
                           **settings})


def search(path, cfg=None, fitness=None, evaluate=None, **kw):
    with Store(path) as store:
        return run_search(cfg or GA(), load_space("mlp"), evaluate or serial(fitness or Counting()), store, TCH, **kw)


def test_the_elite_is_re_measured_and_kept_by_its_mean(tmp_path):
    fitness = Counting()
    result = search(tmp_path / "s.db", fitness=fitness)
    with Store(tmp_path / "s.db") as store:
        rows = store.records.evaluations(result.search_id)
    again = {}
    for row in rows:
        if row.replicate:
            again.setdefault(row.genome_hash, []).append(row)
            assert row.seed == remeasure_seed(row.genome_hash, row.replicate) and row.index == -1
    assert all(len(r) == 2 for r in again.values())
    for before, after in zip(result.history, result.history[1:]):
        # the elite (elite=1) the next generation keeps is the best of this one by score, and re-measured
        best = min(before.members, key=lambda m: rank_key(m.genome, m.score))
        assert after.members[0].genome_hash == best.genome_hash in again
        assert best.score == pytest.approx((best.fitness + sum(r.fitness for r in again[best.genome_hash])) / 3)
    # each network is measured once per seed, and only the crowned ones more than once
    assert max(fitness.calls.values()) == 1
    assert result.trainings == len(rows) == result.evaluations + 2 * len(again)


def test_the_final_top_ranks_by_the_mean_and_reports_every_seed(tmp_path):
    result = search(tmp_path / "s.db", GA(top=4))
    assert len(result.top) == 4
    for t in result.top:
        assert len(t.fitnesses) == len(t.seeds) == 3 and len(set(t.seeds)) == 3
        assert t.fitness == pytest.approx(sum(t.fitnesses) / 3) and t.spread > 0
        assert t.seeds[1:] == (remeasure_seed(t.genome_hash, 1), remeasure_seed(t.genome_hash, 2))
    assert [t.fitness for t in result.top] == sorted((t.fitness for t in result.top), reverse=True)
    # a genome crowned by one lucky seed is not crowned by three
    single = max((m for g in result.history for m in g.members), key=lambda m: m.fitness)
    assert single.fitness > result.top[0].fitness
    with Store(tmp_path / "s.db") as store:
        summary = store.records.searches()[0].summary["top"]
    assert [e["fitnesses"] for e in summary] == [list(t.fitnesses) for t in result.top]


def test_without_re_measuring_nothing_is_trained_twice_and_the_top_is_measured_once(tmp_path):
    fitness = Counting()
    result = search(tmp_path / "s.db", GA(remeasure=0), fitness=fitness)
    assert result.trainings == result.evaluations == sum(fitness.calls.values())
    assert all(t.fitnesses == (t.fitness,) and t.spread is None for t in result.top)


def test_a_failed_re_measure_makes_the_network_rank_as_failed(tmp_path):
    def fragile(candidate):
        if candidate.replicate == 2 and candidate.genome["activation"] == "relu":
            return Outcome.failed("diverged with another seed")
        return noisy(candidate)

    result = search(tmp_path / "s.db", GA(top=6), fitness=Counting(fragile))
    assert result.top and all(t.genome["activation"] != "relu" for t in result.top)
    assert any(m.genome["activation"] == "relu" and m.ok for g in result.history for m in g.members)


@pytest.mark.parametrize("crash_at", [1, 3, 5])
def test_a_search_killed_while_re_measuring_resumes_to_the_same_result(tmp_path, crash_at):
    reference = search(tmp_path / "ref.db")
    fitness = Counting()
    remeasures = []

    def crashing(candidates, record):
        for c in candidates:
            if c.replicate:
                if len(remeasures) == crash_at:
                    raise KeyboardInterrupt
                remeasures.append(c)
            record(c, fitness(c))

    with pytest.raises(KeyboardInterrupt):
        search(tmp_path / "s.db", evaluate=crashing)
    resumed = search(tmp_path / "s.db", fitness=fitness, resume=True)
    assert resumed == reference
    assert max(fitness.calls.values()) == 1  # what was recorded before the kill was not trained again


def test_a_later_search_is_served_the_re_measures_of_an_earlier_one(tmp_path):
    first = search(tmp_path / "s.db")
    fitness = Counting()
    second = search(tmp_path / "s.db", fitness=fitness)  # the same settings: everything is in the store
    assert not fitness.calls and second.search_id != first.search_id
    assert [(t.genome, t.fitnesses, t.seeds) for t in second.top] == [(t.genome, t.fitnesses, t.seeds) for t in first.top]
