"""The gp sampler (Optuna's GPSampler): seeded from the search seed, it learns from what it is told,
keeps each gene's kind (int, log, float rounded to its digits, a listed value), proposes the same
generations when a search resumes or a worker plays it through the queue, tells the model what
failed or was pruned, asks no more than the budget trains, and refuses in one line where it cannot
run. Fake fitness; the sampler imports torch (through Optuna) only when it proposes."""

import builtins
import dataclasses
import json
import math
import sys
import threading
import time

import pytest

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search import Outcome, Search, Store, genome_hash, load_space, make_sampler, run_search, serial
from towerlab.search.history import Generation, GenerationStats, Member
from towerlab.search.samplers import Shape
from towerlab.search.work.worker import Worker, WorkerOptions

pytest.importorskip("optuna")
pytest.importorskip("scipy")

# An int range, a log int range, a log float range, a float range and a listed gene.
SPACE = load_space(json.dumps({"model": "custom", "genes": {
    "depth": {"low": 1, "high": 4}, "units": {"low": 8, "high": 512, "log": True},
    "lr": {"low": 1e-4, "high": 0.1, "log": True}, "dropout": {"low": 0.0, "high": 0.9},
    "act": ["relu", "tanh", "gelu"]}}))
NUMERIC = load_space(json.dumps({"model": "custom", "genes": {
    name: gene.to_dict() for name, gene in SPACE.genes.items() if name != "act"}}))
LISTED = load_space(json.dumps({"model": "custom", "genes": {"act": ["relu", "tanh", "gelu"], "depth": [1, 2, 3, 4]}}))
TCH = "gp-train-config"


def peak(candidate):
    """Highest at depth 2, 128 units, lr 0.003, dropout 0.3, gelu."""
    g = candidate.genome
    return Outcome.ok(1 - abs(g["depth"] - 2) / 10 - (math.log2(g["units"]) - 7) ** 2 / 40
                      - (math.log10(g["lr"]) + 2.5) ** 2 / 5 - (g["dropout"] - 0.3) ** 2 - (g["act"] != "gelu") / 10,
                      epochs=1, seconds=0.1)


def gp_config(**changes):
    return SearchConfig(**{"sampler": "gp", "generations": 18, "remeasure": 0, "top": 2, "seed": 3, **changes})


def search(path, cfg, fitness=peak, evaluate=None, **kw):
    with Store(path) as store:
        return run_search(cfg, SPACE, evaluate or serial(fitness), store, TCH, **kw)


def genomes(result):
    return [[m.genome for m in g.members] for g in result.history]


def test_gp_is_seeded_and_learns_from_what_it_is_told(tmp_path):
    a = search(tmp_path / "a.db", gp_config())
    assert a == search(tmp_path / "b.db", gp_config())
    assert all(len(g.members) == 1 for g in a.history)  # its default population
    other = search(tmp_path / "c.db", gp_config(seed=4, generations=1))
    assert genomes(other)[0] != genomes(a)[0]
    start = [m.fitness for g in a.history[:10] for m in g.members]  # its 10 random start-up trials
    model = [m.fitness for g in a.history[10:] for m in g.members]
    assert sum(model) / len(model) > sum(start) / len(start) + 0.1


