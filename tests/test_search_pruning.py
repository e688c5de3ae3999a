"""Early pruning (successive halving per generation): every candidate trains the first rung, the
best 1/prune_factor go on, up to --max-epochs; each rung is stored and replayed exactly; the last
rung's rows are an unpruned search's. Fake fitness that improves with the epochs trained. The judge
takes every rung as shown to rank here (`every_rung_ranks`): these are the rungs' mechanics, and
tests/test_search_judge.py tests which rungs the judge uses."""

import json
import math
import sqlite3
from collections import Counter

import pytest

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search import (Outcome, Store, SuccessiveHalving, format_search, genome_hash, load_space, rank_key,
                             rung_epochs, rung_hash, run_search, serial)

TCH = "tch"
pytestmark = pytest.mark.usefixtures("every_rung_ranks")


def learning(candidate):
    """Fitness grows with the epochs, by a genome-dependent amount: the order changes between rungs."""
    h = int(candidate.genome_hash[:8], 16) / 16**8
    slope = int(candidate.genome_hash[8:16], 16) / 16**8
    epochs = candidate.max_epochs
    return Outcome.ok(0.3 + 0.3 * h + 0.3 * slope * (1 - 1 / epochs), epochs=epochs, seconds=float(epochs))


class Counting:
    def __init__(self):
        self.calls = Counter()

    def __call__(self, candidate):
        self.calls[candidate.genome_hash, candidate.max_epochs, candidate.replicate] += 1
        return learning(candidate)


def pruned(**settings):
    return SearchConfig(**{"sampler": "ga", "population": 9, "generations": 4, "max_epochs": 9, "min_epochs": 1,
                           "prune_factor": 3, "remeasure": 0, "seed": 1, **settings})


def search(path, cfg, fitness=None, evaluate=None, **kw):
    with Store(path) as store:
        return run_search(cfg, load_space("mlp"), evaluate or serial(fitness or Counting()), store, TCH, **kw)


def test_the_rungs():
    assert rung_epochs(10, None, 3) == [10]
    assert rung_epochs(10, 1, 3) == [1, 3, 10] and rung_epochs(9, 1, 3) == [1, 3, 9]
    assert rung_epochs(10, 1, 2) == [1, 2, 4, 10] and rung_epochs(10, 4, 3) == [4, 10]
    assert rung_epochs(10, 1, 10**30) == [1, 10]  # a huge factor is legal: the first rung, then the last
    assert rung_hash(TCH, 10, 10) == TCH != rung_hash(TCH, 3, 10) != rung_hash(TCH, 1, 10)
    with pytest.raises(UserError, match="--min-epochs .* must be below --max-epochs"):
        SearchConfig(min_epochs=10, max_epochs=10)
    with pytest.raises(UserError, match="--prune-factor must be at least 2"):
        SearchConfig(prune_factor=1)


def test_successive_halving_promotes_the_best_third_and_the_held_by_its_places():
    ranked = list("abcdefg")  # seven successes, best first; "f" already holds the next rung
    counted_over_all = SuccessiveHalving(9, 1, 3, "all")
    assert counted_over_all.rungs == [1, 3, 9] and counted_over_all.most_promoted(9) == [3, 1]
    assert counted_over_all.promoted(ranked, {"f"}) == {"a", "b", "c", "f"}  # ceil(7 / 3) places, f besides
    assert counted_over_all.promoted(list("fabcdeg"), {"f"}) == {"f", "a", "b"}  # f takes the first place
    counted_over_new = SuccessiveHalving(9, 1, 3, "new")
    assert counted_over_new.promoted(list("fabcdeg"), {"f"}) == {"f", "a", "b"}  # ceil(6 / 3) places for the new
    # 5 results in (4 successes), 4 still running: at most ceil(9 / 3) = 3 places, 4 running could take them all
    assert counted_over_all.sure(list("abcd"), 5, list("wxyz"), set()) == []
    # 8 results in (7 successes), 1 running: ceil(7 / 3) - 1 = 2 places are certain, held ones never handed out
    assert counted_over_all.sure(ranked, 8, ["z"], set()) == ["a", "b"]
    assert counted_over_all.sure(ranked, 8, ["z"], {"a"}) == ["b"]
    assert counted_over_new.sure(ranked, 8, ["z"], {"z"}) == ["a", "b", "c"]  # a held one running takes no place


