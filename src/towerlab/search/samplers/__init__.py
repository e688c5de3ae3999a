"""Samplers: what proposes a search's candidates. The engine (`towerlab.search.engine`) runs every
search in one loop: it asks the sampler for a generation (`propose`, from the space, the history
and the sampler's own random streams), serves or trains it through the store, re-measures what the
sampler is about to crown, and tells the sampler the outcomes (`tell`). A sampler never trains,
never touches the store and never reads the clock, so replaying a search against its store
proposes the same generations again: that is how a search resumes.

Adding a sampler: a module here with a `Sampler` subclass, and its line in `SAMPLERS`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Sequence

import numpy as np

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search.space import Range, Space

if TYPE_CHECKING:
    from towerlab.search.history import Generation

SAMPLERS = {
    "ga": "towerlab.search.samplers.ga:GeneticSampler",
    "grid": "towerlab.search.samplers.grid:GridSampler",
    "random": "towerlab.search.samplers.random:RandomSampler",
    "tpe": "towerlab.search.samplers.tpe:TPESampler",
}

# numpy draws indices below 2**63; a larger space is sampled gene by gene (so is a space with a
# range gene: its genomes are drawn from each gene's distribution, never by position).
INDEXABLE = 2**62


class Sampler:
    """Proposes generations of genomes. `identity` names the SearchConfig fields (besides the seed
    and what every search keeps) that change what it proposes: a resumed search must keep them.
    `elite`: how many of the latest generation's best it keeps unchanged, which the engine
    re-measures before `propose` sees their scores. `one_generation`: it proposes everything at
    once (the grid), so --generations bounds nothing and is not checked against its budget."""

    default_population = 20
    identity: tuple[str, ...] = ("population",)
    one_generation = False

    def __init__(self, cfg: SearchConfig, space: Space) -> None:
        self.cfg, self.space = cfg, space
        self.population = cfg.population or self.default_population
        self.elite = 0

    def propose(self, history: Sequence[Generation]) -> list[dict]:
        """The next generation's genomes (genomes of `self.space`), or [] when there are no more."""
        raise NotImplementedError

    def tell(self, generation: Generation) -> None:
        """The outcome of the generation just proposed (each member's `score`, `rung`, `ok`). The
        samplers that read the history in `propose` need nothing more."""


def sampler_class(name: str) -> type[Sampler]:
    target = SAMPLERS.get(name)
    if target is None:
        raise UserError(f"unknown sampler {name!r}: choose one of {', '.join(SAMPLERS)}")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def settings_of_others(sampler: str) -> dict[str, list[str]]:
    """The SearchConfig fields that only other samplers read (their `identity`), each with those samplers."""
    mine = sampler_class(sampler).identity
    readers = {f.name: [s for s in SAMPLERS if f.name in sampler_class(s).identity]
               for f in dataclasses.fields(SearchConfig) if f.name not in mine}
    return {name: users for name, users in readers.items() if users}


def refuse_unused_settings(cfg: SearchConfig) -> None:
    """A setting that only other samplers read, set away from its default, is a UserError: `evolve
    --limit 5` would otherwise run the whole search as if it had not been given. So is
    --prune-factor in a search that is not pruned (no --min-epochs): checked here rather than in
    SearchConfig beside --prune-places's twin check, so that a search recorded with an ignored factor
    still resumes."""
    defaults = {f.name: f.default for f in dataclasses.fields(SearchConfig)}
    if cfg.min_epochs is None and cfg.prune_factor != defaults["prune_factor"]:
        raise UserError(f"--prune-factor {cfg.prune_factor} does nothing without --min-epochs: the search is not "
                        "pruned (add --min-epochs, or drop --prune-factor)")
    for name, users in settings_of_others(cfg.sampler).items():
        if getattr(cfg, name) != defaults[name]:
            flag = "--" + name.replace("_", "-")
            readers = users[0] if len(users) == 1 else ", ".join(users[:-1]) + " and " + users[-1]
            raise UserError(f"{flag} does nothing in a {cfg.sampler} search: only the {readers} sampler"
                            f"{'s read' if len(users) > 1 else ' reads'} it (drop {flag})")


def make_sampler(cfg: SearchConfig, space: Space) -> Sampler:
    """The sampler `cfg.sampler` names, set up for this search (a bad name or setting: UserError)."""
    sampler = sampler_class(cfg.sampler)(cfg, space)
    most = sampler.population * cfg.generations
    if not sampler.one_generation and cfg.max_evaluations is not None and cfg.max_evaluations > most:
        raise UserError(f"--max-evaluations {cfg.max_evaluations} is more than {cfg.generations} "
                        f"generation{'' if cfg.generations == 1 else 's'} of "
                        f"{sampler.population} can train: pass --generations "
                        f"{-(-cfg.max_evaluations // sampler.population)} (or more) with it")
    return sampler


def random_genome(rng: np.random.Generator, space: Space) -> dict:
    """Each gene drawn from its distribution: uniformly among a list's values, from a range as
    `Range.draw` says."""
    return {name: values.draw(rng) if isinstance(values, Range) else values[int(rng.integers(len(values)))]
            for name, values in space.genes.items()}
