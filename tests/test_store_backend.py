"""A store's backend is what `towerlab.search.store.database.Backend` and `Transaction` name, nothing more: a
double that subclasses nothing of towerlab's plays a whole search to the rows the SQLite backend gives; every
backend gives each SQL token its dialect's text."""

from __future__ import annotations

from typing import Any, Callable, Optional

from towerlab.config import SearchConfig
from towerlab.search import Candidate, Outcome, load_space, run_search, serial
from towerlab.search.store import Store
from towerlab.search.store.database import TOKENS, Database
from towerlab.search.store.postgresql import PostgreSQL
from towerlab.search.store.sqlite import SQLite

CFG = SearchConfig(sampler="ga", population=6, generations=3, max_epochs=3, remeasure=1, top=2, seed=4, elite=2)


def fitness(c: Candidate) -> Outcome:
    return Outcome.ok(int(c.genome_hash[:6], 16) / 16**6, epochs=1)


class Recording:
    """A backend of its own, a subclass of nothing: it hands the store's SQL to an SQLite backend it holds,
    and records what the store asked of it beyond SQL (its settles)."""

    def __init__(self, inner: SQLite) -> None:
        self.inner, self.where, self.settled = inner, inner.where, []

    def read(self, sql: str, args: tuple = ()) -> list[dict]:
        return self.inner.read(sql, args)

    def write(self, work: Callable[[Any], Any], *, lock: Optional[int] = None) -> Any:
        return self.inner.write(lambda tx: work(_RecordingStatements(tx, self.settled)), lock=lock)

    def open_schema(self, where: object, create: bool, checked: bool = False) -> None:
        self.inner.open_schema(where, create, checked)

    def close(self) -> None:
        self.inner.close()


class _RecordingStatements:
    def __init__(self, tx: Any, settled: list) -> None:
        self.tx, self.settled = tx, settled

    def run(self, sql: str, args: tuple = ()) -> int:
        return self.tx.run(sql, args)

    def rows(self, sql: str, args: tuple = ()) -> list[dict]:
        return self.tx.rows(sql, args)

    def one(self, sql: str, args: tuple = ()) -> Optional[dict]:
        return self.tx.one(sql, args)

    def settle(self, table: str) -> None:
        self.settled.append(table)


def rows(store: Store) -> list[tuple]:
    return sorted((e.generation, e.index, e.replicate, e.genome_hash, e.seed, e.status, e.fitness)
                  for e in store.records.evaluations())


def test_a_backend_that_is_no_database_plays_a_whole_search(tmp_path):
    with Store(tmp_path / "plain.db") as store:
        run_search(CFG, load_space("mlp"), serial(fitness), store, "tch")
        expected = rows(store)
    doubles = []

    def backend(where):
        doubles.append(Recording(SQLite(where)))
        return doubles[-1]

    with Store(tmp_path / "double.db", backend=backend) as store:
        result = run_search(CFG, load_space("mlp"), serial(fitness), store, "tch")
        assert rows(store) == expected and result.generations == 3
        assert store.db is doubles[0] and not isinstance(doubles[0], Database)
    assert doubles[0].settled == ["evaluations"] * 3  # each generation's watermark, as it began


def test_every_backend_gives_each_token_its_text():
    assert set(SQLite._TOKENS) == set(PostgreSQL._TOKENS) == set(TOKENS)
    assert all(TOKENS.values())
