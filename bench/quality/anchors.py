"""The anchors that bench/quality/lcbench.py and bench/quality/rbv2_xgboost.py share, each run on a towerlab `Space` (its
genes and `when` conditions) as its own users run it, one trial at a time, each knowing every outcome
before it. `evaluate(config) -> float` trains a configuration (its active genes) and returns what is
maximized; a method is asked until `trials` are done or `evaluate` raises the benchmark's BudgetSpent.
Each returns {"sampler_seconds": the CPU its proposing took (the whole run's less the trainings')}.

- Optuna (`optuna_run`): a study asked define-by-run, as an objective with `if booster == "dart":
  trial.suggest_float("rate_drop", ...)` asks it: each active gene suggested in the space's order.
- SMAC3 2.x (`smac_run`): a ConfigSpace with the space's conditions (InCondition / EqualsCondition, and
  their conjunction where a gene names several), `Scenario(cs, deterministic=True, n_trials=trials,
  seed=seed)` (the surrogates answer the same whatever the seed: SMAC's own examples of a deterministic
  target say so, and without it SMAC's intensifier evaluates each configuration on up to 3 seeds), and
  `facade.optimize()` with the facade's defaults: HyperparameterOptimizationFacade (a random forest, its
  Sobol initial design, local and random search of the acquisition) or BlackBoxFacade (a Gaussian
  process). SMAC minimizes: its cost is -evaluate(config).
- HEBO 0.3 (`hebo_run`): its DesignSpace takes no conditions, so every gene is given (a log range as
  `pow`, a log int range as `pow_int`, a list as `cat`) and the genes a configuration's conditions leave
  inactive are dropped before it trains (what a HEBO user's objective does); `suggest(n_suggestions=1)`,
  `observe(-value)`, seeded through numpy's and torch's global generators, as HEBO draws from them.

Each method's module is imported where it runs: SMAC3 needs ConfigSpace 1.x, which yahpo-gym's pin
(ConfigSpace <= 0.6.1) keeps out of .venv-lcbench, and HEBO numpy < 1.25, so both run from .venv-anchors
(docs/benchmarks.md says how it is made).
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from bench.common.record import write_json
from towerlab.search.ranges import Range
from towerlab.search.space import Space

Evaluate = Callable[[dict], float]


def active(space: Space, config: Mapping[str, Any]) -> dict:
    """`config`'s active genes, in the space's gene order, each as the space takes it (an int gene an int)."""
    decided: dict[str, Any] = {}
    for name in space.order:
        if space.active(name, decided):
            gene, value = space.genes[name], config[name]
            if isinstance(gene, Range):
                value = int(round(float(value))) if gene.kind == "int" else float(value)
                value = min(max(value, gene.low), gene.high)
            elif hasattr(value, "item"):  # a numpy scalar from a method's table
                value = value.item()
            decided[name] = value
    return {name: decided[name] for name in space.genes if name in decided}


class _Clock:
    """CPU seconds of the whole run, less those spent in `evaluate` (`sampler_seconds`)."""

    def __init__(self, evaluate: Evaluate) -> None:
        self._evaluate, self._training, self._start = evaluate, 0.0, time.process_time()

    def evaluate(self, config: dict) -> float:
        started = time.process_time()
        try:
            return self._evaluate(config)
        finally:
            self._training += time.process_time() - started

    @property
    def sampler_seconds(self) -> float:
        return time.process_time() - self._start - self._training


# yahpo-gym reads the data's folder from a configuration file, by default ~/.config/yahpo_gym, which its
# init_config and set_data_path rewrite in place: a process of another benchmark then reads it half-written,
# or waits on the lock that guards it. These benchmarks give it a file of their own, written whole by the
# record writer (JSON is YAML, which yahpo-gym reads it as) where it does not already say the right folder,
# and never in place.
YAHPO_CONFIG = Path(tempfile.gettempdir()) / "towerlab-bench-yahpo-gym.json"


def yahpo(data_dir: Path) -> Any:
    """yahpo_gym's benchmark_set module, reading its surrogates from `data_dir` through YAHPO_CONFIG; under
    ConfigSpace 1.x (.venv-anchors) too."""
    import json
    import os

    wanted = {"data_path": str(data_dir)}
    os.environ["YAHPO_LOCAL_CONFIG"] = str(YAHPO_CONFIG)  # read where yahpo_gym is imported
    try:
        current = json.loads(YAHPO_CONFIG.read_text())
    except (OSError, ValueError):
        current = None
    if current != wanted:
        write_json(YAHPO_CONFIG, wanted)
    from ConfigSpace import ConfigurationSpace
    from yahpo_gym import benchmark_set, local_config

    local_config.settings_path = YAHPO_CONFIG  # (where it was imported before the variable was set)
    if not hasattr(ConfigurationSpace, "_sort_hyperparameters"):
        # ConfigSpace 1.x dropped the method yahpo-gym 1.0.2 re-sorts the space with before each query; the
        # order is not read (values are encoded by name), so it is made a no-op
        ConfigurationSpace._sort_hyperparameters = lambda self: None  # type: ignore[attr-defined]  # gone in 1.x
    return benchmark_set


def _optuna() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)  # GPSampler warns of each conditional gene, each trial
    return optuna


def _suggest(trial: Any, name: str, gene: Any) -> Any:
    if not isinstance(gene, Range):
        return trial.suggest_categorical(name, list(gene))
    if gene.kind == "int":
        return trial.suggest_int(name, int(gene.low), int(gene.high), log=gene.log)
    return trial.suggest_float(name, gene.low, gene.high, log=gene.log)


def optuna_run(space: Space, make_sampler: Callable[[Any, int], Any], evaluate: Evaluate, trials: int,
               seed: int) -> dict:
    """An Optuna sampler asked define-by-run, one trial at a time, until `trials` or the budget."""
    optuna = _optuna()
    clock = _Clock(evaluate)
    with warnings.catch_warnings():  # GPSampler's "independent sampling" of a conditional parameter, each trial
        warnings.simplefilter("ignore")
        study = optuna.create_study(direction="maximize", sampler=make_sampler(optuna, seed))
        for _ in range(trials):
            trial = study.ask()
            decided: dict[str, Any] = {}
            for name in space.order:
                if space.active(name, decided):
                    decided[name] = _suggest(trial, name, space.genes[name])
            study.tell(trial, clock.evaluate(active(space, decided)))
    return {"sampler_seconds": clock.sampler_seconds}


def configspace(space: Space, seed: int) -> Any:
    """The space as a ConfigSpace 1.x ConfigurationSpace, its conditions included."""
    from ConfigSpace import (AndConjunction, Categorical, ConfigurationSpace, EqualsCondition, Float, InCondition,
                             Integer)

    cs = ConfigurationSpace(seed=seed)
    for name, gene in space.genes.items():
        if not isinstance(gene, Range):
            cs.add(Categorical(name, list(gene)))
        elif gene.kind == "int":
            cs.add(Integer(name, (int(gene.low), int(gene.high)), log=gene.log))
        else:
            cs.add(Float(name, (float(gene.low), float(gene.high)), log=gene.log))
    for child, when in space.when.items():
        parts = [InCondition(cs[child], cs[parent], list(values)) if len(values) > 1
                 else EqualsCondition(cs[child], cs[parent], values[0]) for parent, values in when.items()]
        cs.add(parts[0] if len(parts) == 1 else AndConjunction(*parts))
    return cs


def smac_run(space: Space, facade: str, evaluate: Evaluate, trials: int, seed: int) -> dict:
    """SMAC3's `facade` ("hpo": HyperparameterOptimizationFacade, "bb": BlackBoxFacade) with its defaults,
    `optimize()` over `trials` trials of a deterministic target."""
    import smac

    clock = _Clock(evaluate)

    def target(config: Any, seed: int = 0) -> float:
        return -clock.evaluate(active(space, dict(config)))

    kind = {"hpo": smac.HyperparameterOptimizationFacade, "bb": smac.BlackBoxFacade}[facade]
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scenario = smac.Scenario(configspace(space, seed), deterministic=True, n_trials=trials, seed=seed,
                                 output_directory=Path(folder) / "smac")
        kind(scenario, target, overwrite=True, logging_level=40).optimize()
    return {"sampler_seconds": clock.sampler_seconds}


def hebo_space(space: Space) -> Any:
    """The space as HEBO's DesignSpace: every gene, no conditions."""
    from hebo.design_space.design_space import DesignSpace

    params = []
    for name, gene in space.genes.items():
        if not isinstance(gene, Range):
            params.append({"name": name, "type": "cat", "categories": list(gene)})
        elif gene.kind == "int":
            params.append({"name": name, "type": "pow_int" if gene.log else "int", "lb": int(gene.low),
                           "ub": int(gene.high)})
        else:
            params.append({"name": name, "type": "pow" if gene.log else "num", "lb": float(gene.low),
                           "ub": float(gene.high)})
    return DesignSpace().parse(params)


def hebo_run(space: Space, evaluate: Evaluate, trials: int, seed: int) -> dict:
    """HEBO with its defaults, asked one suggestion at a time until `trials` or the budget."""
    import numpy as np
    import torch
    from hebo.optimizers.hebo import HEBO

    np.random.seed(seed)
    torch.manual_seed(seed)
    clock = _Clock(evaluate)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer = HEBO(hebo_space(space), scramble_seed=seed)
        for _ in range(trials):
            suggested = optimizer.suggest(n_suggestions=1)
            value = clock.evaluate(active(space, suggested.iloc[0].to_dict()))
            optimizer.observe(suggested, np.array([[-value]]))
    return {"sampler_seconds": clock.sampler_seconds}
