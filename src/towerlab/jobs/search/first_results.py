"""A search of your own objective whose first results all failed the same way stops there (`Watch` asks):
a metric named wrong, a flag the script does not take, a typo in the function, fail every trial alike,
and the rest of the budget would go on the same failure. "The same way" is what a failure says whatever
its genes (`towerlab.objective.result.failure_way`): a timeout or a NaN, which may well depend on them,
never stops a search.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from towerlab.objective.result import failure_way
from towerlab.errors import UserError
from towerlab.search import Search
from towerlab.search.store import Evaluation, Store

FIRST_RESULTS = 4  # of a start of a search that plans more: its first this many results, all failed alike, stop it


def failed_alike(rows: Sequence[Evaluation], search: Search, out: Path) -> Optional[str]:
    """Why `search` stops, where its first results `rows` all failed the same way; None otherwise. Where they
    failed for want of the metric and hold others, the line says how to continue with one of those."""
    ways = {failure_way(r.reason) if r.status == "failed" else None for r in rows}
    if not rows or len(ways) > 1 or None in ways:
        return None
    held = sorted({name for r in rows for name in (r.metrics or {})})
    if held and (rows[0].reason or "").startswith("its result has no "):
        again = (f"continue it with `towerlab search run --resume {out} --metric NAME`, NAME one of those its results "
                 f"hold ({', '.join(map(repr, held))}): they are read again, not trained again")
    else:
        again = f"fix it, then continue with `towerlab search run --resume {out}`, or start the search again"
    return (f"the first {len(rows)} trials of search {search.id} all failed the same way (the first: {rows[0].reason}): "
            f"it is stopped before the rest of its budget goes the same way; {again}")


def stop_if_failed_alike(store: Store, search: Search, before: int, out: Path) -> None:
    """A UserError where the first results of `search` after evaluation `before` (this start's) all failed alike."""
    stop = failed_alike(store.records.evaluations(search.stored_id, after=before)[:FIRST_RESULTS], search, out)
    if stop is not None:
        raise UserError(stop)
