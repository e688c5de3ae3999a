"""`--sampler tpe`: Optuna's Tree-structured Parzen Estimator, asked through a study that lives in
memory and is built afresh for each proposal (towerlab's store is the record, not Optuna's).

Each proposal is made from its inputs alone: the outcomes told so far (each member of a complete
generation, in generation order: a failure FAIL, one a pruned search stopped early PRUNED with its
fitness at the rung it reached), the genomes still in flight as running trials (Optuna's constant
liar keeps the new ones apart from them), and a TPE seeded from the search seed and the generation's
number. No state is carried from one proposal to the next, so any process that has the same inputs
proposes the same genomes: the search records each proposal and its inputs, and whoever takes over
proposing goes on from the store (`towerlab.search.play`).

Without --population (the default), a search proposes one candidate at a time, as workers need one,
with every training then in flight a running trial: asynchronous TPE, as Optuna runs it with several
processes on one storage, and a proposal that repeats a genome is asked again (a repeat would teach
the model nothing). With --population N, each generation asks N trials before any is told and, with
`--overlap` (the default), while the generation before still trains (its trials running): the
history is then the same however many workers train it. `--no-overlap` asks each generation once the
one before is told, as searches recorded before the setting existed did. A listed gene is categorical
(each value a choice, as in the baselines the sampler was measured against); a range gene is Optuna's
int or float distribution, with its log scale or step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from towerlab.config import SamplerSettings, SearchConfig, setting
from towerlab.errors import UserError
from towerlab.search.candidates import sampler_rng
from towerlab.search.history import Generation, Member
from towerlab.search.samplers import InFlight, Sampler, budget_left, generation_number, random_genome
from towerlab.search.samplers.optuna_params import ask_genome, own_distributions
from towerlab.search.space import Gene, Range, Space, genome_hash

Fill = Callable[[Mapping[str, Any]], Mapping[str, Any]]  # a genome as a study is told it (`told`)
REPEATS, DRAWS = 3, 1000  # a repeated genome asked again, then drawn at random (`asked_anew`)
STARTUP = 10  # the trials Optuna's TPESampler draws at random (n_startup_trials' default)


def optuna_module(needed_by: str, instead: str = "") -> Any:
    """The optuna package, or a UserError saying how to install it."""
    try:
        import optuna
    except ImportError:
        raise UserError(f"{needed_by} needs Optuna: pip install 'towerlab[tpe]'{instead}") from None
    return optuna


def distribution(optuna: Any, gene: Gene) -> Any:
    """The Optuna distribution of a gene."""
    if not isinstance(gene, Range):
        return optuna.distributions.CategoricalDistribution(gene)
    if gene.kind == "int":
        return optuna.distributions.IntDistribution(gene.low, gene.high, log=gene.log, step=gene.step or 1)
    return optuna.distributions.FloatDistribution(gene.low, gene.high, log=gene.log, step=gene.step)


@dataclass(frozen=True)
class TPESettings(SamplerSettings):
    """TPE's settings (search run --sampler tpe)."""

    overlap: bool = setting(True, "tpe only: ask each generation's trials while the generation before still "
                                  "trains, its trials counted as running (Optuna's constant liar), so that no "
                                  "worker waits at a generation's end; --no-overlap asks once its outcomes are told")


class TPESampler(Sampler):
    default_population = 4
    Settings = TPESettings
    can_wait_less = True

    @classmethod
    def needs(cls, cfg: SearchConfig, space: Space) -> None:
        optuna_module("the tpe sampler", " (or choose --sampler ga, random or grid)")

    @classmethod
    def asynchronous(cls, cfg: SearchConfig, settings: SamplerSettings) -> bool:
        assert isinstance(settings, TPESettings)
        return super().asynchronous(cfg, settings) and settings.overlap

    def __init__(self, cfg: SearchConfig, space: Space, rungs: int) -> None:
        super().__init__(cfg, space, rungs)
        assert isinstance(self.settings, TPESettings)
        self.overlaps = self.settings.overlap
        self.repeats = self.asynchronous(cfg, self.settings)  # one at a time: a repeat is asked again
        self.startup = STARTUP if self.repeats else 0  # Optuna's TPE draws its first 10 trials at random
        self._optuna = optuna_module("the tpe sampler", " (or choose --sampler ga, random or grid)")
        self._optuna.logging.set_verbosity(self._optuna.logging.WARNING)
        self._distributions = {name: distribution(self._optuna, values) for name, values in space.genes.items()}

    def prepare(self) -> None:
        prepared(self._optuna, self._optuna.samplers.TPESampler(seed=0, n_startup_trials=1))

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        """`population` trials, or fewer where --max-evaluations leaves fewer trainings: the asking stops
        at the first genome past those the budget can train (the engine cuts the generation just
        before it, where it would have cut the whole population's). Each ask costs Optuna time in
        proportion to the trials it holds, so a population of 1,000,000 with --max-evaluations 2
        asks 3 trials, not a million (quadratic: 20,000 took 127 s). The trials asked first are the
        same however many follow, so a generation's members do not change."""
        number = generation_number(history, in_flight)
        with warnings.catch_warnings():  # constant_liar is "experimental" in older Optuna
            warnings.simplefilter("ignore")
            engine = self._optuna.samplers.TPESampler(
                seed=int(sampler_rng(self.cfg.seed, "tpe", number).integers(2**32)), constant_liar=True)
        study = study_of(self._optuna, engine, self._distributions, self.rungs, history, in_flight)
        budget = budget_left(self.cfg, history, in_flight)
        seen = self.proposed(history, in_flight)
        if self.repeats:
            return asked_anew(study, self.space, self._distributions, seen,
                              sampler_rng(self.cfg.seed, "tpe", 2, number),
                              self.population if budget is None else min(self.population, budget))
        genomes: list[dict] = []
        new: set[str] = set()
        for _ in range(self.population):
            _, genome = ask_genome(study, self.space, self._distributions)
            genomes.append(genome)
            if budget is not None:
                h = genome_hash(genomes[-1])
                if h not in seen:
                    new.add(h)
                    if len(new) > budget:
                        break
        return genomes


