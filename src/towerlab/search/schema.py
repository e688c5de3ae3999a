"""The search store's schema (`PRAGMA user_version` SCHEMA_VERSION) and the migrations of older
stores to it: 1, before samplers; 2, before numerics. `towerlab.search.store` runs them, each in
one transaction, when it opens an older store; the tables are described there."""

from __future__ import annotations

import json
import sqlite3

from towerlab.config import upgrade_search_config

SCHEMA_VERSION = 3

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
SCHEMA = _SEARCHES + """;
CREATE TABLE evaluations (
    id INTEGER PRIMARY KEY,
    genome_hash TEXT NOT NULL,
    train_config_hash TEXT NOT NULL,
    genome TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('ok', 'failed')),
    fitness REAL CHECK (status <> 'ok' OR fitness IS NOT NULL),
    val_loss REAL,
    test_accuracy REAL,
    epochs INTEGER NOT NULL,
    seconds REAL NOT NULL,
    worker TEXT NOT NULL,
    reason TEXT,
    search_id INTEGER NOT NULL REFERENCES searches (id),
    generation INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    seed INTEGER NOT NULL,
    finished_at TEXT NOT NULL,
    max_epochs INTEGER,
    replicate INTEGER NOT NULL DEFAULT 0,
    numerics TEXT
);""" + _EVALUATION_INDEXES + """;
CREATE TABLE generations (
    search_id INTEGER NOT NULL REFERENCES searches (id),
    generation INTEGER NOT NULL,
    members TEXT NOT NULL,
    results TEXT,
    stats TEXT,
    complete INTEGER NOT NULL DEFAULT 0 CHECK (complete IN (0, 1)),
    started TEXT NOT NULL,
    finished TEXT,
    PRIMARY KEY (search_id, generation)
);
"""
TABLES = {"searches", "evaluations", "generations"}


def statements(script: str) -> list[str]:
    return [s for s in script.split(";") if s.strip()]


def create_tables(db: sqlite3.Connection) -> None:
    """An empty store of this schema."""
    for statement in statements(SCHEMA):
        db.execute(statement)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


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


def upgrade_from_2(db: sqlite3.Connection) -> None:
    """Version 2 (before numerics): evaluations gain the column, NULL (unknown) in their rows."""
    db.execute("ALTER TABLE evaluations ADD COLUMN numerics TEXT")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _top_of_v1(db: sqlite3.Connection, genome_hash: str, train_config_hash: str) -> dict:
    """A version-1 summary's top entry in the form `towerlab.search.engine` writes (its one row)."""
    row = db.execute("SELECT * FROM evaluations WHERE genome_hash = ? AND train_config_hash = ? AND status = 'ok'",
                     (genome_hash, train_config_hash)).fetchone()
    return {"genome_hash": genome_hash, "genome": json.loads(row["genome"]), "fitness": row["fitness"],
            "fitnesses": [row["fitness"]], "seeds": [row["seed"]], "rung": 0,
            "train_config_hash": train_config_hash}
