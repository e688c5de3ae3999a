"""Typed genes: integer and float ranges (log scale, step, grid points) in a TOML file, a JSON text
and a dict; every sampler draws, mutates or lists them; the store keeps their values bit for bit.
Fake fitness, no torch."""

import importlib.util
import itertools
import json
import math
import struct

import numpy as np
import pytest

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search import Outcome, Space, Store, load_space, make_sampler, random_genome, run_search, serial
from towerlab.search.samplers.ga import initial_population, mutate
from towerlab.search.samplers.grid import grid_genomes
from towerlab.search.space import Range

TYPED = ('model = "cnn"\n[genes]\nfilters = {low = 8, high = 64, log = true}\nblocks = {low = 1, high = 4}\n'
         'lr = {low = 1e-4, high = 0.1, log = true}\ndropout = {low = 0, high = 0.5, step = 0.1}\n'
         'batch_size = [64, 128]\n')
TCH = "typed-train-config"


@pytest.fixture
def typed(tmp_path):
    path = tmp_path / "typed.toml"
    path.write_text(TYPED)
    return path


def fitness(candidate):
    g = candidate.genome
    return Outcome.ok(0.5 - abs(math.log10(g["lr"]) + 2.5) / 10 + g["filters"] / 1000 - g["dropout"] / 10,
                      epochs=1, seconds=0.01)


def search(path, cfg, space, fit=fitness, **kw):
    with Store(path) as store:
        return run_search(cfg, space, serial(fit), store, TCH, **kw)


def bits(x):
    return struct.pack("<d", x) if isinstance(x, float) else x


def test_a_range_is_int_when_both_bounds_are_ints_and_the_gene_takes_ints(typed):
    space = load_space(typed)
    assert space.genes["filters"] == Range("int", 8, 64, log=True)
    assert space.genes["blocks"] == Range("int", 1, 4)
    assert space.genes["lr"] == Range("float", 1e-4, 0.1, log=True)
    assert space.genes["dropout"] == Range("float", 0.0, 0.5, step=0.1)  # int bounds, float gene: floats
    assert type(space.genes["dropout"].low) is float and space.genes["batch_size"] == (64, 128)
    assert space.typed and space.size == math.inf and space.size_text == "a space continuous in lr"
    assert space.gene_size("filters") == 57 and space.gene_size("dropout") == 6


def test_the_same_space_from_toml_json_and_a_dict(typed):
    from_toml = load_space(typed)
    genes = {"filters": {"low": 8, "high": 64, "log": True}, "blocks": {"low": 1, "high": 4},
             "lr": {"low": 1e-4, "high": 0.1, "log": True}, "dropout": {"low": 0, "high": 0.5, "step": 0.1},
             "batch_size": [64, 128]}
    from_json = load_space(json.dumps({"model": "cnn", "genes": genes}))
    assert from_json.genes == from_toml.genes and from_json.fingerprint == from_toml.fingerprint
    assert from_json.to_dict()["genes"]["dropout"] == {"low": 0.0, "high": 0.5, "step": 0.1}
    edited = json.dumps({"model": "cnn", "genes": {**genes, "lr": {"low": 1e-4, "high": 0.2, "log": True}}})
    assert load_space(edited).fingerprint != from_toml.fingerprint
    unlogged = json.dumps({"model": "cnn", "genes": {**genes, "lr": {"low": 1e-4, "high": 0.1}}})
    assert load_space(unlogged).fingerprint != from_toml.fingerprint


def test_a_space_of_lists_keeps_its_fingerprint():
    # as the stores written before typed genes hold them: their searches still resume
    assert {name: load_space(name).fingerprint[:16] for name in ("mlp", "cnn", "whitenet")} == {
        "mlp": "016942f8a2d408b5", "cnn": "8ac0cdda08591482", "whitenet": "1abaad6030ef5d2c"}
    assert not load_space("mlp").typed


