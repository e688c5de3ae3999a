"""Samplers: what proposes a search's candidates. The search (`Search.play`) runs every
search in one loop: it asks the sampler for a generation (`propose`, from the space, the history
and the sampler's own random streams), serves or trains it through the store, re-measures what the
sampler is about to crown, and tells the sampler the outcomes (`tell`). A sampler never trains,
never touches the store and never reads the clock, so replaying a search against its store
proposes the same generations again: that is how a search resumes.

Adding a sampler: a module here with a `Sampler` subclass, and its line in `SAMPLERS`. A sampler
with settings of its own declares them in that module, as a `SamplerSettings` dataclass of
`setting` fields (towerlab.config) that its `Settings` names: they become flags and config keys of
every search command (listed in the help of those whose sampler reads them), are checked when the sampler is made, recorded with the search's other
settings (config.json, the store) and refused in a search by another sampler. A setting's name is
its sampler's alone: neither another sampler nor SearchConfig declares it. The command line imports
every sampler's module to build its flags, and `towerlab --help` answers without numpy: a sampler
module imports numpy (and anything heavier) where it is used, not at its top.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

from towerlab.config import SamplerSettings, SearchConfig
from towerlab.fields import to_dict, unknown_keys
from towerlab.errors import UserError
from towerlab.search.space import Gene, Range, Space, genome_hash

if TYPE_CHECKING:  # numpy is not imported to build the command line's flags from the samplers' settings
    import numpy as np

    from towerlab.search.history import Generation

SAMPLERS = {
    "auto": "towerlab.search.samplers.auto:AutoSampler",
    "ga": "towerlab.search.samplers.ga:GeneticSampler",
    "gp": "towerlab.search.samplers.gp:GPSampler",
    "grid": "towerlab.search.samplers.grid:GridSampler",
    "random": "towerlab.search.samplers.random:RandomSampler",
    "tpe": "towerlab.search.samplers.tpe:TPESampler",
}

# numpy draws indices below 2**63; a larger space is sampled gene by gene (so is a space with a
# range gene: its genomes are drawn from each gene's distribution, never by position).
INDEXABLE = 2**62


@dataclass(frozen=True)
class Shape:
    """What a search's plan needs of its sampler: its generations' size, the elite it re-measures
    after each, whether it proposes everything at once, and whether it proposes asynchronously (one
    candidate at a time, as workers need them, with any number in flight: `Sampler.asynchronous`)."""

    population: int
    elite: int
    one_generation: bool
    asynchronous: bool = False


@dataclass(frozen=True)
class InFlight:
    """The generations proposed and being trained whose outcomes the sampler has not been told: their
    genomes (in generation order), the new trainings their first rungs make (what they take of
    --max-evaluations), and how many generations they are (the one before, in a search of generations;
    any number in an asynchronous one)."""

    genomes: tuple[dict, ...]
    new: int
    generations: int = 1


def generation_number(history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> int:
    """The number of the generation being proposed: those told, and those in flight."""
    return len(history) + (in_flight.generations if in_flight is not None else 0)


class Sampler:
    """Proposes generations of genomes. `identity` names the SearchConfig fields (besides the seed
    and what every search keeps) that change what it proposes; with its own `Settings` they are what
    it `reads`, and a resumed search must keep them. `settings`: its own settings, checked.
    `elite`: how many of the latest generation's best it keeps unchanged, which the engine
    re-measures before `propose` sees their scores. `one_generation`: it proposes everything at
    once (the grid), so --generations bounds nothing and is not checked against its budget.
    `overlaps`: it proposes a generation while the one before still trains (`propose(history,
    in_flight)`), so that no worker waits at a generation's end; the search then always asks it so,
    which is part of what its history is (a sampler whose proposals do not read the outcomes gives
    the same history either way). `can_wait_less`: it can also propose one candidate at a time with any
    number in flight, which it does without --population (`asynchronous`). Its `shape` is known without
    building it. `rungs`: how many rungs its search's pruner has (the search's `Ladder` says; a member
    told at a lower one was pruned). Its settings are resolved once (`own`), and handed to `shape`.

    A proposal is made from its inputs alone (the generations told, those in flight, the seed and the
    generation's number: `generation_number`), never from a state carried from an earlier proposal: the
    search records each generation once, with what it was proposed from, and whoever proposes next (a
    resumed search, another worker) starts from the store without proposing the recorded ones again."""

    default_population = 20
    default_generations = 10
    identity: tuple[str, ...] = ("population",)
    Settings: type[SamplerSettings] = SamplerSettings
    one_generation = False
    overlaps = False
    can_wait_less = False
    startup = 0  # its first proposals that read no outcome: an asynchronous search queues them at once

    def __init__(self, cfg: SearchConfig, space: Space, rungs: int) -> None:
        self.cfg, self.space, self.rungs = cfg, space, rungs
        self.settings = self.own(cfg)
        shape = self.shape(cfg, space, self.settings)
        self.population, self.elite = shape.population, shape.elite
        self._seen: set[str] = set()  # the hashes of the members of self._counted[:...]: see `proposed`
        self._counted: list[Generation] = []

    @classmethod
    def own(cls, cfg: SearchConfig) -> SamplerSettings:
        """Its own settings, as `cfg` gives them and at their defaults otherwise. Every setting `cfg` gives is
        checked by the sampler that declares it, whichever sampler runs, as a SearchConfig field would be (a
        bad value, or a setting no sampler declares: UserError)."""
        known = _defaults()
        unknown = sorted(set(cfg.settings) - set(known))
        if unknown:
            raise unknown_keys(unknown, known, "search setting")
        checked = {settings: settings(**{f.name: cfg.settings[f.name] for f in dataclasses.fields(settings)
                                         if f.name in cfg.settings})
                   for settings in settings_classes()}
        return checked[cls.Settings] if cls.Settings in checked else cls.Settings()

    @classmethod
    def shape(cls, cfg: SearchConfig, space: Space, settings: SamplerSettings) -> Shape:
        """The shape of its search of `space` under `cfg` and its own `settings` (`own`), once every setting it
        would refuse has been (a UserError), without building it: a sampler is built where it proposes. A
        subclass whose generations or elite differ from --population's and none says so here. An
        asynchronous search's generations are one candidate each."""
        if cls.asynchronous(cfg, settings):
            return Shape(1, 0, cls.one_generation, asynchronous=True)
        return Shape(cls.generation_size(cfg), 0, cls.one_generation)

    @classmethod
    def generation_size(cls, cfg: SearchConfig) -> int:
        """The members of each of its generations, in a search in generations: --population, or its default."""
        return cfg.population or cls.default_population

    @classmethod
    def needs(cls, cfg: SearchConfig, space: Space) -> None:
        """Refuse (UserError) where a package it proposes with is missing: checked once every setting has
        been, so that a command line refused for its settings imports nothing heavy (Optuna takes seconds)."""

    @classmethod
    def asynchronous(cls, cfg: SearchConfig, settings: SamplerSettings) -> bool:
        """Whether its search of `cfg` proposes asynchronously: one candidate at a time, whenever a worker
        needs one, with every training then in flight told as running (what `can_wait_less` samplers do
        without --population; a pruned one's member is promoted against the trainings of the generations
        complete before it: `towerlab.search.rounds.Rounds.peers`). Its history then depends on when the
        outcomes came in, and is recorded with each proposal's inputs; with --population, generations of
        that size are the same however many workers train them."""
        return cls.can_wait_less and cfg.population is None

    @classmethod
    def generations(cls, cfg: SearchConfig, space: Space) -> int:
        """The generations a search of `space` under `cfg` runs at most: --generations, or its own default.
        An asynchronous search's generations are its candidates: as many as its budget holds
        (--max-evaluations, or the trainings --budget-epochs pays for), else its own default's
        trainings (population x generations). A search in generations runs its default's, or as many as
        its budget may take where that is more (each generation's members trained at its shortest rung
        alone): a budget is spent, not cut short by a default it never named."""
        if cfg.generations is not None:
            return cfg.generations
        shortest = cfg.min_epochs or cfg.max_epochs
        budgets = [b for b in (cfg.max_evaluations,
                               None if cfg.budget_epochs is None else -(-cfg.budget_epochs // shortest))
                   if b is not None]
        if cls.asynchronous(cfg, cls.own(cfg)):
            return min(budgets) if budgets else cls.default_population * cls.default_generations
        if not budgets:
            return cls.default_generations
        return max(cls.default_generations, -(-min(budgets) // cls.generation_size(cfg)))

    @classmethod
    def reads(cls) -> tuple[str, ...]:
        """The settings whose values change what it proposes: its `identity` and its own settings."""
        return (*cls.identity, *(f.name for f in dataclasses.fields(cls.Settings)))

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        """The next generation's genomes (genomes of `self.space`), or [] when there are no more. A
        sampler that `overlaps` is also asked with the generation before still `in_flight`."""
        raise NotImplementedError

    def propose_quickly(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        """`propose`'s generation made in far less time, for a worker that waits for it now (an asynchronous
        search whose proposals fall behind its workers): a sampler whose proposals are costly (gp) proposes
        from the same inputs another, cheaper way; the others as `propose`. A function of its inputs too."""
        return self.propose(history, in_flight)

    def tell(self, generation: Generation) -> None:
        """The outcome of the generation just proposed (each member's `score`, `rung`, `ok`). The
        samplers that read the history in `propose` need nothing more."""

    def prepare(self) -> None:
        """Import and set up what it proposes with, where its first proposal would (the modules Optuna imports
        when it first asks, a first fit): done by a worker before its driver thread starts
        (`Search.prepare`), so that no thread imports them beside another. It changes no proposal."""

    def proposed(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> set[str]:
        """The genomes proposed so far: every member of the history, and those of the generation in flight.
        A search's history only grows, so the members of the generations counted before are kept and only
        the new ones are added: rebuilt whole each generation, the set cost a trial time in proportion to
        the history (6% of a worker's time at 100,000 trials, bench/queue/objective_overhead.py). Any other
        history (one that is not the counted one grown) is counted anew."""
        counted = len(self._counted)
        if len(history) < counted or any(a is not b for a, b in zip(history[:counted], self._counted)):
            self._seen, self._counted, counted = set(), [], 0
        for generation in history[counted:]:
            self._seen.update(m.genome_hash for m in generation.members)
            self._counted.append(generation)
        return self._seen | ({genome_hash(g) for g in in_flight.genomes} if in_flight else set())


def sampler_class(name: str) -> type[Sampler]:
    target = SAMPLERS.get(name)
    if target is None:
        raise UserError(f"unknown sampler {name!r}: choose one of {', '.join(SAMPLERS)}")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def settings_classes() -> list[type[SamplerSettings]]:
    """The registered samplers' own settings that hold any, in SAMPLERS' order: the flags and config
    keys a search takes besides SearchConfig's fields. A name declared twice is a bug (RuntimeError):
    its flag would be one sampler's or the other's."""
    classes: list[type[SamplerSettings]] = []
    declared = {f.name: "SearchConfig" for f in dataclasses.fields(SearchConfig)}
    for sampler in SAMPLERS:
        settings = sampler_class(sampler).Settings
        if settings in classes or not dataclasses.fields(settings):
            continue
        for f in dataclasses.fields(settings):
            if f.name in declared:
                raise RuntimeError(f"sampler {sampler} declares the setting {f.name}, which {declared[f.name]} "
                                   "declares as well: give it a name of its own")
            declared[f.name] = f"the {sampler} sampler"
        classes.append(settings)
    return classes


def _defaults() -> dict:
    """Every setting's default: SearchConfig's fields' and every sampler's own."""
    classes: list[type] = [SearchConfig, *settings_classes()]
    return {f.name: f.default for cls in classes for f in dataclasses.fields(cls) if not f.metadata.get("flat")}


def resolved_settings(cfg: SearchConfig, sampler: Optional[type[Sampler]] = None) -> SearchConfig:
    """`cfg` with its sampler's own settings complete (each at its default where not given), as a
    search records them, and the settings of other samplers left out where they are at their
    defaults (set away from them, they stay for `refuse_unused_settings` to name). `sampler`: its
    class, where the caller has it (else looked up by its name)."""
    defaults, own = _defaults(), to_dict((sampler or sampler_class(cfg.sampler)).own(cfg))
    others = {name: value for name, value in cfg.settings.items() if name not in own and value != defaults[name]}
    return dataclasses.replace(cfg, settings={**own, **others})


def settings_of_others(sampler: str) -> dict[str, list[str]]:
    """The settings that only other samplers read (their `reads`), each with those samplers."""
    mine = sampler_class(sampler).reads()
    readers = {name: [s for s in SAMPLERS if name in sampler_class(s).reads()]
               for name in _defaults() if name not in mine}
    return {name: users for name, users in readers.items() if users}


def refuse_unused_settings(cfg: SearchConfig) -> None:
    """A setting that only other samplers read, set away from its default, is a UserError: `evolve
    --limit 5` would otherwise run the whole search as if it had not been given. So is
    --prune-factor in a search that is not pruned (no --min-epochs): checked here rather than in
    SearchConfig beside --prune-places's twin check, so that a search recorded with an ignored factor
    still resumes."""
    defaults, values = _defaults(), to_dict(cfg)
    if cfg.min_epochs is None and cfg.prune_factor != defaults["prune_factor"]:
        raise UserError(f"--prune-factor {cfg.prune_factor} does nothing without --min-epochs: the search is not "
                        "pruned (add --min-epochs, or drop --prune-factor)")
    for name, users in settings_of_others(cfg.sampler).items():
        if name in values and values[name] != defaults[name]:
            flag = "--" + name.replace("_", "-")
            readers = users[0] if len(users) == 1 else ", ".join(users[:-1]) + " and " + users[-1]
            raise UserError(f"{flag} does nothing in a {cfg.sampler} search: only the {readers} sampler"
                            f"{'s read' if len(users) > 1 else ' reads'} it (drop {flag})")


def sampler_shape(cfg: SearchConfig, space: Space, sampler: Optional[type[Sampler]] = None) -> Shape:
    """The shape of the search `cfg` describes, once every refusal of its sampler has been made (a bad
    name or setting, a space it cannot sample, a budget its generations cannot hold: UserError).
    `sampler`: its class, where the caller has it (else looked up by its name)."""
    sampler = sampler or sampler_class(cfg.sampler)
    shape = sampler.shape(cfg, space, sampler.own(cfg))
    generations = sampler.generations(cfg, space)
    most = shape.population * generations
    if not shape.one_generation and cfg.max_evaluations is not None and cfg.max_evaluations > most:
        raise UserError(f"--max-evaluations {cfg.max_evaluations} is more than {generations} "
                        f"generation{'' if generations == 1 else 's'} of "
                        f"{shape.population} can train: pass --generations "
                        f"{-(-cfg.max_evaluations // shape.population)} (or more) with it")
    return shape


def make_sampler(cfg: SearchConfig, space: Space, rungs: int) -> Sampler:
    """The sampler `cfg.sampler` names, set up to propose for this search of `rungs` rungs (a bad name
    or setting: UserError)."""
    return sampler_class(cfg.sampler)(cfg, space, rungs)


def budget_left(cfg: SearchConfig, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> int | None:
    """How many new trainings --max-evaluations leaves the generation about to be proposed (None:
    no limit), counted as the engine counts them (each generation's `evaluated`, and what the one in
    flight takes). A sampler whose proposals cost time need make no more than it takes to find that
    many genomes new to the history: the engine cuts the generation where the budget is reached."""
    if cfg.max_evaluations is None:
        return None
    return max(0, cfg.max_evaluations - sum(g.stats.evaluated for g in history) - (in_flight.new if in_flight else 0))


def random_genome(rng: np.random.Generator, space: Space) -> dict:
    """Each gene drawn from its distribution: uniformly among a list's values, from a range as
    `Range.draw` says; in a conditional space each active gene in turn (`Space.order`), an inactive
    one left out, as Optuna's RandomSampler draws a define-by-run trial."""
    if space.conditional:
        return space.settled({}, lambda name: draw_gene(rng, space.genes[name]))
    return {name: draw_gene(rng, values) for name, values in space.genes.items()}


def draw_gene(rng: np.random.Generator, gene: Gene) -> Any:
    """A value of one gene, drawn from its distribution."""
    return gene.draw(rng) if isinstance(gene, Range) else gene[int(rng.integers(len(gene)))]
