"""The search store: every evaluation, every generation, what resume replays, and the queue of work that
every worker claims from. An SQLite file (one machine) or a PostgreSQL database (many), the same tables in
both. A `Store` is made of parts over one backend, none of which knows the others:

- the backend (`towerlab.search.store.database.Backend`: `towerlab.search.store.sqlite`, `towerlab.search.store.postgresql`),
  what `connect` opens for a store's name: the one SQL text the parts write, run in its dialect, each
  write one transaction, retried where its connection was lost;
- the schema (`towerlab.search.store.schema`), which the backend checks when the store opens: made in an empty
  database, an older store migrated in place, a damaged, foreign or newer one refused in one line;
- `records` (`towerlab.search.store.records.Records`): searches, evaluations and generations, and the cache's
  rule of which row serves a genome;
- `queue` (`towerlab.search.store.queue.TaskQueue`): the tasks workers claim under leases and close once, and
  the workers; its rules are documented there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from towerlab.search.store.database import Backend
from towerlab.search.store.location import STORE_NAME, is_url, opened
from towerlab.search.store.postgresql import PostgreSQL
from towerlab.search.store.records import Records
from towerlab.search.store.rows import Evaluation, GenerationRow, SearchRow, Task
from towerlab.search.store.sqlite import SQLite
from towerlab.search.store.queue import TaskQueue

__all__ = ["STORE_NAME", "Evaluation", "GenerationRow", "SearchRow", "Store", "Task", "connect"]


def connect(target: str | os.PathLike) -> Backend:
    """The backend a store's name means: a postgresql:// URL, or an SQLite file."""
    if is_url(str(target)):
        return PostgreSQL(str(target))
    return SQLite(Path(target))


class Store:
    """A search store: an SQLite file at `target` (or `target`/search.db when `target` is a folder;
    created, with its folder, unless `create=False`), or the PostgreSQL database a postgresql:// URL
    names (its tables created unless `create=False`), as `location.opened` says; its `records` and its
    `queue`. `backend` makes the backend of what it opens (`connect`; a test double, say). `checked`: this
    process's parent opened the store and checked an SQLite file's pages then (a crew's worker process):
    not again (`PRAGMA quick_check` reads the whole file, about 0.3 s at 100,000 trainings; damage met
    later, by any read, is refused in the same line)."""

    def __init__(self, target: str | os.PathLike, *, create: bool = True,
                 backend: Callable[[str | Path], Backend] = connect, checked: bool = False) -> None:
        where = opened(target, create)
        self.url = where if isinstance(where, str) else None
        self.db = backend(where)
        self.path: Path | str = self.db.where if self.url else where
        try:
            self.db.open_schema(self.path, create, checked)
        except BaseException:
            self.db.close()
            raise
        self.records = Records(self.db, self.path)
        self.queue = TaskQueue(self.db, self.path)

    @property
    def target(self) -> str:
        """What opens this store again: its file, or its URL (with the password it was given)."""
        return self.url or str(self.path)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