@pytest.mark.parametrize("gene, message", [
    ("lr = {low = 0.1}", "a range needs low and high"),
    ("lr = {low = 0.1, high = 0.01}", "low (0.1) must be below high (0.01)"),
    ("lr = {low = 0.0, high = 0.1, log = true}", "bound 0.0 is not a number > 0"),
    ("dropout = {low = 0.0, high = 0.5, log = true}", "a log range needs low > 0"),
    ("lr = {low = 0.1, high = 1.0, log = 1}", "log must be true or false"),
    ("lr = {low = 0.1, high = 1.0, log = true, step = 0.1}", "log and step do not go together"),
    ("dropout = {low = 0.0, high = 0.5, step = 0.2}", "must be a multiple of step"),
    ("dropout = {low = 0.0, high = 0.5, step = -0.1}", "step must be a positive number"),
    ("blocks = {low = 1, high = 4, step = 1.5}", "step must be a positive int"),
    ("blocks = {low = 1, high = 4, points = 3}", "points is for a float range without step"),
    ("dropout = {low = 0.0, high = 0.5, points = 1}", "points must be an int >= 2"),
    ("blocks = {low = 1.0, high = 4.0}", "takes ints: give its range int bounds"),
    ("blocks = {low = 1, high = 9}", "bound 9 is not an int in [1, 4]"),
    ("dropout = {low = 0.0, high = 1.0}", "bound 1.0 is not a number in [0, 1)"),
    ("kernel_size = {low = 3, high = 7}", "takes odd ints"),
    ('optimizer = {low = 1, high = 2}', "takes a list of values"),
    ('lr = {low = "a", high = 0.1}', "low and high must be finite numbers"),
    ("lr = {low = 0.1, high = inf}", "low and high must be finite numbers"),
    ("lr = {low = 0.1, high = 0.2, scale = 2}", "unknown key(s) scale in its range"),
])
def test_a_bad_range_is_one_line_naming_the_file_and_the_gene(tmp_path, gene, message):
    path = tmp_path / "bad.toml"
    path.write_text(f'model = "cnn"\n[genes]\n{gene}\n')
    with pytest.raises(UserError) as err:
        load_space(path)
    text = str(err.value)
    assert message in text and str(path) in text and f"gene '{gene.split()[0]}'" in text and "\n" not in text


def test_an_odd_int_range_steps_by_two(tmp_path):
    path = tmp_path / "odd.toml"
    path.write_text('model = "cnn"\n[genes]\nkernel_size = {low = 3, high = 9, step = 2}\n')
    assert list(load_space(path).all_genomes()) == [{"kernel_size": k} for k in (3, 5, 7, 9)]


def test_random_draws_from_each_distribution(typed):
    space = load_space(typed)
    rng = np.random.default_rng(0)
    draws = [random_genome(rng, space) for _ in range(4000)]
    assert all(space.contains(g) for g in draws)
    assert all(type(g["filters"]) is int and type(g["lr"]) is float for g in draws)
    # log-uniform: half the draws below the geometric middle of [1e-4, 0.1], a quarter below 10**-3.25
    below = sum(g["lr"] < 10**-2.5 for g in draws) / len(draws)
    quarter = sum(g["lr"] < 10**-3.25 for g in draws) / len(draws)
    assert 0.46 < below < 0.54 and 0.22 < quarter < 0.28
    assert 0.46 < sum(g["filters"] <= 23 for g in draws) / len(draws) < 0.54  # sqrt(8 * 64) = 22.6
    assert sorted({g["dropout"] for g in draws}) == [0.0, 0.1, 0.2, 0.30000000000000004, 0.4, 0.5]
    assert {g["blocks"] for g in draws} == {1, 2, 3, 4}


def test_ga_mutates_a_range_by_a_bounded_step_on_its_scale(typed):
    space = load_space(typed)
    rng = np.random.default_rng(1)
    lr, filters = space.genes["lr"], space.genes["filters"]
    for _ in range(500):
        start = lr.draw(rng)
        moved = lr.moved(rng, start)
        assert lr.holds(moved) and moved != start
        assert abs(math.log(moved) - math.log(start)) <= math.log(1000) / 5 + 1e-12
        n = filters.draw(rng)
        m = filters.moved(rng, n)
        assert filters.holds(m) and m != n and abs(math.log(m) - math.log(n)) <= math.log(8) / 5 + math.log(2)
    assert space.genes["blocks"].moved(rng, 1) == 2 and space.genes["blocks"].moved(rng, 4) == 3
    genome = random_genome(rng, space)
    children = [mutate(rng, space, genome) for _ in range(200)]
    assert all(space.contains(c) and sum(c[k] != genome[k] for k in c) == 1 for c in children)
    assert {k for c in children for k in c if c[k] != genome[k]} == set(space.genes)
    population = initial_population(rng, space, 30)
    assert len({json.dumps(g, sort_keys=True) for g in population}) == 30


