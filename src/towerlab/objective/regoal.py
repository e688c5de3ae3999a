"""A search of your own objective resumed with another goal (`towerlab search run --resume DIR --metric NAME`,
or `--direction`): its trials' results are read again, not trained again.

A trial's row keeps every metric its result gave, a failed trial's too (a result without the search's
metric fails, and keeps the others). A resume may name another of those metrics, or the other direction,
where the rows hold it: each row that gave a result is scored again (ok where it gives the new metric, a
number; failed, saying why, where it does not), every row moves to the search's new training hash (the
goal is part of it), its tasks are dropped and its generations forgotten, so that the search is played
again from its first generation, each member served by its row (the same seeds propose the same first
members; what follows is proposed from the new scores). One transaction (`Records.regoal`), once the
worker side is admitted under the new goal (the objective's code must still be the search's).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from towerlab.errors import UserError
from towerlab.fields import replace, to_dict
from towerlab.objective.admission import admit
from towerlab.objective.kind import Here, Kind
from towerlab.search import Search
from towerlab.search.goal import Aim, Goal
from towerlab.search.pruners import Ladder
from towerlab.search.store import Evaluation, Store


def regoal(store: Store, stored: Search, search: Search, objective: Kind) -> Search:
    """`stored` (the search as its store holds it) ranked from now on by `search`'s goal (the resume's, decided
    by its settings), its rows scored again; `stored` itself where the goal is the same. A UserError (nothing
    changed) where no row holds the metric, or the job's `objective` is not admitted."""
    goal = search.goal
    if goal == stored.goal:
        return stored
    rows = store.records.evaluations(stored.stored_id)
    if not any(goal.metric in (r.metrics or {}) for r in rows):
        held = sorted({name for r in rows for name in (r.metrics or {})})
        raise UserError(f"cannot resume search {stored.id} with --metric {goal.metric}: none of its {len(rows)} "
                        f"result(s) holds it ({'they hold ' + ', '.join(map(repr, held)) if held else 'none holds a metric'}"
                        "): name one they hold, or start a new search")
    # Admitted as the search stands (its code, its numerics: what decides its rows), then ranked anew.
    here = objective.here
    as_it_was = type(objective)(stored, Here(here.device, here.threads, dataclasses.replace(
        here.named, metric=None, direction=None), resuming=True, function=here.function))
    try:
        admit(stored, as_it_was)
    except UserError as exc:
        raise UserError(f"cannot resume search {stored.id} of {store.path}: {exc}") from None
    recorded = {**stored.recorded("objective"), **Aim(stored.aim.kind, goal=goal).recorded()}
    cfg = replace(stored.cfg, metric=goal.metric, direction=goal.direction)
    # The hash as the job measures it against the search's objective (a command's files as recorded).
    regoaled = dataclasses.replace(stored, cfg=cfg, setup={"objective": recorded},
                                   aim=dataclasses.replace(stored.aim, goal=goal))
    new_hash = type(objective)(regoaled, here).training_hash(regoaled)
    hashes = dict(zip(stored.ladder.hashes, Ladder(stored.pruner, new_hash).hashes))
    rescored = [(r.id, *scored(r, goal)) for r in rows if r.metrics]
    store.records.regoal(stored.stored_id, to_dict(cfg), recorded, new_hash, hashes, rescored)
    row = store.records.search(stored.stored_id)
    assert row is not None, "the search is in its store"
    return Search.of_row(row, str(store.path))


def scored(row: Evaluation, goal: Goal) -> tuple[str, Optional[float], Optional[str]]:
    """A row that gave a result, scored by `goal`: (status, fitness, reason)."""
    metrics = row.metrics or {}
    if goal.metric not in metrics:
        return ("failed", None, f"its result has no {goal.metric!r} (it has {', '.join(map(repr, metrics))}): name the "
                                "metric to search (--metric)")
    value = metrics[goal.metric]
    if value is None:
        return "failed", None, f"its {goal.metric} is not finite"
    return "ok", goal.fitness(value), None
