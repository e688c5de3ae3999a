"""The SQLite backend of a search store (`towerlab.search.store.database`): a file on this machine, the
default. One writer at a time holds the whole file (BEGIN IMMEDIATE), and a statement waits
`SQLITE_BUSY` for another process's write lock before it is tried again; the store's clock is the
kernel's (`towerlab.search.store.sqlite_file.KernelClock`), and the file is watched (`StoreFile`): still the one
the connection opened, still writable. The store is WAL with synchronous=FULL. A damaged file (a page
malformed: quick_check when it opens, or any read) is a UserError that names the file and what to do.

Its schema (`towerlab.search.store.schema`) is versioned by `PRAGMA user_version`; a store of versions 1 to 3
(before the queue) is an SQLite file, whose migrations are here: version 1's (before samplers) rebuilds
its searches table with foreign keys off."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any, Callable, Optional

from towerlab.upgrades import upgrade_search_config
from towerlab.errors import UserError
from towerlab.search.store.database import Database, Transaction, damaged
from towerlab.search.store.schema import (EVALUATION_INDEXES, OLD_TABLES, SCHEMA_VERSION, TABLES, V3_SEARCHES, NoStore,
                                    create_tables, refuse_newer, statements, upgrade_from_2, upgrade_from_3,
                                    upgrade_from_4, upgrade_from_5, upgrade_from_6, upgrade_from_7)
from towerlab.search.store.sqlite_file import KernelClock, StoreFile, never_close

# How long an SQLite statement waits for another process's write lock before it is tried again (a
# transaction holds it for milliseconds: one held this long belongs to a process stopped mid-write).
SQLITE_BUSY = 30.0


def is_damage(error: BaseException) -> bool:
    """SQLITE_CORRUPT (a malformed page), as opposed to a busy, full or read-only database."""
    name = getattr(error, "sqlite_errorname", "")  # Python 3.11+
    return name.startswith("SQLITE_CORRUPT") or (not name and "malformed" in str(error))


def _overwritten(error: BaseException) -> bool:
    """SQLITE_NOTADB in a store that opened as one: its file was truncated or overwritten while in use (at
    opening, the same error is a file that never was a store)."""
    name = getattr(error, "sqlite_errorname", "")
    return name.startswith("SQLITE_NOTADB") or (not name and "not a database" in str(error))


class SQLite(Database):
    _TOKENS = {"{id}": "INTEGER PRIMARY KEY",
               "{now}": "towerlab_now()",  # the kernel's clock of this machine (sqlite_file.KernelClock)
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
            self._abandon()
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

    def open_schema(self, where: object, create: bool, checked: bool = False) -> None:
        open_sqlite(self, where, create, checked)

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
        if isinstance(error, sqlite3.DatabaseError) and (is_damage(error) or _overwritten(error)):
            return damaged(self.path, error)
        if writing and isinstance(error, sqlite3.OperationalError):
            return UserError(f"cannot write to search store {self.path} ({error}): every evaluation recorded "
                             "before is kept; fix the disk (space, permissions) and continue with --resume")
        return error


# -- its schema: checked, created or migrated ------------------------------------------------------


def open_sqlite(db: SQLite, where: object, create: bool, checked: bool = False) -> None:
    """Check an SQLite store before anything is written: damage (quick_check, unless this process's parent
    `checked` it), a newer schema or a foreign file are UserErrors; an empty file gets today's
    tables, an older store is migrated."""
    try:
        if not checked:
            problems = [r[0] for r in db.raw.execute("PRAGMA quick_check").fetchall()]
            if problems != ["ok"]:
                raise damaged(where, "; ".join(problems[:2]))
        _check_sqlite(db, where, create)
        db.configure()
    except sqlite3.DatabaseError as e:
        if is_damage(e):
            raise damaged(where, e) from None
        raise UserError(f"{where} is not a towerlab search store ({e}): give the search.db of a search, or a "
                        "new path") from None


def _sqlite_schema(db: SQLite) -> tuple[int, set[str]]:
    version = db.raw.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in db.raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    return version, tables


def _check_sqlite(db: SQLite, where: object, create: bool) -> None:
    version, tables = _sqlite_schema(db)
    refuse_newer(version, where)
    if version == SCHEMA_VERSION and TABLES <= tables:
        return
    if version in (4, 5, 6, 7) and TABLES <= tables:
        if version == 4:
            _migrate(db, 4, upgrade_from_4)
        if version <= 5:
            _migrate(db, 5, upgrade_from_5)
        if version <= 6:
            _migrate(db, 6, upgrade_from_6)
        _migrate(db, 7, upgrade_from_7)
        return
    if version in (1, 2, 3) and OLD_TABLES <= tables:
        if version == 1:
            _migrate_from_1(db, where)
        if version <= 2:
            _migrate(db, 2, upgrade_from_2)
        _migrate(db, 3, upgrade_from_3)
        _migrate(db, 4, upgrade_from_4)
        _migrate(db, 5, upgrade_from_5)
        _migrate(db, 6, upgrade_from_6)
        _migrate(db, 7, upgrade_from_7)
        return
    if version == 0 and not tables and not create:  # made, and its tables not yet (a search just starting)
        raise NoStore(f"{where} holds no search yet: an empty database (a search that is starting writes its "
                        "tables in a moment)")
    if version != 0 or tables or not create:
        raise UserError(f"{where} is an SQLite file but not a towerlab search store: give the search.db of a "
                        "search, or a new path")

    def make(tx: Transaction) -> bool:
        if _sqlite_schema(db) != (0, set()):
            return False  # another process wrote it meanwhile
        create_tables(tx)
        tx.run(f"PRAGMA user_version = {SCHEMA_VERSION}")
        return True

    if not db.write(make):
        _check_sqlite(db, where, create=False)


def _migrate_from_1(db: SQLite, where: object) -> None:
    db.raw.execute("PRAGMA foreign_keys = OFF")  # the searches table is rebuilt under its rows
    try:
        def upgrade(tx: Transaction) -> None:
            if db.raw.execute("PRAGMA user_version").fetchone()[0] != 1:
                return  # another process migrated it meanwhile
            if not upgrade_from_1(db.raw):
                raise damaged(where, "rows that name no search")
        db.write(upgrade)
    finally:
        db.raw.execute("PRAGMA foreign_keys = ON")


def _migrate(db: SQLite, version: int, upgrade: Callable[[Transaction], None]) -> None:
    def run(tx: Transaction) -> None:
        if db.raw.execute("PRAGMA user_version").fetchone()[0] != version:
            return  # another process migrated it meanwhile
        upgrade(tx)
        tx.run(f"PRAGMA user_version = {version + 1}")
    db.write(run)


def upgrade_from_1(db: sqlite3.Connection) -> bool:
    """Version 1 (before samplers) to 2, with foreign keys off: `kind` ('evolve'|'grid', a CHECK-ed
    list) becomes `sampler` (ga, grid); configs gain the settings they ran with; evaluations gain
    their budget and replicate, and one successful row per genome becomes one per genome and search.
    False when rows then name no search (the caller rolls the transaction back)."""
    db.execute(V3_SEARCHES.replace("CREATE TABLE searches", "CREATE TABLE searches_v2"))
    for row in db.execute("SELECT * FROM searches").fetchall():
        config = upgrade_search_config(json.loads(row["config"]), row["kind"])
        summary = None if row["summary"] is None else json.loads(row["summary"])
        if summary is not None:  # its top: the hashes of genomes measured once each
            summary["top"] = [_top_of_v1(db, h, row["train_config_hash"]) for h in summary["top"]]
        db.execute("INSERT INTO searches_v2 VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                   (row["id"], config["sampler"], json.dumps(config, sort_keys=True), row["space"],
                    row["space_fingerprint"], row["train_config_hash"], row["created"],
                    row["finished"], None if summary is None else json.dumps(summary)))
    db.execute("DROP TABLE searches")
    db.execute("ALTER TABLE searches_v2 RENAME TO searches")
    db.execute("ALTER TABLE evaluations ADD COLUMN max_epochs INTEGER")
    db.execute("ALTER TABLE evaluations ADD COLUMN replicate INTEGER NOT NULL DEFAULT 0")
    db.execute("UPDATE evaluations SET max_epochs = (SELECT json_extract(config, '$.max_epochs')"
               " FROM searches WHERE searches.id = evaluations.search_id)")
    db.execute("DROP INDEX evaluations_ok")
    db.execute("DROP INDEX evaluations_search")
    for statement in statements(EVALUATION_INDEXES):
        db.execute(statement)
    if db.execute("PRAGMA foreign_key_check").fetchall():
        return False
    db.execute("PRAGMA user_version = 2")
    return True


def _top_of_v1(db: sqlite3.Connection, genome_hash: str, train_config_hash: str) -> dict:
    """A version-1 summary's top entry in the form `Search.finish` writes (its one row)."""
    row = db.execute("SELECT * FROM evaluations WHERE genome_hash = ? AND train_config_hash = ? AND status = 'ok'",
                     (genome_hash, train_config_hash)).fetchone()
    return {"genome_hash": genome_hash, "genome": json.loads(row["genome"]), "fitness": row["fitness"],
            "fitnesses": [row["fitness"]], "seeds": [row["seed"]], "rung": 0,
            "train_config_hash": train_config_hash}
