"""The search store's schema (version SCHEMA_VERSION: SQLite's `PRAGMA user_version`, PostgreSQL's
`towerlab_schema` table) and the migrations of older stores to it: 1, before samplers; 2, before
numerics; 3, before the queue; 4, before each evaluation's provenance. `towerlab.search.store` runs them,
each in one transaction, when it opens an older store; the tables are described there. Stores of versions
1 to 3 are SQLite files: their migrations speak SQLite; today's schema and the migrations from 3 and 4
speak what both databases read (a PostgreSQL store of version 4 is migrated too, under the schema lock)."""

from __future__ import annotations

import json
import sqlite3
from typing import Callable, Optional

from towerlab.config import upgrade_search_config
from towerlab.errors import UserError
from towerlab.search.database import PostgreSQL, SQLite, Transaction, damaged, is_damage

SCHEMA_VERSION = 5


class NoStore(UserError):
    """The place names no store yet (no file, an empty database): a search that starts there makes one."""


# Version 3's tables, as SQLite stores of versions 1 to 3 hold them (`upgrade_from_1` rebuilds this one).
_SEARCHES = """
CREATE TABLE searches (
    id INTEGER PRIMARY KEY,
    sampler TEXT NOT NULL,
    config TEXT NOT NULL,
    space TEXT NOT NULL,
    space_fingerprint TEXT NOT NULL,
    train_config_hash TEXT NOT NULL,
    created TEXT NOT NULL,
    finished TEXT,
    summary TEXT
)"""
_EVALUATION_INDEXES = """
CREATE INDEX evaluations_ok ON evaluations (genome_hash, train_config_hash, replicate) WHERE status = 'ok';
CREATE UNIQUE INDEX evaluations_search ON evaluations (search_id, genome_hash, train_config_hash, replicate)
"""

# Today's schema, in the SQL that SQLite and PostgreSQL both read (`towerlab.search.database` supplies
# {id}); the same tables in both, described in `towerlab.search.store`.
SCHEMA = """
CREATE TABLE searches (
    id {id},
    sampler TEXT NOT NULL,
    config TEXT NOT NULL,
    space TEXT NOT NULL,
    space_fingerprint TEXT NOT NULL,
    train_config_hash TEXT NOT NULL,
    created TEXT NOT NULL,
    finished TEXT,
    summary TEXT,
    setup TEXT,
    token TEXT
);
CREATE UNIQUE INDEX searches_token ON searches (token);
CREATE TABLE evaluations (
    id {id},
    genome_hash TEXT NOT NULL,
    train_config_hash TEXT NOT NULL,
    genome TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('ok', 'failed')),
    fitness DOUBLE PRECISION CHECK (status <> 'ok' OR fitness IS NOT NULL),
    val_loss DOUBLE PRECISION,
    test_accuracy DOUBLE PRECISION,
    epochs INTEGER NOT NULL,
    seconds DOUBLE PRECISION NOT NULL,
    worker TEXT NOT NULL,
    reason TEXT,
    search_id BIGINT NOT NULL REFERENCES searches (id),
    generation INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    seed BIGINT NOT NULL,
    finished_at TEXT NOT NULL,
    max_epochs INTEGER,
    replicate INTEGER NOT NULL DEFAULT 0,
    numerics TEXT,
    provenance TEXT
);""" + _EVALUATION_INDEXES + """;
CREATE TABLE generations (
    search_id BIGINT NOT NULL REFERENCES searches (id),
    generation INTEGER NOT NULL,
    members TEXT NOT NULL,
    results TEXT,
    stats TEXT,
    complete INTEGER NOT NULL DEFAULT 0 CHECK (complete IN (0, 1)),
    started TEXT NOT NULL,
    finished TEXT,
    watermark BIGINT,
    PRIMARY KEY (search_id, generation)
);
""" 

