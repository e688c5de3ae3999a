"""The database under a search store: SQLite, a file on this machine (the default), or PostgreSQL, a
server that workers on many machines reach by URL. `towerlab.search.store` writes its queries once, in
the SQL both understand, with `?` for parameters and three tokens: `{id}` (an auto-numbered primary
key), `{now}` (the store's clock in seconds since the epoch, so that leases never depend on which
machine's clock reads them) and `{stamp}` (the same clock as text, ISO 8601 in UTC, for the times
a store records). This module turns them into each dialect and runs them. The store's clock is the
database server's (PostgreSQL), or the kernel's of the machine that holds an SQLite file: every
process reads the same, whatever its own clock says (`towerlab.search.store_file`).

Every write is one transaction, given as a function of a `Transaction` so that it can be run again:
PostgreSQL's connection may drop (the server restarts, the network blinks), and then the transaction is
retried on a new connection with a bounded backoff (`RETRY_SECONDS` in all) before the store gives up
with one line. So is one that waited too long for what another process held: every wait inside a
transaction is bounded (PostgreSQL ends a session left idle in a transaction, and a lock or statement
waited on too long, as this module sets on each session; SQLite waits SQLITE_BUSY for its write lock),
since a process frozen mid-transaction (SIGSTOP, a cut network) would otherwise stall every worker.
The functions are written to be idempotent (inserts that do nothing on conflict, updates that check
what they change), so a retry after a commit whose answer was lost changes nothing twice.
`lock=KEY` serialises the transactions that take the same key: SQLite serialises every write anyway
(BEGIN IMMEDIATE); PostgreSQL takes a transaction-scoped advisory lock.

A password in a URL is never printed (`towerlab.search.location`): `redacted(url)` is what messages and
records show, and a driver's error is scrubbed of it; the password itself may come from the URL, from
$PGPASSWORD or from ~/.pgpass, as libpq reads them.
"""

from __future__ import annotations

import os
import re
import sqlite3
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar
from urllib.parse import unquote

from towerlab.errors import UserError
from towerlab.search.store_file import KernelClock, StoreFile, never_close
from towerlab.search.location import is_url, password_spans, redacted

T = TypeVar("T")

# How long a lost PostgreSQL connection is retried, in all, before the store gives up (seconds), and the
# longest wait between two tries: enough for a server restart or a failover, not for an outage.
RETRY_SECONDS = 120.0
RETRY_WAIT = 8.0
RETRY_ENV = "TOWERLAB_DB_RETRY_SECONDS"
# Bounds on every wait inside a PostgreSQL transaction (seconds), set on each session towerlab opens: a
# transaction left open by a process that froze (stopped, swapped out, cut off by the network) is ended
# by the server after IDLE_IN_TRANSACTION, and its locks are freed (they stalled every worker, without
# a limit); a statement waits at most LOCK for a lock and runs at most STATEMENT. A transaction that
# meets one is rolled back and tried again, as after a lost connection (RETRY_SECONDS in all).
IDLE_IN_TRANSACTION = 10.0
LOCK = 20.0
STATEMENT = 60.0
# How long an SQLite statement waits for another process's write lock before it is tried again (a
# transaction holds it for milliseconds: one held this long belongs to a process stopped mid-write).
SQLITE_BUSY = 30.0
# Rows read with one statement at most, where a query lists values (SQLite caps a statement's parameters).
CHUNK = 500


def retry_seconds() -> float:
    text = os.environ.get(RETRY_ENV, "").strip()
    if not text:
        return RETRY_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 86400:
        raise UserError(f"{RETRY_ENV}={text!r}: give the seconds a lost database connection is retried, 0 to 86400")
    return value


class StoreLost(UserError):
    """The store's database stayed out of reach, or held by another process, past every retry: the
    process that meets it stops (a worker's task goes back on the queue once it can), one line."""


class Transaction:
    """The statements of one transaction; rows come back as dicts."""

    def __init__(self, db: Database, connection: Any) -> None:
        self._db, self._connection = db, connection

    def run(self, sql: str, args: tuple = ()) -> int:
        """Execute; the number of rows it changed."""
        return self._db._execute(self._connection, sql, args).rowcount

    def rows(self, sql: str, args: tuple = ()) -> list[dict]:
        return self._db._fetch(self._db._execute(self._connection, sql, args))

    def one(self, sql: str, args: tuple = ()) -> Optional[dict]:
        rows = self.rows(sql, args)
        return rows[0] if rows else None


