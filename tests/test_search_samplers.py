"""Samplers run by the one engine loop: the genetic algorithm and the grid give the histories the
code before samplers recorded (tests/fixtures/ga_history_v1.json), random never repeats, TPE is
seeded and resumes, and every sampler stops at --max-evaluations. Fake fitness, no torch."""

import builtins
import json
import sys
from pathlib import Path

import pytest

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search import (SAMPLERS, Outcome, Sampler, Space, Store, genome_hash, load_space, make_sampler,
                             run_search, serial)

FIXTURES = Path(__file__).parent / "fixtures"
HISTORIES = json.loads((FIXTURES / "ga_history_v1.json").read_text())
TCH = "fixture-train-config"
SMALL = Space("small.toml", "mlp", {"neurons": (16, 32, 64), "layers": (1, 2), "activation": ("relu", "tanh", "sigmoid")})


def fixture_fitness(candidate):
    """The fake fitness the fixtures were recorded with: structureless in the genome and dependent
    on the candidate's seed, so a history pins both the proposals and the seeds."""
    if candidate.genome.get("activation") == "sigmoid":
        return Outcome.failed("loss became NaN", epochs=1, seconds=0.5)
    base = int(candidate.genome_hash[:8], 16) / 16**8
    return Outcome.ok(0.9 * base + (candidate.seed % 1000) / 1e5, val_loss=1 - base, epochs=2, seconds=0.25)


def recorded_config(name):
    data = dict(HISTORIES[name]["config"])
    return SearchConfig(**{**data, "sampler": "ga" if HISTORIES[name]["kind"] == "evolve" else "grid",
                           "remeasure": 0})


def recorded_space(name):
    return SMALL if HISTORIES[name]["space"]["name"] == "small.toml" else load_space(HISTORIES[name]["space"]["name"])


def as_recorded(result):
    """A result in the fixture's form."""
    return {
        "history": [{"members": [[m.genome_hash[:16], m.fitness, m.seed, m.source] for m in g.members],
                     "stats": {k: v for k, v in g.stats.to_json().items() if k != "seconds"}} for g in result.history],
        "top": [[t.genome_hash[:16], t.fitness, t.seed, t.generation] for t in result.top],
        "counts": [result.evaluations, result.cache_hits, result.failures, result.generations],
    }


def search(path, cfg, space="mlp", fitness=fixture_fitness, evaluate=None, tch=TCH, **kw):
    with Store(path) as store:
        return run_search(cfg, load_space(space) if isinstance(space, str) else space,
                          evaluate or serial(fitness), store, tch, **kw)


@pytest.mark.parametrize("name", ["ga-default", "ga-small-elite3", "ga-seed11", "grid-limit"])
def test_ga_and_grid_give_the_histories_recorded_before_samplers(tmp_path, name):
    result = search(tmp_path / "s.db", recorded_config(name), recorded_space(name))
    recorded = HISTORIES[name]
    assert as_recorded(result) == {k: recorded[k] for k in ("history", "top", "counts")}


def test_a_store_from_before_samplers_opens_migrates_and_resumes_to_the_recorded_history(tmp_path):
    path = tmp_path / "search.db"
    import sqlite3

    db = sqlite3.connect(path)
    db.executescript((FIXTURES / "store_v1.sql").read_text())
    db.close()
    with Store(path) as store:
        grid, evolve = store.records.searches()
        assert (grid.sampler, evolve.sampler) == ("grid", "ga")
        assert evolve.config["remeasure"] == 0 and evolve.config["sampler"] == "ga" and evolve.finished is None
        kept = store.records.evaluations(2)
        assert [e.replicate for e in store.records.evaluations()] == [0] * len(store.records.evaluations())
        assert {e.max_epochs for e in store.records.evaluations()} == {10}
        top = grid.summary["top"]
        assert top[0]["fitnesses"] == [top[0]["fitness"]] and store.records.lookup(
            top[0]["genome_hash"], "fixture-grid-config", 1).test_accuracy == 0.875
    calls = []

    def counting(candidate):
        calls.append(candidate.genome_hash)
        return fixture_fitness(candidate)

    resumed = search(path, recorded_config("ga-seed11"), fitness=counting, resume=True)
    recorded = HISTORIES["ga-seed11"]
    assert as_recorded(resumed) == {k: recorded[k] for k in ("history", "top", "counts")}
    assert len(calls) == resumed.evaluations - len(kept)  # what the old code recorded was not trained again
    with Store(path) as store:
        assert store.records.searches()[1].finished and len(store.records.evaluations(2)) == resumed.evaluations
    text = __import__("towerlab.search", fromlist=["format_search"]).format_search(path)
    assert "search 1: grid over space mlp" in text and "0.8750" in text and "search 2: ga over space mlp" in text


