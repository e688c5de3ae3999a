"""The store as the queue (towerlab.search.work.worker), with a fake fitness and no torch: any number of
workers, joining late or dying at random, play a search to the very rows one process makes; leases
lapse and hand a task on; a late result is dropped; a task that loses its workers too often is
recorded as failed; on SQLite and on a real PostgreSQL server."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import signal
import sqlite3
import threading
import time

import pytest

from towerlab.config import SearchConfig
from towerlab.search import Candidate, Outcome, Search, load_space, run_search, serial
from towerlab.search.work.worker import MAX_ATTEMPTS, Worker, WorkerOptions
from towerlab.search.store import Store

SPACE = load_space("mlp")
SEARCHES = {
    "ga-pruned": SearchConfig(sampler="ga", population=6, generations=4, max_epochs=9, min_epochs=1, remeasure=1,
                              top=2, seed=3, elite=2),
    "tpe": SearchConfig(sampler="tpe", population=4, generations=5, max_epochs=3, remeasure=1, top=2, seed=4),
    "random": SearchConfig(sampler="random", population=5, generations=3, max_epochs=3, remeasure=0, top=3, seed=5),
    "grid": SearchConfig(sampler="grid", limit=12, max_epochs=3, remeasure=2, top=2, seed=6),
}


def fitness(c: Candidate) -> Outcome:
    """Deterministic in the candidate (genome, seed, epochs): the same whoever computes it."""
    r = random.Random(f"{c.genome_hash}/{c.seed}/{c.max_epochs}")
    if r.random() < 0.05:
        return Outcome.failed("diverged", seconds=0.001)
    return Outcome.ok(round(r.random(), 6), val_loss=round(r.random(), 6), epochs=c.max_epochs or 1, seconds=0.001)


def scored(outcome: Outcome, assignment, accuracy: float) -> Outcome:
    """`outcome` with the test accuracy `accuracy` where its assignment has its network scored on the test split."""
    tested = outcome.status == "ok" and assignment.tests(outcome.fitness)
    return dataclasses.replace(outcome, test_accuracy=accuracy) if tested else outcome


def trainer_for(delay: float = 0.0):
    def trainer(search):
        def train(assignment):
            time.sleep(delay)
            return scored(fitness(assignment.candidate), assignment, 0.5)
        return train
    return trainer


def rows(store: Store) -> list[tuple]:
    """What decides a history: (generation, index, replicate, genome, seed, status, fitness) of every row."""
    return sorted((e.generation, e.index, e.replicate, e.genome_hash, e.seed, e.status, e.fitness)
                  for e in store.records.evaluations())


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "search.db")
    return request.getfixturevalue("postgres_url")


def reference(cfg: SearchConfig, tmp_path) -> tuple[list[tuple], dict]:
    with Store(tmp_path / "reference.db") as store:
        run_search(cfg, SPACE, serial(fitness), store, "tch")
        return rows(store), store.records.searches()[0].summary


def new_search(target: str, cfg: SearchConfig) -> int:
    with Store(target) as store:
        return Search.resolve(cfg, SPACE).create(store, "tch", {"test": True}).id


def work(target: str, name: str, search_id: int, delay: float = 0.0, lease: float = 30.0) -> int:
    with Store(target) as store:
        return Worker(store, name, "cpu", trainer_for(delay), WorkerOptions(search_ids=[search_id], lease=lease)).run()


@pytest.mark.parametrize("name", SEARCHES)
@pytest.mark.parametrize("workers", [1, 3])
def test_any_number_of_workers_plays_the_same_search(name, workers, target, tmp_path):
    cfg = SEARCHES[name]
    expected, summary = reference(cfg, tmp_path)
    search_id = new_search(target, cfg)
    threads = [threading.Thread(target=work, args=(target, f"w{i}", search_id)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    with Store(target) as store:
        assert rows(store) == expected
        finished = store.records.search(search_id)
        assert finished.finished is not None and finished.summary["top"] == summary["top"]
        tests = store.queue.tasks(search_id, "test")  # the top's networks not scored as they trained
        assert len(tests) <= len(summary["top"]) and all(t.state == "done" for t in tests)
        assert all(store.records.lookup(t["genome_hash"], t["train_config_hash"], search_id).test_accuracy == 0.5
                   for t in summary["top"])


def _die_at_random(target: str, name: str, search_id: int, seed: int) -> None:
    """A worker process that trains slowly enough to be killed mid-task."""
    work(target, name, search_id, delay=0.05 + random.Random(seed).random() * 0.05, lease=3.0)


def test_workers_joining_and_dying_at_random_play_the_same_search(target, tmp_path):
    """Worker processes start at random moments and are killed (SIGKILL) at random moments, some of
    them put back at once (as a local launcher does), the others left to their lease; the rows are
    those of one uninterrupted process."""
    cfg = SEARCHES["ga-pruned"]
    expected, _ = reference(cfg, tmp_path)
    search_id = new_search(target, cfg)
    rng = random.Random(7)
    context = multiprocessing.get_context("fork")
    running: list[tuple[multiprocessing.Process, str]] = []
    deadline = time.monotonic() + 240
    started = killed = 0
    with Store(target) as store:
        while store.records.search(search_id).finished is None:
            assert time.monotonic() < deadline, "the search did not finish"
            if len(running) < 3 and (not running or rng.random() < 0.5):
                name = f"w{started}"
                p = context.Process(target=_die_at_random, args=(target, name, search_id, started))
                p.start()
                running.append((p, name))
                started += 1
            if killed < 6 and rng.random() < 0.3:
                p, name = running.pop(rng.randrange(len(running)))
                os.kill(p.pid, signal.SIGKILL)
                p.join()
                killed += 1
                if killed % 2:
                    store.queue.release(name, "was killed")
            time.sleep(rng.random() * 0.4)
            running = [(p, n) for p, n in running if p.is_alive() or p.join() or False]
        for p, _ in running:
            p.join(timeout=60)
        assert rows(store) == expected
    assert killed == 6 and started > 6


def test_a_lapsed_lease_hands_the_task_on_and_a_late_result_is_dropped(target):
    search_id = new_search(target, SEARCHES["random"])
    genome = {"neurons": 64}
    candidate = Candidate(0, 0, genome, "h", 11, 3)
    with Store(target) as store:
        store.queue.enqueue(search_id, "train", [(candidate, "tch")])
        first = store.queue.claim("w1", [search_id], lease=0.5, max_attempts=MAX_ATTEMPTS)
        assert store.queue.claim("w2", [search_id], lease=30, max_attempts=MAX_ATTEMPTS) is None  # held
        assert store.queue.renew(first, "w1", 0.5)
        time.sleep(0.8)
        second = store.queue.claim("w2", [search_id], lease=30, max_attempts=MAX_ATTEMPTS)
        assert second.id == first.id and second.attempts == 2 and "the lease of worker w1 lapsed" in second.lost
        assert not store.queue.renew(first, "w1", 30)  # w1 learns it lost the task
        assert store.queue.complete(first, "w1", Outcome.ok(0.1, worker="w1")) == (False, None)
        done, row = store.queue.complete(second, "w2", Outcome.ok(0.9, worker="w2"))
        assert done and (row.fitness, row.worker) == (0.9, "w2")
        assert [e.fitness for e in store.records.evaluations(search_id)] == [0.9]  # written once
        assert store.queue.queue_counts(search_id) == {"open": 0, "claimed": 0, "done": 1}



def test_a_claim_reads_the_tasks_not_done_not_every_task_the_search_had(tmp_path):
    """What a claim costs does not grow with the tasks its search has done (issue 64: a trial's cost stays
    flat as the history grows), counted in SQLite's virtual-machine steps, not in seconds: the same with
    20 tasks done and with 2,000. Its query once read every task of the search, through an OR of states."""
    target = str(tmp_path / "steps.db")
    search_id = new_search(target, SEARCHES["random"])
    with Store(target) as store:
        raw = store.db.raw

        def claim_steps(done: int) -> int:
            start = raw.execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
            store.queue.enqueue(search_id, "train", [(Candidate(0, i, {"neurons": i}, f"h{i}", i, 3), "tch")
                                                     for i in range(start, start + done + 1)])
            raw.execute("UPDATE tasks SET state = 'done' WHERE id <= ?", (start + done,))
            steps = [0]

            def count() -> int:
                steps[0] += 1
                return 0
            raw.set_progress_handler(count, 10)
            task = store.queue.claim("w", [search_id], lease=30, max_attempts=MAX_ATTEMPTS)
            raw.set_progress_handler(None, 10)
            assert task is not None and task.candidate.genome_hash == f"h{start + done}"
            store.queue.complete(task, "w", Outcome.ok(0.5, worker="w"))
            return steps[0]

        few, many = claim_steps(20), claim_steps(2000)
        assert many < 2 * few, (few, many)


def test_a_task_whose_workers_are_lost_again_and_again_is_recorded_failed(target):
    """An out-of-memory kill recurs whoever trains the candidate: after MAX_ATTEMPTS losses the next
    claim records it as failed and hands out the next task instead."""
    search_id = new_search(target, SEARCHES["random"])
    doomed, fine = Candidate(0, 0, {"neurons": 1}, "a", 1, 3), Candidate(0, 1, {"neurons": 2}, "b", 2, 3)
    with Store(target) as store:
        store.queue.enqueue(search_id, "train", [(doomed, "tch"), (fine, "tch")])  # the doomed one first
        for attempt in range(1, MAX_ATTEMPTS + 1):
            task = store.queue.claim(f"w{attempt}", [search_id], lease=30, max_attempts=MAX_ATTEMPTS)
            assert (task.candidate.genome_hash, task.attempts) == ("a", attempt)
            assert store.queue.release(f"w{attempt}", "was killed by SIGKILL") == 1
        task = store.queue.claim("w9", [search_id], lease=30, max_attempts=MAX_ATTEMPTS)
        assert task.candidate.genome_hash == "b"
        failed = store.records.lookup("a", "tch", search_id)
        assert failed.status == "failed" and f"lost {MAX_ATTEMPTS} times" in failed.reason
        assert "was killed by SIGKILL" in failed.reason


def test_a_worker_lost_while_training_a_finished_search_s_task_held_nothing_anyone_needs(target):
    """A worker stopped as its search ended, while it trained a re-measure of a network the last trainings left
    out of the top (an idle worker's, trained ahead): releasing it counts no task, so `search run` says no
    "its task is back on the queue" at a search's normal end; a task of a search still running counts."""
    ended, running = new_search(target, SEARCHES["random"]), new_search(target, SEARCHES["random"])
    with Store(target) as store:
        for search_id in (ended, running):
            store.queue.enqueue(search_id, "train", [(Candidate(4, -1, {"neurons": 1}, "a", 1, 3, 1), "tch")])
            assert store.queue.claim(f"w{search_id}", [search_id], lease=30, max_attempts=MAX_ATTEMPTS) is not None
        assert store.records.finish_search(ended, {"done": True})
        assert store.queue.release(f"w{ended}", "was stopped (SIGTERM)") == 0
        assert store.queue.release(f"w{running}", "was stopped (SIGTERM)") == 1


def test_a_task_put_back_on_interrupt_is_not_a_loss(target):
    search_id = new_search(target, SEARCHES["random"])
    with Store(target) as store:
        store.queue.enqueue(search_id, "train", [(Candidate(0, 0, {"neurons": 1}, "a", 1, 3), "tch")])
        for _ in range(MAX_ATTEMPTS + 2):
            task = store.queue.claim("w", [search_id], lease=30, max_attempts=MAX_ATTEMPTS)
            assert task is not None and task.attempts == 1
            store.queue.put_back(task, "w")


def test_a_worker_that_finishes_early_takes_the_next_generation(target):
    """The random sampler and TPE propose a generation while the one before still trains: a worker done
    with its share of generation 1 trains generation 2's candidates instead of waiting for a slow one."""
    cfg = SearchConfig(sampler="random", population=4, generations=3, max_epochs=3, remeasure=0, top=1, seed=8)
    search_id = new_search(target, cfg)

    def second_done() -> bool:
        with Store(target) as store:
            return sum(t.state == "done" for t in store.queue.tasks(search_id, "train") if t.candidate.generation == 1) == 4

    def slow_first(search):
        def train(assignment):
            c = assignment.candidate
            if (c.generation, c.index) == (0, 0):  # trains until generation 2 is done, a minute at most
                deadline = time.monotonic() + 60
                while not second_done() and time.monotonic() < deadline:
                    time.sleep(0.05)
            else:
                time.sleep(0.05)
            return scored(fitness(c), assignment, 0.5)
        return train

    def work_slowly(name):
        with Store(target) as store:
            Worker(store, name, "cpu", slow_first, WorkerOptions(search_ids=[search_id])).run()

    threads = [threading.Thread(target=work_slowly, args=(f"w{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    with Store(target) as store:
        tasks = store.queue.tasks(search_id, "train")
        slow = next(t for t in tasks if (t.candidate.generation, t.candidate.index) == (0, 0))
        second = [t for t in tasks if t.candidate.generation == 1]
        # Every candidate of generation 2 was trained by the other worker while the slow one trained (without
        # the overlap, the slow one would have waited its minute out, and trained some of them after).
        assert slow.seconds < 60 and {t.worker for t in second} == {w for w in ("w0", "w1") if w != slow.worker}
        # Generation 1 went on the queue before generation 2 (queued first, generation 2 was taken first now
        # and then: a worker claimed it before generation 1's tasks were there, and trained both).
        assert max(t.id for t in tasks if t.candidate.generation == 0) < min(t.id for t in second)
        assert store.records.search(search_id).finished is not None


def test_tpe_overlaps_by_default_and_a_search_recorded_before_resumes_without(tmp_path):
    """TPE's history depends on whether it asks a generation before the one before is told: the setting
    is recorded, and a search recorded before it existed (no `overlap` in its settings) replays without."""
    cfg = SEARCHES["tpe"]
    with Store(tmp_path / "a.db") as store:
        overlapped = run_search(cfg, SPACE, serial(fitness), store, "tch")
        assert store.records.searches()[0].config["overlap"] is True
    with Store(tmp_path / "b.db") as store:
        told_first = run_search(SearchConfig(**{**cfg.__dict__, **cfg.settings, "overlap": False}), SPACE,
                                serial(fitness), store, "tch")
    assert [m.genome for g in overlapped.history for m in g.members] != \
        [m.genome for g in told_first.history for m in g.members]
    # An older record: two generations of a no-overlap search, its settings without the key.
    path = tmp_path / "old.db"
    short = SearchConfig(**{**cfg.__dict__, **cfg.settings, "overlap": False, "generations": 2})
    with Store(path) as store:
        run_search(short, SPACE, serial(fitness), store, "tch")
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        config = json.loads(db.execute("SELECT config FROM searches").fetchone()[0])
        del config["overlap"]
        db.execute("UPDATE searches SET config = ?, finished = NULL", (json.dumps(config),))
    with Store(path) as store:
        resumed = run_search(SearchConfig(**{**cfg.__dict__, **cfg.settings, "overlap": False}), SPACE,
                             serial(fitness), store, "tch", resume=1)
    # The same generations and top (its first start crowned the top of two generations: more re-measures)
    assert (resumed.history, resumed.top) == (told_first.history, told_first.top)


def test_tasks_are_handed_out_oldest_generation_first_then_costliest_first(target):
    search_id = new_search(target, SEARCHES["random"])
    small, big, later = (Candidate(0, 0, {"n": 1}, "s", 1, 3), Candidate(0, 1, {"n": 2}, "b", 2, 3),
                         Candidate(1, 0, {"n": 3}, "l", 3, 3))
    with Store(target) as store:
        ids = store.queue.enqueue(search_id, "train", [(later, "tch"), (small, "tch"), (big, "tch")])
        assert sorted(c.genome_hash for c in ids.values()) == ["b", "l", "s"]
        assert store.queue.enqueue(search_id, "train", [(small, "tch")]) == {}  # there already: not this call's
        store.queue.prioritize({task_id: {"s": 1.0, "b": 9.0, "l": 99.0}[c.genome_hash] for task_id, c in ids.items()})
        order = [store.queue.claim("w", [search_id], lease=30, max_attempts=MAX_ATTEMPTS).candidate.genome_hash
                 for _ in range(3)]
    assert order == ["b", "s", "l"]