def prepared(optuna: Any, sampler: Any) -> None:
    """One throwaway proposal of `sampler` from three made-up outcomes: what its first ask imports and sets up."""
    distributions = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    study = optuna.create_study(direction="maximize", sampler=sampler)
    study.add_trials([optuna.trial.create_trial(params={"x": x}, distributions=distributions, value=x)
                      for x in (0.1, 0.5, 0.9)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study.ask(distributions)


def as_it_is(genome: Mapping[str, Any]) -> Mapping[str, Any]:
    """A genome told to a study as it is (its active genes): `told`'s usual `fill`."""
    return genome


def told(optuna: Any, member: Member, distributions: dict, rungs: int, fill: Fill = as_it_is) -> Any:
    """The trial a member of the history is to an Optuna sampler: FAIL where it failed, PRUNED (with its
    score at the rung it reached) where a pruned search stopped it early, else COMPLETE with its score;
    its genome as `fill` completes it."""
    states, create = optuna.trial.TrialState, optuna.trial.create_trial
    genome = fill(member.genome)
    distributions = own_distributions(distributions, genome)
    if not member.ok:
        return create(params=genome, distributions=distributions, state=states.FAIL)
    if member.rung < rungs - 1:
        return create(params=genome, distributions=distributions, state=states.PRUNED,
                      intermediate_values={member.rung: member.score})
    return create(params=genome, distributions=distributions, value=member.score)


def study_of(optuna: Any, sampler: Any, distributions: dict, rungs: int, history: Sequence[Generation],
             in_flight: Optional[InFlight], fill: Fill = as_it_is) -> Any:
    """A study in memory that holds a proposal's inputs: every member of the history told (`told`, the
    generations in their order, whatever order they completed in), then the genomes in flight as running
    trials, each genome as `fill` completes it (`told`); asked through `sampler`."""
    study = optuna.create_study(direction="maximize", sampler=sampler)
    running = optuna.trial.TrialState.RUNNING
    trials = [told(optuna, m, distributions, rungs, fill)
              for generation in sorted(history, key=lambda g: g.generation) for m in generation.members]
    flying = [fill(g) for g in (in_flight.genomes if in_flight else ())]
    trials += [optuna.trial.create_trial(params=g, distributions=own_distributions(distributions, g), state=running)
               for g in flying]
    study.add_trials(trials)
    return study


def asked_anew(study: Any, space: Space, distributions: dict, seen: set[str], rng: Any, n: int,
               rounded: Callable[[str, Any], Any] = lambda name, value: value) -> list[dict]:
    """Up to `n` genomes none of which is in `seen` (which grows with them): each the model's, asked again
    while it repeats one (a repeat stays a running trial of the model, whose next proposal goes elsewhere),
    else, after REPEATS repeats, one drawn at random from `rng`; fewer where DRAWS draws find none (the
    space is all but used up). A repeat would be served from the store and teach the model nothing: a
    search whose model had settled on one genome would go on proposing it, each proposal training nothing.
    `rounded(name, value)`: the value a gene trains with."""
    genomes: list[dict] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while len(genomes) < n:
            genome = _new(study, space, distributions, seen, rng, rounded)
            if genome is None:
                break
            genomes.append(genome)
            seen.add(genome_hash(genome))
    return genomes


def _new(study: Any, space: Space, distributions: dict, seen: set[str], rng: Any,
         rounded: Callable[[str, Any], Any]) -> Optional[dict]:
    for _ in range(REPEATS):
        _, asked = ask_genome(study, space, distributions)
        genome = {name: rounded(name, value) for name, value in asked.items()}
        if genome_hash(genome) not in seen:
            return genome
    for _ in range(DRAWS):
        genome = random_genome(rng, space)
        if genome_hash(genome) not in seen:
            return genome
    return None
