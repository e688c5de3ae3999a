"""Resume: a search killed at any point and resumed from its store ends exactly like an
uninterrupted one, without training anything twice."""

import json
import sqlite3
from collections import Counter

import pytest

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search import Candidate, Outcome, Space, load_space, run_search, serial
from towerlab.search.store import Store

TCH = "train-config"


def GA(**settings):
    return SearchConfig(**{"sampler": "ga", "remeasure": 0, **settings})


CFG = GA(population=10, generations=6, seed=11)


class Counting:
    """A fake fitness counting its calls per genome; sigmoid networks fail."""

    def __init__(self):
        self.calls = Counter()

    def __call__(self, candidate: Candidate) -> Outcome:
        self.calls[candidate.genome_hash] += 1
        if candidate.genome.get("activation") == "sigmoid":
            return Outcome.failed("loss became NaN", epochs=1)
        fitness = int(candidate.genome_hash[:8], 16) / 16**8
        return Outcome.ok(fitness, val_loss=1 - fitness, epochs=2, seconds=0.25, worker="fake")


def crashing(fitness, generation, after=0, exc=KeyboardInterrupt):
    """An evaluator that dies in `generation` once it has recorded `after` outcomes there."""

    def evaluate(candidates, record):
        for i, c in enumerate(candidates):
            if c.generation == generation and i == after:
                raise exc()
            record(c, fitness(c))

    return evaluate


def run(path, cfg=CFG, evaluate=None, fitness=None, space="mlp", **kw):
    fitness = fitness or Counting()
    with Store(path) as store:
        return run_search(cfg, load_space(space) if isinstance(space, str) else space,
                      evaluate or serial(fitness), store, TCH, **kw)


@pytest.fixture
def reference(tmp_path):
    """An uninterrupted run and the calls it made."""
    fitness = Counting()
    return run(tmp_path / "ref.db", fitness=fitness), fitness.calls


def assert_same_search(resumed, reference):
    assert resumed == reference  # history (members and stats), top, counts; not seconds or search id
    assert resumed.history == reference.history and resumed.top == reference.top
    assert (resumed.evaluations, resumed.cache_hits, resumed.failures, resumed.generations) == \
        (reference.evaluations, reference.cache_hits, reference.failures, reference.generations)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_resume_after_a_kill_between_generations(tmp_path, reference, exc):
    result, reference_calls = reference
    fitness = Counting()
    with pytest.raises(exc):
        run(tmp_path / "s.db", evaluate=crashing(fitness, generation=3, exc=exc))
    done = sum(fitness.calls.values())
    seen = []
    resumed = run(tmp_path / "s.db", fitness=fitness, resume=True, on_generation=seen.append)
    assert fitness.calls == reference_calls and max(fitness.calls.values()) == 1  # nothing twice
    assert sum(fitness.calls.values()) - done == sum(g.stats.evaluated for g in result.history[3:])
    assert_same_search(resumed, result)
    assert [s.replayed for s in seen] == [True] * 3 + [False] * 3
    assert result.failures > 0 and result.cache_hits > 0  # the reference exercises both


def test_resume_after_a_kill_in_on_generation(tmp_path, reference):
    result, reference_calls = reference
    fitness = Counting()

    def stop_after_two(stats):
        if stats.generation == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "s.db", fitness=fitness, on_generation=stop_after_two)
    resumed = run(tmp_path / "s.db", fitness=fitness, resume=True)
    assert fitness.calls == reference_calls
    assert_same_search(resumed, result)


@pytest.mark.parametrize("generation, after", [(0, 4), (2, 1), (4, 2)])
def test_resume_after_a_kill_in_the_middle_of_a_generation(tmp_path, reference, generation, after):
    result, reference_calls = reference
    fitness = Counting()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "s.db", evaluate=crashing(fitness, generation, after))
    with Store(tmp_path / "s.db") as store:
        kept = [e for e in store.records.evaluations() if e.generation == generation]
    assert len(kept) == after
    resumed = run(tmp_path / "s.db", fitness=fitness, resume=True)
    assert fitness.calls == reference_calls and max(fitness.calls.values()) == 1  # finished ones not redone
    assert_same_search(resumed, result)
    members = resumed.history[generation].members
    assert {m.genome_hash for m in members if m.source == "evaluated"} >= {e.genome_hash for e in kept}


