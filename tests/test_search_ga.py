"""The genetic operators, the generation loop, the cache and the grid, with fake fitness functions.
Every network is measured once here (remeasure=0): re-measuring is tested in test_search_noise.py."""

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from towerlab.config import SearchConfig
from towerlab.search import (
    Candidate,
    Outcome,
    Space,
    breed,
    candidate_seed,
    genome_hash,
    grid_genomes,
    initial_population,
    load_space,
    make_rng,
    mutate,
    next_generation,
    random_genome,
    rank_key,
    run_search,
    serial,
)
from towerlab.search.store import Store

TCH = "train-config-a"


def GA(**settings):
    return SearchConfig(sampler="ga", remeasure=0, **settings)


def GRID(**settings):
    return SearchConfig(sampler="grid", remeasure=0, **settings)


def score(genome: dict) -> float:
    """A deterministic, structureless fitness in [0, 1)."""
    return int(genome_hash(genome)[:8], 16) / 16**8


class Counting:
    """A fake fitness counting its calls per genome; genomes in `fail` fail."""

    def __init__(self, fail=lambda genome: False):
        self.calls = Counter()
        self.fail = fail

    def __call__(self, candidate: Candidate) -> Outcome:
        self.calls[candidate.genome_hash] += 1
        if self.fail(candidate.genome):
            raise RuntimeError(f"out of memory with {candidate.genome}")
        return Outcome.ok(score(candidate.genome), val_loss=1 - score(candidate.genome), epochs=3, seconds=0.5)


def evolve(tmp_path, cfg=GA(), space="mlp", fitness=None, evaluate=None, tch=TCH, name="s.db", **kw):
    fitness = fitness or Counting()
    with Store(tmp_path / name) as store:
        return run_search(cfg, load_space(space) if isinstance(space, str) else space,
                             evaluate or serial(fitness), store, tch, **kw)


def genomes_of(generation):
    return [m.genome for m in generation.members]


# -- operators ---------------------------------------------------------------------------------

gene_values = st.one_of(st.lists(st.integers(-50, 50), min_size=1, max_size=6, unique=True),
                        st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=6, unique=True))


@st.composite
def spaces(draw):
    genes = {f"g{i}": tuple(draw(gene_values)) for i in range(draw(st.integers(1, 6)))}
    return Space("random", "mlp", genes)


@settings(max_examples=200, deadline=None)
@given(spaces(), st.integers(0, 2**32))
def test_mutation_changes_exactly_one_gene_to_another_allowed_value(space, seed):
    rng = make_rng(seed)
    genome = random_genome(rng, space)
    child = mutate(rng, space, genome)
    changed = [k for k in genome if genome[k] != child[k]]
    assert space.contains(child)
    if any(len(v) > 1 for v in space.genes.values()):
        assert len(changed) == 1
        assert len(space.genes[changed[0]]) > 1
    else:
        assert child == genome


@settings(max_examples=200, deadline=None)
@given(spaces(), st.integers(0, 2**32))
def test_children_only_carry_their_parents_genes(space, seed):
    rng = make_rng(seed)
    mother, father = random_genome(rng, space), random_genome(rng, space)
    child = breed(rng, mother, father)
    assert list(child) == list(mother)
    assert all(child[k] in (mother[k], father[k]) for k in child)


def test_breed_mixes_both_parents():
    rng = make_rng(0)
    mother = {f"g{i}": 0 for i in range(40)}
    father = {f"g{i}": 1 for i in range(40)}
    assert 5 < sum(breed(rng, mother, father).values()) < 35
    with pytest.raises(ValueError):
        breed(rng, mother, {"other": 1})


def test_initial_population_is_distinct_when_the_space_allows():
    space = load_space("mlp")
    population = initial_population(make_rng(1), space, 20)
    assert len({genome_hash(g) for g in population}) == 20 and all(map(space.contains, population))
    tiny = Space("tiny", "mlp", {"layers": (1, 2, 3)})
    population = initial_population(make_rng(1), tiny, 5)
    assert len(population) == 5 and {g["layers"] for g in population[:3]} == {1, 2, 3}