def test_random_never_repeats_a_genome_and_exhausts_the_space(tmp_path):
    cfg = SearchConfig(sampler="random", population=5, generations=100, remeasure=0, seed=2)
    result = search(tmp_path / "r.db", cfg, SMALL)
    proposed = [m.genome_hash for g in result.history for m in g.members]
    assert len(proposed) == len(set(proposed)) == SMALL.size == 18
    assert result.generations == 4 and [len(g.members) for g in result.history] == [5, 5, 5, 3]
    assert result.evaluations == 18 and result.cache_hits == 0
    again = search(tmp_path / "r2.db", cfg, SMALL)
    assert again == result
    other = search(tmp_path / "r3.db", SearchConfig(sampler="random", population=5, remeasure=0, seed=3), SMALL)
    assert [m.genome for m in other.history[0].members] != [m.genome for m in result.history[0].members]


def test_random_in_a_large_space_draws_distinct_genomes(tmp_path):
    cfg = SearchConfig(sampler="random", population=30, generations=3, remeasure=0)
    result = search(tmp_path / "r.db", cfg)
    proposed = [m.genome_hash for g in result.history for m in g.members]
    assert len(set(proposed)) == 90 and all(load_space("mlp").contains(m.genome)
                                            for g in result.history for m in g.members)



def test_the_genomes_proposed_are_counted_as_the_history_grows_and_anew_for_another_history(tmp_path):
    """`Sampler.proposed` adds only the generations new since its last count (rebuilt whole each
    generation, the set cost a trial time in proportion to the history): at every length of a growing
    history, for another history, and with a generation in flight, it is every member's hash."""
    from towerlab.search.samplers import InFlight

    cfg = SearchConfig(sampler="random", population=5, generations=4, remeasure=0, seed=2)
    history = search(tmp_path / "a.db", cfg).history
    other = search(tmp_path / "b.db", SearchConfig(sampler="random", population=5, generations=4, remeasure=0,
                                                   seed=3)).history
    sampler = make_sampler(cfg, load_space("mlp"), 1)

    def every(generations, *genomes):
        return {m.genome_hash for g in generations for m in g.members} | {genome_hash(g) for g in genomes}

    for n in range(len(history) + 1):
        assert sampler.proposed(history[:n]) == every(history[:n])
    assert sampler.proposed(other[:2]) == every(other[:2])  # not the counted one grown: counted anew
    mixed = [*history[:1], *other[1:3]]  # the counted history's first generation, then another's
    assert sampler.proposed(mixed) == every(mixed)
    flying = other[3].members[0].genome
    assert sampler.proposed(mixed, InFlight((flying,), 1)) == every(mixed, flying)
    assert sampler.proposed(history[:1]) == every(history[:1])  # shorter than the counted one


def tpe_config(**changes):
    return SearchConfig(**{"sampler": "tpe", "population": 4, "generations": 6, "remeasure": 0, "seed": 5,
                           **changes})


def smooth(candidate):
    g = candidate.genome
    return Outcome.ok(0.5 + g["neurons"] / 4096 + g["layers"] / 20 + (g["activation"] == "relu") / 10
                      + (g["optimizer"] == "adam") / 20)


def test_tpe_is_seeded_and_learns_from_what_it_is_told(tmp_path):
    pytest.importorskip("optuna")
    a = search(tmp_path / "a.db", tpe_config(generations=10), fitness=smooth)
    b = search(tmp_path / "b.db", tpe_config(generations=10), fitness=smooth)
    assert a == b and a.generations == 10 and all(len(g.members) == 4 for g in a.history)
    c = search(tmp_path / "c.db", tpe_config(generations=10, seed=6), fitness=smooth)
    assert [m.genome for m in c.history[0].members] != [m.genome for m in a.history[0].members]
    early = [m.fitness for g in a.history[:3] for m in g.members]  # random start-up trials
    late = [m.fitness for g in a.history[-3:] for m in g.members]
    assert sum(late) / len(late) > sum(early) / len(early)


