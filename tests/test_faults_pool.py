"""The search's task pool under faults, in one process: a real torch.distributed store (HashStore)
and workers that die at each point of their protocol, simulated by writing (or not writing) the
keys a dying worker leaves behind. Fast: no training, no processes."""

from __future__ import annotations

import json
import threading
import time

import pytest
from torch.distributed import HashStore

from towerlab.search import pool as pool_module
from towerlab.errors import UserError
from towerlab.search.pool import Pool

STALE = 0.5  # seconds; the real default is 30 (TOWERLAB_WORKER_STALE_SECONDS)


def coordinator(store, log=None, **kw) -> Pool:
    lines = log if log is not None else []
    return Pool(store, 0, 2, lambda task: {"value": task["x"] * 10, "by": 0}, stale=STALE, log=lines.append, **kw)


def run_map(pool: Pool, n: int) -> dict[int, dict]:
    results = {}
    pool.map([{"x": i} for i in range(n)], lambda i, r: results.__setitem__(i, r))
    return results


def test_keys_of_an_earlier_attempt_are_never_taken_for_this_one():
    """torchrun keeps its store across restarts: results an earlier attempt left under batch 1 must not
    be handed out as the results of the restarted attempt's batch 1 (other tasks)."""
    store = HashStore()
    old = Pool(store, 0, 2, lambda task: {"value": -1, "by": "old attempt"}, stale=STALE, namespace="attempt0")
    run_map(old, 3)
    old.close()
    new = coordinator(store, namespace="attempt1")
    try:
        assert run_map(new, 3) == {i: {"value": 10 * i, "by": 0} for i in range(3)}
    finally:
        new.close()


def test_a_worker_dead_between_claim_counter_and_claim_is_detected():
    """Rank 1 took task 0 from the counter and died before writing its claim: the coordinator runs
    task 0 itself once it has been unclaimed for `stale` seconds, instead of waiting forever."""
    store = HashStore()
    lines = []
    pool = coordinator(store, lines)
    store.add(pool._key(1, "next"), 1)  # what the dying worker did: the counter moved, nothing else
    try:
        started = time.monotonic()
        assert run_map(pool, 3) == {i: {"value": 10 * i, "by": 0} for i in range(3)}
        assert time.monotonic() - started < 20 * STALE
    finally:
        pool.close()
    assert any("a worker stopped beating while training task 0" in line for line in lines), lines


def test_a_worker_whose_heart_stopped_has_its_task_run_again_once():
    store = HashStore()
    lines = []
    pool = coordinator(store, lines)
    store.add(pool._key(1, "next"), 1)  # rank 1 claimed task 0 properly, beat once, then died
    store.set(pool._key(1, "claim", 0), "1")
    store.add(pool._key("alive", 1), 1)
    try:
        assert run_map(pool, 3) == {i: {"value": 10 * i, "by": 0} for i in range(3)}
    finally:
        pool.close()
    assert [line for line in lines if "stopped beating" in line] == [
        "towerlab: warning: worker rank 1 stopped beating while training task 0 of batch 1; training it here instead"]


def test_a_result_written_just_before_the_worker_died_is_kept_not_retrained():
    """Rank 1 wrote its result, then died before counting it as done: no rerun, its result is used."""
    store = HashStore()
    lines, trained = [], []

    def work(task):
        trained.append(task["x"])
        return {"value": task["x"] * 10, "by": 0}

    pool = Pool(store, 0, 2, work, stale=STALE, log=lines.append)
    store.add(pool._key(1, "next"), 1)
    store.set(pool._key(1, "claim", 0), "1")
    store.add(pool._key("alive", 1), 1)
    store.set(pool._key(1, "result", 0), json.dumps({"value": 0, "by": 1}))  # no "done" increment
    try:
        assert run_map(pool, 3) == {0: {"value": 0, "by": 1}, 1: {"value": 10, "by": 0}, 2: {"value": 20, "by": 0}}
    finally:
        pool.close()
    assert sorted(trained) == [1, 2] and not any("stopped beating" in line for line in lines)