def test_grid_lists_ranges_and_refuses_a_float_range_without_points(tmp_path, typed):
    with pytest.raises(UserError) as err:
        make_sampler(SearchConfig(sampler="grid"), load_space(typed), 1)
    assert "float gene 'lr'" in str(err.value) and "points = N" in str(err.value) and "\n" not in str(err.value)
    path = tmp_path / "points.toml"
    path.write_text('model = "cnn"\n[genes]\nlr = {low = 1e-4, high = 0.1, log = true, points = 4}\n'
                    'blocks = {low = 1, high = 3}\ndropout = {low = 0, high = 0.5, points = 3}\n')
    space = load_space(path)
    genomes = grid_genomes(space, None, 0)
    assert len(genomes) == 4 * 3 * 3 and make_sampler(SearchConfig(sampler="grid"), space, 1).population == 36
    assert sorted({g["lr"] for g in genomes}) == pytest.approx([1e-4, 1e-3, 1e-2, 0.1])
    assert {g["lr"] for g in genomes} >= {1e-4, 0.1}  # the bounds exactly
    assert sorted({g["dropout"] for g in genomes}) == [0.0, 0.25, 0.5]
    assert all(space.contains(g) for g in genomes)
    subset = grid_genomes(space, 5, 3)
    assert len(subset) == 5 and all(g in genomes for g in subset)


def test_a_grid_never_lists_a_range_out(tmp_path):
    """issue 50: --limit 1 of a 30-million-value int range took 7 minutes and 6.3 GB, a range to 10**18 or
    points = 10**12 was a MemoryError: a limited grid now draws positions and builds only those genomes."""
    space = Space("huge", "cnn", {"dense": Range("int", 1, 10**18),
                                  "dropout": Range("float", 0.0, 0.5, points=10**12), "blocks": (1, 2)})
    picked = grid_genomes(space, 3, 0)
    assert len(picked) == 3 and all(space.contains(g) for g in picked)
    assert picked == grid_genomes(space, 3, 0) != grid_genomes(space, 3, 1)
    positions = [(g["dense"] - 1) * 2 * 10**12 for g in picked]  # the grid keeps its order
    assert positions == sorted(positions)
    wide = Space("wide", "cnn", {"dense": Range("int", 1, 30_000_000)})
    assert [g["dense"] for g in grid_genomes(wide, 4, 7)] == sorted(g["dense"] for g in grid_genomes(wide, 4, 7))
    assert make_sampler(SearchConfig(sampler="grid", settings={"limit": 2}), space, 1).population == 2
    with pytest.raises(UserError, match=r"has 2000000000000000000000000000000 genomes: grid a random subset"):
        make_sampler(SearchConfig(sampler="grid"), space, 1)
    exact = Space("exact", "cnn", {"dense": Range("int", 0, 2**60 + 1)})  # counted without a float's rounding
    assert exact.size == 2**60 + 2 and exact.genome_at(2**60 + 1) == {"dense": 2**60 + 1}


def test_a_limited_grid_draws_what_it_drew_when_it_listed_its_ranges():
    """The positions of a grid small enough to be listed before are still numpy's choice() of them."""
    space = Space("s", "cnn", {"filters": (8, 16), "dense": Range("int", 1, 40),
                               "lr": Range("float", 1e-4, 0.1, log=True, points=5)})
    listed = [dict(zip(("filters", "dense", "lr"), v)) for v in itertools.product(
        (8, 16), range(1, 41), [1e-4, *(math.exp(math.log(1e-4) + (math.log(0.1) - math.log(1e-4)) * i / 4)
                                    for i in range(1, 4)), 0.1])]
    picks = np.random.Generator(np.random.PCG64(np.random.SeedSequence(3, spawn_key=(1,)))).choice(
        len(listed), size=7, replace=False)
    assert grid_genomes(space, 7, 3) == [listed[int(i)] for i in sorted(picks)]
    assert grid_genomes(space, None, 0) == listed


@pytest.mark.parametrize("gene, fragment", [
    ({"low": -1e308, "high": 1e308}, "is wider than the largest float (high - low overflows)"),
    ({"low": -10**308, "high": 10**308}, "is wider than the largest float"),
    ({"low": 0.0, "high": 1e308, "step": 1e-300}, "cuts the range into more values than a float counts"),
    ({"low": 1, "high": 2**1100}, "got 1 and an int of 332 digits"),
])
def test_a_range_no_sampler_could_draw_from_is_refused_in_one_line(gene, fragment):
    """issue 50: these passed validation, then crashed a sampler (OverflowError) or validation itself."""
    with pytest.raises(UserError) as err:
        load_space(json.dumps({"model": "custom", "genes": {"x": gene}}))
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("sampler", ["random", "ga", "tpe", "grid"])
@pytest.mark.parametrize("gene", [{"low": 0, "high": 2**70}, {"low": -2**63, "high": 2**63},
                                  {"low": -8e307, "high": 8e307, "points": 3}])
