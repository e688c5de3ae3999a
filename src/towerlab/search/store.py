"""The search store: every evaluation, every generation, what resume replays, and the queue of work that
every worker claims from. An SQLite file (one machine) or a PostgreSQL database (many), the same tables
in both (`towerlab.search.schema`, `towerlab.search.database`):

searches     id, sampler (its name), config (SearchConfig JSON), space (JSON: name, model, genes),
             space_fingerprint, train_config_hash, created, finished (NULL while running or
             interrupted), summary (JSON counts and the top, when finished), setup (JSON: how its
             workers train: device kind, threads, the model, the data; NULL before schema 4), token
             (what its creator named it by, so a retried creation makes one search).
evaluations  one row per training: genome_hash, train_config_hash (of a pruned search's lower rung,
             see `towerlab.search.rounds`), genome (JSON), status ('ok'|'failed'), fitness
             (validation accuracy; NULL unless ok), val_loss, test_accuracy (set by a test task),
             epochs (trained), max_epochs (the budget it trained under), replicate (0: the
             evaluation; 1..: a re-measure with a fresh seed), seconds, worker, reason (why it
             failed), search_id, generation, idx (-1 for a re-measure), seed, finished_at, numerics
             (JSON: what the result depends on besides its settings and seed, as the worker saw it:
             device, threads, precision, torch; NULL before schema 3). Unique per (search_id,
             genome_hash, train_config_hash, replicate): writing a row a search already has is a no-op
             that returns the row.
generations  (search_id, generation) key, members (JSON list of {genome_hash, genome} in population
             order, written when the generation begins, with `watermark`, the newest evaluation id
             then), results (JSON per-member records) and stats (JSON), written with complete = 1 when
             it ends; started, finished.
tasks        the queue: one row per training a search needs and no evaluation serves (kind 'train':
             an evaluation, a higher rung, a re-measure) or per retraining of a top network for its
             test accuracy (kind 'test'), unique per (search_id, kind, genome_hash,
             train_config_hash, replicate); state 'open', 'claimed' (by `worker`, until
             `lease_until` on the database's clock) or 'done'; attempts (claims so far), lost (why the
             last claimant lost it), result (a test task's outcome, JSON).
workers      every worker that joined: id, host, pid, device, started, seen (its last claim or
             renewal), left_at, task (what it holds now).

The cache: `lookup` serves a search its own row first, whatever its status, and otherwise the oldest
'ok' row of any search, written before the generation began (its watermark): so every worker of a
search, whenever it looks, takes the same decision. A failed candidate is not retried by the search
that failed it, resumed or not (its history stays reproducible), while a later search retries it (the
failure may have been the machine's: out of memory, a lost worker). Two searches running at once may
both train a genome neither found; each keeps its own row and its own history, as if it had run alone.

The queue: `claim` hands a worker the first open task (or one whose lease lapsed) of the searches it
works on, largest first, in one transaction; `renew` extends the lease while it trains; `complete`
writes the result and closes the task in one transaction, only while the worker still holds it, so a
worker that comes back after its lease lapsed cannot write a second result. A task whose workers were
lost `attempts` times is recorded as failed by the next claim instead of being handed out again.

Durability: one transaction per write, so a process killed mid-write leaves no half row; SQLite
stores are WAL with synchronous=FULL. An older SQLite store (1: before samplers; 2: before numerics;
3: before the queue) is migrated in place when opened. A damaged file (SQLite's quick_check at
open, a read that finds a page malformed, a record that no longer parses) is a UserError that names
the file and what to do.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

from towerlab.config import upgrade_search_config
from towerlab.errors import UserError
from towerlab.search.candidates import Candidate, Outcome
from towerlab.search.database import (CHUNK, Database, PostgreSQL, SQLite, Transaction, connect, damaged, is_damage,
                                      is_url, placeholders)
from towerlab.search.schema import (OLD_TABLES, SCHEMA_VERSION, TABLES, create_tables, upgrade_from_1,
                                    upgrade_from_2, upgrade_from_3)
from towerlab.search.space import Space

STORE_NAME = "search.db"  # the store's file name inside a search folder
_SCHEMA_LOCK = -1  # the advisory lock key under which a PostgreSQL store's tables are made


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
    setup: Optional[dict] = None
    token: Optional[str] = None


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
    watermark: Optional[int] = None


@dataclass(frozen=True)
class Task:
    """A piece of a search's work as the queue holds it: `candidate` to train under `train_config_hash`
    (kind "train"), or to retrain for its test accuracy (kind "test")."""

    id: int
    search_id: int
    kind: str
    candidate: Candidate
    train_config_hash: str
    state: str
    worker: Optional[str]
    attempts: int
    lost: Optional[str]
    result: Optional[dict]
    seconds: Optional[float] = None  # from its claim to its end, when done


class Store:
    """A search store: an SQLite file at `target` (or `target`/search.db when `target` is a folder;
    created, with its folder, unless `create=False`), or the PostgreSQL database a postgresql:// URL
    names (its tables created unless `create=False`)."""

    def __init__(self, target: str | os.PathLike, *, create: bool = True) -> None:
        self.url = str(target) if is_url(str(target)) else None
        if self.url is None:
            path = Path(target)
            if path.is_dir():
                path = path / STORE_NAME
            if not create and not path.is_file():
                raise UserError(f"no search store at {path}: give the search.db of a search "
                                f"(or the folder holding it)")
            if create:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise UserError(f"cannot create the search store {path}: {exc.strerror or exc}") from None
        self.db: Database = connect(self.url or path)
        self.path: Path | str = self.db.where if self.url else path
        try:
            if isinstance(self.db, SQLite):
                self._open_sqlite(create)
            else:
                self._open_postgresql(create)
        except BaseException:
            self.db.close()
            raise

    @property
    def target(self) -> str:
        """What opens this store again: its file, or its URL (with the password it was given)."""
        return self.url or str(self.path)

    # -- opening ----------------------------------------------------------------------------------

    def _open_sqlite(self, create: bool) -> None:
        db = self.db
        assert isinstance(db, SQLite)
        try:
            self._check_integrity(db)  # before anything is migrated or written
            self._check_sqlite_schema(db, create)
            db.configure()
        except sqlite3.DatabaseError as e:
            if is_damage(e):
                raise damaged(self.path, e) from None
            raise UserError(f"{self.path} is not a towerlab search store ({e}): "
                            f"give the search.db of a search, or a new path") from None

    def _check_integrity(self, db: SQLite) -> None:
        problems = [r[0] for r in db.raw.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise damaged(self.path, "; ".join(problems[:2]))

    @staticmethod
    def _sqlite_schema(db: SQLite) -> tuple[int, set[str]]:
        version = db.raw.execute("PRAGMA user_version").fetchone()[0]
        tables = {r[0] for r in db.raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return version, tables

    def _check_sqlite_schema(self, db: SQLite, create: bool) -> None:
        """Refuse a newer schema or a foreign file before writing anything; create an empty one;
        migrate an older one."""
        version, tables = self._sqlite_schema(db)
        self._refuse_newer(version)
        if version == SCHEMA_VERSION and TABLES <= tables:
            return
        if version in (1, 2, 3) and OLD_TABLES <= tables:
            if version == 1:
                self._migrate_from_1(db)
            if version <= 2:
                self._migrate(db, 2, upgrade_from_2)
            self._migrate(db, 3, upgrade_from_3)
            return
        if version != 0 or tables or not create:
            raise UserError(f"{self.path} is an SQLite file but not a towerlab search store: "
                            f"give the search.db of a search, or a new path")

        def make(tx: Transaction) -> bool:
            if self._sqlite_schema(db) != (0, set()):
                return False  # another process wrote it meanwhile
            create_tables(tx)
            tx.run(f"PRAGMA user_version = {SCHEMA_VERSION}")
            return True

        if not db.write(make):
            self._check_sqlite_schema(db, create=False)

    def _refuse_newer(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise UserError(f"search store {self.path} has schema version {version}, newer than this "
                            f"towerlab reads ({SCHEMA_VERSION}): upgrade towerlab to open it")

    def _migrate_from_1(self, db: SQLite) -> None:
        db.raw.execute("PRAGMA foreign_keys = OFF")  # the searches table is rebuilt under its rows
        try:
            def upgrade(tx: Transaction) -> None:
                if db.raw.execute("PRAGMA user_version").fetchone()[0] != 1:
                    return  # another process migrated it meanwhile
                if not upgrade_from_1(db.raw):
                    raise damaged(self.path, "rows that name no search")
            db.write(upgrade)
        finally:
            db.raw.execute("PRAGMA foreign_keys = ON")

    @staticmethod
    def _migrate(db: SQLite, version: int, upgrade: Any) -> None:
        def run(tx: Transaction) -> None:
            if db.raw.execute("PRAGMA user_version").fetchone()[0] != version:
                return  # another process migrated it meanwhile
            upgrade(tx)
            tx.run(f"PRAGMA user_version = {version + 1}")
        db.write(run)

    def _open_postgresql(self, create: bool) -> None:
        db = self.db
        assert isinstance(db, PostgreSQL)

        def version(tx: Transaction) -> Optional[int]:
            if tx.one("SELECT to_regclass('towerlab_schema') AS t")["t"] is None:
                return None
            row = tx.one("SELECT version FROM towerlab_schema")
            return None if row is None else int(row["version"])

        def make(tx: Transaction) -> Optional[int]:
            found = version(tx)
            if found is not None:
                return found
            if tx.one("SELECT to_regclass('searches') AS t")["t"] is not None:
                raise UserError(f"the database {self.path} holds a table named searches but no towerlab store: "
                                "give a database of its own to towerlab")
            if not create:
                raise UserError(f"the database {self.path} holds no search store")
            create_tables(tx)
            tx.run("CREATE TABLE towerlab_schema (version INTEGER NOT NULL)")
            tx.run("INSERT INTO towerlab_schema (version) VALUES (?)", (SCHEMA_VERSION,))
            return SCHEMA_VERSION

        found = db.write(version)
        if found is None:
            found = db.write(make, lock=_SCHEMA_LOCK)
        self._refuse_newer(found)

    # -- the parts every query shares ------------------------------------------------------------------

    def _read(self, sql: str, args: tuple = ()) -> list[dict]:
        return self.db.read(sql, args)

    def _json(self, text: Optional[str]) -> Any:
        try:
            return None if text is None else json.loads(text)
        except ValueError as e:  # bytes changed inside a row: the pages are sound, the data is not
            raise damaged(self.path, f"unreadable record: {e}") from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- searches -------------------------------------------------------------------------------

    def begin_search(self, sampler: str, config: dict, space: Space, train_config_hash: str,
                     setup: Optional[dict] = None, token: Optional[str] = None) -> int:
        """A new search's id. `token` names it (a new one when not given): a creation retried after a
        lost connection finds the search it made instead of making a second one."""
        token = token or uuid.uuid4().hex

        def insert(tx: Transaction) -> int:
            tx.run("INSERT INTO searches (sampler, config, space, space_fingerprint, train_config_hash, created,"
                   " setup, token) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (token) DO NOTHING",
                   (sampler, json.dumps(config, sort_keys=True), json.dumps(space.to_dict()), space.fingerprint,
                    train_config_hash, _now(), None if setup is None else json.dumps(setup, sort_keys=True), token))
            return int(tx.one("SELECT id FROM searches WHERE token = ?", (token,))["id"])

        return self.db.write(insert)

    def resume_search(self, search_id: int, config: dict) -> None:
        """Mark the search running again, under `config` (it may extend the generations)."""
        self.db.write(lambda tx: tx.run("UPDATE searches SET config = ?, finished = NULL, summary = NULL WHERE id = ?",
                                        (json.dumps(config, sort_keys=True), search_id)))

    def finish_search(self, search_id: int, summary: dict, config: Optional[dict] = None) -> bool:
        """The search's summary; the first process to finish it writes it (every one computes the same).
        With `config`, only while the search still has those settings: a worker that played it under
        settings a resume has since changed (more generations) finishes nothing. Whether it wrote it."""
        if config is None:
            return 1 == self.db.write(lambda tx: tx.run(
                "UPDATE searches SET finished = ?, summary = ? WHERE id = ? AND finished IS NULL",
                (_now(), json.dumps(summary), search_id)))
        def finish(tx: Transaction) -> bool:
            row = tx.one("SELECT sampler, config, finished FROM searches WHERE id = ?", (search_id,))
            if row is None or row["finished"] is not None or (
                    upgrade_search_config(json.loads(row["config"]), row["sampler"]) != json.loads(json.dumps(config))):
                return False
            tx.run("UPDATE searches SET finished = ?, summary = ? WHERE id = ?", (_now(), json.dumps(summary), search_id))
            return True
        return self.db.write(finish)

    def _search(self, row: dict) -> SearchRow:
        data = dict(row)
        for key in ("config", "space", "summary", "setup"):
            data[key] = self._json(data.get(key))
        if isinstance(data["config"], dict):  # a search recorded before a setting existed ran without it
            data["config"] = upgrade_search_config(data["config"], data["sampler"])
        return SearchRow(**data)

    def search(self, search_id: int) -> Optional[SearchRow]:
        rows = self._read("SELECT * FROM searches WHERE id = ?", (search_id,))
        return self._search(rows[0]) if rows else None

    def latest_search(self, sampler: Optional[str] = None) -> Optional[SearchRow]:
        if sampler is None:
            rows = self._read("SELECT * FROM searches ORDER BY id DESC LIMIT 1")
        else:
            rows = self._read("SELECT * FROM searches WHERE sampler = ? ORDER BY id DESC LIMIT 1", (sampler,))
        return self._search(rows[0]) if rows else None

    def searches(self) -> list[SearchRow]:
        return [self._search(r) for r in self._read("SELECT * FROM searches ORDER BY id")]

    def unfinished_searches(self) -> list[SearchRow]:
        return [self._search(r) for r in self._read("SELECT * FROM searches WHERE finished IS NULL ORDER BY id")]

    # -- evaluations ----------------------------------------------------------------------------

    def _evaluation(self, row: dict) -> Evaluation:
        data = dict(row)
        data["genome"] = self._json(data["genome"])
        data["numerics"] = self._json(data["numerics"])
        data["index"] = data.pop("idx")
        return Evaluation(**data)

    def lookup(self, genome_hash: str, train_config_hash: str, search_id: Optional[int] = None,
               replicate: int = 0, watermark: Optional[int] = None) -> Optional[Evaluation]:
        """The evaluation that serves this genome: the row of `search_id` itself if it has one (ok or
        failed), else the oldest successful row of any search (of those up to id `watermark`, when
        given); None when it must be trained."""
        others = "status = 'ok'" + ("" if watermark is None else " AND id <= ?")
        bound = () if watermark is None else (watermark,)
        if search_id is None:
            rows = self._read(f"SELECT * FROM evaluations WHERE genome_hash = ? AND train_config_hash = ?"
                              f" AND replicate = ? AND {others} ORDER BY id LIMIT 1",
                              (genome_hash, train_config_hash, replicate, *bound))
        else:
            rows = self._read(f"SELECT * FROM evaluations WHERE genome_hash = ? AND train_config_hash = ?"
                              f" AND replicate = ? AND (search_id = ? OR ({others}))"
                              " ORDER BY CASE WHEN search_id = ? THEN 0 ELSE 1 END, id LIMIT 1",
                              (genome_hash, train_config_hash, replicate, search_id, *bound, search_id))
        return self._evaluation(rows[0]) if rows else None

    @staticmethod
    def _insert_evaluation(tx: Transaction, candidate: Candidate, outcome: Outcome, train_config_hash: str,
                           search_id: int) -> dict:
        fitness = outcome.fitness if outcome.status == "ok" else None
        val_loss = outcome.val_loss if outcome.val_loss is None or math.isfinite(outcome.val_loss) else None
        tx.run("INSERT INTO evaluations (genome_hash, train_config_hash, genome, status, fitness, val_loss,"
               " test_accuracy, epochs, seconds, worker, reason, search_id, generation, idx, seed, finished_at,"
               " max_epochs, replicate, numerics) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
               " ON CONFLICT (search_id, genome_hash, train_config_hash, replicate) DO NOTHING",
               (candidate.genome_hash, train_config_hash, json.dumps(candidate.genome), outcome.status, fitness,
                val_loss, None, outcome.epochs, outcome.seconds, outcome.worker, outcome.reason, search_id,
                candidate.generation, candidate.index, candidate.seed, _now(), candidate.max_epochs,
                candidate.replicate,
                None if outcome.numerics is None else json.dumps(outcome.numerics, sort_keys=True)))
        row = tx.one("SELECT * FROM evaluations WHERE search_id = ? AND genome_hash = ? AND train_config_hash = ?"
                     " AND replicate = ?", (search_id, candidate.genome_hash, train_config_hash, candidate.replicate))
        assert row is not None
        return row

    def record(self, candidate: Candidate, outcome: Outcome, train_config_hash: str,
               search_id: int) -> Evaluation:
        """Write one finished evaluation (one transaction) and return its row. When the search
        already has a row for this key (another process got there first), that row stays and is
        returned: the same key, the same seed, the same training."""
        return self._evaluation(self.db.write(
            lambda tx: self._insert_evaluation(tx, candidate, outcome, train_config_hash, search_id)))

    def set_test_accuracy(self, evaluation_id: int, accuracy: float) -> None:
        """Attach the test accuracy to a successful evaluation."""
        changed = self.db.write(lambda tx: tx.run(
            "UPDATE evaluations SET test_accuracy = ? WHERE id = ? AND status = 'ok'", (float(accuracy), evaluation_id)))
        if changed != 1:
            raise KeyError(f"no successful evaluation {evaluation_id} in {self.path}")

    def search_top(self, search_id: int, n: int) -> list[Evaluation]:
        """The `n` best successful evaluations (one per genome, replicate 0) among the genomes of
        this search's generations (those it trained and those the cache served it), best first."""
        search = self.search(search_id)
        if search is None:
            return []
        wanted = sorted({m["genome_hash"] for gen in self.generations(search_id) for m in gen.members})
        best: dict[str, Evaluation] = {}
        for start in range(0, len(wanted), CHUNK):
            chunk = wanted[start:start + CHUNK]
            for row in self._read(
                    "SELECT * FROM evaluations WHERE status = 'ok' AND train_config_hash = ? AND replicate = 0"
                    f" AND genome_hash IN ({placeholders(len(chunk))})"
                    " ORDER BY CASE WHEN search_id = ? THEN 0 ELSE 1 END, id",
                    (search.train_config_hash, *chunk, search_id)):
                best.setdefault(row["genome_hash"], self._evaluation(row))
        return sorted(best.values(), key=lambda e: (-e.fitness, e.genome_hash))[:n]

    def evaluations(self, search_id: Optional[int] = None, after: int = 0) -> list[Evaluation]:
        """Evaluations in the order they finished (of one search, or all), those after id `after`."""
        if search_id is None:
            rows = self._read("SELECT * FROM evaluations WHERE id > ? ORDER BY id", (after,))
        else:
            rows = self._read("SELECT * FROM evaluations WHERE search_id = ? AND id > ? ORDER BY id",
                              (search_id, after))
        return [self._evaluation(r) for r in rows]

    def newest_evaluation(self) -> int:
        """The id of the newest evaluation (0 in an empty store)."""
        return int(self._read("SELECT COALESCE(MAX(id), 0) AS n FROM evaluations")[0]["n"])

    def own_rows(self, search_id: int, keys: Sequence[tuple[str, str, int]]) -> dict[tuple[str, str, int], Evaluation]:
        """The rows this search itself holds for (genome_hash, train_config_hash, replicate) keys."""
        wanted, found = set(keys), {}
        hashes = sorted({h for h, _, _ in keys})
        for start in range(0, len(hashes), CHUNK):
            chunk = hashes[start:start + CHUNK]
            for row in self._read(f"SELECT * FROM evaluations WHERE search_id = ? AND genome_hash IN"
                                  f" ({placeholders(len(chunk))})", (search_id, *chunk)):
                key = (row["genome_hash"], row["train_config_hash"], row["replicate"])
                if key in wanted:
                    found[key] = self._evaluation(row)
        return found

    # -- generations ----------------------------------------------------------------------------

    def begin_generation(self, search_id: int, generation: int, genomes: list[dict],
                         hashes: list[str]) -> GenerationRow:
        """Record a generation's members (genomes and their hashes, in population order) and the newest
        evaluation id now (what other searches may serve it from), unless the search has it already
        (another worker began it); return the row."""
        members = [{"genome_hash": h, "genome": g} for h, g in zip(hashes, genomes, strict=True)]
        self.db.write(lambda tx: tx.run(
            "INSERT INTO generations (search_id, generation, members, started, watermark)"
            " SELECT ?, ?, ?, ?, COALESCE(MAX(id), 0) FROM evaluations WHERE true"
            " ON CONFLICT (search_id, generation) DO NOTHING",
            (search_id, generation, json.dumps(members), _now())), lock=search_id)
        stored = self.generation(search_id, generation)
        assert stored is not None
        return stored

    def complete_generation(self, search_id: int, generation: int, results: list[dict],
                            stats: dict) -> None:
        """The generation's results; the first process to complete it writes them (every one computes the same)."""
        def complete(tx: Transaction) -> None:
            if tx.one("SELECT complete FROM generations WHERE search_id = ? AND generation = ?",
                      (search_id, generation)) is None:
                raise KeyError(f"generation {generation} of search {search_id} was never begun")
            tx.run("UPDATE generations SET results = ?, stats = ?, complete = 1, finished = ?"
                   " WHERE search_id = ? AND generation = ? AND complete = 0",
                   (json.dumps(results), json.dumps(stats), _now(), search_id, generation))
        self.db.write(complete)

    def _generation(self, row: dict) -> GenerationRow:
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

    # -- the queue --------------------------------------------------------------------------------

    def enqueue(self, search_id: int, kind: str, candidates: Sequence[tuple[Candidate, str, float]]) -> None:
        """Put (candidate, train_config_hash, priority) on the queue unless the search has them there
        already (another worker put them first), in one transaction."""
        if not candidates:
            return

        def insert(tx: Transaction) -> None:
            for c, training_hash, priority in candidates:
                tx.run("INSERT INTO tasks (search_id, kind, genome_hash, train_config_hash, replicate, generation,"
                       " idx, genome, seed, max_epochs, priority, state, created)"
                       " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'open', {now})"
                       " ON CONFLICT (search_id, kind, genome_hash, train_config_hash, replicate) DO NOTHING",
                       (search_id, kind, c.genome_hash, training_hash, c.replicate, c.generation, c.index,
                        json.dumps(c.genome), c.seed, c.max_epochs, float(priority)))

        self.db.write(insert)

    def _task(self, row: dict) -> Task:
        candidate = Candidate(row["generation"], row["idx"], self._json(row["genome"]), row["genome_hash"],
                              int(row["seed"]), row["max_epochs"], row["replicate"])
        seconds = (row["finished"] - row["claimed"]) if row.get("finished") and row.get("claimed") else None
        return Task(row["id"], row["search_id"], row["kind"], candidate, row["train_config_hash"], row["state"],
                    row["worker"], row["attempts"], row["lost"], self._json(row["result"]), seconds)

    def claim(self, worker: str, search_ids: Sequence[int], lease: float, max_attempts: int) -> Optional[Task]:
        """The next task for `worker` among `search_ids` (open, or claimed under a lease that lapsed),
        claimed until the database's clock reads `lease` seconds later; None when there is none. A task
        whose claimants were lost `max_attempts` times is recorded as failed on the way (a test task
        with a failed result), and the next one is taken."""
        if not search_ids:
            return None
        ids = tuple(search_ids)

        def take(tx: Transaction) -> Optional[dict]:
            while True:
                row = tx.one(f"SELECT * FROM tasks WHERE search_id IN ({placeholders(len(ids))}) AND"
                             " (state = 'open' OR (state = 'claimed' AND lease_until < {now}))"
                             " ORDER BY search_id, priority DESC, id LIMIT 1{skip_locked}", ids)
                if row is None:
                    return None
                if row["state"] == "claimed":  # its claimant stopped renewing: lost
                    row["lost"] = f"the lease of worker {row['worker']} lapsed"
                if row["attempts"] < max_attempts:
                    tx.run("UPDATE tasks SET state = 'claimed', worker = ?, lease_until = {now} + ?,"
                           " attempts = attempts + 1, claimed = {now}, lost = ? WHERE id = ?",
                           (worker, lease, row["lost"], row["id"]))
                    tx.run("UPDATE workers SET seen = {now}, task = ? WHERE id = ?", (row["id"], worker))
                    return tx.one("SELECT * FROM tasks WHERE id = ?", (row["id"],))
                self._give_up(tx, self._task(row), worker, max_attempts)

        row = self.db.write(take)
        return None if row is None else self._task(row)

    def _give_up(self, tx: Transaction, task: Task, worker: str, attempts: int) -> None:
        reason = (f"its worker was lost {attempts} times while training it (last: {task.lost or 'unknown'}); "
                  "killed by the out-of-memory killer?")
        self._close(tx, task, Outcome.failed(reason, worker=worker), None)

    def _close(self, tx: Transaction, task: Task, outcome: Outcome, test_accuracy: Optional[float]) -> Optional[dict]:
        """Write the task's result and mark it done (the caller checked it may)."""
        result = {"status": outcome.status, "fitness": outcome.fitness, "reason": outcome.reason,
                  "seconds": outcome.seconds, "worker": outcome.worker, "test_accuracy": test_accuracy}
        tx.run("UPDATE tasks SET state = 'done', finished = {now}, result = ?, lease_until = NULL WHERE id = ?",
               (json.dumps(result), task.id))
        if task.kind == "train":
            return self._insert_evaluation(tx, task.candidate, outcome, task.train_config_hash, task.search_id)
        if outcome.status == "ok" and test_accuracy is not None:
            served = tx.one("SELECT id FROM evaluations WHERE genome_hash = ? AND train_config_hash = ? AND"
                            " replicate = 0 AND (search_id = ? OR status = 'ok')"
                            " ORDER BY CASE WHEN search_id = ? THEN 0 ELSE 1 END, id LIMIT 1",
                            (task.candidate.genome_hash, task.train_config_hash, task.search_id, task.search_id))
            if served is not None:
                tx.run("UPDATE evaluations SET test_accuracy = ? WHERE id = ? AND status = 'ok'",
                       (float(test_accuracy), served["id"]))
        return None

    def renew(self, task: Task, worker: str, lease: float) -> bool:
        """Extend `worker`'s lease on `task`; False when it no longer holds it (the lease lapsed and
        another worker took the task)."""
        def extend(tx: Transaction) -> bool:
            held = tx.run("UPDATE tasks SET lease_until = {now} + ? WHERE id = ? AND worker = ? AND state = 'claimed'",
                          (lease, task.id, worker))
            tx.run("UPDATE workers SET seen = {now} WHERE id = ?", (worker,))
            return held == 1
        return self.db.write(extend)

    def complete(self, task: Task, worker: str, outcome: Outcome,
                 test_accuracy: Optional[float] = None) -> tuple[bool, Optional[Evaluation]]:
        """Write the result of `task` and close it, in one transaction, if `worker` still holds it:
        (True, its evaluation row for a training task). (False, None) when the lease was lost: the result
        is dropped, since the task is another worker's now (or done already)."""
        def close(tx: Transaction) -> tuple[bool, Optional[dict]]:
            held = tx.one("SELECT id FROM tasks WHERE id = ? AND worker = ? AND state = 'claimed'", (task.id, worker))
            if held is None:
                return False, None
            tx.run("UPDATE workers SET seen = {now}, task = NULL WHERE id = ?", (worker,))
            return True, self._close(tx, task, outcome, test_accuracy)

        done, row = self.db.write(close)
        return done, None if row is None else self._evaluation(row)

    def put_back(self, task: Task, worker: str) -> None:
        """Hand a task back unfinished (its worker was interrupted): open again at once, and the claim
        not counted as a loss."""
        self.db.write(lambda tx: tx.run(
            "UPDATE tasks SET state = 'open', worker = NULL, lease_until = NULL, attempts = attempts - 1"
            " WHERE id = ? AND worker = ? AND state = 'claimed'", (task.id, worker)))

    def release(self, worker: str, reason: str) -> int:
        """A worker is gone (its process ended, `reason` says how): the tasks it held are open again at
        once, the loss counted; returns how many."""
        def free(tx: Transaction) -> int:
            n = tx.run("UPDATE tasks SET state = 'open', lease_until = NULL, lost = ?"
                       " WHERE worker = ? AND state = 'claimed'", (f"worker {worker} {reason}", worker))
            tx.run("UPDATE workers SET left_at = {now}, task = NULL WHERE id = ? AND left_at IS NULL", (worker,))
            return n
        return self.db.write(free)

    def reopen_failed_tests(self, search_id: int) -> int:
        """Put the search's failed test retrainings back on the queue (and the search back to unfinished,
        so that its workers take them); how many."""
        failed = [t.id for t in self.tasks(search_id, "test") if t.state == "done" and (t.result or {}).get("status") != "ok"]

        def reopen(tx: Transaction) -> None:
            for task_id in failed:
                tx.run("UPDATE tasks SET state = 'open', attempts = 0, result = NULL, worker = NULL, lost = NULL"
                       " WHERE id = ?", (task_id,))
            tx.run("UPDATE searches SET finished = NULL, summary = NULL WHERE id = ?", (search_id,))

        if failed:
            self.db.write(reopen)
        return len(failed)

    def tasks(self, search_id: int, kind: Optional[str] = None) -> list[Task]:
        if kind is None:
            rows = self._read("SELECT * FROM tasks WHERE search_id = ? ORDER BY id", (search_id,))
        else:
            rows = self._read("SELECT * FROM tasks WHERE search_id = ? AND kind = ? ORDER BY id", (search_id, kind))
        return [self._task(r) for r in rows]

    def waiting(self, search_ids: Sequence[int]) -> int:
        """How many tasks of these searches are open or claimed."""
        if not search_ids:
            return 0
        return int(self._read(f"SELECT COUNT(*) AS n FROM tasks WHERE search_id IN ({placeholders(len(search_ids))})"
                              " AND state <> 'done'", tuple(search_ids))[0]["n"])

    def queue_counts(self, search_id: int) -> dict[str, int]:
        """The search's tasks by state: open, claimed (lease held or lapsed), done."""
        counts = {"open": 0, "claimed": 0, "done": 0}
        for row in self._read("SELECT state, COUNT(*) AS n FROM tasks WHERE search_id = ? GROUP BY state",
                              (search_id,)):
            counts[row["state"]] = int(row["n"])
        return counts

    # -- workers ----------------------------------------------------------------------------------

    def join(self, worker: str, host: str, pid: int, device: str) -> None:
        self.db.write(lambda tx: tx.run(
            "INSERT INTO workers (id, host, pid, device, started, seen) VALUES (?, ?, ?, ?, {now}, {now})"
            " ON CONFLICT (id) DO UPDATE SET seen = excluded.seen, left_at = NULL", (worker, host, pid, device)))

    def leave(self, worker: str) -> None:
        self.db.write(lambda tx: tx.run("UPDATE workers SET left_at = {now}, task = NULL WHERE id = ?", (worker,)))

    def workers(self) -> list[dict]:
        """Every worker that joined, with `age` (seconds since it was last seen, on the database's clock)."""
        return self._read("SELECT w.*, {now} - w.seen AS age, t.search_id AS search_id, t.generation AS generation,"
                          " t.idx AS idx, t.kind AS kind FROM workers w LEFT JOIN tasks t ON t.id = w.task"
                          " ORDER BY w.started")

    def clock(self) -> float:
        """The database's clock (seconds since the epoch)."""
        return float(self._read("SELECT {now} AS now")[0]["now"])