def test_the_model_proposes_once_the_start_up_s_10_trials_are_proposed(tmp_path, monkeypatch):
    """A generation is asked while the one before trains: Optuna's rule (10 complete trials) would draw
    the generation in flight at random too. The 11th proposal is the model's whatever the population:
    the first 10 are those of a search that never leaves its start-up, the 11th is not."""
    from towerlab.search.samplers import gp

    def proposed(population, startup):
        monkeypatch.setattr(gp, "STARTUP", startup)
        cfg = gp_config(population=population, generations=-(-11 // population))
        return [g for gen in genomes(search(tmp_path / f"{population}-{startup}.db", cfg)) for g in gen][:11]

    startup = gp.STARTUP
    for population in (1, 2):
        model, random_only = proposed(population, startup), proposed(population, 1000)
        assert model[:10] == random_only[:10] and model[10] != random_only[10]


def test_gp_keeps_each_gene_s_kind_and_bounds_and_rounds_floats_to_its_digits(tmp_path):
    from towerlab.search.samplers.gp import DIGITS

    result = search(tmp_path / "s.db", gp_config(generations=14))
    members = [m.genome for g in result.history for m in g.members]
    assert all(SPACE.contains(g) for g in members)
    assert all(type(g["depth"]) is int and type(g["units"]) is int and g["act"] in ("relu", "tanh", "gelu")
               for g in members)
    for g in members[10:]:  # the model's proposals
        for name in ("lr", "dropout"):
            assert type(g[name]) is float and float(f"{g[name]:.{DIGITS}g}") == g[name]
    assert len({g["units"] for g in members}) > 3  # a log int range is explored, not pinned to a bound


def test_gp_models_a_wide_int_range_as_floats_and_proposes_it_rounded(tmp_path):
    """An int range of more than RELAXED values is a float range to the Gaussian process (Optuna searches an int
    gene's acquisition value by value: most of a proposal's CPU); its proposals come back as ints, in bounds."""
    optuna = pytest.importorskip("optuna")
    from towerlab.search.samplers.gp import RELAXED, modelled

    units, depth = SPACE.genes["units"], SPACE.genes["depth"]
    assert units.high - units.low + 1 > RELAXED >= depth.high - depth.low + 1
    wide = modelled(optuna, units)
    assert isinstance(wide, optuna.distributions.FloatDistribution) and (wide.low, wide.high, wide.log) == (8, 512, True)
    assert isinstance(modelled(optuna, depth), optuna.distributions.IntDistribution)
    result = search(tmp_path / "s.db", gp_config(generations=16))
    model = [m.genome["units"] for g in result.history[10:] for m in g.members]
    assert len(model) == 6 and all(type(u) is int and 8 <= u <= 512 for u in model)


def test_gp_never_proposes_a_genome_twice_and_ends_when_the_space_is_used_up(tmp_path):
    """A model settled on one genome would propose it again and again (the store serving it, nothing
    trained): a repeat is asked again, then drawn at random, and a used-up space ends the search."""
    small = load_space(json.dumps({"model": "custom", "genes": {"x": {"low": 1, "high": 4}, "y": {"low": 1, "high": 3}}}))

    def near_corner(candidate):
        return Outcome.ok(candidate.genome["x"] / 4 + candidate.genome["y"] / 30, epochs=1)

    with Store(tmp_path / "s.db") as store:
        result = run_search(gp_config(generations=20), small, serial(near_corner), store, TCH)
    proposed = [genome_hash(m.genome) for g in result.history for m in g.members]
    assert len(proposed) == len(set(proposed)) == 12 and result.cache_hits == 0 and result.generations == 12


@pytest.mark.slow
def test_gp_resumes_mid_generation_to_the_uninterrupted_history(tmp_path):
    reference = search(tmp_path / "ref.db", gp_config(generations=14, population=2))
    trained = []

    def crash(candidates, record):  # dies in generation 6, after the model has proposed
        for c in candidates:
            if c.generation == 6 and c.index == 1:
                raise KeyboardInterrupt
            trained.append(c)
            record(c, peak(c))

    with pytest.raises(KeyboardInterrupt):
        search(tmp_path / "s.db", gp_config(generations=14, population=2), evaluate=crash)
    assert search(tmp_path / "s.db", gp_config(generations=14, population=2), resume=True) == reference


def test_two_workers_through_the_queue_store_the_one_process_history(tmp_path):
    """In generations (--population 1: each proposed while the one before trains), 2 workers, one of whose
    drivers leads the search, record the one-process search's generations."""
    cfg = gp_config(generations=14, population=1)
    alone = search(tmp_path / "a.db", cfg)

    def trainer(search_):
        def train(assignment):
            time.sleep(0.01 * (assignment.candidate.index + 1))  # the workers' results come back out of order
            outcome = peak(assignment.candidate)
            return dataclasses.replace(outcome, test_accuracy=0.75) if assignment.tests(outcome.fitness) else outcome
        return train

    def work(name, search_id):
        with Store(tmp_path / "q.db") as store:
            Worker(store, name, "cpu", trainer, WorkerOptions(search_ids=[search_id], lease=30.0)).run()

    with Store(tmp_path / "q.db") as store:
        search_id = Search.resolve(cfg, SPACE).create(store, TCH, {"test": True}).id
    threads = [threading.Thread(target=work, args=(f"w{i}", search_id)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    with Store(tmp_path / "q.db") as store:
        stored = [[m["genome"] for m in g.members] for g in store.records.generations(search_id)]
        assert store.records.search(search_id).finished is not None
    assert stored == genomes(alone)


def _member(i, genome, status="ok", rung=0, score=0.5):
    return Member(i, genome, genome_hash(genome), status, score if status == "ok" else None, 1.0, 1, 1.0, 0,
                  "evaluated", reason=None if status == "ok" else "diverged", rung=rung,
                  score=score if status == "ok" else None)


def test_gp_tells_the_model_complete_pruned_and_failed_trials():
    sampler = make_sampler(gp_config(population=3), SPACE, 3)
    first = sampler.propose([])
    members = (_member(0, first[0], rung=2, score=0.7), _member(1, first[1], rung=0, score=0.4),
               _member(2, first[2], status="failed"))
    from towerlab.search.samplers.tpe import told

    states = sampler._optuna.trial.TrialState
    trials = [told(sampler._optuna, m, sampler._distributions, sampler.rungs) for m in members]
    assert [t.state for t in trials] == [states.COMPLETE, states.PRUNED, states.FAIL]
    assert trials[0].value == pytest.approx(0.7) and trials[1].intermediate_values == {0: pytest.approx(0.4)}
    history = [Generation(0, members, GenerationStats(0, 3, 3, 0, 1, 0.7, 0.55, 0.4, 3.0))]
    assert all(SPACE.contains(g) for g in sampler.propose(history))


def test_gp_asks_no_more_trials_than_the_budget_can_train(tmp_path):
    result = search(tmp_path / "s.db", gp_config(population=500, generations=1, max_evaluations=3))
    assert (result.evaluations, len(result.history[0].members)) == (3, 3)


def test_a_gp_search_larger_than_its_model_affords_is_refused_in_one_line_and_auto_takes_it():
    with pytest.raises(UserError, match=r"^the gp sampler fits its Gaussian process to every outcome, .* it takes at "
                                        r"most 2,000 trainings, and this search plans 2,001 \(1 x --generations 2001, "
                                        r"or --max-evaluations\): give fewer, or choose --sampler auto") as caught:
        Search.resolve(gp_config(generations=2001), SPACE)
    assert "\n" not in str(caught.value)
    assert Search.resolve(gp_config(generations=2001, max_evaluations=2000), SPACE).shape.population == 1
    assert Search.resolve(gp_config(sampler="auto", generations=5000), NUMERIC).shape.population == 1


def test_gp_runs_20_trainings_by_default_and_one_a_generation_when_pruned_but_a_population_of_1_is_refused():
    """One a generation: --generations' default is then the sampler's 20 (the start-up's 10 and 10 of
    the model's), as many trainings as 10 generations of 2. Pruned too, asynchronously (each candidate
    promoted against the trainings before it: issue 73); but generations of a --population of 1 would have
    nobody to prune against, and are refused in one line."""
    unset = dict(generations=None)
    assert Search.resolve(gp_config(**unset), NUMERIC).cfg.generations == 20
    assert Search.resolve(gp_config(sampler="auto", **unset), NUMERIC).cfg.generations == 20
    assert Search.resolve(gp_config(sampler="auto", **unset), SPACE).cfg.generations == 20  # ranges beside a list
    assert Search.resolve(gp_config(sampler="auto", **unset), LISTED).cfg.generations == 40  # tpe's 4 x 10 trainings
    assert Search.resolve(gp_config(generations=7), NUMERIC).cfg.generations == 7
    pruned = dict(max_epochs=3, min_epochs=1)
    assert Search.resolve(gp_config(**pruned), NUMERIC).shape == Shape(1, 0, False, asynchronous=True)
    with pytest.raises(UserError, match=r"^--min-epochs prunes the members of a generation against each other: it "
                                        r"needs a --population of 2 or more, got 1 \(or none: then each candidate "
                                        r"is pruned against the trainings before it\)$"):
        Search.resolve(gp_config(population=1, **pruned), NUMERIC)


def test_auto_runs_gp_on_numeric_ranges_pruned_or_not_and_tpe_on_listed_genes_alone(tmp_path):
    def history(sampler, space, **changes):
        with Store(tmp_path / f"{sampler}-{space.fingerprint[:6]}-{len(changes)}.db") as store:
            cfg = gp_config(**{"sampler": sampler, "generations": 13, **changes})
            return genomes(run_search(cfg, space, serial(peak if space is not LISTED else listed_peak), store, TCH))

    def listed_peak(candidate):
        return Outcome.ok(1 - abs(candidate.genome["depth"] - 2) / 10 - (candidate.genome["act"] != "gelu") / 10,
                          epochs=1, seconds=0.1)

    assert history("auto", NUMERIC) == history("gp", NUMERIC)  # 1 a generation, the model from the 11th
    assert history("auto", SPACE, generations=12) == history("gp", SPACE, generations=12)  # ranges beside a list
    listed = history("auto", LISTED, generations=2)
    assert listed == history("tpe", LISTED, generations=2) and len(listed[0]) == 1  # one at a time, as gp
    pruned = dict(generations=2, max_epochs=3, min_epochs=1)
    assert history("auto", NUMERIC, **pruned) == history("gp", NUMERIC, **pruned)  # 2 a generation, racing
    assert history("auto", NUMERIC, **pruned) != history("tpe", NUMERIC, **pruned)


def test_gp_without_scipy_is_one_clear_line(monkeypatch):
    real_import = builtins.__import__

    def no_scipy(name, *args, **kwargs):
        if name == "scipy" or name.startswith("scipy."):
            raise ImportError("No module named 'scipy'", name="scipy")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "scipy", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_scipy)
    with pytest.raises(UserError, match=r"^the gp sampler \(auto's choice where a numeric range is in every trial\) "
                                        r"needs SciPy: pip install 'towerlab\[tpe\]' \(or choose --sampler tpe") as caught:
        Search.resolve(gp_config(), SPACE)
    assert "\n" not in str(caught.value)
