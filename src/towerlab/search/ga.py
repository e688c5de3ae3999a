"""The genetic algorithm: pure operators of (rng, ...) and the generation loop.

Every random draw comes from a `numpy.random.Generator` the search derives from its seed; a
generation's population depends only on (seed, generation, the previous generation's scores), so
a resumed search replays the finished generations from the store and reaches the same members.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from towerlab.config import SearchConfig
from towerlab.search.engine import (
    Generation,
    GenerationStats,
    SearchResult,
    finish_search,
    open_search,
    play_generation,
    rank_key,
)
from towerlab.search.evaluation import GENERATION_STREAM, Evaluate, make_rng
from towerlab.search.space import Space, genome_hash

if TYPE_CHECKING:
    from towerlab.store import Store

# Attempts at a child that is not yet in the generation before a duplicate is accepted (it will be
# a cache hit, not a second training).
_CHILD_TRIES = 32
# numpy draws indices below 2**63; a larger space is sampled gene by gene.
_INDEXABLE = 2**62


def random_genome(rng: np.random.Generator, space: Space) -> dict:
    """Each gene drawn uniformly from its allowed values."""
    return {name: values[int(rng.integers(len(values)))] for name, values in space.genes.items()}


def breed(rng: np.random.Generator, mother: dict, father: dict) -> dict:
    """A child taking each gene from the mother or the father, with even odds."""
    if set(mother) != set(father):
        raise ValueError(f"parents have different genes: {sorted(mother)} vs {sorted(father)}")
    from_mother = rng.random(len(mother)) < 0.5
    return {name: mother[name] if pick else father[name] for name, pick in zip(mother, from_mother)}


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def mutate(rng: np.random.Generator, space: Space, genome: dict) -> dict:
    """A copy with exactly one gene changed to another allowed value. Genes with a single allowed
    value are never picked; when no gene can change, the genome comes back unchanged."""
    changeable = [name for name, values in space.genes.items() if len(values) > 1]
    child = dict(genome)
    if not changeable:
        return child
    name = changeable[int(rng.integers(len(changeable)))]
    others = [v for v in space.genes[name] if not _same(v, genome[name])]
    child[name] = others[int(rng.integers(len(others)))]
    return child


def initial_population(rng: np.random.Generator, space: Space, population: int) -> list[dict]:
    """`population` distinct random genomes; when the space is smaller, every genome (in random
    order) and then random repeats."""
    size = space.size
    if size > _INDEXABLE:
        genomes: dict[str, dict] = {}
        while len(genomes) < population:
            genome = random_genome(rng, space)
            genomes.setdefault(genome_hash(genome), genome)
        return list(genomes.values())
    if size >= population:
        return [space.genome_at(int(i)) for i in rng.choice(size, size=population, replace=False)]
    every = [space.genome_at(int(i)) for i in rng.permutation(size)]
    return every + [random_genome(rng, space) for _ in range(population - size)]


def next_generation(rng: np.random.Generator, space: Space, scored: Sequence[tuple[dict, Optional[float]]],
                    *, population: int, retain: float, random_select: float, mutate_chance: float,
                    elite: int) -> list[dict]:
    """The next population from a scored one: (genome, fitness) pairs, fitness None for a failure.

    Ranked best first (failures last, ties by canonical genome) and deduplicated, the survivors
    are the best max(elite, floor(retain * n), 2) (capped at n), plus each other successful genome
    with probability `random_select`; they pass unchanged and are the parents. Children of two
    distinct random parents (each gene from one of them, then one gene redrawn with probability
    `mutate_chance`) fill the population, retried up to `_CHILD_TRIES` times while they repeat a
    genome already in it. With a single parent, children are its mutations.
    """
    ranked: dict[str, tuple[dict, Optional[float]]] = {}
    for genome, fitness in sorted(scored, key=lambda s: rank_key(*s)):
        ranked.setdefault(genome_hash(genome), (genome, fitness))
    order = list(ranked.values())
    n = len(order)
    keep = min(max(elite, math.floor(n * retain + 1e-9), min(2, n)), n, population)
    parents = [dict(genome) for genome, _ in order[:keep]]
    for genome, fitness in order[keep:]:
        lucky = rng.random() < random_select  # drawn for every rejected one: a stable draw count
        if lucky and fitness is not None and len(parents) < population:
            parents.append(dict(genome))

    result = [dict(p) for p in parents]
    seen = {genome_hash(g) for g in result}
    while len(result) < population:
        child = _child(rng, space, parents, mutate_chance, seen)
        seen.add(genome_hash(child))
        result.append(child)
    return result


def _child(rng: np.random.Generator, space: Space, parents: list[dict], mutate_chance: float,
           seen: set[str]) -> dict:
    for _ in range(_CHILD_TRIES):
        if len(parents) >= 2:
            mother, father = rng.choice(len(parents), size=2, replace=False)
            child = breed(rng, parents[int(mother)], parents[int(father)])
            if rng.random() < mutate_chance:
                child = mutate(rng, space, child)
        else:
            child = mutate(rng, space, parents[0])
        if genome_hash(child) not in seen:
            break
    return child


def run_evolution(cfg: SearchConfig, space: Space, evaluate: Evaluate, store: Store,
                  train_config_hash: str, on_generation: Optional[Callable[[GenerationStats], None]] = None,
                  *, resume: int | bool | None = None) -> SearchResult:
    """Evolve `cfg.generations` generations of `cfg.population` genomes of `space`.

    `evaluate(candidates, record)` trains what the store (keyed by genome hash and
    `train_config_hash`) cannot serve; see `towerlab.search.evaluation`; the counts are defined in
    `towerlab.search.engine`. `on_generation(stats)` is
    called after each generation, replayed ones included (`stats.replayed`). `resume` continues a
    search of the store (True: its latest evolve search; an int: that search id) instead of
    starting a new one: finished generations are replayed and checked, finished evaluations are
    kept, and the result equals an uninterrupted run's.
    """
    search_id = open_search(store, "evolve", cfg, space, train_config_hash, resume)
    history: list[Generation] = []
    population = initial_population(make_rng(cfg.seed, GENERATION_STREAM, 0), space, cfg.population)
    for generation in range(cfg.generations):
        if generation:
            scored = [(m.genome, m.fitness if m.ok else None) for m in history[-1].members]
            population = next_generation(
                make_rng(cfg.seed, GENERATION_STREAM, generation), space, scored,
                population=cfg.population, retain=cfg.retain, random_select=cfg.random_select,
                mutate_chance=cfg.mutate_chance, elite=cfg.elite)
        record = play_generation(store, search_id, cfg.seed, train_config_hash, generation, population,
                                 evaluate)
        history.append(record)
        if on_generation is not None:
            on_generation(record.stats)
    return finish_search(store, search_id, "evolve", history, cfg.top)