def test_each_rung_keeps_the_best_third_of_the_one_below(tmp_path):
    fitness = Counting()
    result = search(tmp_path / "s.db", pruned(), fitness)
    first = result.history[0]
    assert len({m.genome_hash for m in first.members}) == 9
    assert Counter(m.rung for m in first.members) == {0: 6, 1: 2, 2: 1}
    trained = Counter(epochs for (h, epochs, _), n in fitness.calls.items())
    assert trained[1] == result.evaluations and max(fitness.calls.values()) == 1
    # rung 1 holds the best three of rung 0, rung 2 the best of rung 1 (by the fitness at that rung)
    with Store(tmp_path / "s.db") as store:
        rows = [e for e in store.records.evaluations() if e.generation == 0]
    at = {epochs: {e.genome_hash: e for e in rows if e.max_epochs == epochs} for epochs in (1, 3, 9)}
    best = sorted(at[1].values(), key=lambda e: rank_key(e.genome, e.fitness))
    assert set(at[3]) == {e.genome_hash for e in best[:3]}
    assert set(at[9]) == {min(at[3].values(), key=lambda e: rank_key(e.genome, e.fitness)).genome_hash}
    assert {e.train_config_hash for e in rows} == {rung_hash(TCH, 1, 9), rung_hash(TCH, 3, 9), TCH}
    # a member carries its highest rung; the top is ranked by rung, then fitness
    top = result.top[0]
    assert top.rung == 2 and top.train_config_hash == TCH and top.fitness == learning_at(top.genome, top.seed, 9)
    assert first.stats.train_seconds == 9 * 1 + 3 * 3 + 1 * 9  # every training of the generation, every rung


def learning_at(genome, seed, epochs):
    from towerlab.search import Candidate

    return learning(Candidate(0, 0, genome, genome_hash(genome), seed, epochs)).fitness


def test_pruning_trains_far_fewer_epochs_and_keeps_the_same_seed_per_rung(tmp_path):
    fitness = Counting()
    result = search(tmp_path / "s.db", pruned(generations=3), fitness)
    epochs = sum(e * n for (h, e, r), n in fitness.calls.items())
    unpruned = Counting()
    full = search(tmp_path / "u.db", pruned(generations=3, min_epochs=None), unpruned)
    assert epochs < sum(e * n for (h, e, r), n in unpruned.calls.items()) / 2
    assert full.evaluations == sum(unpruned.calls.values())
    assert result.trainings == sum(fitness.calls.values()) > result.evaluations  # the promotions trained again
    with Store(tmp_path / "s.db") as store:
        seeds = {}
        for e in store.records.evaluations():
            seeds.setdefault(e.genome_hash, set()).add(e.seed)
    assert all(len(s) == 1 for s in seeds.values())  # a higher rung retrains with the rung below's seed


def test_a_genome_keeps_the_rung_it_reached_and_the_elite_its_place(tmp_path):
    """The elite (and any genome proposed again) is served its higher rungs from the store instead
    of being pruned below them by the newcomers of a later generation: the GA's best never falls."""
    fitness = Counting()
    result = search(tmp_path / "s.db", pruned(generations=8, population=12, elite=2), fitness)
    highest: dict[str, int] = {}
    kept = 0
    for gen in result.history:
        for m in gen.members:
            if m.ok and m.genome_hash in highest:
                assert m.rung >= highest[m.genome_hash]
                kept += m.rung == 2 and m.source == "cached"
            highest[m.genome_hash] = max(highest.get(m.genome_hash, 0), m.rung if m.ok else 0)
    assert kept >= len(result.history) - 1  # every generation after the first holds an earlier finalist
    bests = [g.stats.best for g in result.history]
    assert bests == sorted(bests)
    assert max(fitness.calls.values()) == 1  # served, not trained again


