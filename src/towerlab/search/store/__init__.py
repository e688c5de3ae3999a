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

from towerlab.errors import UserError
from towerlab.search.store.database import Database
from towerlab.search.store.location import is_url, store_location
from towerlab.search.store.postgresql import PostgreSQL
from towerlab.search.store.records import Records
from towerlab.search.store.rows import Evaluation, GenerationRow, SearchRow, Task
from towerlab.search.store.schema import NoStore
from towerlab.search.store.sqlite import SQLite
from towerlab.search.store.queue import TaskQueue

__all__ = ["STORE_NAME", "Evaluation", "GenerationRow", "SearchRow", "Store", "Task", "connect"]

STORE_NAME = "search.db"  # the store's file name inside a search folder


def connect(target: str | os.PathLike) -> Database:
    """The backend a store's name means: a postgresql:// URL, or an SQLite file."""
    if is_url(str(target)):
        return PostgreSQL(str(target))
    return SQLite(Path(target))


class Store:
    """A search store: an SQLite file at `target` (or `target`/search.db when `target` is a folder;
    created, with its folder, unless `create=False`), or the PostgreSQL database a postgresql:// URL
    names (its tables created unless `create=False`); its `records` and its `queue`."""

    def __init__(self, target: str | os.PathLike, *, create: bool = True) -> None:
        if isinstance(target, str):
            target = store_location(target)
        self.url = str(target) if is_url(str(target)) else None
        if self.url is None:
            path = Path(target)
            if path.is_dir():
                path = path / STORE_NAME
            if not create and not path.is_file():
                raise NoStore(f"no search store at {path}: give the search.db of a search "
                              f"(or the folder holding it)")
            if create:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise UserError(f"cannot create the search store {path}: {exc.strerror or exc}") from None
        self.db = connect(self.url or path)
        self.path: Path | str = self.db.where if self.url else path
        try:
            self.db.open_schema(self.path, create)
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