def scored(space, rng, n, fail_every=0):
    population = initial_population(rng, space, n)
    return [(g, None if fail_every and i % fail_every == 0 else score(g)) for i, g in enumerate(population)]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.integers(2, 30), st.floats(0, 1), st.floats(0, 1), st.integers(0, 30))
def test_next_generation_keeps_size_elites_and_parents(seed, population, retain, random_select, elite):
    space, rng = load_space("mlp"), make_rng(seed)
    elite = min(elite, population)
    before = scored(space, rng, population, fail_every=4)
    after = next_generation(rng, space, before, population=population, retain=retain,
                            random_select=random_select, mutate_chance=0.0, elite=elite)
    assert len(after) == population
    ranked = [g for g, f in sorted(before, key=lambda s: rank_key(*s))]
    survivors = max(elite, int(population * retain + 1e-9), 2)
    assert after[:survivors] == ranked[:survivors]  # the best pass unchanged, elites included
    positions = [ranked.index(g) if g in ranked else -1 for g in after]
    kept = 1
    while kept < population and positions[kept] > positions[kept - 1]:
        kept += 1  # survivors come first, in rank order
    parents, children = after[:kept], after[kept:]
    for child in children:  # every gene from one of two distinct parents (no mutation here)
        assert any(all(child[k] in (p[k], q[k]) for k in child)
                   for i, p in enumerate(parents) for q in parents[i + 1:])


def test_a_generation_has_no_repeats_when_the_space_allows():
    space = load_space("mlp")
    for seed in range(20):
        rng = make_rng(seed)
        after = next_generation(rng, space, scored(space, rng, 20), population=20, retain=0.4,
                                random_select=0.1, mutate_chance=0.2, elite=1)
        assert len({genome_hash(g) for g in after}) == 20


def test_failures_rank_last_and_are_not_kept_by_chance():
    space, rng = load_space("mlp"), make_rng(3)
    before = scored(space, rng, 10, fail_every=2)  # 5 fail
    failed = [g for g, f in before if f is None]
    after = next_generation(rng, space, before, population=10, retain=0.5, random_select=1.0,
                            mutate_chance=0.0, elite=1)
    assert not any(g in after[:5] for g in failed)
    assert rank_key({"a": 1}, 0.0) < rank_key({"a": 0}, None)


def test_retain_zero_still_keeps_two_parents():
    space, rng = load_space("mlp"), make_rng(4)
    before = scored(space, rng, 10)
    ranked = [g for g, f in sorted(before, key=lambda s: rank_key(*s))]
    after = next_generation(rng, space, before, population=10, retain=0.0, random_select=0.0,
                            mutate_chance=0.0, elite=0)
    assert after[:2] == ranked[:2]
    best, second = ranked[:2]  # the only parents: every child is made of their genes
    assert all(all(child[k] in (best[k], second[k]) for k in child) for child in after[2:])


def test_candidate_seed_depends_only_on_search_generation_and_index():
    seeds = {candidate_seed(7, g, i) for g in range(5) for i in range(20)}
    assert len(seeds) == 100 and all(isinstance(s, int) and 0 <= s < 2**31 for s in seeds)
    assert candidate_seed(7, 2, 3) == candidate_seed(7, 2, 3) != candidate_seed(8, 2, 3)


def test_the_search_leaves_global_random_state_alone():
    import random
    random.seed(5)
    np.random.seed(5)
    before = (random.random(), np.random.random())
    random.seed(5)
    np.random.seed(5)
    initial_population(make_rng(0), load_space("mlp"), 20)
    assert (random.random(), np.random.random()) == before


# -- the loop ----------------------------------------------------------------------------------

def test_population_size_kept_and_counts_add_up(tmp_path):
    result = evolve(tmp_path, GA(population=12, generations=6))
    assert result.generations == len(result.history) == 6
    for gen in result.history:
        assert len(gen.members) == gen.stats.size == 12
        assert gen.stats.evaluated + gen.stats.cached == 12
    assert result.evaluations == sum(g.stats.evaluated for g in result.history)
    assert result.cache_hits == 6 * 12 - result.evaluations