def test_an_interrupted_coordinator_leaves_while_waiting_and_keeps_what_landed():
    """Ctrl-C while the coordinator only waits for a worker: it leaves within a poll (check_stop
    raises), and the results already in are still handed over."""
    store = HashStore()
    stop = threading.Event()

    class Stop(Exception):
        pass

    def check_stop():
        if stop.is_set():
            raise Stop

    pool = Pool(store, 0, 2, lambda task: {"value": task["x"] * 10}, stale=60.0, check_stop=check_stop)
    store.add(pool._key(1, "next"), 1)  # task 0 belongs to a live, slow worker
    store.set(pool._key(1, "claim", 0), "1")
    results = {}
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    try:
        with pytest.raises(Stop):
            pool.map([{"x": i} for i in range(3)], lambda i, r: results.__setitem__(i, r))
    finally:
        pool.close()
    assert time.monotonic() - started < 5
    assert results == {1: {"value": 10}, 2: {"value": 20}}


def test_an_interrupted_retry_is_not_recorded_as_a_failure():
    store = HashStore()
    interrupted = threading.Event()

    class Stop(Exception):
        pass

    def work(task):
        if task["x"] == 0:  # the orphan: the coordinator is interrupted while retraining it
            interrupted.set()
            raise Stop
        return {"value": task["x"]}

    def check_stop():
        if interrupted.is_set():
            raise Stop

    pool = Pool(store, 0, 2, work, stale=STALE, check_stop=check_stop, log=lambda _line: None)
    store.add(pool._key(1, "next"), 1)  # task 0: taken by a worker that died at once
    results = {}
    try:
        with pytest.raises(Stop):
            pool.map([{"x": i} for i in range(2)], lambda i, r: results.__setitem__(i, r))
    finally:
        pool.close()
    assert results == {1: {"value": 1}}  # task 0 is neither done nor "failed": --resume trains it


def test_tasks_a_result_adds_join_its_batch_and_waiting_ranks_take_them():
    """A pruned generation's next rung: results answer with more tasks. Every task runs once,
    on the coordinator or on a worker that waited for one, and the worker left waiting when the
    batch closed serves the next batch."""
    store = HashStore()
    worker = Pool(store, 1, 2, lambda task: {"value": task["x"] * 10, "by": 1}, stale=60.0)
    serving = threading.Thread(target=worker.serve)
    serving.start()

    def slow(task):
        time.sleep(0.05)
        return {"value": task["x"] * 10, "by": 0}

    pool = Pool(store, 0, 2, slow, stale=60.0)
    results = {}

    def on_result(index, result):
        results[index] = result
        return [{"x": 100 + index}, {"x": 200 + index}] if index < 3 else None  # tasks 0-2 add two each

    try:
        pool.map([{"x": i} for i in range(3)], on_result)
        assert sorted(results) == list(range(9))
        assert sorted(r["value"] for r in results.values()) == sorted(
            [0, 10, 20] + [10 * (base + i) for base in (100, 200) for i in range(3)])
        second = run_map(pool, 4)
        assert [second[i]["value"] for i in range(4)] == [0, 10, 20, 30]
    finally:
        pool.shutdown()
        serving.join(timeout=30)
    assert not serving.is_alive()


@pytest.mark.parametrize("value, ok", [("", True), ("45", True), ("3", True), ("2.9", False), ("0", False),
                                       ("-5", False), ("nan", False), ("inf", False), ("soon", False)])
def test_the_stale_setting_comes_from_the_environment_and_is_checked(monkeypatch, value, ok):
    monkeypatch.setenv(pool_module.STALE_ENV, value)
    if ok:
        assert pool_module.stale_seconds() == (float(value) if value else pool_module.DEFAULT_STALE)
    else:
        with pytest.raises(UserError, match="TOWERLAB_WORKER_STALE_SECONDS"):
            pool_module.stale_seconds()
