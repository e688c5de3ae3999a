"""A search store's records: its searches, every evaluation (one row per training) and every
generation, what resume replays (`towerlab.search.store` puts them beside the queue, over one backend;
the tables are described in `towerlab.search.store.schema`). Every write is one transaction.

The cache: `lookup` serves a search its own row first, whatever its status, and otherwise the oldest
'ok' row of any search, written before the generation began (its watermark): so every worker of a
search, whenever it looks, takes the same decision. A failed candidate is not retried by the search
that failed it, resumed or not (its history stays reproducible), while a later search retries it (the
failure may have been the machine's: out of memory, a lost worker). Two searches running at once may
both train a genome neither found; each keeps its own row and its own history, as if it had run alone.
A generation records its members when it begins (the first process to begin it: whoever plays the
search later reads them, and proposes none of them again), with what they were proposed from, and its
results when it ends (the first to complete it: every one computes the same); a search's summary is
written once, by the first process to finish it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Optional, Sequence

from towerlab.upgrades import upgrade_search_config
from towerlab.search.candidates import Candidate, Outcome
from towerlab.search.store.database import CHUNK, Backend, Transaction, placeholders
from towerlab.search.store.rows import (Evaluation, GenerationRow, Rows, SearchRow, insert_evaluation, serving,
                                       set_test_accuracy)
from towerlab.search.space import Space


class Records:
    """The records of the store whose backend is `db` (`where`: the store, as messages name it)."""

    def __init__(self, db: Backend, where: Path | str) -> None:
        self.db, self._rows = db, Rows(db, where)

    # -- searches -------------------------------------------------------------------------------

    def begin_search(self, sampler: str, config: dict, space: Space, train_config_hash: str,
                     setup: Optional[dict] = None, token: Optional[str] = None) -> int:
        """A new search's id. `token` names it (a new one when not given): a creation retried after a
        lost connection finds the search it made instead of making a second one."""
        token = token or uuid.uuid4().hex

        def insert(tx: Transaction) -> int:
            tx.run("INSERT INTO searches (sampler, config, space, space_fingerprint, train_config_hash, created,"
                   " setup, token) VALUES (?, ?, ?, ?, ?, {stamp}, ?, ?) ON CONFLICT (token) DO NOTHING",
                   (sampler, json.dumps(config, sort_keys=True), json.dumps(space.to_dict()), space.fingerprint,
                    train_config_hash, None if setup is None else json.dumps(setup, sort_keys=True), token))
            return int(tx.rows("SELECT id FROM searches WHERE token = ?", (token,))[0]["id"])

        return self.db.write(insert)

    def resume_search(self, search_id: int, config: dict) -> None:
        """Mark the search running again, under `config` (it may extend the generations)."""
        self.db.write(lambda tx: tx.run("UPDATE searches SET config = ?, finished = NULL, summary = NULL WHERE id = ?",
                                        (json.dumps(config, sort_keys=True), search_id)))

    def regoal(self, search_id: int, config: dict, objective: dict, train_config_hash: str, hashes: dict[str, str],
               rescored: Sequence[tuple[int, str, Optional[float], Optional[str]]]) -> None:
        """A search of your own objective ranked by another goal from its resume on (`towerlab.objective.regoal`), in one
        transaction: its settings, its setup's objective and its training hash; its rows rescored (id, status,
        fitness, reason) and moved from each rung's old training hash to its new one (`hashes`); its tasks
        dropped (the queue is filled again from its rows) and its generations forgotten (played again, served
        by its rows)."""
        def change(tx: Transaction) -> None:
            found = tx.one("SELECT setup FROM searches WHERE id = ?", (search_id,))
            setup = {**((self._rows.json(found["setup"]) if found else None) or {}), "objective": objective}
            tx.run("UPDATE searches SET config = ?, setup = ?, train_config_hash = ?, finished = NULL, summary = NULL"
                   " WHERE id = ?", (json.dumps(config, sort_keys=True), json.dumps(setup, sort_keys=True),
                                     train_config_hash, search_id))
            for row_id, status, fitness, reason in rescored:
                tx.run("UPDATE evaluations SET status = ?, fitness = ?, reason = ? WHERE id = ?",
                       (status, fitness, reason, row_id))
            for old, new in hashes.items():
                tx.run("UPDATE evaluations SET train_config_hash = ? WHERE search_id = ? AND train_config_hash = ?",
                       (new, search_id, old))
            tx.run("UPDATE workers SET task = NULL WHERE task IN (SELECT id FROM tasks WHERE search_id = ?)",
                   (search_id,))
            tx.run("DELETE FROM tasks WHERE search_id = ?", (search_id,))
            tx.run("DELETE FROM generations WHERE search_id = ?", (search_id,))

        self.db.write(change)

    def update_setup(self, search_id: int, setup: dict) -> None:
        """How the search's workers train from now on (a resume by another towerlab or torch records its own)."""
        self.db.write(lambda tx: tx.run("UPDATE searches SET setup = ? WHERE id = ?",
                                        (json.dumps(setup, sort_keys=True), search_id)))

    def finish_search(self, search_id: int, summary: dict, config: Optional[dict] = None) -> bool:
        """The search's summary; the first process to finish it writes it (every one computes the same).
        With `config`, only while the search still has those settings: a worker that played it under
        settings a resume has since changed (more generations) finishes nothing. Whether it wrote it."""
        if config is None:
            return 1 == self.db.write(lambda tx: tx.run(
                "UPDATE searches SET finished = {stamp}, summary = ? WHERE id = ? AND finished IS NULL",
                (json.dumps(summary), search_id)))
        def finish(tx: Transaction) -> bool:
            row = tx.one("SELECT sampler, config, finished FROM searches WHERE id = ?", (search_id,))
            if row is None or row["finished"] is not None or (
                    upgrade_search_config(json.loads(row["config"]), row["sampler"]) != json.loads(json.dumps(config))):
                return False
            tx.run("UPDATE searches SET finished = {stamp}, summary = ? WHERE id = ?", (json.dumps(summary), search_id))
            return True
        return self.db.write(finish)

    def search(self, search_id: int) -> Optional[SearchRow]:
        if not -2**63 <= search_id < 2**63:  # beyond the column's 64 bits: no such search (the drivers would raise)
            return None
        rows = self._rows.read("SELECT * FROM searches WHERE id = ?", (search_id,))
        return self._rows.search(rows[0]) if rows else None

    def latest_search(self, sampler: Optional[str] = None) -> Optional[SearchRow]:
        if sampler is None:
            rows = self._rows.read("SELECT * FROM searches ORDER BY id DESC LIMIT 1")
        else:
            rows = self._rows.read("SELECT * FROM searches WHERE sampler = ? ORDER BY id DESC LIMIT 1", (sampler,))
        return self._rows.search(rows[0]) if rows else None

    def searches(self) -> list[SearchRow]:
        return [self._rows.search(r) for r in self._rows.read("SELECT * FROM searches ORDER BY id")]

    def unfinished_searches(self) -> list[SearchRow]:
        rows = self._rows.read("SELECT * FROM searches WHERE finished IS NULL ORDER BY id")
        return [self._rows.search(r) for r in rows]

    def finished(self, search_id: int) -> bool:
        """Whether the search is finished (its summary written), or gone: nothing is left to do for it."""
        row = self.search(search_id)
        return row is None or row.finished is not None

    # -- evaluations ----------------------------------------------------------------------------

    def lookup(self, genome_hash: str, train_config_hash: str, search_id: Optional[int] = None,
               replicate: int = 0, watermark: Optional[int] = None) -> Optional[Evaluation]:
        """The evaluation that serves this genome: the row of `search_id` itself if it has one (ok or
        failed), else the oldest successful row of any search (of those up to id `watermark`, when
        given); None when it must be trained."""
        rows = self._rows.read(*serving(genome_hash, train_config_hash, search_id, replicate, watermark))
        return self._rows.evaluation(rows[0]) if rows else None

    def record(self, candidate: Candidate, outcome: Outcome, train_config_hash: str,
               search_id: int) -> Evaluation:
        """Write one finished evaluation (one transaction) and return its row. When the search
        already has a row for this key (another process got there first), that row stays and is
        returned: the same key, the same seed, the same training."""
        return self._rows.evaluation(self.db.write(
            lambda tx: insert_evaluation(tx, candidate, outcome, train_config_hash, search_id)))

    def set_test_accuracy(self, evaluation_id: int, accuracy: float) -> None:
        """Attach the test accuracy to a successful evaluation."""
        changed = self.db.write(lambda tx: set_test_accuracy(tx, evaluation_id, accuracy))
        if changed != 1:
            raise KeyError(f"no successful evaluation {evaluation_id} in {self._rows.where}")

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
            for row in self._rows.read(
                    "SELECT * FROM evaluations WHERE status = 'ok' AND train_config_hash = ? AND replicate = 0"
                    f" AND genome_hash IN ({placeholders(len(chunk))})"
                    " ORDER BY CASE WHEN search_id = ? THEN 0 ELSE 1 END, id",
                    (search.train_config_hash, *chunk, search_id)):
                best.setdefault(row["genome_hash"], self._rows.evaluation(row))
        return sorted(best.values(), key=lambda e: (-(e.fitness or 0.0), e.genome_hash))[:n]  # ok rows: fitness set

    def top_bar(self, search_id: int, train_config_hash: str, n: int) -> Optional[float]:
        """The validation accuracy a network must reach to be among the `n` best genomes this search trained
        (replicate 0, under `train_config_hash`, each genome by its best row): the `n`-th best's; None where
        fewer than `n` succeeded (any network enters)."""
        rows = self._rows.read(
            "SELECT MAX(fitness) AS best FROM evaluations WHERE search_id = ? AND train_config_hash = ? AND replicate = 0"
            " AND status = 'ok' GROUP BY genome_hash ORDER BY best DESC LIMIT 1 OFFSET ?",
            (search_id, train_config_hash, min(n, 2**63) - 1))  # a --top past 64 bits: past every genome
        return float(rows[0]["best"]) if rows else None

    def evaluations(self, search_id: Optional[int] = None, after: int = 0) -> list[Evaluation]:
        """Evaluations in the order they finished (of one search, or all), those after id `after`."""
        if search_id is None:
            rows = self._rows.read("SELECT * FROM evaluations WHERE id > ? ORDER BY id", (after,))
        else:
            rows = self._rows.read("SELECT * FROM evaluations WHERE search_id = ? AND id > ? ORDER BY id",
                              (search_id, after))
        return [self._rows.evaluation(r) for r in rows]

    def provenances(self, search_id: int) -> dict[str, int]:
        """How many of the search's evaluations come from each provenance (its JSON, keys sorted; "null"
        where a row has none), the first found first: counted by the database, where reading every row
        took `search show` 17 s at 100,000 rows."""
        kinds: dict[str, int] = {}
        for row in self._rows.read("SELECT provenance, COUNT(*) AS n, MIN(id) AS first FROM evaluations"
                                   " WHERE search_id = ? GROUP BY provenance ORDER BY first", (search_id,)):
            key = json.dumps(self._rows.json(row["provenance"]), sort_keys=True)
            kinds[key] = kinds.get(key, 0) + int(row["n"])
        return kinds

    def generation_counts(self, search_id: int) -> dict[int, int]:
        """Each generation's evaluations of replicate 0 that the search holds, counted by the database."""
        return {int(row["generation"]): int(row["n"]) for row in self._rows.read(
            "SELECT generation, COUNT(*) AS n FROM evaluations WHERE search_id = ? AND replicate = 0"
            " GROUP BY generation", (search_id,))}

    def count_evaluations(self, search_id: int, after: int = 0) -> int:
        """How many evaluations the search holds with an id above `after`."""
        return int(self._rows.read("SELECT COUNT(*) AS n FROM evaluations WHERE search_id = ? AND id > ?",
                              (search_id, after))[0]["n"])

    def epochs_given(self, search_id: int, before: int, max_epochs: int) -> int:
        """The epochs the search's own trainings of generations before `before` were given (each the budget it
        trained under, `max_epochs` where a row predates budgets: every rung and re-measure counted), less those
        a promotion continued from its lower rung rather than train again."""
        return int(self._rows.read("SELECT COALESCE(SUM(COALESCE(max_epochs, ?) - continued), 0) AS n FROM evaluations"
                                   " WHERE search_id = ? AND generation < ?", (max_epochs, search_id, before))[0]["n"])

    def own_history(self, search_id: int, since: int, before: int) -> list[Evaluation]:
        """The search's own evaluations (replicate 0) of generations `since` to `before` (not included), in
        the order they finished: what the pruner's judge learns from (`towerlab.search.judge`: the successful
        ones, and where it probed)."""
        rows = self._rows.read("SELECT * FROM evaluations WHERE search_id = ? AND replicate = 0"
                               " AND generation >= ? AND generation < ? ORDER BY id", (search_id, since, before))
        return [self._rows.evaluation(r) for r in rows]

    def newest_evaluation(self) -> int:
        """The id of the newest evaluation (0 in an empty store)."""
        return int(self._rows.read("SELECT COALESCE(MAX(id), 0) AS n FROM evaluations")[0]["n"])

    def own_rows(self, search_id: int, keys: Sequence[tuple[str, str, int]]) -> dict[tuple[str, str, int], Evaluation]:
        """The rows this search itself holds for (genome_hash, train_config_hash, replicate) keys."""
        wanted, found = set(keys), {}
        hashes = sorted({h for h, _, _ in keys})
        for start in range(0, len(hashes), CHUNK):
            chunk = hashes[start:start + CHUNK]
            for row in self._rows.read(f"SELECT * FROM evaluations WHERE search_id = ? AND genome_hash IN"
                                  f" ({placeholders(len(chunk))})", (search_id, *chunk)):
                key = (row["genome_hash"], row["train_config_hash"], row["replicate"])
                if key in wanted:
                    found[key] = self._rows.evaluation(row)
        return found

    # -- generations ----------------------------------------------------------------------------

    def begin_generation(self, search_id: int, generation: int, genomes: list[dict],
                         hashes: list[str], proposed: Optional[dict] = None) -> GenerationRow:
        """Record a generation's members (genomes and their hashes, in population order), what they were
        `proposed` from (the generations then in flight, ...: `towerlab.search.store.schema`) and the newest
        evaluation id now (what other searches may serve it from), unless the search has it already
        (another worker began it: the store's members are the generation's); return the row."""
        members = [{"genome_hash": h, "genome": g} for h, g in zip(hashes, genomes, strict=True)]

        def begin(tx: Transaction) -> None:
            tx.settle("evaluations")  # every row up to the newest id there for good: the watermark
            tx.run("INSERT INTO generations (search_id, generation, members, started, watermark, proposed)"
                   " SELECT ?, ?, ?, {stamp}, COALESCE(MAX(id), 0), ? FROM evaluations WHERE true"
                   " ON CONFLICT (search_id, generation) DO NOTHING",
                   (search_id, generation, json.dumps(members), None if proposed is None else json.dumps(proposed)))

        self.db.write(begin, lock=search_id)
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
            tx.run("UPDATE generations SET results = ?, stats = ?, complete = 1, finished = {stamp}"
                   " WHERE search_id = ? AND generation = ? AND complete = 0",
                   (json.dumps(results), json.dumps(stats), search_id, generation))
        self.db.write(complete)

    def generation(self, search_id: int, generation: int) -> Optional[GenerationRow]:
        rows = self._rows.read("SELECT * FROM generations WHERE search_id = ? AND generation = ?",
                          (search_id, generation))
        return self._rows.generation(rows[0]) if rows else None

    def generations(self, search_id: int, since: int = 0) -> list[GenerationRow]:
        """The search's generations from number `since` on (a watcher reads only those it has not shown:
        each holds its members and results, and a long search has thousands)."""
        rows = self._rows.read("SELECT * FROM generations WHERE search_id = ? AND generation >= ? ORDER BY generation",
                               (search_id, since))
        return [self._rows.generation(r) for r in rows]