def test_elites_survive_every_generation(tmp_path):
    result = evolve(tmp_path, GA(population=10, generations=6, retain=0.0, random_select=0.0, elite=3))
    for gen, nxt in zip(result.history, result.history[1:]):
        best = sorted(gen.members, key=lambda m: rank_key(m.genome, m.fitness))[:3]
        assert genomes_of(nxt)[:3] == [m.genome for m in best]
        assert nxt.stats.best >= gen.stats.best


def test_same_seed_same_history_other_seed_other_history(tmp_path):
    a = evolve(tmp_path, name="a.db")
    b = evolve(tmp_path, name="b.db")
    c = evolve(tmp_path, GA(seed=1), name="c.db")
    assert a == b
    assert a.history[0].members != c.history[0].members


def test_fitness_is_called_once_per_unique_genome_across_generations_and_searches(tmp_path):
    fitness = Counting()
    first = evolve(tmp_path, fitness=fitness)
    assert max(fitness.calls.values()) == 1 and sum(fitness.calls.values()) == first.evaluations
    unique = {m.genome_hash for g in first.history for m in g.members}
    assert len(unique) == first.evaluations < 200
    second = evolve(tmp_path, GA(seed=1), fitness=fitness)  # same store, another search
    assert max(fitness.calls.values()) == 1
    assert sum(fitness.calls.values()) == first.evaluations + second.evaluations
    reused = {m.genome_hash for g in second.history for m in g.members} & unique
    assert reused and second.cache_hits > 0
    assert second.search_id != first.search_id
    third = evolve(tmp_path, fitness=fitness, tch="train-config-b")  # other training settings: no reuse
    assert third.evaluations == first.evaluations and max(fitness.calls.values()) == 2


def test_each_unique_genome_is_trained_once_per_generation(tmp_path):
    tiny = Space("tiny", "mlp", {"layers": (1, 2, 3)})
    batches = []

    def evaluate(candidates, record):
        batches.append([c.genome_hash for c in candidates])
        serial(Counting())(candidates, record)

    result = evolve(tmp_path, GA(population=6, generations=3), space=tiny, evaluate=evaluate)
    assert batches == [sorted(set(batches[0]), key=batches[0].index)] and len(batches[0]) == 3
    first = result.history[0]
    assert (first.stats.evaluated, first.stats.cached) == (3, 3)
    assert [m.source for m in first.members].count("evaluated") == 3
    assert all(g.stats.evaluated == 0 for g in result.history[1:])


def shuffled(fitness, seed):
    rng = np.random.default_rng(seed)

    def evaluate(candidates, record):
        for i in rng.permutation(len(candidates)):
            record(candidates[i], fitness(candidates[i]))

    return evaluate


def threaded(fitness):
    def evaluate(candidates, record):
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda c: record(c, fitness(c)), candidates[::-1]))

    return evaluate


def test_outcome_order_does_not_change_the_history(tmp_path):
    base = evolve(tmp_path, name="a.db")
    assert evolve(tmp_path, evaluate=shuffled(Counting(), 1), name="b.db") == base
    assert evolve(tmp_path, evaluate=threaded(Counting()), name="c.db") == base


def test_failures_rank_last_are_recorded_and_the_search_goes_on(tmp_path):
    fitness = Counting(fail=lambda g: g["activation"] == "sigmoid")
    result = evolve(tmp_path, fitness=fitness)
    assert result.generations == 10 and result.failures > 0
    assert result.failures == sum(g.stats.failed for g in result.history)
    for gen in result.history:
        failed = [m for m in gen.members if not m.ok]
        assert all(m.fitness is None and m.reason.startswith("RuntimeError: out of memory") for m in failed)
        ranked = sorted(gen.members, key=lambda m: rank_key(m.genome, m.fitness))
        assert all(not m.ok for m in ranked[len(ranked) - len(failed):])
    assert all(t.genome["activation"] != "sigmoid" for t in result.top)
    with Store(tmp_path / "s.db") as store:
        rows = [e for e in store.records.evaluations() if e.status == "failed"]
        assert len(rows) == result.failures and all("out of memory" in e.reason for e in rows)


