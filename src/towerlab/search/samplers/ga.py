"""The genetic algorithm (the original's, with an elite): pure operators of (rng, ...) and the
sampler that chains them.

Every random draw comes from a `numpy.random.Generator` the search derives from its seed; a
generation's population depends only on (seed, generation, the previous generation's scores), so
a resumed search replays the finished generations from the store and reaches the same members.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from towerlab.config import SamplerSettings, SearchConfig, setting
from towerlab.checks import check_fraction
from towerlab.fields import to_dict
from towerlab.errors import UserError
from towerlab.search.candidates import GENERATION_STREAM, make_rng
from towerlab.search.history import Generation, rank_key
from towerlab.search.samplers import INDEXABLE, InFlight, Sampler, Shape, draw_gene, random_genome
from towerlab.search.space import Range, Space, genome_hash

if TYPE_CHECKING:  # numpy is not imported to build the command line's flags from the samplers' settings
    import numpy as np

# Attempts at a child that is not yet in the generation before a duplicate is accepted (it will be
# a cache hit, not a second training).
_CHILD_TRIES = 32


def breed(rng: np.random.Generator, mother: dict, father: dict, space: Optional[Space] = None) -> dict:
    """A child taking each gene from the mother or the father, with even odds. In a conditional
    `space`, the child's genes are decided in order (`Space.order`): an active gene from the parent
    its coin names where that parent has it, else from the other, else (active in neither, as where
    the child's genes that decide it came from both) drawn from its distribution; an inactive gene
    is left out. So a child is always a genome of the space, whichever branches its parents took."""
    if space is not None and space.conditional:
        coins = dict(zip(space.genes, rng.random(len(space.genes)) < 0.5))  # one coin a gene, as below

        def inherited(name: str) -> object:
            first, second = (mother, father) if coins[name] else (father, mother)
            return first[name] if name in first else second[name] if name in second \
                else draw_gene(rng, space.genes[name])
        return space.settled({}, inherited)
    if set(mother) != set(father):
        raise ValueError(f"parents have different genes: {sorted(mother)} vs {sorted(father)}")
    from_mother = rng.random(len(mother)) < 0.5
    return {name: mother[name] if pick else father[name] for name, pick in zip(mother, from_mother)}


def _same(a: object, b: object) -> bool:
    return type(a) is type(b) and a == b


def mutate(rng: np.random.Generator, space: Space, genome: dict) -> dict:
    """A copy with exactly one gene changed: a listed gene to another of its values, drawn
    uniformly; a range gene by a bounded random step on its scale (`Range.moved`). Genes with a
    single allowed value are never picked; when no gene can change, the genome comes back unchanged.
    In a conditional space, one of its active genes changes; where that activates a gene, it is drawn
    from its distribution, and a gene it deactivates is left out."""
    changeable = [name for name in space.genes if name in genome and space.gene_size(name) > 1]
    child = dict(genome)
    if not changeable:
        return child
    name = changeable[int(rng.integers(len(changeable)))]
    gene = space.genes[name]
    if isinstance(gene, Range):
        child[name] = gene.moved(rng, genome[name])
    else:
        others = [v for v in gene if not _same(v, genome[name])]
        child[name] = others[int(rng.integers(len(others)))]
    return space.settled(child, lambda name: draw_gene(rng, space.genes[name])) if space.conditional else child


def initial_population(rng: np.random.Generator, space: Space, population: int) -> list[dict]:
    """`population` distinct random genomes; when the space is smaller, every genome (in random
    order) and then random repeats."""
    size = space.size
    if size > INDEXABLE or (space.drawn_by_gene and size >= population):
        genomes: dict[str, dict] = {}
        while len(genomes) < population:
            genome = random_genome(rng, space)
            genomes.setdefault(genome_hash(genome), genome)
        return list(genomes.values())
    if size >= population:
        return [space.genome_at(int(i)) for i in rng.choice(size, size=population, replace=False)]
    every = [space.genome_at(int(i)) for i in rng.permutation(size)]
    return every + [random_genome(rng, space) for _ in range(population - size)]  # type: ignore[call-overload]  # size: whole here


def next_generation(rng: np.random.Generator, space: Space, scored: Sequence[tuple],
                    *, population: int, retain: float, random_select: float, mutate_chance: float,
                    elite: int) -> list[dict]:
    """The next population from a scored one: (genome, fitness) pairs, fitness None for a failure,
    or (genome, fitness, rung) triples from a pruned search.

    Ranked best first (`rank_key`: failures last, ties by canonical genome) and deduplicated, the survivors
    are the best max(elite, floor(retain * n), 2) (capped at n), plus each other successful genome
    with probability `random_select`; they pass unchanged and are the parents. Children of two
    distinct random parents (each gene from one of them, then one gene redrawn with probability
    `mutate_chance`) fill the population, retried up to `_CHILD_TRIES` times while they repeat a
    genome already in it. With a single parent, children are its mutations.
    """
    ranked: dict[str, tuple[dict, Optional[float]]] = {}
    for genome, fitness, *_ in sorted(scored, key=lambda s: rank_key(*s)):
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
            child = breed(rng, parents[int(mother)], parents[int(father)], space)
            if rng.random() < mutate_chance:
                child = mutate(rng, space, child)
        else:
            child = mutate(rng, space, parents[0])
        if genome_hash(child) not in seen:
            break
    return child


@dataclass(frozen=True)
class GeneticSettings(SamplerSettings):
    """The genetic algorithm's settings (ga, towerlab evolve); their defaults are the original's."""

    retain: float = setting(0.4, "ga: fraction of the best networks kept as parents")
    random_select: float = setting(0.1, "ga: probability of also keeping each rejected network")
    mutate_chance: float = setting(0.2, "ga: probability that a child has one gene redrawn")
    elite: int = setting(1, "ga: the best K networks always survive unchanged")

    def check(self) -> None:
        for name in ("retain", "random_select", "mutate_chance"):
            check_fraction(name, getattr(self, name))


class GeneticSampler(Sampler):
    """`--sampler ga` (`towerlab evolve`): generation 0 is `initial_population`, each next one
    `next_generation` of the one before, ranked by score (re-measured elites by their mean)."""

    Settings = GeneticSettings
    settings: GeneticSettings

    @classmethod
    def shape(cls, cfg: SearchConfig, space: Space, settings: SamplerSettings) -> Shape:
        shape = super().shape(cfg, space, settings)
        assert isinstance(settings, GeneticSettings)
        if shape.population < 2:
            raise UserError(f"the ga sampler breeds each child from two parents: --population must be at least 2, "
                            f"got {shape.population}")
        elite = settings.elite
        if not 0 <= elite <= shape.population:
            raise UserError(f"--elite must be between 0 and --population ({shape.population}), got {elite}")
        return dataclasses.replace(shape, elite=elite)

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        rng = make_rng(self.cfg.seed, GENERATION_STREAM, len(history))
        if not history:
            return initial_population(rng, self.space, self.population)
        return next_generation(rng, self.space, [(m.genome, m.score, m.rung) for m in history[-1].members],
                               population=self.population, **to_dict(self.settings))
