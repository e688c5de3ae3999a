"""The search's SQLite record: every evaluation, every generation, and what resume replays.

Any number of processes may read and write one store at once (WAL, one short transaction per
write): `towerlab search show` while a search runs, two searches sharing a `--store`, even two
processes continuing the same search. Tables:

searches     id, sampler (its name: data, not a fixed list), config (SearchConfig JSON), space
             (JSON: name, model, genes), space_fingerprint, train_config_hash, created, finished
             (NULL while running or interrupted), summary (JSON counts and the top, when finished).
evaluations  one row per training: genome_hash, train_config_hash (of a pruned search's lower rung,
             see `towerlab.search.rounds`), genome (JSON), status ('ok'|'failed'), fitness
             (validation accuracy; NULL unless ok), val_loss, test_accuracy (set afterwards by
             `set_test_accuracy`), epochs (trained), max_epochs (the budget it trained under),
             replicate (0: the evaluation; 1..: a re-measure with a fresh seed), seconds, worker,
             reason (why it failed), search_id, generation, idx (-1 for a re-measure), seed,
             finished_at, numerics (JSON: what the result depends on besides its settings and seed,
             as the worker saw it: device, threads, precision, torch; NULL before schema 3). Unique per (search_id, genome_hash, train_config_hash, replicate): writing
             a row a search already has is a no-op that returns the row (evaluations are idempotent
             by their key, so two processes continuing one search lose nothing and never collide).
generations  (search_id, generation) key, members (JSON list of {genome_hash, genome} in
             population order, written when the generation begins), results (JSON per-member
             records) and stats (JSON), written with complete = 1 when it ends; started, finished.

The cache: `lookup` serves a search its own row first, whatever its status, and otherwise the
oldest 'ok' row of any search. So a failed candidate is not retried by the search that failed it,
resumed or not (its history stays reproducible), while a later search retries it (the failure may
have been the machine's: out of memory, a lost worker). Two searches running at once may both
train a genome neither found; each keeps its own row and its own history, as if it had run alone.

Durability: WAL journal, one transaction per write, so a process killed mid-write leaves no half
row. synchronous=FULL: a commit happens once per finished training (seconds to hours of compute),
so one fsync each costs nothing, and a recorded evaluation then survives a power loss too (NORMAL
in WAL mode may lose the last commits then). The schema version is `PRAGMA user_version`; an
older store (1: before samplers; 2: before numerics) is migrated in place when opened
(`towerlab.search.schema`). A damaged file (SQLite's quick_check at open, a read that finds a page
malformed, a record that no longer parses) is a UserError that names the file and what to do.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Optional

from towerlab.config import upgrade_search_config
from towerlab.errors import UserError
from towerlab.search.schema import SCHEMA_VERSION, TABLES, create_tables, upgrade_from_1, upgrade_from_2
from towerlab.search.candidates import Candidate, Outcome
from towerlab.search.space import Space

STORE_NAME = "search.db"  # the store's file name inside a search folder


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class SearchRow:
    id: int
    sampler: str
    config: dict
    space: dict
    space_fingerprint: str
    train_config_hash: str
    created: str
    finished: Optional[str]
    summary: Optional[dict]


@dataclass(frozen=True)
class Evaluation:
    id: int
    genome_hash: str
    train_config_hash: str
    genome: dict
    status: str
    fitness: Optional[float]
    val_loss: Optional[float]
    test_accuracy: Optional[float]
    epochs: int
    seconds: float
    worker: str
    reason: Optional[str]
    search_id: int
    generation: int
    index: int
    seed: int
    finished_at: str
    max_epochs: Optional[int]
    replicate: int
    numerics: Optional[dict] = None


@dataclass(frozen=True)
class GenerationRow:
    search_id: int
    generation: int
    members: list
    results: Optional[list]
    stats: Optional[dict]
    complete: bool
    started: str
    finished: Optional[str]


def _damaged(path: Path, error: object) -> UserError:
    error = " ".join(str(error).split())  # SQLite's reports span lines; ours is one
    return UserError(f"search store {path} is damaged ({error}): restore it from a copy, or save what is "
                     f"readable with `sqlite3 {path} .recover | sqlite3 recovered.db` and pass "
                     "--store recovered.db; a new search needs another --out")


def _is_damage(error: sqlite3.DatabaseError) -> bool:
    """SQLITE_CORRUPT (a malformed page), as opposed to a busy, full or read-only database."""
    name = getattr(error, "sqlite_errorname", "")  # Python 3.11+
    return name.startswith("SQLITE_CORRUPT") or (not name and "malformed" in str(error))


class Store:
    """A search store at `path`, or at `path`/search.db when `path` is a folder (created, with its
    folder, unless `create=False`)."""

    def __init__(self, path: str | os.PathLike, *, create: bool = True) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / STORE_NAME
        if not create and not self.path.is_file():
            raise UserError(f"no search store at {self.path}: give the search.db of a search "
                            f"(or the folder holding it)")
        if create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        try:
            # isolation_level=None: we open every transaction ourselves (BEGIN IMMEDIATE).
            self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None,
                                       check_same_thread=False)
        except sqlite3.Error as e:
            raise UserError(f"cannot open search store {self.path}: {e}") from None
        try:
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA foreign_keys = ON")
            self._check_integrity()  # before anything is migrated or written
            self._check_schema(create)
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
        except sqlite3.DatabaseError as e:
            self._db.close()
            if _is_damage(e):
                raise _damaged(self.path, e) from None
            raise UserError(f"{self.path} is not a towerlab search store ({e}): "
                            f"give the search.db of a search, or a new path") from None
        except BaseException:
            self._db.close()
            raise

    def _schema(self) -> tuple[int, set[str]]:
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return version, tables

    def _check_schema(self, create: bool) -> None:
        """Refuse a newer schema or a foreign file before writing anything; create an empty one;
        migrate an older one."""
        version, tables = self._schema()
        if version > SCHEMA_VERSION:
            raise UserError(f"search store {self.path} has schema version {version}, newer than this "
                            f"towerlab reads ({SCHEMA_VERSION}): upgrade towerlab to open it")
        if version == SCHEMA_VERSION and TABLES <= tables:
            return
        if version in (1, 2) and TABLES <= tables:
            if version == 1:
                self._migrate_from_1()
            self._migrate_from_2()
            return
        if version != 0 or tables or not create:
            raise UserError(f"{self.path} is an SQLite file but not a towerlab search store: "
                            f"give the search.db of a search, or a new path")
        with self._write():
            raced = self._schema() != (0, set())  # another process wrote it meanwhile
            if not raced:
                create_tables(self._db)
        if raced:
            self._check_schema(create=False)

    def _migrate_from_1(self) -> None:
        self._db.execute("PRAGMA foreign_keys = OFF")  # the searches table is rebuilt under its rows
        try:
            with self._write() as db:
                if db.execute("PRAGMA user_version").fetchone()[0] != 1:
                    return  # another process migrated it meanwhile
                if not upgrade_from_1(db):
                    raise _damaged(self.path, "rows that name no search")
        finally:
            self._db.execute("PRAGMA foreign_keys = ON")

    def _migrate_from_2(self) -> None:
        with self._write() as db:
            if db.execute("PRAGMA user_version").fetchone()[0] != 2:
                return  # another process migrated it meanwhile
            upgrade_from_2(db)

    def _check_integrity(self) -> None:
        problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise _damaged(self.path, "; ".join(problems[:2]))

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction: committed whole, or rolled back whole (even on KeyboardInterrupt).

        A write the disk refuses (full, I/O error, read-only, locked for 30 s) is a UserError: what
        was committed before stays, and the search can be resumed once the disk is fixed."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    # SQLite may have rolled back already (e.g. SQLITE_FULL): then ROLLBACK itself fails.
                    if self._db.in_transaction:
                        with suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as e:
                raise UserError(f"cannot write to search store {self.path} ({e}): every evaluation recorded "
                                f"before is kept; fix the disk (space, permissions) and continue with --resume"
                                ) from None
            except sqlite3.DatabaseError as e:
                if _is_damage(e):
                    raise _damaged(self.path, e) from None
                raise

    def _read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.DatabaseError as e:
                if _is_damage(e):
                    raise _damaged(self.path, e) from None
                raise

    def _json(self, text: Optional[str]) -> Any:
        try:
            return _loads(text)
        except ValueError as e:  # bytes changed inside a row: the pages are sound, the data is not
            raise _damaged(self.path, f"unreadable record: {e}") from None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- searches -------------------------------------------------------------------------------

    def begin_search(self, sampler: str, config: dict, space: Space, train_config_hash: str) -> int:
        with self._write() as db:
            cursor = db.execute(
                "INSERT INTO searches (sampler, config, space, space_fingerprint, train_config_hash, created)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (sampler, json.dumps(config, sort_keys=True), json.dumps(space.to_dict()), space.fingerprint,
                 train_config_hash, _now()))
            return int(cursor.lastrowid)

    def resume_search(self, search_id: int, config: dict) -> None:
        """Mark the search running again, under `config` (it may extend the generations)."""
        with self._write() as db:
            db.execute("UPDATE searches SET config = ?, finished = NULL, summary = NULL WHERE id = ?",
                       (json.dumps(config, sort_keys=True), search_id))

    def finish_search(self, search_id: int, summary: dict) -> None:
        with self._write() as db:
            db.execute("UPDATE searches SET finished = ?, summary = ? WHERE id = ?",
                       (_now(), json.dumps(summary), search_id))

    def _search(self, row: sqlite3.Row) -> SearchRow:
        data = dict(row)
        for key in ("config", "space", "summary"):
            data[key] = self._json(data[key])
        if isinstance(data["config"], dict):  # a search recorded before a setting existed ran without it
            data["config"] = upgrade_search_config(data["config"], data["sampler"])
        return SearchRow(**data)

    def search(self, search_id: int) -> Optional[SearchRow]:
        rows = self._read("SELECT * FROM searches WHERE id = ?", (search_id,))
        return self._search(rows[0]) if rows else None

    def latest_search(self, sampler: Optional[str] = None) -> Optional[SearchRow]:
        rows = self._read("SELECT * FROM searches WHERE ? IS NULL OR sampler = ? ORDER BY id DESC LIMIT 1",
                          (sampler, sampler))
        return self._search(rows[0]) if rows else None

    def searches(self) -> list[SearchRow]:
        return [self._search(r) for r in self._read("SELECT * FROM searches ORDER BY id")]

    # -- evaluations ----------------------------------------------------------------------------

    def _evaluation(self, row: sqlite3.Row) -> Evaluation:
        data = dict(row)
        data["genome"] = self._json(data["genome"])
        data["numerics"] = self._json(data["numerics"])
        data["index"] = data.pop("idx")
        return Evaluation(**data)

    def lookup(self, genome_hash: str, train_config_hash: str, search_id: Optional[int] = None,
               replicate: int = 0) -> Optional[Evaluation]:
        """The evaluation that serves this genome: the row of `search_id` itself if it has one (ok or
        failed), else the oldest successful row of any search; None when it must be trained."""
        rows = self._read(
            "SELECT * FROM evaluations WHERE genome_hash = ? AND train_config_hash = ? AND replicate = ?"
            " AND (status = 'ok' OR search_id IS ?) ORDER BY search_id IS ? DESC, id LIMIT 1",
            (genome_hash, train_config_hash, replicate, search_id, search_id))
        return self._evaluation(rows[0]) if rows else None

    def record(self, candidate: Candidate, outcome: Outcome, train_config_hash: str,
               search_id: int) -> Evaluation:
        """Write one finished evaluation (one transaction) and return its row. When the search
        already has a row for this key (another process continuing it got there first), that row
        stays and is returned: the same key, the same seed, the same training."""
        fitness = outcome.fitness if outcome.status == "ok" else None
        val_loss = outcome.val_loss if outcome.val_loss is None or math.isfinite(outcome.val_loss) else None
        values = (candidate.genome_hash, train_config_hash, json.dumps(candidate.genome), outcome.status,
                  fitness, val_loss, None, outcome.epochs, outcome.seconds, outcome.worker,
                  outcome.reason, search_id, candidate.generation, candidate.index, candidate.seed, _now(),
                  candidate.max_epochs, candidate.replicate,
                  None if outcome.numerics is None else json.dumps(outcome.numerics, sort_keys=True))
        with self._write() as db:
            db.execute(
                "INSERT INTO evaluations (genome_hash, train_config_hash, genome, status, fitness,"
                " val_loss, test_accuracy, epochs, seconds, worker, reason, search_id, generation, idx,"
                " seed, finished_at, max_epochs, replicate, numerics) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
                " ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (search_id, genome_hash, train_config_hash, replicate) DO NOTHING",
                values)
            row = db.execute("SELECT * FROM evaluations WHERE search_id = ? AND genome_hash = ?"
                             " AND train_config_hash = ? AND replicate = ?",
                             (search_id, candidate.genome_hash, train_config_hash, candidate.replicate)).fetchone()
        return self._evaluation(row)

    def set_test_accuracy(self, evaluation_id: int, accuracy: float) -> None:
        """Attach the test accuracy to a successful evaluation."""
        with self._write() as db:
            cursor = db.execute("UPDATE evaluations SET test_accuracy = ? WHERE id = ? AND status = 'ok'",
                                (float(accuracy), evaluation_id))
            if cursor.rowcount != 1:
                raise KeyError(f"no successful evaluation {evaluation_id} in {self.path}")

    def search_top(self, search_id: int, n: int) -> list[Evaluation]:
        """The `n` best successful evaluations (one per genome, replicate 0) among the genomes of
        this search's generations (those it trained and those the cache served it), best first."""
        search = self.search(search_id)
        if search is None:
            return []
        wanted = sorted({m["genome_hash"] for gen in self.generations(search_id) for m in gen.members})
        best: dict[str, Evaluation] = {}
        for start in range(0, len(wanted), 500):  # SQLite caps the parameters of one statement
            chunk = wanted[start:start + 500]
            for row in self._read(
                    "SELECT * FROM evaluations WHERE status = 'ok' AND train_config_hash = ? AND replicate = 0"
                    f" AND genome_hash IN ({', '.join('?' * len(chunk))}) ORDER BY search_id IS ? DESC, id",
                    (search.train_config_hash, *chunk, search_id)):
                best.setdefault(row["genome_hash"], self._evaluation(row))
        return sorted(best.values(), key=lambda e: (-e.fitness, e.genome_hash))[:n]

    def evaluations(self, search_id: Optional[int] = None) -> list[Evaluation]:
        """Evaluations in the order they finished (of one search, or all)."""
        rows = self._read("SELECT * FROM evaluations WHERE ? IS NULL OR search_id = ? ORDER BY id",
                          (search_id, search_id))
        return [self._evaluation(r) for r in rows]

    # -- generations ----------------------------------------------------------------------------

    def begin_generation(self, search_id: int, generation: int, genomes: list[dict],
                         hashes: list[str]) -> GenerationRow:
        """Record a generation's members (genomes and their hashes, in population order), unless the
        search has it already (another process continuing the search began it); return the row."""
        members = [{"genome_hash": h, "genome": g} for h, g in zip(hashes, genomes, strict=True)]
        with self._write() as db:
            db.execute("INSERT INTO generations (search_id, generation, members, started) VALUES (?, ?, ?, ?)"
                       " ON CONFLICT (search_id, generation) DO NOTHING",
                       (search_id, generation, json.dumps(members), _now()))
        stored = self.generation(search_id, generation)
        assert stored is not None
        return stored

    def complete_generation(self, search_id: int, generation: int, results: list[dict],
                            stats: dict) -> None:
        with self._write() as db:
            cursor = db.execute(
                "UPDATE generations SET results = ?, stats = ?, complete = 1, finished = ?"
                " WHERE search_id = ? AND generation = ?",
                (json.dumps(results), json.dumps(stats), _now(), search_id, generation))
            if cursor.rowcount != 1:
                raise KeyError(f"generation {generation} of search {search_id} was never begun")

    def _generation(self, row: sqlite3.Row) -> GenerationRow:
        data = dict(row)
        for key in ("members", "results", "stats"):
            data[key] = self._json(data[key])
        data["complete"] = bool(data["complete"])
        return GenerationRow(**data)

    def generation(self, search_id: int, generation: int) -> Optional[GenerationRow]:
        rows = self._read("SELECT * FROM generations WHERE search_id = ? AND generation = ?",
                          (search_id, generation))
        return self._generation(rows[0]) if rows else None

    def generations(self, search_id: int) -> list[GenerationRow]:
        rows = self._read("SELECT * FROM generations WHERE search_id = ? ORDER BY generation", (search_id,))
        return [self._generation(r) for r in rows]


def _loads(text: Optional[str]) -> Any:
    return None if text is None else json.loads(text)
