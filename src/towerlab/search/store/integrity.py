"""A store's records checked for their form: valid JSON of the wrong form (a list for a search's settings, a
string for a genome: an edited store, or another program's) is named in one line (`records_of`, around
every reader: the job, its workers, `search show`, `search export`) rather than met as a TypeError deep in
a reader (`misformed_record`)."""

from __future__ import annotations

import contextlib
from typing import Iterator

from towerlab.errors import UserError
from towerlab.search.store import Store


@contextlib.contextmanager
def records_of(store: Store) -> Iterator[None]:
    """Reading `store`'s records: valid JSON of the wrong form there (a list for a search's settings,
    a string for a genome: an edited store, or another program's) is one line naming the record,
    instead of the TypeError or KeyError it meets. An error that the records do not explain is
    left as it is: our bug, with its traceback."""
    try:
        yield
    except (KeyError, TypeError, AttributeError, ValueError, IndexError):
        problem = misformed_record(store)
        if problem is None:
            raise
        raise UserError(f"search store {store.path} holds a record of the wrong form ({problem}): it was edited, "
                        "or written by another program; restore it from a copy") from None


_MEMBER = {"genome_hash": str, "genome": dict}
_RESULT = {**_MEMBER, "status": str, "seed": int, "source": str, "epochs": int, "seconds": (int, float),
           "fitness": (int, float, type(None)), "val_loss": (int, float, type(None))}
_STATS = {"evaluated": int, "cached": int, "failed": int, "seconds": (int, float),
          **{k: (int, float, type(None)) for k in ("best", "mean", "worst")}}
_SETTINGS = {"seed": int, "max_epochs": int, "top": int, "generations": int, "population": (int, type(None))}
_TOP = {"genome_hash": str, "train_config_hash": str, "genome": dict, "fitness": (int, float, type(None)),
        "fitnesses": list}


def misformed_record(store: Store) -> str | None:
    """The first record of `store` that is not of the form towerlab writes, described (None: all are)."""
    from towerlab.config import SearchConfig
    from towerlab.fields import from_dict
    from towerlab.search.samplers import settings_classes

    def lacks(value: object, keys: dict) -> str | None:
        if not isinstance(value, dict):
            return f"{type(value).__name__}, not an object"
        for key, kind in keys.items():
            if not isinstance(value.get(key), kind) or isinstance(value.get(key), bool) and kind in (int, (int, float)):
                return f"its {key} is {type(value.get(key)).__name__}" if key in value else f"it lacks {key}"
        return None

    def rows(value: object, keys: dict) -> str | None:
        if not isinstance(value, list):
            return f"{type(value).__name__}, not a list"
        return next((f"item {i}: {why}" for i, item in enumerate(value) if (why := lacks(item, keys))), None)

    for search in store.records.searches():
        where = f"search {search.id}"
        if not isinstance(search.config, dict):
            return f"{where}'s settings are a {type(search.config).__name__}"
        try:
            from_dict(SearchConfig, search.config, where=f"{where}'s settings", extra=settings_classes())
        except UserError as exc:
            return str(exc)
        why = lacks(search.config, _SETTINGS) or lacks(search.space, {"name": str, "model": str, "genes": dict})
        if why is None and search.summary is not None:
            why = lacks(search.summary, {"top": list}) or rows(search.summary["top"], _TOP)
            where += "'s summary"
        if why:
            return f"{where}: {why}"
        for generation in store.records.generations(search.id):
            where = f"generation {generation.generation + 1} of search {search.id}"
            why = (rows(generation.members, _MEMBER)  # type: ignore[assignment]  # a str, or False: none
                   or (generation.results is not None and rows(generation.results, _RESULT))
                   or (generation.stats is not None and lacks(generation.stats, _STATS)))
            if why:
                return f"{where}: {why}"
        try:
            tasks = store.queue.tasks(search.id)
        except TypeError as exc:  # a task's genome (the store reads no task of that form)
            return f"search {search.id}: {exc}"
        for task in tasks:
            if not isinstance(task.result, (dict, type(None))):
                return f"search {search.id}: task {task.id}'s result is a {type(task.result).__name__}, not an object"
    for evaluation in store.records.evaluations():
        if not isinstance(evaluation.genome, dict) or not isinstance(evaluation.numerics, (dict, type(None))):
            return f"evaluation {evaluation.id}: its genome or numerics are not an object"
    return None