def test_resume_survives_two_interruptions_and_a_resumed_finished_search_trains_nothing(tmp_path, reference):
    result, reference_calls = reference
    fitness = Counting()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "s.db", evaluate=crashing(fitness, 1, 2))
    with pytest.raises(SystemExit):
        run(tmp_path / "s.db", evaluate=crashing(fitness, 4, 1, SystemExit), resume=True)
    assert_same_search(run(tmp_path / "s.db", fitness=fitness, resume=True), result)
    assert fitness.calls == reference_calls
    again = run(tmp_path / "s.db", fitness=fitness, resume=True)
    assert_same_search(again, result)
    assert fitness.calls == reference_calls
    with Store(tmp_path / "s.db") as store:
        assert len(store.records.searches()) == 1 and store.records.searches()[0].finished


def test_resume_can_add_generations(tmp_path):
    longer = run(tmp_path / "ref.db", cfg=GA(population=10, generations=8, seed=11))
    fitness = Counting()
    shorter = run(tmp_path / "s.db", fitness=fitness)
    assert shorter.history == longer.history[:6]
    extended = run(tmp_path / "s.db", cfg=GA(population=10, generations=8, seed=11),
                   fitness=fitness, resume=True)
    assert extended == longer and max(fitness.calls.values()) == 1
    with pytest.raises(UserError, match="already holds 8 complete generations: resume with --generations 8"):
        run(tmp_path / "s.db", cfg=GA(population=10, generations=5, seed=11), resume=True)


def test_failed_candidates_are_not_retried_by_their_search_but_by_a_later_one(tmp_path, reference):
    result, _ = reference
    failed = {m.genome_hash for g in result.history for m in g.members if not m.ok}
    assert failed
    fitness = Counting()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "s.db", evaluate=crashing(fitness, 5, 1))
    run(tmp_path / "s.db", fitness=fitness, resume=True)
    assert all(fitness.calls[h] == 1 for h in failed)
    later = run(tmp_path / "s.db", fitness=fitness)  # a new search in the same store, same settings
    assert later.evaluations == later.failures == len(failed)
    assert all(fitness.calls[h] == 2 for h in failed)
    assert [[(m.genome, m.fitness) for m in g.members] for g in later.history] == \
        [[(m.genome, m.fitness) for m in g.members] for g in result.history]


def test_a_later_search_reuses_the_store_and_writes_its_own_rows(tmp_path, reference):
    result, _ = reference
    fitness = Counting()
    run(tmp_path / "s.db", fitness=fitness)
    other = run(tmp_path / "s.db", cfg=GA(population=10, generations=6, seed=12), fitness=fitness)
    assert other.search_id == 2 and other.cache_hits > 0
    assert max(fitness.calls.values()) <= 2  # only failures retried
    with Store(tmp_path / "s.db") as store:
        assert [s.id for s in store.records.searches()] == [1, 2]
        assert len(store.records.generations(2)) == 6 and all(g.complete for g in store.records.generations(2))
        assert len(store.records.evaluations(2)) == other.evaluations


def test_resume_refuses_another_space(tmp_path):
    run(tmp_path / "s.db")
    other = Space("other.toml", "mlp", {"neurons": (64, 128), "layers": (1, 2)})
    with pytest.raises(UserError, match=f"store {tmp_path / 's.db'} was made for space mlp .*, not other.toml"):
        run(tmp_path / "s.db", space=other, resume=True)


