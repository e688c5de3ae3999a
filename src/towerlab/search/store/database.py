"""The database under a search store, as its parts (`towerlab.search.store`: records, queue, rows, schema)
see it: `Backend` and `Transaction`, the interfaces that name what a backend must provide (typing
Protocols: a backend provides them without subclassing anything, as a test double does), and `Database`,
what SQLite (`towerlab.search.store.sqlite`, a file on this machine, the default) and PostgreSQL
(`towerlab.search.store.postgresql`, a server that workers on many machines reach by URL) share over a
Python database driver. A third backend is one more file that provides `Backend` (a `Database` subclass
supplies its connection, its BEGIN and how its driver's errors read), and its line in
`towerlab.search.store.connect`. The parts import only these interfaces (tests/test_layout.py).

The parts write their queries once, in the SQL both databases understand, with `?` for parameters and
the tokens of TOKENS (each described there), which a backend turns into its dialect (`Database._TOKENS`,
`_PARAMETER`) and runs. Where the dialects differ beyond a token, the backend does it: a transaction's
`settle(table)` (PostgreSQL locks the table until the writes under way have committed; SQLite, whose
writes are serialised, has nothing to wait for). The store's clock is the database server's
(PostgreSQL), or the kernel's of the machine that holds an SQLite file: every process reads the same,
whatever its own clock says (`towerlab.search.store.sqlite_file`).

Every write is one transaction, given as a function of a `Transaction` so that it can be run again:
PostgreSQL's connection may drop (the server restarts, the network blinks), and then the transaction is
retried on a new connection with a bounded backoff (`RETRY_SECONDS` in all) before the store gives up
with one line. So is one that waited too long for what another process held: every wait inside a
transaction is bounded (each backend says how), since a process frozen mid-transaction (SIGSTOP, a cut
network) would otherwise stall every worker. The functions are written to be idempotent (inserts that
do nothing on conflict, updates that check what they change), so a retry after a commit whose answer
was lost changes nothing twice. `lock=KEY` serialises the transactions that take the same key: SQLite
serialises every write anyway (BEGIN IMMEDIATE); PostgreSQL takes a transaction-scoped advisory lock.
One transaction per write also means a process killed mid-write leaves no half row.

A password in a URL is never printed (`towerlab.search.store.location`): `redacted(url)` is what messages and
records show, and a driver's error is scrubbed of it (`secrets`); the password itself may come from the
URL, from $PGPASSWORD or from ~/.pgpass, as libpq reads them.
"""

from __future__ import annotations

import abc
import os
import sys
import threading
import time
from contextlib import suppress
from typing import Any, Callable, Optional, Protocol, TypeVar

from towerlab.checks import env_number
from towerlab.errors import UserError

T = TypeVar("T")

# The tokens of the store's SQL, and what each stands for; every backend gives each its dialect's text.
TOKENS = {
    "{id}": "an auto-numbered primary key column (its type and constraint)",
    "{now}": "the store's clock in seconds since the epoch, as a number (leases never depend on which "
             "machine's clock reads them)",
    "{stamp}": "the same clock as text, ISO 8601 in UTC, for the times a store records",
    "{skip_locked}": "after a SELECT that claims a row: rows another transaction holds are passed over, not "
                     "waited for (empty where one writer holds the whole store at a time)",
}

# How long a lost PostgreSQL connection is retried, in all, before the store gives up (seconds), and the
# longest wait between two tries: enough for a server restart or a failover, not for an outage.
RETRY_SECONDS = 120.0
RETRY_WAIT = 8.0
RETRY_ENV = "TOWERLAB_DB_RETRY_SECONDS"
# Rows read with one statement at most, where a query lists values (SQLite caps a statement's parameters).
CHUNK = 500


def retry_seconds() -> float:
    """Seconds a lost connection is retried: $TOWERLAB_DB_RETRY_SECONDS, else RETRY_SECONDS."""
    return env_number(RETRY_ENV, RETRY_SECONDS, lambda seconds: 0 <= seconds <= 86400,
                      f"{RETRY_ENV}={{text}}: give the seconds a lost database connection is retried, 0 to 86400")


class StoreLost(UserError):
    """The store's database stayed out of reach, or held by another process, past every retry: the
    process that meets it stops (a worker's task goes back on the queue once it can), one line."""


