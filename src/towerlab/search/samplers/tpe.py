"""`--sampler tpe`: Optuna's Tree-structured Parzen Estimator, asked and told through a study that
lives in memory (towerlab's store is the record, not Optuna's).

Each generation asks `--population` trials before any is told (Optuna's constant liar keeps them
apart), so the history does not depend on how many workers train them; fewer per generation
means a better-informed TPE and less parallel work. The sampler is seeded from the search seed, so
replaying the tells of a stored search asks the same trials again: a TPE search resumes exactly,
with the same Optuna version. A listed gene is categorical (each value a choice, as in the
baselines the sampler was measured against); a range gene is Optuna's int or float distribution,
with its log scale or step; a conditional gene is suggested only where it is active (define-by-run:
towerlab.search.samplers.optuna_params). A failed candidate is told FAIL; one a pruned search stopped
early is told PRUNED with its fitness at the rung it reached.

With `--overlap` (the default), a generation's trials are asked while the generation before still
trains: its trials count as running, as Optuna does for trials in flight on other workers, and they
are told when it ends. So a worker that finishes early takes the next generation's candidates instead
of waiting, and the history is still one (asks and tells in a fixed order, whatever ran them).
`--no-overlap` asks each generation once the one before is told, as searches recorded before the
setting existed did (they resume that way).
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from towerlab.config import SamplerSettings, SearchConfig, setting
from towerlab.errors import UserError
from towerlab.search.candidates import sampler_rng
from towerlab.search.history import Generation
from towerlab.search.samplers import InFlight, Sampler, Shape, budget_left
from towerlab.search.samplers.optuna_params import ask_genome
from towerlab.search.space import Gene, Range, Space, genome_hash


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

    @classmethod
    def shape(cls, cfg: SearchConfig, space: Space, settings: SamplerSettings) -> Shape:
        shape = super().shape(cfg, space, settings)
        optuna_module("the tpe sampler", " (or choose --sampler ga, random or grid)")
        return shape

    def __init__(self, cfg: SearchConfig, space: Space, rungs: int) -> None:
        super().__init__(cfg, space, rungs)
        assert isinstance(self.settings, TPESettings)
        self.overlaps = self.settings.overlap
        optuna = self._optuna = optuna_module("the tpe sampler", " (or choose --sampler ga, random or grid)")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with warnings.catch_warnings():  # constant_liar is "experimental" in older Optuna
            warnings.simplefilter("ignore")
            sampler = optuna.samplers.TPESampler(seed=int(sampler_rng(cfg.seed, "tpe").integers(2**32)),
                                                 constant_liar=True)
        self._study = optuna.create_study(direction="maximize", sampler=sampler)
        self._distributions = {name: distribution(optuna, values) for name, values in space.genes.items()}
        self._asked: deque[list[Any]] = deque()  # the trials of each generation not told yet, oldest first

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        """`population` trials, or fewer where --max-evaluations leaves fewer trainings: the asking stops
        at the first genome past those the budget can train (the engine cuts the generation just
        before it, where it would have cut the whole population's). Each ask costs Optuna time in
        proportion to the trials it holds, so a population of 1,000,000 with --max-evaluations 2
        asks 3 trials, not a million (quadratic: 20,000 took 127 s). The trials asked first are the
        same however many follow, so a generation's members do not change."""
        budget = budget_left(self.cfg, history, in_flight)
        seen = self.proposed(history, in_flight)
        asked: list[Any] = []
        self._asked.append(asked)
        genomes: list[dict] = []
        new: set[str] = set()
        for _ in range(self.population):
            trial, genome = ask_genome(self._study, self.space, self._distributions)
            asked.append(trial)
            genomes.append(genome)
            if budget is not None:
                h = genome_hash(genomes[-1])
                if h not in seen:
                    new.add(h)
                    if len(new) > budget:
                        break
        return genomes

    def tell(self, generation: Generation) -> None:
        states = self._optuna.trial.TrialState
        # A budget may have cut the generation: the trials past its end stay unanswered.
        for trial, member in zip(self._asked.popleft(), generation.members):
            if not member.ok:
                self._study.tell(trial, state=states.FAIL)
            elif member.rung < self.rungs - 1:
                trial.report(member.score, step=member.rung)
                self._study.tell(trial, state=states.PRUNED)
            else:
                self._study.tell(trial, member.score)