def test_tpe_resumes_mid_generation_to_the_uninterrupted_history(tmp_path):
    pytest.importorskip("optuna")
    reference = search(tmp_path / "ref.db", tpe_config(), fitness=smooth)

    trained = []

    def crash(candidates, record):  # dies in the first generation with 2 new genomes after the 6th
        for c in candidates:
            if len(trained) >= 6 and len(candidates) > 1 and c is candidates[1]:
                raise KeyboardInterrupt
            trained.append(c)
            record(c, smooth(c))

    with pytest.raises(KeyboardInterrupt):
        search(tmp_path / "s.db", tpe_config(), evaluate=crash)
    with Store(tmp_path / "s.db") as store:
        assert not store.records.generations(1)[-1].complete
    assert search(tmp_path / "s.db", tpe_config(), fitness=smooth, resume=True) == reference


def test_tpe_tells_optuna_pruned_below_the_search_s_last_rung_and_complete_at_it():
    """The sampler learns a search's rungs from the search (its ladder), not from a config of its own:
    a member told at a lower rung is a pruned trial, one at the last rung a complete one."""
    pytest.importorskip("optuna")
    from towerlab.search.history import Generation, GenerationStats, Member

    from towerlab.search.samplers.tpe import study_of

    sampler = make_sampler(tpe_config(population=3), load_space("mlp"), 3)
    genomes = sampler.propose([])
    members = tuple(Member(i, g, genome_hash(g), "ok", 0.5 + i / 10, 1.0, 1, 1.0, 0, "evaluated", rung=rung,
                           score=0.5 + i / 10) for i, (g, rung) in enumerate(zip(genomes, (0, 1, 2))))
    history = [Generation(0, members, GenerationStats(0, 3, 3, 0, 0, 0.7, 0.6, 0.5, 3.0))]
    study = study_of(sampler._optuna, None, sampler._distributions, sampler.rungs, history, None)
    states = sampler._optuna.trial.TrialState
    assert [t.state for t in study.trials] == [states.PRUNED, states.PRUNED, states.COMPLETE]
    assert study.trials[2].value == pytest.approx(0.7)


def test_tpe_asks_no_more_trials_than_the_budget_can_train(tmp_path, monkeypatch):
    """issue 50: --population 1,000,000 with --max-evaluations 2 was still asking Optuna for trials after
    13.5 minutes (each ask costs time in proportion to the trials before it)."""
    pytest.importorskip("optuna")
    import optuna

    sampler = make_sampler(tpe_config(population=300, generations=1, max_evaluations=2), load_space("mlp"), 1)
    asked = []
    ask = optuna.study.Study.ask
    monkeypatch.setattr(optuna.study.Study, "ask", lambda *a, **k: asked.append(1) or ask(*a, **k))
    assert len(sampler.propose([])) == len(asked) <= 3
    result = search(tmp_path / "s.db", tpe_config(population=1_000_000, generations=1, max_evaluations=2),
                    fitness=smooth)
    assert (result.evaluations, len(result.history[0].members)) == (2, 2)


def test_tpe_proposing_within_the_budget_keeps_every_generation_it_made_before(tmp_path, monkeypatch):
    """The trials asked first do not depend on how many follow: a budget-cut generation has the members
    (repeats and all) it had when the whole population was asked."""
    pytest.importorskip("optuna")
    from towerlab.search.samplers.tpe import TPESampler

    from towerlab.search.candidates import sampler_rng
    from towerlab.search.samplers import generation_number
    from towerlab.search.samplers.optuna_params import ask_genome
    from towerlab.search.samplers.tpe import study_of

    def asking_everything(self, history, in_flight=None):  # the sampler before issue 50: the whole population
        number = generation_number(history, in_flight)
        engine = self._optuna.samplers.TPESampler(
            seed=int(sampler_rng(self.cfg.seed, "tpe", number).integers(2**32)), constant_liar=True)
        study = study_of(self._optuna, engine, self._distributions, self.rungs, history, in_flight)
        return [ask_genome(study, self.space, self._distributions)[1] for _ in range(self.population)]

    space = Space("tiny", "mlp", {"neurons": (16, 32), "layers": (1, 2), "activation": ("relu", "tanh")})
    cfg = tpe_config(population=12, generations=4, max_evaluations=7)
    now = search(tmp_path / "now.db", cfg, space=space, fitness=smooth_small)
    monkeypatch.setattr(TPESampler, "propose", asking_everything)
    before = search(tmp_path / "before.db", cfg, space=space, fitness=smooth_small)
    assert now == before and now.evaluations == 7 and now.cache_hits > 0


def smooth_small(candidate):
    g = candidate.genome
    return Outcome.ok(0.5 + g["neurons"] / 4096 + g["layers"] / 20 + (g["activation"] == "relu") / 10)


