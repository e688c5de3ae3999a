"""The rows of a search store as Python values (`SearchRow`, `Evaluation`, `GenerationRow`, `Task`), and
`Records`, what every part of the store shares: its database connection, reading rows, parsing a
record's JSON (a record that no longer parses is damage, one line), writing an evaluation. The tables
are described in `towerlab.search.store`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from towerlab.search.candidates import Candidate, Outcome
from towerlab.search.database import Database, Transaction, damaged


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
    provenance: Optional[dict] = None


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


class Records:
    """What the parts of a store share (see the module's docstring)."""

    db: Database
    path: Path | str

    def _read(self, sql: str, args: tuple = ()) -> list[dict]:
        return self.db.read(sql, args)

    def _json(self, text: Optional[str]) -> Any:
        try:
            return None if text is None else json.loads(text)
        except ValueError as e:  # bytes changed inside a row: the pages are sound, the data is not
            raise damaged(self.path, f"unreadable record: {e}") from None

    def _evaluation(self, row: dict) -> Evaluation:
        data = dict(row)
        data["genome"] = self._json(data["genome"])
        data["numerics"] = self._json(data["numerics"])
        data["provenance"] = self._json(data.get("provenance"))
        data["index"] = data.pop("idx")
        return Evaluation(**data)

    def _task(self, row: dict) -> Task:
        genome = self._json(row["genome"])
        if not isinstance(genome, dict):  # an edited row: never trained (`show.records_of` names it)
            raise TypeError(f"task {row['id']}'s genome is a {type(genome).__name__}, not an object")
        candidate = Candidate(row["generation"], row["idx"], genome, row["genome_hash"],
                              int(row["seed"]), row["max_epochs"], row["replicate"])
        seconds = (row["finished"] - row["claimed"]) if row.get("finished") and row.get("claimed") else None
        return Task(row["id"], row["search_id"], row["kind"], candidate, row["train_config_hash"], row["state"],
                    row["worker"], row["attempts"], row["lost"], self._json(row["result"]), seconds)

    @staticmethod
    def _insert_evaluation(tx: Transaction, candidate: Candidate, outcome: Outcome, train_config_hash: str,
                           search_id: int) -> dict:
        fitness = outcome.fitness if outcome.status == "ok" else None
        val_loss = outcome.val_loss if outcome.val_loss is None or math.isfinite(outcome.val_loss) else None
        tx.run("INSERT INTO evaluations (genome_hash, train_config_hash, genome, status, fitness, val_loss,"
               " test_accuracy, epochs, seconds, worker, reason, search_id, generation, idx, seed, finished_at,"
               " max_epochs, replicate, numerics, provenance)"
               " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, {stamp}, ?, ?, ?, ?)"
               " ON CONFLICT (search_id, genome_hash, train_config_hash, replicate) DO NOTHING",
               (candidate.genome_hash, train_config_hash, json.dumps(candidate.genome), outcome.status, fitness,
                val_loss, None, outcome.epochs, outcome.seconds, outcome.worker, outcome.reason, search_id,
                candidate.generation, candidate.index, candidate.seed, candidate.max_epochs,
                candidate.replicate,
                None if outcome.numerics is None else json.dumps(outcome.numerics, sort_keys=True),
                None if outcome.provenance is None else json.dumps(outcome.provenance, sort_keys=True)))
        row = tx.one("SELECT * FROM evaluations WHERE search_id = ? AND genome_hash = ? AND train_config_hash = ?"
                     " AND replicate = ?", (search_id, candidate.genome_hash, train_config_hash, candidate.replicate))
        assert row is not None
        return row
