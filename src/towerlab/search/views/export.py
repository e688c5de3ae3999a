"""`towerlab search export DIR --optuna STORAGE_URL`: a store's searches as Optuna studies, so that
optuna-dashboard and `optuna.visualization` read a towerlab search.

One study per search (maximised: the value is the validation accuracy; a search of your own objective's
study has its direction, and the value is its metric as your objective returned it), one trial per genome
the search's generations hold, in the order they first appear, at the highest rung it reached (as the
search ranks it): params with their distributions (a list gene categorical, a range Optuna's int or
float distribution; a conditional gene inactive in the genome is neither, as Optuna records a
parameter a trial did not suggest), the value and state (COMPLETE; PRUNED below a pruned search's last rung; FAIL),
the value at each rung it trained as intermediate values (step = the rung's epochs; also the searched metric at
each epoch of the curve its training reported, your objective's or towerlab's own: step = the epoch), and in the
user attributes its seed, where it came from (trained by this search, or served by the cache), its
re-measures (`val_accuracies`, or your objective's `values`, and `seeds`: the evaluation's first), its
test accuracy when the search tested it, every metric your objective returned (`metrics`), and why it
failed. Only complete generations are exported.

`--follow` keeps the studies in step with a running search, so that optuna-dashboard follows it: each
generation's new genomes are added as it completes, until the search is finished.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable, Optional

from towerlab.atomic import require_regular_file
from towerlab.errors import UserError
from towerlab.search.search import Search
from towerlab.search.store.integrity import records_of
from towerlab.search.samplers.tpe import distribution, optuna_module
from towerlab.search.samplers.optuna_params import own_distributions
from towerlab.search.store import Evaluation, SearchRow, Store


def export_optuna(store: Store, storage_url: str, study_name: str,
                  follow: Optional[Callable[[list[tuple[str, int]]], None]] = None) -> list[tuple[str, int]]:
    """Write every search of `store` as a study of the Optuna storage `storage_url`, named
    `study_name` (`study_name`-ID when the store holds several searches); returns (study name,
    trials) per search. Refused before anything is written: a study of that name already there, an
    SQLite storage that keeps nothing (in memory) or that is the store itself. A failure while
    writing (a full disk) removes the studies begun and the file the export made: nothing is left
    that would block the same export once there is room."""
    optuna = optuna_module("--optuna", "")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    searches = store.records.searches()
    if not searches:
        raise UserError(f"store {store.path} holds no search to export")
    study_name = printable(study_name)
    names = {s.id: study_name if len(searches) == 1 else f"{study_name}-{s.id}" for s in searches}
    target = sqlite_file(storage_url, store.path)
    with records_of(store):  # every trial read before anything is opened for writing
        studies = [(search, search_trials(optuna, store, search)) for search in searches]
        progress = {search.id: _progress(store, search.id) for search in searches}
    made = target is not None and not target.exists()
    try:
        storage = optuna.storages.get_storage(storage_url)
        existing = {s.study_name for s in optuna.get_all_study_summaries(storage)}
    except Exception as exc:  # noqa: BLE001 - a bad URL, an unreachable database or a full disk: say which
        _remove(target if made else None)
        raise UserError(f"cannot open the Optuna storage {printable(storage_url)!r}: {_reason(exc)}") from None
    taken = sorted(set(names.values()) & existing)
    if taken:
        raise UserError(f"the Optuna storage {printable(storage_url)} already holds a study {taken[0]!r}: "
                        "pass another --study-name (or delete that study)")
    written: list[tuple[str, int]] = []
    try:
        for search, trials in studies:
            study = optuna.create_study(storage=storage, study_name=names[search.id],
                                        direction=Search.of_row(search, str(store.path)).goal.direction)
            written.append((names[search.id], 0))
            study.set_user_attr("towerlab_search", {"id": search.id, "store": printable(str(store.path)),
                                                    "sampler": search.sampler, "space": search.space,
                                                    "config": search.config})
            study.add_trials(trials)
            written[-1] = (names[search.id], len(trials))
            for key, value in progress[search.id].items():
                study.set_user_attr(key, value)
    except Exception as exc:  # noqa: BLE001 - a full disk, a lost connection: undo what this export began
        for name, _ in written:
            with contextlib.suppress(Exception):
                optuna.delete_study(study_name=name, storage=storage)
        _close(storage)
        _remove(target if made else None)
        raise UserError(f"could not write the studies to the Optuna storage {printable(storage_url)}: {_reason(exc)}; "
                        "nothing was written") from None
    if follow is not None:
        follow(written)
        _follow(optuna, store, storage, {s.id: names[s.id] for s, _ in studies},
                {s.id: {t.user_attrs["genome_hash"] for t in trials} for s, trials in studies}, follow)
    return written


FOLLOW_EVERY = 5.0  # seconds between looks at the store while following


def _follow(optuna: Any, store: Store, storage: Any, names: dict[int, str], exported: dict[int, set[str]],
            told: Callable[[list[tuple[str, int]]], None]) -> None:
    """Keep the studies in step with their searches until every one is finished: each look adds a trial
    for every genome that a newly complete generation brought (as the export makes it), and updates
    the study's `towerlab_progress` attribute; `told` hears (study, trials added) after each look that
    added any. A genome's trial is the one it got when it first appeared: a later promotion to a higher
    rung, or the top's test accuracies (the study's `towerlab_top` attribute at the end), do not
    change it; an export once the search is finished writes them all."""
    while True:
        # Looked at first: a search that finishes during this look is followed once more.
        done = all(store.records.finished(i) for i in names)
        added = []
        for search_id, name in names.items():
            search = store.records.search(search_id)
            if search is None:
                continue
            with records_of(store):
                fresh = [t for t in search_trials(optuna, store, search) if t.user_attrs["genome_hash"]
                         not in exported[search_id]]
                progress = _progress(store, search_id)
            study = optuna.load_study(study_name=name, storage=storage)
            if fresh:
                study.add_trials(fresh)
                exported[search_id] |= {t.user_attrs["genome_hash"] for t in fresh}
                added.append((name, len(fresh)))
            for key, value in progress.items():
                study.set_user_attr(key, value)
        if added:
            told(added)
        if done:
            return
        time.sleep(FOLLOW_EVERY)


def _progress(store: Store, search_id: int) -> dict:
    """A study's attributes that say where its search stands: `towerlab_progress` (generations complete,
    when it finished) and, once finished, `towerlab_top`, its crowned top (genome, validation accuracy
    over its seeds, or your objective's `value`, test accuracy)."""
    search = store.records.search(search_id)
    if search is None:
        return {}
    generations = store.records.generations(search_id)
    attrs: dict[str, Any] = {"towerlab_progress": {"generations_complete": sum(g.complete for g in generations),
                                                   "finished": search.finished}}
    if search.summary is not None:
        top = []
        stored = Search.of_row(search, str(store.path))
        for entry in search.summary.get("top", []):
            row = store.records.lookup(entry["genome_hash"], entry["train_config_hash"], search_id)
            top.append({"genome": entry["genome"],
                        "value" if stored.own else "val_accuracy": stored.goal.value(entry["fitness"]),
                        "test_accuracy": None if row is None else row.test_accuracy})
        attrs["towerlab_top"] = top
    return attrs


def printable(text: str) -> str:
    """`text` with what is not UTF-8 (a folder name's stray bytes, kept by Python as surrogates)
    replaced: a database takes UTF-8 text only."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def sqlite_file(storage_url: str, store_path: str | os.PathLike) -> Optional[Path]:
    """The file of an SQLite storage URL (None for another database), refusing one that saves
    nothing (`sqlite://`, `sqlite:///`, `sqlite:///:memory:`: a study in memory ends with this
    command), one that is not a regular file, and the store itself (its own input would take
    Optuna's tables)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(storage_url)
    except (ArgumentError, ValueError):
        return None  # the storage's own open says what is wrong with it
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file::memory:") or url.query.get("mode") == "memory":
        raise UserError(f"--optuna {storage_url}: an SQLite database in memory is gone when the export ends, so "
                        "nothing would be saved: give a file, e.g. sqlite:///study.db")
    path = Path(database.removeprefix("file:") if url.query.get("uri") else database)
    require_regular_file(path, "--optuna")
    with contextlib.suppress(OSError):
        if os.path.samefile(path, store_path):
            raise UserError(f"--optuna {printable(storage_url)} is the search store this command reads: Optuna's "
                            "tables would be written into it; give another file, e.g. sqlite:///study.db")
    return path


def _reason(exc: BaseException) -> str:
    """What went wrong, from the innermost cause (Optuna wraps a full disk in a StorageInternalError
    that blames "invalid data")."""
    while (inner := exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)) is not None:
        exc = inner
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


def _close(storage: Any) -> None:
    """Let go of an SQLite storage's file (its engine's connections), so that it can be removed."""
    with contextlib.suppress(Exception):
        storage.engine.dispose()


def _remove(path: Optional[Path]) -> None:
    """Remove a database file this export made (with SQLite's side files), when the export failed."""
    if path is None:
        return
    for name in (path, Path(f"{path}-journal"), Path(f"{path}-wal"), Path(f"{path}-shm")):
        with contextlib.suppress(OSError):
            name.unlink()


def search_trials(optuna: Any, store: Store, search: SearchRow) -> list[Any]:
    """The Optuna trials (FrozenTrial) of one search."""
    stored = Search.of_row(search, str(store.path))
    value = stored.goal.value
    distributions = {name: distribution(optuna, gene) for name, gene in stored.space.genes.items()}
    ladder, hashes = stored.ladder.epochs, stored.ladder.hashes
    members: dict[str, dict] = {}
    for generation in store.records.generations(search.id):
        if not generation.complete:
            continue
        for m in generation.final_results:
            best = members.get(m["genome_hash"])
            if best is None or m.get("rung", 0) > best.get("rung", 0):
                members[m["genome_hash"]] = {**m, "generation": (best or {"generation": generation.generation})
                                             ["generation"]}
    trials = []
    for h, m in members.items():
        rung = m.get("rung", 0)
        rows = [store.records.lookup(h, hashes[r], search.id) for r in range(rung + 1)]
        row = rows[rung]
        remeasures = _remeasures(store, h, hashes[rung], search.id, stored.cfg.remeasure or 0)
        state = (optuna.trial.TrialState.FAIL if m["status"] != "ok" else
                 optuna.trial.TrialState.PRUNED if rung < len(ladder) - 1 else optuna.trial.TrialState.COMPLETE)
        attrs = {"genome_hash": h, "seed": m["seed"], "source": m["source"], "generation": m["generation"] + 1,
                 "epochs": m["epochs"], "rung": rung, "seconds": m["seconds"],
                 **({} if stored.own else {"val_loss": m["val_loss"]}),  # towerlab's training's loss, none of yours
                 "values" if stored.own else "val_accuracies": [value(m["fitness"]),
                                                                 *[value(r.fitness) for r in remeasures]],
                 "seeds": [m["seed"], *[r.seed for r in remeasures]]}
        if row is not None and row.test_accuracy is not None:
            attrs["test_accuracy"] = row.test_accuracy
        if row is not None and row.metrics:
            attrs["metrics"] = row.metrics
        if m.get("reason"):
            attrs["reason"] = m["reason"]
        finished = _finished(row)
        trials.append(optuna.trial.FrozenTrial(
            number=0, trial_id=0, state=state, value=value(m["fitness"]) if m["status"] == "ok" else None,
            datetime_start=finished - timedelta(seconds=m["seconds"]), datetime_complete=finished,
            params=dict(m["genome"]), distributions=own_distributions(distributions, m["genome"]),  # an inactive gene: none
            user_attrs=attrs, system_attrs={},
            intermediate_values={**{ladder[r]: value(e.fitness) for r, e in enumerate(rows)
                                    if e is not None and e.status == "ok" and e.fitness is not None
                                    and math.isfinite(e.fitness)}, **_curve(row, stored.goal.metric)}))
    return trials


def _curve(row: Optional[Evaluation], metric: str) -> dict[int, float]:
    """The searched metric at each epoch of the curve an objective of yours reported (`report()`, a command's
    {"epoch": ...} lines): a trial's intermediate values, as Optuna's own `trial.report` makes them."""
    points = (row.curve or []) if row is not None else []
    return {int(p["epoch"]): float(p[metric]) for p in points if isinstance(p, dict) and isinstance(p.get("epoch"), int)
            and isinstance(p.get(metric), (int, float)) and math.isfinite(p[metric])}


def _remeasures(store: Store, h: str, train_config_hash: str, search_id: int, remeasure: int) -> list[Evaluation]:
    """The re-measures the search made of a genome (a failed one included: its fitness is None)."""
    rows = [store.records.lookup(h, train_config_hash, search_id, replicate) for replicate in range(1, remeasure + 1)]
    return [r for r in rows if r is not None]


def _finished(row: Optional[Evaluation]) -> datetime:
    """When the training finished, in local time without a zone, as Optuna keeps its own times."""
    if row is None:
        return datetime.now()
    return datetime.fromisoformat(row.finished_at).astimezone().replace(tzinfo=None)