def test_every_sampler_draws_from_ranges_past_64_bits_and_near_the_largest_float(sampler, gene, tmp_path):
    if sampler == "tpe":
        pytest.importorskip("optuna")
    space = load_space(json.dumps({"model": "custom", "genes": {"x": gene, "y": [1, 2]}}))
    settings = {"limit": 6} if sampler == "grid" else {}
    cfg = SearchConfig(sampler=sampler, population=None if sampler == "grid" else 4, generations=3, remeasure=0,
                       settings=settings)
    result = search(tmp_path / "s.db", cfg, space, lambda c: Outcome.ok(0.5, epochs=1, seconds=0.01))
    genomes = [m.genome for g in result.history for m in g.members]
    assert len(genomes) >= 4 and all(space.contains(g) for g in genomes)


def test_tpe_gets_optunas_int_and_float_distributions(typed):
    optuna = pytest.importorskip("optuna")
    sampler = make_sampler(SearchConfig(sampler="tpe"), load_space(typed), 1)
    d = sampler._distributions
    assert d["filters"] == optuna.distributions.IntDistribution(8, 64, log=True)
    assert d["blocks"] == optuna.distributions.IntDistribution(1, 4)
    assert d["lr"] == optuna.distributions.FloatDistribution(1e-4, 0.1, log=True)
    assert d["dropout"] == optuna.distributions.FloatDistribution(0.0, 0.5, step=0.1)
    assert d["batch_size"] == optuna.distributions.CategoricalDistribution((64, 128))


@pytest.mark.parametrize("sampler", ["random", "ga", "tpe"])
def test_typed_values_round_trip_the_store_bit_for_bit_and_are_served_from_the_cache(tmp_path, typed, sampler):
    if sampler == "tpe":
        pytest.importorskip("optuna")
    space = load_space(typed)
    cfg = SearchConfig(sampler=sampler, population=6, generations=4, remeasure=0, seed=7)
    first = search(tmp_path / "s.db", cfg, space)
    proposed = [m.genome for g in first.history for m in g.members]
    assert all(space.contains(g) for g in proposed) and first.evaluations > 12
    assert len({g["lr"] for g in proposed}) >= 6  # drawn from the distribution, not from a list
    with Store(tmp_path / "s.db") as store:
        stored = {e.genome_hash: e.genome for e in store.records.evaluations(first.search_id)}
    for m in (m for g in first.history for m in g.members):
        assert {k: bits(v) for k, v in stored[m.genome_hash].items()} == {k: bits(v) for k, v in m.genome.items()}
    again = search(tmp_path / "s.db", cfg, space)  # a second search, same seed, same store
    assert again.evaluations == 0 and again.cache_hits == sum(len(g.members) for g in again.history)
    assert [m.genome for g in again.history for m in g.members] == proposed
    assert again.top[0].fitness == first.top[0].fitness


def test_a_resume_with_an_edited_range_is_refused(tmp_path, typed):
    cfg = SearchConfig(sampler="random", population=4, generations=2, remeasure=0)
    search(tmp_path / "s.db", cfg, load_space(typed))
    edited = tmp_path / "edited.toml"
    edited.write_text(TYPED.replace("high = 0.1, log", "high = 0.2, log"))
    with pytest.raises(UserError, match="was made for space"):
        search(tmp_path / "s.db", cfg, load_space(edited), resume=True)
    assert search(tmp_path / "s.db", SearchConfig(sampler="random", population=4, generations=3, remeasure=0),
                  load_space(typed), resume=True).generations == 3


def test_a_huge_range_space_is_sampled_without_listing_it(tmp_path):
    """Issue 41's defect 12: about 10^26 genomes, and one gene of 100,000 values, drawn from at once."""
    huge = tmp_path / "huge.toml"
    huge.write_text('model = "mlp"\n[genes]\nneurons = {low = 1, high = 10000000}\nlayers = {low = 1, high = 1000000}\n'
                    'batch_size = {low = 1, high = 1000000}\nepochs = {low = 1, high = 10000000}\n')
    space = load_space(huge)
    assert space.size == 10**26
    result = search(tmp_path / "r.db", SearchConfig(sampler="random", population=2, generations=1, remeasure=0),
                    space, fit=lambda c: Outcome.ok(0.5))
    assert result.evaluations == 2 and all(space.contains(m.genome) for m in result.history[0].members)
    assert len(space.to_dict()["genes"]["neurons"]) == 2  # low and high, not ten million values
    one = Space("one", "mlp", {"neurons": Range("int", 1, 100000)})
    if importlib.util.find_spec("optuna"):
        tpe = search(tmp_path / "t.db", SearchConfig(sampler="tpe", population=4, generations=3, remeasure=0),
                     one, fit=lambda c: Outcome.ok(c.genome["neurons"] / 10**7))
        assert tpe.evaluations == 12 and all(one.contains(m.genome) for g in tpe.history for m in g.members)
