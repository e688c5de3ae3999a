"""A genome as Optuna's trial parameters, and back, for the samplers that ask Optuna (tpe, gp, auto) and
for search export.

Optuna's own form for a conditional parameter is define-by-run: a trial suggests the parameters its
objective asks for, so a parameter under a branch the trial did not take is simply not among its params
nor its distributions. A genome is the same: it holds its active genes only. So a trial is asked gene by
gene in the space's order (`Space.order`: each gene after those its conditions name), an inactive gene
never suggested (`ask_genome`); and a genome told to Optuna, or exported, carries the distributions of
its own genes alone (`own_distributions`). A space without conditional genes is asked all at once, with
its fixed distributions, as it always was (the same trials, the same histories).

What Optuna's samplers then do with a conditional parameter (Optuna 5.1): TPE without `multivariate`
fits each parameter's densities to the trials that hold it, so a conditional gene is modelled from the
trials of its branch; with `multivariate` it models jointly only the parameters every trial holds and
the others one by one (with a warning a trial), unless `group=True` splits the space into the groups of
parameters that occur together and models each group jointly.
GPSampler fits its Gaussian process to the parameters every complete trial holds (its intersection
search space) and draws the others with its independent sampler, at random: a conditional gene is not
modelled.
"""

from __future__ import annotations

from typing import Any, Mapping

from towerlab.search.space import Space


def ask_genome(study: Any, space: Space, distributions: Mapping[str, Any]) -> tuple[Any, dict]:
    """A new trial of `study` and the genome it suggests: every gene at once (`distributions`, each
    gene's) in a space without conditions; else define-by-run, each active gene suggested in
    `space.order`, an inactive one never."""
    if not space.conditional:
        trial = study.ask(dict(distributions))
        return trial, {name: trial.params[name] for name in space.genes}
    trial = study.ask()
    decided: dict[str, Any] = {}
    for name in space.order:
        if space.active(name, decided):
            decided[name] = suggest(trial, name, distributions[name])
    return trial, {name: decided[name] for name in space.genes if name in decided}


def suggest(trial: Any, name: str, distribution: Any) -> Any:
    """A trial's value of one parameter, through its public suggest_* for the distribution's kind."""
    kind = type(distribution).__name__
    if kind == "CategoricalDistribution":
        return trial.suggest_categorical(name, distribution.choices)
    if kind == "IntDistribution":
        return trial.suggest_int(name, distribution.low, distribution.high, step=distribution.step,
                                 log=distribution.log)
    return trial.suggest_float(name, distribution.low, distribution.high, step=distribution.step,
                               log=distribution.log)


def own_distributions(distributions: Mapping[str, Any], genome: Mapping[str, Any]) -> dict[str, Any]:
    """The distributions of the genes `genome` holds (an inactive gene has none, as a parameter a trial
    did not suggest), in the space's order."""
    return {name: d for name, d in distributions.items() if name in genome}
