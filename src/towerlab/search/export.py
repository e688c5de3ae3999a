"""`towerlab search export DIR --optuna STORAGE_URL`: a store's searches as Optuna studies, so that
optuna-dashboard and `optuna.visualization` read a towerlab search.

One study per search (maximised: the value is the validation accuracy), one trial per genome the
search's generations hold, in the order they first appear, at the highest rung it reached (as the
search ranks it): params with their distributions (a list gene categorical, a range Optuna's int or
float distribution), the value and state (COMPLETE; PRUNED below a pruned search's last rung; FAIL),
the fitness at each rung it trained as intermediate values (step = the rung's epochs), and in the
user attributes its seed, where it came from (trained by this search, or served by the cache), its
re-measures (`val_accuracies` and `seeds`: the evaluation's first), its test accuracy when the search
tested it, and why it failed. Only complete generations are exported.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import Any, Optional

from towerlab.errors import UserError
from towerlab.search.pruners import rung_epochs
from towerlab.search.rounds import rung_hash
from towerlab.search.samplers.tpe import distribution, optuna_module
from towerlab.search.space import space_of
from towerlab.search.store import Evaluation, SearchRow, Store


def export_optuna(store: Store, storage_url: str, study_name: str) -> list[tuple[str, int]]:
    """Write every search of `store` as a study of the Optuna storage `storage_url`, named
    `study_name` (`study_name`-ID when the store holds several searches); returns (study name,
    trials) per search. A study of that name already there is a UserError, before anything is written."""
    optuna = optuna_module("--optuna", "")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    searches = store.searches()
    if not searches:
        raise UserError(f"store {store.path} holds no search to export")
    names = {s.id: study_name if len(searches) == 1 else f"{study_name}-{s.id}" for s in searches}
    try:
        storage = optuna.storages.get_storage(storage_url)
        existing = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    except Exception as exc:  # noqa: BLE001 - a bad URL or an unreachable database: say which
        raise UserError(f"cannot open the Optuna storage {storage_url!r}: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    taken = sorted(set(names.values()) & existing)
    if taken:
        raise UserError(f"the Optuna storage {storage_url} already holds a study {taken[0]!r}: "
                        "pass another --study-name (or delete that study)")
    written = []
    for search in searches:
        trials = search_trials(optuna, store, search)
        study = optuna.create_study(storage=storage, study_name=names[search.id], direction="maximize")
        study.set_user_attr("towerlab_search", {"id": search.id, "store": str(store.path), "sampler": search.sampler,
                                                "space": search.space, "config": search.config})
        study.add_trials(trials)
        written.append((names[search.id], len(trials)))
    return written


def search_trials(optuna: Any, store: Store, search: SearchRow) -> list[Any]:
    """The Optuna trials (FrozenTrial) of one search."""
    cfg = search.config
    space = space_of({"model": search.space["model"], "genes": search.space["genes"]}, search.space["name"],
                     f"store {store.path}")
    distributions = {name: distribution(optuna, gene) for name, gene in space.genes.items()}
    ladder = rung_epochs(cfg["max_epochs"], cfg.get("min_epochs"), cfg.get("prune_factor", 3))
    hashes = [rung_hash(search.train_config_hash, epochs, cfg["max_epochs"]) for epochs in ladder]
    members: dict[str, dict] = {}
    for generation in store.generations(search.id):
        if not generation.complete:
            continue
        for m in generation.results:
            best = members.get(m["genome_hash"])
            if best is None or m.get("rung", 0) > best.get("rung", 0):
                members[m["genome_hash"]] = {**m, "generation": (best or {"generation": generation.generation})
                                             ["generation"]}
    trials = []
    for h, m in members.items():
        rung = m.get("rung", 0)
        rows = [store.lookup(h, hashes[r], search.id) for r in range(rung + 1)]
        row = rows[rung]
        remeasures = _remeasures(store, h, hashes[rung], search.id, cfg.get("remeasure", 0))
        state = (optuna.trial.TrialState.FAIL if m["status"] != "ok" else
                 optuna.trial.TrialState.PRUNED if rung < len(ladder) - 1 else optuna.trial.TrialState.COMPLETE)
        attrs = {"genome_hash": h, "seed": m["seed"], "source": m["source"], "generation": m["generation"],
                 "epochs": m["epochs"], "rung": rung, "seconds": m["seconds"], "val_loss": m["val_loss"],
                 "val_accuracies": [m["fitness"], *[r.fitness for r in remeasures]],
                 "seeds": [m["seed"], *[r.seed for r in remeasures]]}
        if row is not None and row.test_accuracy is not None:
            attrs["test_accuracy"] = row.test_accuracy
        if m.get("reason"):
            attrs["reason"] = m["reason"]
        finished = _finished(row)
        trials.append(optuna.trial.FrozenTrial(
            number=0, trial_id=0, state=state, value=m["fitness"] if m["status"] == "ok" else None,
            datetime_start=finished - timedelta(seconds=m["seconds"]), datetime_complete=finished,
            params=dict(m["genome"]), distributions=dict(distributions), user_attrs=attrs, system_attrs={},
            intermediate_values={ladder[r]: rows[r].fitness for r in range(rung + 1)
                                 if rows[r] is not None and rows[r].status == "ok" and math.isfinite(rows[r].fitness)}))
    return trials


def _remeasures(store: Store, h: str, train_config_hash: str, search_id: int, remeasure: int) -> list[Evaluation]:
    """The re-measures the search made of a genome (a failed one included: its fitness is None)."""
    rows = [store.lookup(h, train_config_hash, search_id, replicate) for replicate in range(1, remeasure + 1)]
    return [r for r in rows if r is not None]


def _finished(row: Optional[Evaluation]) -> datetime:
    """When the training finished, in local time without a zone, as Optuna keeps its own times."""
    if row is None:
        return datetime.now()
    return datetime.fromisoformat(row.finished_at).astimezone().replace(tzinfo=None)