def test_tpe_without_optuna_is_one_clear_line(monkeypatch):
    real_import = builtins.__import__

    def no_optuna(name, *args, **kwargs):
        if name == "optuna" or name.startswith("optuna."):
            raise ImportError("No module named 'optuna'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "optuna", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_optuna)
    with pytest.raises(UserError, match=r"the tpe sampler needs Optuna: pip install 'towerlab\[tpe\]'"):
        make_sampler(SearchConfig(sampler="tpe"), load_space("mlp"), 1)


def test_an_unknown_sampler_is_refused():
    with pytest.raises(UserError, match="unknown sampler 'annealing': choose one of auto, ga, gp, grid, random, tpe"):
        make_sampler(SearchConfig(sampler="annealing"), load_space("mlp"), 1)


@pytest.mark.parametrize("sampler, extra", [("ga", {}), ("random", {}), ("grid", {"limit": 40}), ("tpe", {})])
def test_max_evaluations_stops_every_sampler_after_that_many_distinct_trainings(tmp_path, sampler, extra):
    if sampler == "tpe":
        pytest.importorskip("optuna")
    trained = []

    def counting(candidate):
        trained.append(candidate.genome_hash)
        return smooth(candidate)

    cfg = SearchConfig(sampler=sampler, population=6, generations=50, max_evaluations=13, remeasure=0, **extra)
    result = search(tmp_path / "s.db", cfg, fitness=counting)
    assert len(trained) == len(set(trained)) == result.evaluations == 13
    assert sum(len(g.members) for g in result.history) == result.evaluations + result.cache_hits
    # the generation that reached the budget was cut right after its 13th new genome
    last = result.history[-1].members
    assert last[-1].source == "evaluated"


def test_max_evaluations_resumes_and_may_grow(tmp_path):
    cfg = SearchConfig(sampler="ga", population=6, generations=50, max_evaluations=10, remeasure=0)
    small = search(tmp_path / "s.db", cfg, fitness=smooth)
    assert small.evaluations == 10
    with pytest.raises(UserError, match="already holds 10 evaluations of this search: resume with --max-evaluations 10"):
        search(tmp_path / "s.db", SearchConfig(**{**cfg.__dict__, "max_evaluations": 8}), resume=True)
    grown = search(tmp_path / "s.db", SearchConfig(**{**cfg.__dict__, "max_evaluations": 20}), fitness=smooth,
                   resume=True)
    assert grown.evaluations == 20 and grown.history[:len(small.history)] == small.history


class OneBatch(Sampler):
    """A sampler added the README's way that, like the grid, proposes everything at once."""
    one_generation = True

    def propose(self, history):
        return [] if history else list(self.space.all_genomes())[:self.population]


def test_a_sampler_that_proposes_everything_at_once_is_not_held_to_generations(tmp_path, monkeypatch):
    monkeypatch.setitem(SAMPLERS, "onebatch", f"{__name__}:OneBatch")
    cfg = SearchConfig(sampler="onebatch", population=12, generations=1, max_evaluations=30, remeasure=0)
    first = search(tmp_path / "s.db", cfg, space=SMALL, fitness=smooth)  # 30 > 1 x 12, yet not refused
    assert first.generations == 1 and first.evaluations == 12
    assert search(tmp_path / "s.db", cfg, space=SMALL, resume=True).history == first.history
    monkeypatch.setattr(OneBatch, "one_generation", False)  # a sampler of generations is held to them
    with pytest.raises(UserError, match="--max-evaluations 30 is more than 1 generation of 12 can train: pass --generations 3"):
        search(tmp_path / "t.db", cfg, space=SMALL, fitness=smooth)


def test_the_sampler_is_recorded_as_data(tmp_path):
    search(tmp_path / "s.db", SearchConfig(sampler="random", population=3, generations=1, remeasure=0))
    with Store(tmp_path / "s.db") as store:
        row = store.records.searches()[0]
        assert row.sampler == "random" and row.config["sampler"] == "random"
        sql = store.db.raw.execute("SELECT sql FROM sqlite_master WHERE name = 'searches'").fetchone()[0]
        assert "CHECK" not in sql
    with pytest.raises(UserError, match="search 1 in store .* is a random search, not ga"):
        search(tmp_path / "s.db", SearchConfig(sampler="ga", population=3, generations=1, remeasure=0), resume=1)
    assert genome_hash({"a": 1}) == genome_hash({"a": 1})
