"""The rows of a search store as Python values (`SearchRow`, `Evaluation`, `GenerationRow`, `Task`), and
what the store's parts share: `Rows`, which reads them from the backend and parses their records (a
record that no longer parses is damage: one line naming the store); `insert_evaluation`, which writes a
training's row; `set_test_accuracy`, the one write of a test accuracy; and `serving`, the query for the row
that serves a genome (the cache's one rule,
`towerlab.search.store.records`). The tables are described in `towerlab.search.store.schema`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from towerlab.upgrades import upgrade_search_config, upgrade_search_setup
from towerlab.search.candidates import Candidate, Outcome
from towerlab.search.store.database import Backend, Transaction, damaged


@dataclass(frozen=True)
class SearchRow:
    """A row of `searches`, its JSON parsed (a search's settings in today's fields: `upgrade_search_config`);
    `towerlab.search.search.Search.of_row` is the search it records."""

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
    leader: Optional[str] = None
    leader_until: Optional[float] = None
    activity: Optional[dict] = None


@dataclass(frozen=True)
class GenerationRow:
    """A row of `generations`: its members from when it began, its results and statistics once complete."""

    search_id: int
    generation: int
    members: list
    results: Optional[list]
    stats: Optional[dict]
    complete: bool
    started: str
    finished: Optional[str]
    watermark: Optional[int] = None
    proposed: Optional[dict] = None

    @property
    def final_results(self) -> list:
        """A complete generation's member records (written with its statistics, as it completed)."""
        if self.results is None:
            raise TypeError(f"generation {self.generation + 1} of search {self.search_id} holds no results")
        return self.results

    @property
    def final_stats(self) -> dict:
        """A complete generation's statistics (written with its results, as it completed)."""
        if self.stats is None:
            raise TypeError(f"generation {self.generation + 1} of search {self.search_id} holds no statistics")
        return self.stats


@dataclass(frozen=True)
class Evaluation:
    """A row of `evaluations`: one training, its outcome, and where it was trained."""

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
    provenance: Optional[dict] = None
    metrics: Optional[dict] = None
    curve: Optional[list] = None
    continued: int = 0  # the epochs it did not train again: it continued its lower rung's training


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

    @property
    def test_accuracy(self) -> Optional[float]:
        """The test accuracy its result gives: a test task's, or a training task's whose network was
        scored on the test split as it ended (it entered its search's top then); None where it gives
        none (not done, failed, or not scored)."""
        result = self.result or {}
        return result.get("test_accuracy") if result.get("status") == "ok" else None


class Rows:
    """Rows read from a store's backend, as the values above; `where` names the store in messages."""

    def __init__(self, db: Backend, where: Path | str) -> None:
        self.db, self.where = db, where

    def read(self, sql: str, args: tuple = ()) -> list[dict]:
        return self.db.read(sql, args)

    def json(self, text: Optional[str]) -> Any:
        try:
            return None if text is None else json.loads(text)
        except ValueError as e:  # bytes changed inside a row: the pages are sound, the data is not
            raise damaged(self.where, f"unreadable record: {e}") from None

    def search(self, row: dict) -> SearchRow:
        data = dict(row)
        for key in ("config", "space", "summary", "setup", "activity"):
            data[key] = self.json(data.get(key))
        if isinstance(data["config"], dict):  # a search recorded before a setting existed ran without it
            data["config"] = upgrade_search_config(data["config"], data["sampler"])
            data["setup"] = upgrade_search_setup(data["setup"], data["config"])
        return SearchRow(**data)

    def evaluation(self, row: dict) -> Evaluation:
        data = dict(row)
        data["genome"] = self.json(data["genome"])
        data["numerics"] = self.json(data["numerics"])
        for key in ("provenance", "metrics", "curve"):
            data[key] = self.json(data.get(key))
        data["index"] = data.pop("idx")
        return Evaluation(**data)

    def generation(self, row: dict) -> GenerationRow:
        data = dict(row)
        for key in ("members", "results", "stats", "proposed"):
            data[key] = self.json(data.get(key))
        data["complete"] = bool(data["complete"])
        return GenerationRow(**data)

    def task(self, row: dict) -> Task:
        genome = self.json(row["genome"])
        if not isinstance(genome, dict):  # an edited row: never trained (`integrity.records_of` names it)
            raise TypeError(f"task {row['id']}'s genome is a {type(genome).__name__}, not an object")
        candidate = Candidate(row["generation"], row["idx"], genome, row["genome_hash"],
                              int(row["seed"]), row["max_epochs"], row["replicate"], int(row["starts"]))
        seconds = (row["finished"] - row["claimed"]) if row.get("finished") and row.get("claimed") else None
        return Task(row["id"], row["search_id"], row["kind"], candidate, row["train_config_hash"], row["state"],
                    row["worker"], row["attempts"], row["lost"], self.json(row["result"]), seconds)