@pytest.mark.parametrize("places", ["all", "new"])
@pytest.mark.parametrize("crash_at", [4, 10, 12])
def test_a_pruned_search_killed_mid_rung_resumes_to_the_same_history(tmp_path, crash_at, places):
    """Killed in rung 0 (4) or after some of rung 1's promotions were recorded (10, 12): the
    promotions recorded before the kill are not taken for genomes that held the rung already,
    which under `--prune-places new` would count the places over other members."""
    cfg = pruned(remeasure=1, prune_places=places)
    reference = search(tmp_path / "ref.db", cfg)
    fitness = Counting()
    done = []

    def crashing(candidates, record):
        for c in candidates:
            if len(done) == crash_at:
                raise KeyboardInterrupt
            done.append(c)
            record(c, fitness(c))

    with pytest.raises(KeyboardInterrupt):
        search(tmp_path / "s.db", cfg, evaluate=crashing)
    assert search(tmp_path / "s.db", cfg, fitness, resume=True) == reference
    assert max(fitness.calls.values()) == 1


def test_the_last_rung_is_shared_with_an_unpruned_search(tmp_path):
    result = search(tmp_path / "s.db", pruned(generations=2))
    finalists = {m.genome_hash for g in result.history for m in g.members if m.rung == 2}
    fitness = Counting()
    search(tmp_path / "s.db", pruned(generations=2, min_epochs=None), fitness)
    assert finalists and all((h, 9, 0) not in fitness.calls for h in finalists)


def test_tpe_is_told_where_its_trials_were_pruned(tmp_path):
    pytest.importorskip("optuna")
    cfg = pruned(sampler="tpe", population=6, generations=5)
    a = search(tmp_path / "a.db", cfg)
    assert a == search(tmp_path / "b.db", cfg)
    assert {m.rung for g in a.history for m in g.members} == {0, 1, 2}
    assert math.isclose(a.top[0].fitness, max(m.fitness for g in a.history for m in g.members if m.rung == 2))


@pytest.mark.parametrize("places", ["all", "new"])
def test_a_rungs_places_are_counted_over_whom_prune_places_says(tmp_path, places):
    """all: the best third of every member at the rung, the genomes that already hold the next rung
    (served it for free) included; new: the best third of those that do not hold it yet, besides
    the ones that do. Checked generation by generation against the store's rows."""
    result = search(tmp_path / "s.db", pruned(generations=5, population=12, elite=2, prune_places=places))
    with Store(tmp_path / "s.db") as store:
        rows = store.records.evaluations()
    fitness = {(e.genome_hash, e.max_epochs): e.fitness for e in rows}
    genomes = {e.genome_hash: e.genome for e in rows}
    ladder = [1, 3, 9]
    for gen in result.history:
        rung_of = {m.genome_hash: m.rung for m in gen.members}
        for rung in (0, 1):
            above = ladder[rung + 1]
            held = {e.genome_hash for e in rows if e.max_epochs == above and e.generation < gen.generation}
            at = sorted((h for h, r in rung_of.items() if r >= rung),
                        key=lambda h: rank_key(genomes[h], fitness[h, ladder[rung]]))
            contenders = at if places == "all" else [h for h in at if h not in held]
            places_given = set(contenders[:math.ceil(len(contenders) / 3)])
            trained = {e.genome_hash for e in rows if e.max_epochs == above and e.generation == gen.generation}
            assert trained == places_given - held
            assert {h for h, r in rung_of.items() if r > rung} == places_given | (held & set(at))
    # generation 0 (no member held) trains 2 of 12 to the end either way; the 4 after it, 1 in all or 6
    finals = sum(e.max_epochs == 9 for e in rows)
    assert finals == {"all": 3, "new": 8}[places]
    shown = "pruned (rungs of 1/3/9 epochs, places counted over the new)"
    assert (shown in format_search(tmp_path / "s.db")) == (places == "new")


