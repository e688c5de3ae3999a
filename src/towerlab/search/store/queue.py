"""The queue of a search store: the tasks that workers claim, hold under a lease and close with their
result, and the workers themselves (the `tasks` and `workers` tables: `towerlab.search.store.schema`). Every
method is one transaction; the workers that use them are `towerlab.search.work.worker`'s. The queue's rules,
each where it is enforced:

- a task is one training that a search needs and no evaluation serves (kind 'train': an evaluation, a
  higher rung, a re-measure) or the retraining of a top network for its test accuracy (kind 'test'); it
  is on the queue once, whoever puts it there first (`enqueue`);
- `claim` hands a worker the first open task of the searches it works on (or one whose lease lapsed, or
  runs past any a worker grants, MAX_LEASE: an edited row), the oldest generation's first and the
  costliest of those first (`prioritize`), under a lease on the database's clock; a task whose workers
  were lost `max_attempts` times is recorded as failed on the way instead of being handed out again;
- `renew` extends the lease while the worker trains; `complete` writes the result and closes the task in
  one transaction, only while the worker still holds it, so a worker that comes back after its lease
  lapsed cannot write a second result. A training task's result is its evaluation row; a test task's
  is the test accuracy of the row that serves its genome (`towerlab.search.store.rows.serving`);
- `put_back` opens the task of an interrupted worker at once, the claim not counted as a loss;
  `release` opens the tasks of a worker known to be gone, the loss counted;
- `reopen_failed_tests` puts a search's failed test retrainings back on the queue (a resume retries them:
  the machine's fault, as often as not), and the search back to unfinished;
- one worker at a time leads a search (`lead`: its driver proposes the generations and plays the search),
  under a lease on the database's clock like a task's, renewed while it leads (`lead` again); another
  takes it over once it lapses, at once where the leader stepped down (`step_down`) or is known gone
  (`release`). `pace` tells the leader how many workers are busy and idle and how many of its tasks wait.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

from towerlab.search.candidates import Candidate, Outcome
from towerlab.search.store.database import Backend, Transaction, placeholders
from towerlab.search.store.rows import Evaluation, Rows, Task, insert_evaluation, serving, set_test_accuracy


# The longest lease a worker grants itself (seconds): a lease that runs further than this from the
# database's clock, or none at all, was granted by no worker (an edited row), and counts as lapsed.
MAX_LEASE = 86400.0


class TaskQueue:
    """The queue of the store whose backend is `db` (`where`: the store, as messages name it)."""

    def __init__(self, db: Backend, where: Path | str) -> None:
        self.db, self._rows = db, Rows(db, where)

    # -- the queue --------------------------------------------------------------------------------

    def enqueue(self, search_id: int, kind: str, candidates: Sequence[tuple[Candidate, str]]) -> dict[int, Candidate]:
        """Put (candidate, train_config_hash) on the queue unless the search has them there already
        (another worker put them first), in one transaction; the tasks this call put there, by id.
        They are handed out in the order they came until `prioritize` ranks them."""
        if not candidates:
            return {}

        def insert(tx: Transaction) -> dict[int, Candidate]:
            new = {}
            for c, training_hash in candidates:
                row = tx.one("INSERT INTO tasks (search_id, kind, genome_hash, train_config_hash, replicate, generation,"
                             " idx, genome, seed, max_epochs, starts, priority, state, created)"
                             " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 'open', {now})"
                             " ON CONFLICT (search_id, kind, genome_hash, train_config_hash, replicate) DO NOTHING"
                             " RETURNING id",
                             (search_id, kind, c.genome_hash, training_hash, c.replicate, c.generation, c.index,
                              json.dumps(c.genome), c.seed, c.max_epochs, c.starts))
                if row is not None:
                    new[int(row["id"])] = c
            return new

        return self.db.write(insert)

    def prioritize(self, priorities: dict[int, float]) -> None:
        """Rank waiting tasks (the costliest first, within a generation), in one transaction."""
        if priorities:
            self.db.write(lambda tx: [tx.run("UPDATE tasks SET priority = ? WHERE id = ? AND state = 'open'",
                                             (float(p), task_id)) for task_id, p in priorities.items()])

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
                # `state IN (...)` first: the index then reads only the tasks not done (a generation or
                # two), where an OR over the states read every task the search ever had, per claim.
                row = tx.one(f"SELECT *, {{now}} AS clock FROM tasks WHERE search_id IN ({placeholders(len(ids))}) AND"
                             " state IN ('open', 'claimed') AND (state = 'open' OR lease_until IS NULL"
                             " OR lease_until < {now} OR lease_until > {now} + ?)"
                             " ORDER BY search_id, generation, priority DESC, id LIMIT 1{skip_locked}", (*ids, MAX_LEASE))
                if row is None:
                    return None
                if row["state"] == "claimed":  # its claimant stopped renewing: lost
                    lapsed = row["lease_until"] is not None and row["lease_until"] < row["clock"]
                    row["lost"] = (f"the lease of worker {row['worker']} lapsed" if lapsed else
                                   f"the lease of worker {row['worker']} ran past any a worker grants ({MAX_LEASE:g} s): "
                                   "its row was edited")
                if row["attempts"] < max_attempts:
                    tx.run("UPDATE tasks SET state = 'claimed', worker = ?, lease_until = {now} + ?,"
                           " attempts = attempts + 1, claimed = {now}, lost = ? WHERE id = ?",
                           (worker, lease, row["lost"], row["id"]))
                    tx.run("UPDATE workers SET seen = {now}, task = ? WHERE id = ?", (row["id"], worker))
                    return tx.one("SELECT * FROM tasks WHERE id = ?", (row["id"],))
                self._give_up(tx, self._rows.task(row), worker, max_attempts)

        row = self.db.write(take)
        return None if row is None else self._rows.task(row)

    def _give_up(self, tx: Transaction, task: Task, worker: str, attempts: int) -> None:
        reason = (f"its worker was lost {attempts} times while training it (last: {task.lost or 'unknown'}); "
                  "killed by the out-of-memory killer?")
        self._close(tx, task, Outcome.failed(reason, worker=worker))

    def _close(self, tx: Transaction, task: Task, outcome: Outcome) -> Optional[dict]:
        """Write the task's result and mark it done (the caller checked it may)."""
        result = {"status": outcome.status, "fitness": outcome.fitness, "reason": outcome.reason,
                  "seconds": outcome.seconds, "worker": outcome.worker, "test_accuracy": outcome.test_accuracy,
                  "numerics": outcome.numerics}
        tx.run("UPDATE tasks SET state = 'done', finished = {now}, result = ?, lease_until = NULL WHERE id = ?",
               (json.dumps(result), task.id))
        if task.kind == "train":
            return insert_evaluation(tx, task.candidate, outcome, task.train_config_hash, task.search_id)
        if outcome.status == "ok" and outcome.test_accuracy is not None:
            served = tx.one(*serving(task.candidate.genome_hash, task.train_config_hash, task.search_id))
            if served is not None:
                set_test_accuracy(tx, served["id"], outcome.test_accuracy)
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

    def complete(self, task: Task, worker: str, outcome: Outcome) -> tuple[bool, Optional[Evaluation]]:
        """Write the result of `task` (with its test accuracy, where its network was scored on the test
        split) and close it, in one transaction, if `worker` still holds it:
        (True, its evaluation row for a training task). (False, None) when the lease was lost: the result
        is dropped, since the task is another worker's now (or done already)."""
        def close(tx: Transaction) -> tuple[bool, Optional[dict]]:
            held = tx.one("SELECT id FROM tasks WHERE id = ? AND worker = ? AND state = 'claimed'", (task.id, worker))
            if held is None:
                return False, None
            tx.run("UPDATE workers SET seen = {now}, task = NULL WHERE id = ?", (worker,))
            return True, self._close(tx, task, outcome)

        done, row = self.db.write(close)
        return done, None if row is None else self._rows.evaluation(row)

    def put_back(self, task: Task, worker: str) -> None:
        """Hand a task back unfinished (its worker was interrupted): open again at once, and the claim
        not counted as a loss."""
        self.db.write(lambda tx: tx.run(
            "UPDATE tasks SET state = 'open', worker = NULL, lease_until = NULL, attempts = attempts - 1"
            " WHERE id = ? AND worker = ? AND state = 'claimed'", (task.id, worker)))

    def release(self, worker: str, reason: str) -> int:
        """A worker is gone (its process ended, `reason` says how): the tasks it held are open again at
        once, the loss counted, and the searches it led are free to lead; returns how many tasks of
        searches not finished (a finished search's task was moot: a re-measure an idle worker trained ahead
        for a network the search's last trainings left out of its top, stopped when the search ended)."""
        def free(tx: Transaction) -> int:
            live = tx.one("SELECT COUNT(*) AS n FROM tasks WHERE worker = ? AND state = 'claimed' AND search_id IN"
                          " (SELECT id FROM searches WHERE finished IS NULL)", (worker,))
            tx.run("UPDATE tasks SET state = 'open', lease_until = NULL, lost = ?"
                   " WHERE worker = ? AND state = 'claimed'", (f"worker {worker} {reason}", worker))
            tx.run("UPDATE workers SET left_at = {now}, task = NULL WHERE id = ? AND left_at IS NULL", (worker,))
            tx.run("UPDATE searches SET leader = NULL, leader_until = NULL WHERE leader = ?", (worker,))
            return int(live["n"]) if live is not None else 0
        return self.db.write(free)

    # -- leading a search -------------------------------------------------------------------------

    def lead(self, search_id: int, worker: str, lease: float) -> bool:
        """Whether `worker` leads the unfinished search now: it did and its lease is renewed, or nobody
        held the lease (or it lapsed, or runs past any a worker grants: an edited row) and it is now
        `worker`'s until the database's clock reads `lease` seconds later."""
        return 1 == self.db.write(lambda tx: tx.run(
            "UPDATE searches SET leader = ?, leader_until = {now} + ? WHERE id = ? AND finished IS NULL AND"
            " (leader IS NULL OR leader = ? OR leader_until IS NULL OR leader_until < {now}"
            " OR leader_until > {now} + ?)", (worker, lease, search_id, worker, MAX_LEASE)))

    def leader(self, search_id: int) -> Optional[str]:
        """The worker that leads the search now (its lease holds on the database's clock), or None."""
        rows = self._rows.read("SELECT leader FROM searches WHERE id = ? AND leader IS NOT NULL AND"
                               " leader_until >= {now} AND leader_until <= {now} + ?", (search_id, MAX_LEASE))
        return str(rows[0]["leader"]) if rows else None

    def step_down(self, search_id: int, worker: str) -> None:
        """`worker` no longer leads the search (it stops, or the search is finished): another may at once."""
        self.db.write(lambda tx: tx.run("UPDATE searches SET leader = NULL, leader_until = NULL"
                                        " WHERE id = ? AND leader = ?", (search_id, worker)))

    def tell_activity(self, search_id: int, worker: str, doing: str) -> None:
        """What the search's leader `worker` is doing now (`search show` says it), unless another leads it."""
        self.db.write(lambda tx: tx.run(
            "UPDATE searches SET activity = ? WHERE id = ? AND leader = ?",
            (json.dumps({"doing": doing, "by": worker}), search_id, worker)))

    def pace(self, search_id: int, within: float) -> tuple[int, int, int]:
        """(busy, idle, waiting): the workers of this store alive now (seen in the last `within` seconds on the
        database's clock, not gone) holding a task and holding none, and the search's tasks waiting for one."""
        alive = self._rows.read("SELECT COUNT(*) AS n, COUNT(task) AS busy FROM workers WHERE left_at IS NULL AND"
                                " seen > {now} - ?", (within,))[0]
        waiting = self._rows.read("SELECT COUNT(*) AS n FROM tasks WHERE search_id = ? AND state = 'open'",
                                  (search_id,))[0]
        busy = int(alive["busy"])
        return busy, int(alive["n"]) - busy, int(waiting["n"])

    def reopen_failed_tests(self, search_id: int) -> int:
        """Put the search's failed test retrainings back on the queue (and the search back to unfinished,
        so that its workers take them); how many."""
        failed = [t.id for t in self.tasks(search_id, "test") if t.state == "done" and t.test_accuracy is None]

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
            rows = self._rows.read("SELECT * FROM tasks WHERE search_id = ? ORDER BY id", (search_id,))
        else:
            rows = self._rows.read("SELECT * FROM tasks WHERE search_id = ? AND kind = ? ORDER BY id", (search_id, kind))
        return [self._rows.task(r) for r in rows]

    def at_work(self, search_id: int, within: float) -> bool:
        """Whether workers are at the search now: a task of it held under a lease that has not lapsed, or
        one put on the queue or finished in the last `within` seconds (the database's clock)."""
        return int(self._rows.read("SELECT COUNT(*) AS n FROM tasks WHERE search_id = ? AND ((state = 'claimed' AND"
                              " lease_until > {now}) OR created > {now} - ? OR finished > {now} - ?)",
                              (search_id, within, within))[0]["n"]) > 0

    def queue_counts(self, search_id: int) -> dict[str, int]:
        """The search's tasks by state: open, claimed (lease held or lapsed), done."""
        counts = {"open": 0, "claimed": 0, "done": 0}
        for row in self._rows.read("SELECT state, COUNT(*) AS n FROM tasks WHERE search_id = ? GROUP BY state",
                              (search_id,)):
            counts[row["state"]] = int(row["n"])
        return counts

    # -- workers ----------------------------------------------------------------------------------

    def join(self, worker: str, host: str, pid: int, device: str) -> None:
        self.db.write(lambda tx: tx.run(
            "INSERT INTO workers (id, host, pid, device, started, seen) VALUES (?, ?, ?, ?, {now}, {now})"
            " ON CONFLICT (id) DO UPDATE SET seen = excluded.seen, left_at = NULL", (worker, host, pid, device)))

    def seen(self, worker: str) -> None:
        """`worker` is alive, holding no task (one that waits for work says so now and then)."""
        self.db.write(lambda tx: tx.run("UPDATE workers SET seen = {now} WHERE id = ?", (worker,)))

    def leave(self, worker: str) -> None:
        self.db.write(lambda tx: tx.run("UPDATE workers SET left_at = {now}, task = NULL WHERE id = ?", (worker,)))

    def workers(self) -> list[dict]:
        """Every worker that joined, with `age` (seconds since it was last seen, on the database's clock) and the
        task it holds (`search_id`, `generation`, `idx`, `kind`, and `held`: seconds since it claimed it; None
        where it holds none: the last it claimed may have gone to another worker since, its lease lapsed)."""
        return self._rows.read("SELECT w.*, {now} - w.seen AS age, t.search_id AS search_id, t.generation AS generation,"
                               " t.idx AS idx, t.kind AS kind, {now} - t.claimed AS held"
                               " FROM workers w LEFT JOIN tasks t ON t.id = w.task"
                               " AND t.state = 'claimed' AND t.worker = w.id ORDER BY w.started")