def test_an_evaluator_that_forgets_a_candidate_is_a_bug(tmp_path):
    def lazy(candidates, record):
        record(candidates[0], Outcome.ok(0.5))

    with pytest.raises(RuntimeError, match="without recording 19 of 20"):
        evolve(tmp_path, evaluate=lazy)

    def twice(candidates, record):
        record(candidates[0], Outcome.ok(0.5))
        record(candidates[0], Outcome.ok(0.5))

    with pytest.raises(ValueError, match="recorded twice"):
        evolve(tmp_path, evaluate=twice, name="t.db")


def test_outcome_validation():
    with pytest.raises(ValueError):
        Outcome("done", 0.5)
    with pytest.raises(ValueError):
        Outcome.ok(float("nan"))
    with pytest.raises(ValueError):
        Outcome("failed")
    assert Outcome.ok(np.float32(0.5), val_loss=float("inf")).val_loss is None


def test_on_generation_sees_every_generation(tmp_path):
    seen = []
    result = evolve(tmp_path, GA(generations=4), on_generation=seen.append)
    assert seen == [g.stats for g in result.history]


def test_the_ga_beats_its_first_generation_on_the_original_space(tmp_path):
    space = load_space("mlp")
    rank = {name: {v: i / (len(vs) - 1) for i, v in enumerate(vs)} for name, vs in space.genes.items()}

    def fitness(candidate):
        g = candidate.genome
        # Bigger and deeper is better, relu and adam are best; plus small deterministic noise.
        value = 0.5 + 0.2 * rank["neurons"][g["neurons"]] + 0.1 * rank["layers"][g["layers"]]
        value += 0.1 * (g["activation"] == "relu") + 0.05 * (g["optimizer"] == "adam")
        return Outcome.ok(value + 0.01 * score(g))

    for seed in range(3):
        result = evolve(tmp_path, GA(seed=seed), fitness=fitness, name=f"{seed}.db")
        first, last = result.history[0].stats, result.history[-1].stats
        assert last.best > first.best and last.mean > first.mean + 0.05
        assert result.top[0].fitness == last.best


# -- the grid ----------------------------------------------------------------------------------

def small_space(tmp_path, layers="[1, 2]", neurons="[16, 32, 64]"):
    path = tmp_path / "small.toml"
    path.write_text(f'model = "mlp"\n[genes]\nlayers = {layers}\nneurons = {neurons}\n')
    return load_space(path)


def test_grid_evaluates_every_genome_in_order(tmp_path):
    space, fitness = small_space(tmp_path), Counting()
    with Store(tmp_path / "g.db") as store:
        result = run_search(GRID(top=3), space, serial(fitness), store, TCH)
    assert genomes_of(result.history[0]) == list(space.all_genomes())
    assert result.evaluations == 6 == sum(fitness.calls.values()) and result.cache_hits == 0
    assert [t.fitness for t in result.top] == sorted((score(g) for g in space.all_genomes()), reverse=True)[:3]


def test_grid_limit_draws_a_seeded_subset(tmp_path):
    space = small_space(tmp_path, layers="[1, 2, 3, 4]", neurons="[8, 16, 32, 64, 128]")
    picked = grid_genomes(space, 5, seed=0)
    order = list(space.all_genomes())
    assert len(picked) == 5 and sorted(picked, key=order.index) == picked
    assert grid_genomes(space, 5, seed=0) == picked != grid_genomes(space, 5, seed=1)
    assert grid_genomes(space, 50, seed=0) == order
    with Store(tmp_path / "g.db") as store:
        result = run_search(GRID(limit=5), space, serial(Counting()), store, TCH)
    assert genomes_of(result.history[0]) == picked and result.evaluations == 5


def test_grid_reuses_the_evolution_cache(tmp_path):
    space = small_space(tmp_path)
    fitness = Counting()
    evolved = evolve(tmp_path, GA(population=4, generations=2), space=space, fitness=fitness)
    with Store(tmp_path / "s.db") as store:
        grid = run_search(GRID(), space, serial(fitness), store, TCH)
    assert grid.cache_hits == evolved.evaluations and grid.evaluations == 6 - evolved.evaluations
    assert max(fitness.calls.values()) == 1