class Transaction(Protocol):
    """The statements of one transaction, in the store's SQL (see the module's docstring); rows come back
    as dicts."""

    def run(self, sql: str, args: tuple = ()) -> int:
        """Execute; the number of rows it changed."""

    def rows(self, sql: str, args: tuple = ()) -> list[dict]: ...

    def one(self, sql: str, args: tuple = ()) -> Optional[dict]: ...

    def settle(self, table: str) -> None:
        """Wait until the writes to `table` under way in other transactions have committed, and hold new
        ones off until this one ends: rows are numbered as they are written and may commit out of that
        order, so after this every row of `table` up to its newest id is there for good."""


class Backend(Protocol):
    """What a store needs of its database, and so what a backend must provide: `where` it is as messages
    name it (a file, or a URL without its password), reads, writes run whole or not at all (`work` may be
    run again, see the module's docstring; `lock`, a key that serialises the writes that take it), and its
    schema checked when the store opens."""

    where: str

    def read(self, sql: str, args: tuple = ()) -> list[dict]: ...

    def write(self, work: Callable[[Transaction], T], *, lock: Optional[int] = None) -> T: ...

    def open_schema(self, where: object, create: bool, checked: bool = False) -> None:
        """Check the store's schema before anything is written (`towerlab.search.store.schema`): its tables made
        where `create` and the database is empty, an older store migrated, a damaged, foreign or newer one
        refused (UserError; NoStore where there is no store yet and not `create`). `checked`: this process's parent
        checked its pages for damage when it opened it (`Store`)."""

    def close(self) -> None: ...