@pytest.mark.parametrize("change, message", [
    ({"seed": 12}, "--seed 11, not 12"),
    ({"population": 12}, "--population 10, not 12"),
    ({"mutate_chance": 0.5}, "--mutate-chance 0.2, not 0.5"),
])
def test_resume_refuses_other_search_settings(tmp_path, change, message):
    run(tmp_path / "s.db")
    cfg = GA(**{**dict(population=10, generations=6, seed=11), **change})
    with pytest.raises(UserError, match=message):
        run(tmp_path / "s.db", cfg=cfg, resume=True)


def test_resume_refuses_other_training_settings_and_an_empty_store(tmp_path):
    with pytest.raises(UserError, match="holds no ga search to resume"):
        run(tmp_path / "s.db", resume=True)
    run(tmp_path / "s.db")
    with Store(tmp_path / "s.db") as store, pytest.raises(UserError, match="other training settings"):
        run_search(CFG, load_space("mlp"), serial(Counting()), store, "another", resume=True)
    with pytest.raises(UserError, match="search 1 .* is a ga search, not grid"):
        run(tmp_path / "s.db", cfg=SearchConfig(sampler="grid"), resume=1)
    with pytest.raises(UserError, match="holds no search 7 to resume"):
        run(tmp_path / "s.db", resume=7)


def test_a_resume_follows_the_generations_its_store_holds_and_proposes_none_of_them_again(tmp_path):
    """A recorded generation is the search's, whatever the sampler would propose now (another thread count's
    numerics, another process's timing): a resume plays it as the store holds it (here the generation it
    stopped in, edited: two members swapped) and goes on from there, where it once stopped with "other
    members than it recorded"."""
    fitness = Counting()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "s.db", evaluate=crashing(fitness, 3))
    db = sqlite3.connect(tmp_path / "s.db")
    members = json.loads(db.execute("SELECT members FROM generations WHERE generation = 3").fetchone()[0])
    members[0], members[1] = members[1], members[0]
    db.execute("UPDATE generations SET members = ? WHERE generation = 3", (json.dumps(members),))
    db.commit()
    db.close()
    resumed = run(tmp_path / "s.db", fitness=fitness, resume=True)
    assert [m.genome_hash for m in resumed.history[3].members] == [m["genome_hash"] for m in members]
    assert resumed.generations == CFG.generations


def grid_space(tmp_path):
    path = tmp_path / "grid.toml"
    path.write_text('model = "mlp"\n[genes]\nneurons = [16, 32, 64]\nlayers = [1, 2, 3]\n'
                    'activation = ["relu", "sigmoid"]\n')
    return load_space(path)


@pytest.mark.parametrize("limit", [None, 7])
def test_grid_resume_redoes_only_the_unfinished(tmp_path, limit):
    space = grid_space(tmp_path)
    cfg = SearchConfig(sampler="grid", remeasure=0, limit=limit, seed=3)
    reference = run(tmp_path / "ref.db", cfg=cfg, space=space)
    fitness = Counting()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "s.db", cfg=cfg, evaluate=crashing(fitness, 0, 5), space=space)
    assert sum(fitness.calls.values()) == 5
    resumed = run(tmp_path / "s.db", cfg=cfg, fitness=fitness, space=space, resume=True)
    assert_same_search(resumed, reference)
    assert sum(fitness.calls.values()) == (limit or 18) == resumed.evaluations
    assert max(fitness.calls.values()) == 1
    with pytest.raises(UserError, match="--limit"):
        run(tmp_path / "s.db", cfg=SearchConfig(sampler="grid", remeasure=0, limit=5, seed=3), space=space,
            resume=True)


def test_the_candidate_seeds_survive_resume(tmp_path):
    seeds = {}

    def remember(candidate):
        seeds[candidate.genome_hash] = candidate.seed
        return Counting()(candidate)

    run(tmp_path / "ref.db", fitness=remember)
    reference = dict(seeds)
    seeds.clear()
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "s.db", evaluate=crashing(remember, 2, 3))
    run(tmp_path / "s.db", fitness=remember, resume=True)
    assert seeds == reference
    with Store(tmp_path / "s.db") as store:
        assert {e.genome_hash: e.seed for e in store.records.evaluations()} == reference
