"""`--sampler tpe`: Optuna's Tree-structured Parzen Estimator, asked and told through a study that
lives in memory (towerlab's store is the record, not Optuna's).

Each generation asks `--population` trials before any is told (Optuna's constant liar keeps them
apart), so the history does not depend on how many workers train them; fewer per generation
means a better-informed TPE and less parallel work. The sampler is seeded from the search seed, so
replaying the tells of a stored search asks the same trials again: a TPE search resumes exactly,
with the same Optuna version. A listed gene is categorical (each value a choice, as in the
baselines the sampler was measured against); a range gene is Optuna's int or float distribution,
with its log scale or step. A failed candidate is told FAIL; one a pruned search stopped
early is told PRUNED with its fitness at the rung it reached.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search.candidates import sampler_rng
from towerlab.search.history import Generation
from towerlab.search.pruners import make_pruner
from towerlab.search.samplers import Sampler, budget_left
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


class TPESampler(Sampler):
    default_population = 4

    def __init__(self, cfg: SearchConfig, space: Space) -> None:
        super().__init__(cfg, space)
        optuna = self._optuna = optuna_module("the tpe sampler", " (or choose --sampler ga, random or grid)")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        with warnings.catch_warnings():  # constant_liar is "experimental" in older Optuna
            warnings.simplefilter("ignore")
            sampler = optuna.samplers.TPESampler(seed=int(sampler_rng(cfg.seed, "tpe").integers(2**32)),
                                                 constant_liar=True)
        self._study = optuna.create_study(direction="maximize", sampler=sampler)
        self._distributions = {name: distribution(optuna, values) for name, values in space.genes.items()}
        self._last_rung = len(make_pruner(cfg).rungs) - 1
        self._asked: list[Any] = []

    def propose(self, history: Sequence[Generation]) -> list[dict]:
        """`population` trials, or fewer where --max-evaluations leaves fewer trainings: the asking stops
        at the first genome past those the budget can train (the engine cuts the generation just
        before it, where it would have cut the whole population's). Each ask costs Optuna time in
        proportion to the trials it holds, so a population of 1,000,000 with --max-evaluations 2
        asks 3 trials, not a million (quadratic: 20,000 took 127 s). The trials asked first are the
        same however many follow, so a generation's members do not change."""
        budget = budget_left(self.cfg, history)
        seen = {m.genome_hash for generation in history for m in generation.members}
        self._asked, genomes, new = [], [], set()
        for _ in range(self.population):
            trial = self._study.ask(self._distributions)
            self._asked.append(trial)
            genomes.append({name: trial.params[name] for name in self.space.genes})
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
        for trial, member in zip(self._asked, generation.members):
            if not member.ok:
                self._study.tell(trial, state=states.FAIL)
            elif member.rung < self._last_rung:
                trial.report(member.score, step=member.rung)
                self._study.tell(trial, state=states.PRUNED)
            else:
                self._study.tell(trial, member.score)