# Added by version 4 (the store is the queue): the tasks workers claim, and the workers.
QUEUE = """
CREATE TABLE tasks (
    id {id},
    search_id BIGINT NOT NULL REFERENCES searches (id),
    kind TEXT NOT NULL CHECK (kind IN ('train', 'test')),
    genome_hash TEXT NOT NULL,
    train_config_hash TEXT NOT NULL,
    replicate INTEGER NOT NULL,
    generation INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    genome TEXT NOT NULL,
    seed BIGINT NOT NULL,
    max_epochs INTEGER,
    priority DOUBLE PRECISION NOT NULL DEFAULT 0,
    state TEXT NOT NULL CHECK (state IN ('open', 'claimed', 'done')),
    worker TEXT,
    lease_until DOUBLE PRECISION,
    attempts INTEGER NOT NULL DEFAULT 0,
    lost TEXT,
    result TEXT,
    created DOUBLE PRECISION NOT NULL,
    claimed DOUBLE PRECISION,
    finished DOUBLE PRECISION,
    UNIQUE (search_id, kind, genome_hash, train_config_hash, replicate)
);
CREATE INDEX tasks_waiting ON tasks (search_id, state, priority);
CREATE TABLE workers (
    id TEXT PRIMARY KEY,
    host TEXT NOT NULL,
    pid INTEGER NOT NULL,
    device TEXT NOT NULL,
    started DOUBLE PRECISION NOT NULL,
    seen DOUBLE PRECISION NOT NULL,
    left_at DOUBLE PRECISION,
    task BIGINT
)
"""
TABLES = {"searches", "evaluations", "generations", "tasks", "workers"}
OLD_TABLES = {"searches", "evaluations", "generations"}  # a store of version 1 to 3


def statements(script: str) -> list[str]:
    return [s for s in script.split(";") if s.strip()]


def create_tables(tx: Transaction) -> None:
    """An empty store of this schema (the caller records its version)."""
    for statement in statements(SCHEMA + ";" + QUEUE):
        tx.run(statement)


def upgrade_from_3(tx: Transaction) -> None:
    """Version 3 to 4 (the store is the queue): a search records how its workers train (`setup`) and the
    token its creator gave it; a generation the newest evaluation id other searches may serve it from
    (`watermark`: NULL in older generations, which may take any); the tasks and workers tables."""
    tx.run("ALTER TABLE searches ADD COLUMN setup TEXT")
    tx.run("ALTER TABLE searches ADD COLUMN token TEXT")
    tx.run("CREATE UNIQUE INDEX searches_token ON searches (token)")
    tx.run("ALTER TABLE generations ADD COLUMN watermark BIGINT")
    for statement in statements(QUEUE):
        tx.run(statement)


def upgrade_from_4(tx: Transaction) -> None:
    """Version 4 to 5: evaluations gain their provenance (JSON: host, versions, device, data digest),
    NULL (unknown) in the rows written before."""
    tx.run("ALTER TABLE evaluations ADD COLUMN provenance TEXT")


def upgrade_from_1(db: sqlite3.Connection) -> bool:
    """Version 1 (before samplers) to 2, with foreign keys off: `kind` ('evolve'|'grid', a CHECK-ed
    list) becomes `sampler` (ga, grid); configs gain the settings they ran with; evaluations gain
    their budget and replicate, and one successful row per genome becomes one per genome and search.
    False when rows then name no search (the caller rolls the transaction back)."""
    db.execute(_SEARCHES.replace("CREATE TABLE searches", "CREATE TABLE searches_v2"))
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
    for statement in statements(_EVALUATION_INDEXES):
        db.execute(statement)
    if db.execute("PRAGMA foreign_key_check").fetchall():
        return False
    db.execute("PRAGMA user_version = 2")
    return True


def upgrade_from_2(tx: Transaction) -> None:
    """Version 2 (before numerics): evaluations gain the column, NULL (unknown) in their rows."""
    tx.run("ALTER TABLE evaluations ADD COLUMN numerics TEXT")


