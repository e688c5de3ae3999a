"""Testing a search's top, as one unit: its crowned networks get their accuracy on the test split, each
from a training of the very network (the same genome, seed and epochs as the evaluation that crowned it),
so a test accuracy is measured once and never chosen by.

- Whether a search tests its top: `Search.tests_top` (its data has a test split, as its setup records).
- Before a training starts, `test_from` decides whether its network is scored on the test split as it
  ends: where its validation accuracy reaches the bar of the search's top as the store holds it then
  (`Records.top_bar`), it may stay in the top, and then needs no retraining for its test accuracy. The
  bar is a number handed to the training: nothing asks the store while a network trains.
- Once the top is crowned (`retrainings`), a crowned network whose row has no test accuracy takes the
  one its own training scored, where one did; the others are retrained by test tasks, with their
  evaluation's seed, and `tested` says when those are done.
- An outcome carries its test accuracy (`Outcome.test_accuracy`); the store writes it in one place
  (`towerlab.search.store.rows.set_test_accuracy`); the record reads the top's through `top_tests`.
"""

from __future__ import annotations

from typing import Optional

from towerlab.search.candidates import Candidate
from towerlab.search.history import SearchResult, TopGenome
from towerlab.search.search import Search
from towerlab.search.store import Store
from towerlab.search.store.rows import Evaluation, Task

Wanted = list[tuple[Candidate, str]]  # test tasks to queue: the candidate and its training-config hash


def test_from(store: Store, search: Search, kind: str) -> Optional[float]:
    """The validation accuracy from which the network of a task of `kind` is scored on the test split as
    its training ends: any (-inf) for a test task, the bar of the search's top now for a training (-inf
    while the top is not full), None where the search tests nothing."""
    if not search.tests_top:
        return None
    if kind == "test":
        return float("-inf")
    bar = store.records.top_bar(search.stored_id, search.ladder.train_config_hash, search.cfg.top)
    return float("-inf") if bar is None else bar


def retrainings(store: Store, search: Search, top: list[TopGenome]) -> Wanted:
    """The crowned networks whose test accuracy is unknown: each takes the one its own training scored
    where one did (written to its row); the others are returned, to be retrained by test tasks with the
    seed of their evaluation (the same network, scored on the test split)."""
    if not search.tests_top:
        return []
    untested = [(t, row) for t in top
                for row in [store.records.lookup(t.genome_hash, t.train_config_hash, search.stored_id)]
                if row is not None and row.test_accuracy is None]
    if not untested:
        return []
    scored = {(t.candidate.genome_hash, t.train_config_hash, t.candidate.seed, t.candidate.max_epochs):
              t.test_accuracy for t in store.queue.tasks(search.stored_id, "train") if t.test_accuracy is not None}
    wanted = []
    for t, row in untested:
        early = scored.get((t.genome_hash, t.train_config_hash, t.seed, row.max_epochs))
        if early is not None:
            store.records.set_test_accuracy(row.id, early)
        else:
            wanted.append((Candidate(t.generation, row.index, t.genome, t.genome_hash, t.seed, row.max_epochs),
                           t.train_config_hash))
    return wanted


def tested(store: Store, search: Search, wanted: Wanted) -> bool:
    """Whether every test task of `wanted` is done (with a result or failed)."""
    keys = {(c.genome_hash, training_hash) for c, training_hash in wanted}
    return not any((t.candidate.genome_hash, t.train_config_hash) in keys and t.state != "done"
                   for t in store.queue.tasks(search.stored_id, "test"))


def top_tests(store: Store, result: SearchResult) -> list[tuple[TopGenome, Evaluation, Optional[Task]]]:
    """Each crowned network of a finished search with its evaluation (whose test accuracy is the top's)
    and its test task where it had one (done: its result says how the retraining went)."""
    tasks = {(task.candidate.genome_hash, task.train_config_hash): task
             for task in store.queue.tasks(result.search_id, "test") if task.state == "done"}
    found = []
    for t in result.top:
        evaluation = store.records.lookup(t.genome_hash, t.train_config_hash, result.search_id)
        if evaluation is None:  # it was crowned from that row: only an edited store lacks it
            raise KeyError(f"the store holds no evaluation of crowned genome {t.genome_hash[:12]}")
        found.append((t, evaluation, tasks.get((t.genome_hash, t.train_config_hash))))
    return found