class Database(abc.ABC):
    """A `Backend` over one connection of a Python database driver, shared by this process's threads
    (one at a time): the dialect's tokens, transactions and their retries. A backend supplies its
    connection, its BEGIN, how its driver's errors read (`_lost`, `_busy`, `_failed`), and where it must
    `_settle` a table (nothing to do where its writes are serialised)."""

    where: str  # the file, or the redacted URL
    secrets: tuple[str, ...] = ()  # what no message may show (a URL's password, as typed and decoded)

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._sql: dict[str, str] = {}
        _OPEN.add(self)

    # -- what each dialect supplies ----------------------------------------------------------------

    _TOKENS: dict[str, str] = {}  # each of TOKENS in this dialect
    _PARAMETER = "?"

    def _settle(self, connection: Any, table: str) -> None:
        """See `Transaction.settle`: where every write holds the whole database (SQLite), nothing to wait for."""

    def _line(self, error: object) -> str:
        """An error in one line, without the secrets (a driver may quote the connection string's parts)."""
        text = _one_line(error)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    @abc.abstractmethod
    def _connect(self) -> Any:
        """A new connection to the database."""

    @abc.abstractmethod
    def _begin(self, connection: Any, lock: Optional[int]) -> None:
        """Open a transaction on `connection` (taking the lock `lock` names, where given)."""

    def _lost(self, error: BaseException) -> bool:
        """Whether `error` means the connection is gone (retry on a new one)."""
        return False

    def _busy(self, error: BaseException) -> Optional[str]:
        """Where `error` means another process held what a transaction needed for longer than it may
        wait (retry it), what to say about it; else None."""
        return None

    @abc.abstractmethod
    def _failed(self, error: BaseException, writing: bool) -> BaseException:
        """What to raise for a database error that no retry mends: usually a UserError."""

    @abc.abstractmethod
    def open_schema(self, where: object, create: bool, checked: bool = False) -> None:
        """See `Backend.open_schema`."""

    # -- running statements --------------------------------------------------------------------------

    def sql(self, text: str) -> str:
        """`text` in this dialect: the tokens replaced, `?` as its parameter marker."""
        done = self._sql.get(text)
        if done is None:
            done = text
            for token, value in self._TOKENS.items():
                done = done.replace(token, value)
            if self._PARAMETER != "?":
                done = done.replace("%", "%%").replace("?", self._PARAMETER)
            self._sql[text] = done
        return done

    def _execute(self, connection: Any, sql: str, args: tuple) -> Any:
        return connection.execute(self.sql(sql), args)

    def _fetch(self, cursor: Any) -> list[dict]:
        return [dict(row) for row in cursor.fetchall()] if cursor.description else []

    def write(self, work: Callable[[Transaction], T], *, lock: Optional[int] = None) -> T:
        """`work` in one transaction, committed whole or rolled back whole (KeyboardInterrupt included);
        run again on a new connection where the old one was lost."""
        return self._retrying(lambda connection: self._transaction(connection, work, lock), writing=True)

    def read(self, sql: str, args: tuple = ()) -> list[dict]:
        return self._retrying(lambda connection: self._fetch(self._execute(connection, sql, args)), writing=False)

    def _transaction(self, connection: Any, work: Callable[[Transaction], T], lock: Optional[int]) -> T:
        self._begin(connection, lock)
        try:
            result = work(Statements(self, connection))
            connection.execute("COMMIT")
        except BaseException:
            with suppress(Exception):  # SQLite may have rolled back already (SQLITE_FULL), a lost link cannot
                connection.execute("ROLLBACK")
            raise
        return result

    def _check(self) -> None:
        """Before each try of a transaction or read: raise a UserError where the database can no longer
        be used safely."""

    def _retrying(self, attempt: Callable[[Any], T], writing: bool) -> T:
        with self._lock:
            deadline = None
            wait = 0.5
            while True:
                self._check()
                try:
                    result = attempt(self._connection())
                    if deadline is not None:
                        _say(f"towerlab: reached the search store's database {self.where} again")
                    return result
                except Exception as error:  # noqa: BLE001 - sorted below: retried, a UserError, or raised
                    lost = self._lost(error)
                    busy = None if lost else self._busy(error)
                    if not lost and busy is None:
                        raise self._failed(error, writing) from None
                    if lost:
                        self._drop()
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + retry_seconds()
                        what = busy or f"lost the search store's database {self.where}"
                        _say(f"towerlab: warning: {what} ({self._line(error)}): trying again for up to "
                             f"{retry_seconds():g} s")
                    if now >= deadline and busy is not None:
                        raise StoreLost(f"{busy}, and it still was after {retry_seconds():g} s "
                                        f"({self._line(error)}): every result written before is kept; end or continue "
                                        "the process that holds it, then start the workers again") from None
                    if now >= deadline:
                        raise StoreLost(f"lost the search store's database {self.where} and could not reach it "
                                        f"again for {retry_seconds():g} s ({self._line(error)}): every result "
                                        "written before is kept; start the workers again once it is back") from None
                    time.sleep(min(wait, max(0.0, deadline - now)))
                    wait = min(2 * wait, RETRY_WAIT)

    def _connection(self) -> Any:
        if self._conn is None:
            self._conn = self._connect()
        return self._conn

    def _drop(self) -> None:
        connection, self._conn = self._conn, None
        if connection is not None:
            with suppress(Exception):
                connection.close()

    _conn: Any = None

    def close(self) -> None:
        with self._lock:
            self._drop()
        _OPEN.discard(self)

    def _abandon(self) -> None:
        """This backend never opened (its first connection failed): nothing to forget at a fork."""
        _OPEN.discard(self)

    def forget(self) -> None:
        """In a forked child: never use nor close the parent's connection (closing a PostgreSQL one
        would end the parent's session; an SQLite one may hold the parent's locks). It is kept, unused,
        so that the garbage collector never closes it either."""
        if self._conn is not None:
            _ORPHANS.append(self._conn)
        self._conn = None
        self._lock = threading.RLock()


class Statements:
    """A `Transaction` on one connection of a `Database`."""

    def __init__(self, db: Database, connection: Any) -> None:
        self._db, self._connection = db, connection

    def run(self, sql: str, args: tuple = ()) -> int:
        return self._db._execute(self._connection, sql, args).rowcount

    def rows(self, sql: str, args: tuple = ()) -> list[dict]:
        return self._db._fetch(self._db._execute(self._connection, sql, args))

    def one(self, sql: str, args: tuple = ()) -> Optional[dict]:
        rows = self.rows(sql, args)
        return rows[0] if rows else None

    def settle(self, table: str) -> None:
        self._db._settle(self._connection, table)


_OPEN: set[Database] = set()
_ORPHANS: list[Any] = []


def _forget_all() -> None:
    for db in list(_OPEN):
        db.forget()


os.register_at_fork(after_in_child=_forget_all)


def _say(line: str) -> None:
    with suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def _one_line(error: object) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def damaged(where: object, error: object) -> UserError:
    return UserError(f"search store {where} is damaged ({_one_line(error)}): restore it from a copy, or save "
                     f"what is readable with `sqlite3 {where} .recover | sqlite3 recovered.db` and pass "
                     "--store recovered.db; a new search needs another --out")


def placeholders(n: int) -> str:
    return ", ".join("?" * n)