class Database:
    """One connection to a store's database, shared by this process's threads (one at a time)."""

    dialect: str
    where: str  # the file, or the redacted URL
    secrets: tuple[str, ...] = ()  # what no message may show (a URL's password, as typed and decoded)

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._sql: dict[str, str] = {}
        _OPEN.add(self)

    # -- what each dialect supplies ----------------------------------------------------------------

    _TOKENS: dict[str, str] = {}
    _PARAMETER = "?"

    def _line(self, error: object) -> str:
        """An error in one line, without the secrets (a driver may quote the connection string's parts)."""
        text = _one_line(error)
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def _connect(self) -> Any:
        raise NotImplementedError

    def _begin(self, connection: Any, lock: Optional[int]) -> None:
        raise NotImplementedError

    def _lost(self, error: BaseException) -> bool:
        """Whether `error` means the connection is gone (retry on a new one)."""
        return False

    def _busy(self, error: BaseException) -> Optional[str]:
        """Where `error` means another process held what a transaction needed for longer than it may
        wait (retry it), what to say about it; else None."""
        return None

    def _failed(self, error: BaseException, writing: bool) -> BaseException:
        """What to raise for a database error that no retry mends: usually a UserError."""
        raise NotImplementedError

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
            result = work(Transaction(self, connection))
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

    def forget(self) -> None:
        """In a forked child: never use nor close the parent's connection (closing a PostgreSQL one
        would end the parent's session; an SQLite one may hold the parent's locks). It is kept, unused,
        so that the garbage collector never closes it either."""
        if self._conn is not None:
            _ORPHANS.append(self._conn)
        self._conn = None
        self._lock = threading.RLock()


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


# -- SQLite ------------------------------------------------------------------------------------------


def is_damage(error: BaseException) -> bool:
    """SQLITE_CORRUPT (a malformed page), as opposed to a busy, full or read-only database."""
    name = getattr(error, "sqlite_errorname", "")  # Python 3.11+
    return name.startswith("SQLITE_CORRUPT") or (not name and "malformed" in str(error))


def damaged(where: object, error: object) -> UserError:
    return UserError(f"search store {where} is damaged ({_one_line(error)}): restore it from a copy, or save "
                     f"what is readable with `sqlite3 {where} .recover | sqlite3 recovered.db` and pass "
                     "--store recovered.db; a new search needs another --out")


class SQLite(Database):
    dialect = "sqlite"
    _TOKENS = {"{id}": "INTEGER PRIMARY KEY", "{now}": "towerlab_now()",
               "{stamp}": "strftime('%Y-%m-%dT%H:%M:%S+00:00', towerlab_now(), 'unixepoch')",
               "{skip_locked}": ""}  # BEGIN IMMEDIATE: one writer at a time holds the whole file

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.where = str(path)
        self.clock = KernelClock()
        try:
            self._conn = self._connect()
        except sqlite3.Error as e:
            _OPEN.discard(self)
            raise UserError(f"cannot open search store {path}: {e}") from None
        self.file = StoreFile(path)

    def _check(self) -> None:
        self.clock.reading = None  # each try of a transaction or read reads the clock once
        self.file.check()

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: every transaction is opened here (BEGIN IMMEDIATE).
        connection = sqlite3.connect(self.path, timeout=SQLITE_BUSY, isolation_level=None, check_same_thread=False)
        connection.row_factory = sqlite3.Row
        connection.create_function("towerlab_now", 0, self.clock.read)
        connection.execute("PRAGMA foreign_keys = ON")
        return connection

    def configure(self) -> None:
        """WAL (readers never wait for the writer) and synchronous=FULL: a commit happens once per
        finished training, so one fsync each costs nothing, and a recorded result then survives a
        power loss too (NORMAL in WAL mode may lose the last commits)."""
        self.raw.execute("PRAGMA journal_mode = WAL")
        self.raw.execute("PRAGMA synchronous = FULL")

    @property
    def raw(self) -> sqlite3.Connection:
        """The connection itself, for what only SQLite has (its checks, its migrations)."""
        return self._connection()

    def _begin(self, connection: Any, lock: Optional[int]) -> None:
        connection.execute("BEGIN IMMEDIATE")

    def close(self) -> None:
        if self._conn is not None and self.file.unwritable() is not None:
            never_close(self._conn)  # its close would checkpoint through the -shm file: a bus error
            self._conn = None
        super().close()
        self.clock.close()

    def _busy(self, error: BaseException) -> Optional[str]:
        name = getattr(error, "sqlite_errorname", "")  # Python 3.11+
        if isinstance(error, sqlite3.OperationalError) and (name.startswith("SQLITE_BUSY") or
                                                            (not name and "database is locked" in str(error))):
            return (f"the search store {self.path} is locked: another process has held its write lock for over "
                    f"{SQLITE_BUSY:g} s (stopped mid-write, or hung)")
        return None

    def _failed(self, error: BaseException, writing: bool) -> BaseException:
        if isinstance(error, sqlite3.DatabaseError) and is_damage(error):
            return damaged(self.path, error)
        if writing and isinstance(error, sqlite3.OperationalError):
            return UserError(f"cannot write to search store {self.path} ({error}): every evaluation recorded "
                             "before is kept; fix the disk (space, permissions) and continue with --resume")
        return error


