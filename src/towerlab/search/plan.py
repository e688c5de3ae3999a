"""What a search's budget holds, decided before it starts: the most trainings (and epochs) its settings
plan for each purpose (`planned_trainings`, which the job says before it starts), the default number of
fresh seeds its crowned networks are re-measured with (`resolved_remeasure`), and what re-measuring the
final top takes of a budget in epochs (`crowning_epochs`, which --budget-epochs keeps for it). No store, no
clock: the settings and the sampler's shape alone decide them.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from towerlab.config import SearchConfig
from towerlab.search.judge import MIN_PAIRS
from towerlab.search.pruners import make_pruner
from towerlab.search.samplers import Shape

DEFAULT_REMEASURE = 2
# Of a search's trainings, the most that default re-measuring may add: a quarter, because the
# networks it re-measures are the largest ones as often as not, and races re-measure more (a quick
# search of 8 one-epoch MNIST trainings with 2 seeds for its top 2 spent 98 s re-measuring against 92 s
# searching: bench/results/quality/quick-search-mnist-2026-11-25.json).
REMEASURE_SHARE = 0.25


def planned_trainings(cfg: SearchConfig, shape: Shape, tests: bool = True, probes: bool = False) -> dict:
    """The most trainings the search's budget holds, by purpose, and their epochs: `search`, members
    trained for the first time (population x generations, or --max-evaluations, or as many first rungs
    as --budget-epochs holds); `rungs`, a pruned search's promotions to its higher rungs (as many as its
    pruner's `most_promoted`); `remeasure`, --remeasure K for the final top and for each later
    generation's elite; `test`, the top once each (none where it `tests` nothing). A store that serves
    some of them, early stopping and failures make fewer. A pruned search's generations train at the
    rungs its judge uses (`towerlab.search.judge`: the last, and those below it shown to rank), which no
    plan can know: the counts are those of every rung used, the epochs the most any choice of rungs takes.
    `probes`: its trainings may report no learning curve (an objective of yours), so its judge may probe its
    rungs, each probed genome trained at every rung: fewer than MIN_PAIRS genomes, and those of the (at
    most two) generations that begin before their trainings are judged (`towerlab.search.judge`; asynchronously,
    one a generation, those proposed while they train: one a worker, which no plan knows, counted as two).
    Under --budget-epochs the epochs are at most that budget and the tests': it charges every other training,
    and no new member begins once it is spent (those begun before may still be promoted, a few epochs past it:
    the plan's "about"), where the most that every first rung's promotions take would be tens of times over it."""
    ladder = make_pruner(cfg).rungs
    plans = [_planned(cfg, shape, tests, first) for first in range(len(ladder))]
    plan = {**plans[0], "epochs": max(plan["epochs"] for plan in plans)}
    if probes and len(ladder) > 1:
        probed = min(plan["search"], MIN_PAIRS - 1 + 2 * shape.population)
        plan["rungs"] += probed * (len(ladder) - 1)
        plan["epochs"] += probed * sum(ladder[1:])
    if cfg.budget_epochs is not None:  # it charges every training but the tests; see the docstring
        plan["epochs"] = min(plan["epochs"], cfg.budget_epochs + plan["test"] * cfg.max_epochs)
    return plan


def _planned(cfg: SearchConfig, shape: Shape, tests: bool, first: int) -> dict:
    """`planned_trainings` where every generation's first rung is `first`: its counts with every rung above
    it used, its epochs the most that any choice of the rungs above it takes."""
    generations = 1 if shape.one_generation else generations_of(cfg)
    search = shape.population * generations
    pruner = make_pruner(cfg)
    ladder = pruner.rungs
    # the most first rungs a budget in epochs holds, less what it keeps for crowning the top (`crowning_epochs`)
    first_rungs = (None if cfg.budget_epochs is None
                   else -(-(cfg.budget_epochs - crowning_epochs(cfg)) // ladder[first]))
    budgets = [budget for budget in (cfg.max_evaluations, first_rungs) if budget is not None]
    if budgets:
        search = min(search, *budgets)
        # the generations the budget reaches, each with its promotions and elites (not --generations')
        generations = min(generations, math.ceil(search / shape.population))
    promoted = [n * generations for n in pruner.most_promoted(shape.population)]
    top = min(cfg.top, search)
    remeasure = (cfg.remeasure or 0) * (top + min(shape.elite, shape.population) * (generations - 1))
    test = top if tests else 0
    # The most epochs the promotions take: over every choice of rungs first < s_1 < ... < s_k = last, the j-th
    # training promoted[j - 1] networks at ladder[s_j]; most[r], from the j-th on where s_j is r (j falling).
    last = len(ladder) - 1
    most: dict[int, int] = {}
    for j in range(last - first, 0, -1):
        most = {r: promoted[j - 1] * ladder[r] + (0 if r == last else max(most[q] for q in most if q > r))
                for r in range(first + j, last + 1) if r == last or any(q > r for q in most)}
    above = max(most.values(), default=0)
    return {"search": search, "rungs": sum(promoted[:last - first]), "remeasure": remeasure, "test": test,
            "epochs": search * ladder[first] + above + (remeasure + test) * cfg.max_epochs}


def resolved_remeasure(cfg: SearchConfig, shape: Shape) -> SearchConfig:
    """`cfg` with --remeasure decided: as given, else DEFAULT_REMEASURE fresh seeds, fewer (down to
    none) where those would be more than REMEASURE_SHARE of the search's own trainings: a small
    search should not spend longer re-measuring its winners than finding them (nor, under --budget-epochs,
    more than that share of its epochs)."""
    if cfg.remeasure is not None:
        return cfg
    per_seed = planned_trainings(replace(cfg, remeasure=1), shape)
    most = int(per_seed["search"] * REMEASURE_SHARE // max(1, per_seed["remeasure"]))
    if cfg.budget_epochs is not None:  # and at most that share of a budget in epochs (each at --max-epochs)
        most = min(most, int(cfg.budget_epochs * REMEASURE_SHARE // (max(1, per_seed["remeasure"]) * cfg.max_epochs)))
    return replace(cfg, remeasure=min(DEFAULT_REMEASURE, max(0, most)))  # none where a budget holds no re-measure


def generations_of(cfg: SearchConfig) -> int:
    """A resolved search's --generations (`Search.resolve` gives an unset one its sampler's default)."""
    assert cfg.generations is not None, "a search's --generations is resolved before it is planned or played"
    return cfg.generations


def crowning_epochs(cfg: SearchConfig) -> int:
    """The epochs that re-measuring the final top takes at least (--remeasure K fresh seeds for each of the
    --top networks, each at --max-epochs): what --budget-epochs keeps for it."""
    return (cfg.remeasure or 0) * cfg.top * cfg.max_epochs


def least(*budgets: Optional[int]) -> Optional[int]:
    """The smallest of the budgets that are set (None: none is)."""
    known = [budget for budget in budgets if budget is not None]
    return min(known) if known else None