def test_prune_places_is_kept_on_resume_and_a_search_recorded_before_it_resumes_as_all(tmp_path):
    path = tmp_path / "s.db"
    reference = search(tmp_path / "ref.db", pruned(generations=3))
    search(path, pruned(generations=2))
    with pytest.raises(UserError, match="--prune-places all, not new: resume with the same setting"):
        search(path, pruned(generations=3, prune_places="new"), resume=True)
    with sqlite3.connect(path) as db:  # as written before the setting existed
        (config,) = db.execute("SELECT config FROM searches").fetchone()
        db.execute("UPDATE searches SET config = ?",
                   (json.dumps({k: v for k, v in json.loads(config).items() if k != "prune_places"}),))
    db.close()
    assert search(path, pruned(generations=3), resume=True) == reference
    with pytest.raises(UserError, match="--prune-places new does nothing without --min-epochs"):
        SearchConfig(prune_places="new")
    with pytest.raises(UserError, match="unknown --prune-places 'newcomers': choose one of all, new"):
        SearchConfig(prune_places="newcomers", min_epochs=1)


def flaky(candidate):
    """`learning`, except that about one genome in six fails at its second rung."""
    if candidate.max_epochs == 3 and int(candidate.genome_hash[16:18], 16) % 6 == 0:
        return Outcome.failed("diverged", epochs=1, seconds=1.0)
    return learning(candidate)


def workers(n, seed, log):
    """An evaluator that emulates `n` workers finishing in a random order and asks for the work
    that unlocks (`record.more()`) after every result, as the queue's driver does."""
    import random

    rng = random.Random(seed)

    def evaluate(candidates, record):
        queue, running = list(candidates), []
        while queue or running:
            while queue and len(running) < n:
                running.append(queue.pop(0))
            c = running.pop(rng.randrange(len(running)))
            log.append((c.generation, c.genome_hash, c.max_epochs))
            record(c, flaky(c))
            queue.extend(record.more())

    return evaluate


def rung_by_rung(candidates, record):
    """An evaluator that never asks for more: the search hands it one rung at a time."""
    for c in candidates:
        record(c, flaky(c))


@pytest.mark.parametrize("places", ["all", "new"])
@pytest.mark.parametrize("seed", range(4))
def test_a_rungs_certain_places_go_on_before_its_last_results_and_the_history_is_the_same(tmp_path, places,
                                                                                         seed):
    """Workers that take work as it unlocks start a genome's next rung while its rung still runs,
    once its place is certain, and the search (members, rungs, promotions, every stored training)
    is the rung-by-rung one, whatever order the trainings finish in, failures and the GA's elite
    (genomes that hold a rung already) included."""
    cfg = pruned(generations=4, population=12, elite=2, prune_places=places)
    reference = search(tmp_path / "ref.db", cfg, evaluate=rung_by_rung)
    log = []
    assert search(tmp_path / "s.db", cfg, evaluate=workers(3, seed, log)) == reference

    def trainings(path):
        with Store(path) as store:
            return sorted((e.generation, e.genome_hash, e.max_epochs, e.status, e.fitness, e.seed)
                          for e in store.records.evaluations())

    assert trainings(tmp_path / "s.db") == trainings(tmp_path / "ref.db")
    assert len(log) == len(set(log)) == len(trainings(tmp_path / "ref.db"))
    early = 0  # trainings of a higher rung that started before the rung below had all its results
    for i, (generation, _, epochs) in enumerate(log):
        below = {1: None, 3: 1, 9: 3}[epochs]
        early += below is not None and any(g == generation and e == below for g, _, e in log[i + 1:])
    assert early > 0