def serving(genome_hash: str, train_config_hash: str, search_id: Optional[int], replicate: int = 0,
            watermark: Optional[int] = None) -> tuple[str, tuple]:
    """The query (SQL, arguments) for the evaluation that serves a genome: the row of `search_id` itself
    if it has one (ok or failed), else the oldest successful row of any search (of those up to id
    `watermark`, when given)."""
    others = "status = 'ok'" + ("" if watermark is None else " AND id <= ?")
    bound = () if watermark is None else (watermark,)
    if search_id is None:
        return (f"SELECT * FROM evaluations WHERE genome_hash = ? AND train_config_hash = ? AND replicate = ?"
                f" AND {others} ORDER BY id LIMIT 1", (genome_hash, train_config_hash, replicate, *bound))
    return (f"SELECT * FROM evaluations WHERE genome_hash = ? AND train_config_hash = ? AND replicate = ?"
            f" AND (search_id = ? OR ({others})) ORDER BY CASE WHEN search_id = ? THEN 0 ELSE 1 END, id LIMIT 1",
            (genome_hash, train_config_hash, replicate, search_id, *bound, search_id))


def _whole_curve(lower: Optional[str], own: Optional[list], starts: int) -> Optional[list]:
    """A continued training's curve (`own`, from its epoch `starts` on) after its lower rung's (`lower`, as
    stored) up to `starts`, where it reported none of those epochs itself."""
    try:
        before = json.loads(lower) if lower else None
    except ValueError:
        before = None
    if not isinstance(before, list):
        return own
    reported = {p.get("epoch") for p in own or ()}
    earlier = [p for p in before if isinstance(p, dict) and isinstance(p.get("epoch"), int)
               and p["epoch"] <= starts and p["epoch"] not in reported]
    return sorted([*earlier, *(own or ())], key=lambda p: p["epoch"]) or None


def insert_evaluation(tx: Transaction, candidate: Candidate, outcome: Outcome, train_config_hash: str,
                      search_id: int) -> dict:
    """Write one training's row in `tx`, unless the search has a row for its key already (another process
    got there first: that one stays); the row."""
    fitness = outcome.fitness if outcome.status == "ok" else None
    val_loss = outcome.val_loss if outcome.val_loss is None or math.isfinite(outcome.val_loss) else None
    continued = min(outcome.continued, candidate.starts)  # never more than it could continue
    curve = outcome.curve
    if continued:  # the curve of the whole training: its lower rung's points, then those it reported
        lower = tx.one("SELECT curve FROM evaluations WHERE search_id = ? AND generation = ? AND idx = ? AND"
                       " genome_hash = ? AND replicate = ? AND max_epochs = ?",
                       (search_id, candidate.generation, candidate.index, candidate.genome_hash, candidate.replicate,
                        candidate.starts))
        curve = _whole_curve(lower["curve"] if lower else None, curve, continued)
    tx.run("INSERT INTO evaluations (genome_hash, train_config_hash, genome, status, fitness, val_loss,"
           " test_accuracy, epochs, seconds, worker, reason, search_id, generation, idx, seed, finished_at,"
           " max_epochs, replicate, numerics, provenance, metrics, curve, continued)"
           " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {stamp}, ?, ?, ?, ?, ?, ?, ?)"
           " ON CONFLICT (search_id, genome_hash, train_config_hash, replicate) DO NOTHING",
           (candidate.genome_hash, train_config_hash, json.dumps(candidate.genome), outcome.status, fitness,
            val_loss, None, outcome.epochs, outcome.seconds, outcome.worker, outcome.reason, search_id,
            candidate.generation, candidate.index, candidate.seed, candidate.max_epochs,
            candidate.replicate,
            None if outcome.numerics is None else json.dumps(outcome.numerics, sort_keys=True),
            *(None if value is None else json.dumps(value, sort_keys=True)
              for value in (outcome.provenance, outcome.metrics, curve)), continued))
    row = tx.one("SELECT * FROM evaluations WHERE search_id = ? AND genome_hash = ? AND train_config_hash = ?"
                 " AND replicate = ?", (search_id, candidate.genome_hash, train_config_hash, candidate.replicate))
    assert row is not None
    return row


def set_test_accuracy(tx: Transaction, evaluation_id: int, accuracy: float) -> int:
    """Attach a test accuracy to a successful evaluation, in `tx` (the one place that writes one: the
    driver's from a training that scored it as it ended, a test task's on closing); how many rows changed."""
    return tx.run("UPDATE evaluations SET test_accuracy = ? WHERE id = ? AND status = 'ok'",
                  (float(accuracy), evaluation_id))