# -- PostgreSQL --------------------------------------------------------------------------------------


def psycopg_module() -> Any:
    try:
        import psycopg
    except ImportError:
        raise UserError("a postgresql:// store needs psycopg: pip install 'towerlab[postgresql]'") from None
    return psycopg


class PostgreSQL(Database):
    dialect = "postgresql"
    _TOKENS = {"{id}": "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
               "{now}": "(extract(epoch from clock_timestamp())::double precision)",
               "{stamp}": "to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"+00:00\"')",
               "{skip_locked}": " FOR UPDATE SKIP LOCKED"}
    _PARAMETER = "%s"

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.where = redacted(url)
        typed = [url[begin:end] for begin, end in password_spans(url) if end > begin]
        # libpq may read a password that holds '@' or '/' as parts of the URL, and quote one in its error
        pieces = [piece for text in typed for piece in re.split(r"[@/:?#\s]", text) if len(piece) >= 4]
        self.secrets = tuple(sorted({*typed, *map(unquote, typed), *pieces}, key=len, reverse=True))
        self._psycopg = psycopg_module()
        try:
            self._conn = self._connect()
        except self._psycopg.Error as e:
            _OPEN.discard(self)
            raise UserError(f"cannot reach the search store's database {self.where}: {self._line(e)}") from None

    def _connect(self) -> Any:
        from psycopg.rows import dict_row

        # autocommit: every transaction is opened here (BEGIN); a short connect timeout so a retry
        # loop polls a restarting server rather than waiting on one attempt.
        connection = self._psycopg.connect(self.url, autocommit=True, row_factory=dict_row, connect_timeout=10,
                                           application_name="towerlab")
        connection.execute("SELECT set_config('idle_in_transaction_session_timeout', %s, false),"
                           " set_config('lock_timeout', %s, false), set_config('statement_timeout', %s, false)",
                           tuple(f"{round(seconds * 1000)}ms" for seconds in (IDLE_IN_TRANSACTION, LOCK, STATEMENT)))
        return connection

    def _begin(self, connection: Any, lock: Optional[int]) -> None:
        connection.execute("BEGIN")
        if lock is not None:
            connection.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_SPACE + lock,))

    def _lost(self, error: BaseException) -> bool:
        psycopg = self._psycopg
        if isinstance(error, (psycopg.errors.AdminShutdown, psycopg.errors.CannotConnectNow,
                              psycopg.errors.ConnectionFailure)):
            return True
        # Any error on a connection that broke meanwhile: the server ended a session left idle in a
        # transaction with an error of class 25 (IdleInTransactionSessionTimeout), not 08.
        return isinstance(error, psycopg.Error) and (self._conn is None or self._conn.closed or self._conn.broken)

    def _busy(self, error: BaseException) -> Optional[str]:
        errors = self._psycopg.errors
        if isinstance(error, errors.LockNotAvailable):
            return (f"the search store's database {self.where} kept a lock from this process for over {LOCK:g} s "
                    "(another session holds it)")
        if isinstance(error, errors.QueryCanceled):
            return f"a statement on the search store's database {self.where} ran for over {STATEMENT:g} s"
        return None

    def _failed(self, error: BaseException, writing: bool) -> BaseException:
        if isinstance(error, self._psycopg.errors.DiskFull):
            return UserError(f"the search store's database {self.where} is out of disk ({self._line(error)}): "
                             "every result written before is kept; make room and start the workers again")
        if isinstance(error, self._psycopg.errors.InsufficientPrivilege):
            return UserError(f"the search store's database {self.where} refused: {self._line(error)} (grant "
                             "the user the rights of docs/distributed-search.md)")
        return error


# Advisory lock keys of towerlab (one per search id above this base; 0 for creating the schema), apart
# from small keys that other programs sharing the database may take.
_LOCK_SPACE = 0x746C_0000_0000


def connect(target: str | os.PathLike) -> Database:
    """The database a store names: a postgresql:// URL, or an SQLite file."""
    if is_url(str(target)):
        return PostgreSQL(str(target))
    return SQLite(Path(target))


def placeholders(n: int) -> str:
    return ", ".join("?" * n)