def _top_of_v1(db: sqlite3.Connection, genome_hash: str, train_config_hash: str) -> dict:
    """A version-1 summary's top entry in the form `Search.finish` writes (its one row)."""
    row = db.execute("SELECT * FROM evaluations WHERE genome_hash = ? AND train_config_hash = ? AND status = 'ok'",
                     (genome_hash, train_config_hash)).fetchone()
    return {"genome_hash": genome_hash, "genome": json.loads(row["genome"]), "fitness": row["fitness"],
            "fitnesses": [row["fitness"]], "seeds": [row["seed"]], "rung": 0,
            "train_config_hash": train_config_hash}


# -- opening a store: its schema checked, created or migrated ----------------------------------------------


def open_sqlite(db: SQLite, where: object, create: bool) -> None:
    """Check an SQLite store before anything is written: damage (quick_check), a newer schema or a foreign
    file are UserErrors; an empty file gets today's tables, an older store is migrated."""
    try:
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
    if version == 4 and TABLES <= tables:
        _migrate(db, 4, upgrade_from_4)
        return
    if version in (1, 2, 3) and OLD_TABLES <= tables:
        if version == 1:
            _migrate_from_1(db, where)
        if version <= 2:
            _migrate(db, 2, upgrade_from_2)
        _migrate(db, 3, upgrade_from_3)
        _migrate(db, 4, upgrade_from_4)
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


def refuse_newer(version: int, where: object) -> None:
    if version > SCHEMA_VERSION:
        raise UserError(f"search store {where} has schema version {version}, newer than this towerlab reads "
                        f"({SCHEMA_VERSION}): upgrade towerlab to open it")


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


# The advisory lock key under which a PostgreSQL store's tables are made.
SCHEMA_LOCK = -1


def open_postgresql(db: PostgreSQL, where: object, create: bool) -> None:
    """Check a PostgreSQL store's schema, or create its tables in an empty database (one transaction,
    under an advisory lock, so that two workers starting at once make them once)."""
    def exists(tx: Transaction, table: str) -> bool:
        # pg_class read with the statement's snapshot, not to_regclass: that looks in the session's catalog
        # cache, which may still miss a table that another session committed while this one waited for the
        # lock (it did, with two searches starting at once on a new database).
        return tx.one("SELECT count(*) AS n FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace s ON "
                      "s.oid = c.relnamespace WHERE c.relname = ? AND s.nspname = current_schema()", (table,))["n"] > 0

    def version(tx: Transaction) -> Optional[int]:
        if not exists(tx, "towerlab_schema"):
            return None
        row = tx.one("SELECT version FROM towerlab_schema")
        return None if row is None else int(row["version"])

    def make(tx: Transaction) -> Optional[int]:
        found = version(tx)
        if found is not None:
            return found
        clash = next((table for table in sorted(TABLES) if exists(tx, table)), None)
        if clash is not None:  # creating the others would end in a DuplicateTable error
            raise UserError(f"the database {where} holds a table named {clash} but no towerlab store: give "
                            "towerlab a database of its own")
        if not create:
            raise NoStore(f"the database {where} holds no search store yet: start a search there (search run --store), "
                          "or wait for one (search worker --wait)")
        create_tables(tx)
        tx.run("CREATE TABLE towerlab_schema (version INTEGER NOT NULL)")
        tx.run("INSERT INTO towerlab_schema (version) VALUES (?)", (SCHEMA_VERSION,))
        return SCHEMA_VERSION

    def migrate(tx: Transaction) -> int:
        found = version(tx)
        if found == 4:  # another process may have migrated it meanwhile: read again under the lock
            upgrade_from_4(tx)
            tx.run("UPDATE towerlab_schema SET version = ?", (SCHEMA_VERSION,))
            return SCHEMA_VERSION
        return found

    found = db.write(version)
    if found is None:
        found = db.write(make, lock=SCHEMA_LOCK)
    if found == 4:
        found = db.write(migrate, lock=SCHEMA_LOCK)
    refuse_newer(found, where)
