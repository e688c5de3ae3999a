"""Search candidates handed to every worker process through the key-value store of the
torch.distributed process group: no sockets or server of our own.

Rank 0 (the coordinator) publishes a batch of tasks; every rank, the coordinator included, claims
the next task number with the store's atomic counter (`add`), so a slow candidate never stalls
the fast ones. A collector thread on rank 0 hands each result to the caller the moment it appears,
so a result is in the search's SQLite store within a fraction of a second of its training ending.
The caller may answer a result with more tasks (a pruned generation's next rung): they join the
batch, numbered on, and a rank whose number has no task yet waits for one until the batch closes.

Workers beat a heartbeat counter. A task whose worker's heartbeat stops changing for `stale`
seconds (as seen by rank 0's own clock, so machines' clocks need not agree) is run again by the
coordinator; if that fails too, it is recorded as failed. So is a task taken from the claim counter
by a worker that died before it could write its claim. `stale` defaults to the environment
variable TOWERLAB_WORKER_STALE_SECONDS, else 30 seconds; it must be at least 3 heartbeats (3 s):
a worker that trains holds the heartbeat thread back a little, and a false alarm costs a
second training of the same candidate (harmless, but wasted).

`check_stop`, when given, is called between tasks and while waiting; it raises to end the loop
(the search passes one that raises `Interrupted` after Ctrl-C / SIGTERM), so an interrupted
coordinator leaves within a poll instead of waiting for the batch.

Keys, under `towerlab/pool/<namespace>`: `b<B>/task/<i>`, `b<B>/open` (set after the first
tasks), `b<B>/next` (claim counter), `b<B>/claim/<i>` (claimant rank), `b<B>/result/<i>`,
`b<B>/done` (results counter), `b<B>/closed` (every task done), `alive/<rank>` (heartbeat),
`stop`. The namespace must be new for every start of the job's processes: torchrun keeps its
store across the restarts of a worker group, and a restarted pool that found batch 1's keys of the
previous attempt would take their results for its own (different) tasks. The search uses the
torchrun restart count.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any, Callable

from towerlab.errors import UserError

PREFIX = "towerlab/pool/"
POLL = 0.05          # seconds between looks at the store
HEARTBEAT = 1.0      # seconds between a worker's heartbeats
STALE_ENV = "TOWERLAB_WORKER_STALE_SECONDS"
DEFAULT_STALE = 30.0


def stale_seconds() -> float:
    """Seconds without a heartbeat after which a worker's task is run again: $TOWERLAB_WORKER_STALE_SECONDS,
    else 30."""
    text = os.environ.get(STALE_ENV, "").strip()
    if not text:
        return DEFAULT_STALE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 3 * HEARTBEAT:
        raise UserError(f"{STALE_ENV}={text!r}: give a number of seconds, at least {3 * HEARTBEAT:g} "
                        f"(workers beat every {HEARTBEAT:g} s)")
    return value




class Pool:
    def __init__(self, store: Any, rank: int, world_size: int, work: Callable[[dict], dict], *,
                 stale: float | None = None, check_stop: Callable[[], None] | None = None,
                 log: Callable[[str], None] | None = None, namespace: str = ""):
        self.store = store
        self.prefix = PREFIX + (namespace.strip("/") + "/" if namespace.strip("/") else "")
        self.rank = rank
        self.world_size = world_size
        self.work = work
        self.stale = stale_seconds() if stale is None else stale
        self.check_stop = check_stop or (lambda: None)
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.batch = 0
        self._beating = threading.Event()
        self._heart = threading.Thread(target=self._beat, name="towerlab-heartbeat", daemon=True)
        self._heart.start()

    def _key(self, *parts: Any) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def _beat(self) -> None:
        while not self._beating.is_set():
            self.store.add(self._key("alive", self.rank), 1)
            self._beating.wait(HEARTBEAT)

    def close(self) -> None:
        # Wait for the heartbeat thread to be out of the store: a process that exits while a thread
        # is inside a TCPStore call can abort ("terminate called without an active exception").
        self._beating.set()
        if self._heart.is_alive() and self._heart is not threading.current_thread():
            self._heart.join(timeout=30.0)

    # ------------------------------------------------------------------ every rank

    def _run(self, batch: int, index: int) -> None:
        task = json.loads(self.store.get(self._key(batch, "task", index)))
        result = self.work(task)
        self.store.set(self._key(batch, "result", index), json.dumps(result))
        self.store.add(self._key(batch, "done"), 1)

    def _claim(self, batch: int) -> int:
        """The next task number, named as this rank's at once (its task may not be published yet)."""
        index = self.store.add(self._key(batch, "next"), 1) - 1
        self.store.set(self._key(batch, "claim", index), str(self.rank))
        return index

    # ------------------------------------------------------------------ workers (rank > 0)

    def serve(self) -> None:
        """Work batch after batch until the coordinator says stop."""
        batch = 0
        try:
            while True:
                batch += 1
                if not self._wait_for(self._key(batch, "open")):
                    return
                while True:
                    self.check_stop()
                    index = self._claim(batch)
                    if not self._wait_for(self._key(batch, "task", index), self._key(batch, "closed")):
                        break
                    self._run(batch, index)
        finally:
            self.close()

    def _wait_for(self, key: str, closed: str | None = None) -> bool:
        """Wait until `key` is set: True; False when the pool stops (or `closed` is set) first."""
        while not self.store.check([key]):
            if self.store.check([self._key("stop")]) or (closed is not None and self.store.check([closed])):
                return False
            self.check_stop()
            time.sleep(POLL)
        return True

    # ------------------------------------------------------------------ the coordinator (rank 0)

    def map(self, tasks: list[dict], on_result: Callable[[int, dict], list[dict] | None]) -> None:
        """Run every task on some rank; `on_result(i, result)` is called once per task, from a
        collector thread, as soon as that task is done. It may return more tasks: they join the
        batch (numbered on from the tasks so far) and are run as well before `map` returns."""
        self.batch += 1
        batch = self.batch
        collector = _Collector(self, batch, on_result)
        collector.publish(tasks)
        self.store.set(self._key(batch, "open"), "1")
        collector.start()
        try:
            index = None
            while collector.error is None and not collector.finished.is_set():
                self.check_stop()
                if index is None:
                    index = self._claim(batch)
                if index < collector.published:
                    self._run(batch, index)
                    index = None
                    continue
                orphan = collector.orphan()
                if orphan is None:
                    collector.finished.wait(POLL)
                else:
                    self._run_again(batch, orphan)
        finally:
            collector.stop()
        if collector.error is not None:
            raise collector.error
        self.store.set(self._key(batch, "closed"), "1")

    def _run_again(self, batch: int, index: int) -> None:
        claim = self._key(batch, "claim", index)
        who = f"worker rank {self.store.get(claim).decode()}" if self.store.check([claim]) else "a worker"
        self.log(f"towerlab: warning: {who} stopped beating while training task {index} of batch {batch}; "
                 "training it here instead")
        try:
            self._run(batch, index)
        except Exception as exc:  # noqa: BLE001 - the retry failed as well: that is the outcome
            self.check_stop()  # ...unless it was interrupted: then leave, and --resume trains it again
            failed = {"status": "failed", "reason": f"its worker died and the retry failed: {exc}"}
            self.store.set(self._key(batch, "result", index), json.dumps(failed))

    def shutdown(self) -> None:
        self.store.set(self._key("stop"), "1")
        self.close()


class _Collector(threading.Thread):
    def __init__(self, pool: Pool, batch: int, on_result: Callable[[int, dict], list[dict] | None]):
        super().__init__(name="towerlab-collector", daemon=True)
        self.pool, self.batch, self.on_result = pool, batch, on_result
        self.published = 0  # tasks 0 .. published-1 are in the store
        self.pending: set[int] = set()
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self._stop_requested = threading.Event()
        self._retried: set[int] = set()
        self._orphans: list[int] = []
        self._lock = threading.Lock()
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (last heartbeat, when it changed)
        self._unnamed: dict[int, float] = {}  # claimed index without a claimant -> when first seen
        self._sweep_now = False

    def run(self) -> None:
        store, seen_done = self.pool.store, -1
        try:
            while self.pending and not self._stop_requested.is_set():
                done = store.add(self.pool._key(self.batch, "done"), 0)
                if done != seen_done or self._sweep_now:
                    seen_done, self._sweep_now = done, False
                    self._sweep()
                self._watch()
                time.sleep(POLL)
            self._sweep()  # results that landed while stopping are kept too
        except BaseException as exc:  # noqa: BLE001 - handed to the coordinator's thread
            self.error = exc
        finally:
            if not self.pending or self.error is not None:
                self.finished.set()

    def publish(self, tasks: list[dict]) -> None:
        for task in tasks:
            self.pool.store.set(self.pool._key(self.batch, "task", self.published), json.dumps(task))
            self.pending.add(self.published)
            self.published += 1  # only now may a rank that waits for this number take it

    def _sweep(self) -> None:
        store = self.pool.store
        for index in sorted(self.pending):
            key = self.pool._key(self.batch, "result", index)
            if store.check([key]):
                more = self.on_result(index, json.loads(store.get(key)))
                self.pending.discard(index)
                self.publish(more or [])
        if not self.pending:
            self.finished.set()

    def _watch(self) -> None:
        """Find claimed tasks whose worker stopped beating, or died between taking the task from
        the claim counter and writing its claim."""
        store, now = self.pool.store, time.monotonic()
        handed_out = store.add(self.pool._key(self.batch, "next"), 0)  # indices below this were claimed
        for index in sorted(self.pending - self._retried):
            if index >= handed_out:
                continue
            claim = self.pool._key(self.batch, "claim", index)
            if not store.check([claim]):
                if now - self._unnamed.setdefault(index, now) > self.pool.stale:
                    self._orphan(index)
                continue
            rank = int(store.get(claim))
            if rank == self.pool.rank:
                continue
            beat = store.add(self.pool._key("alive", rank), 0)
            last, since = self._beats.get(rank, (-1, now))
            if beat != last:
                self._beats[rank] = (beat, now)
            elif now - since > self.pool.stale:
                self._orphan(index)

    def _orphan(self, index: int) -> None:
        if self.pool.store.check([self.pool._key(self.batch, "result", index)]):
            self._sweep_now = True  # it finished; its worker died before counting it as done
            return
        with self._lock:
            self._retried.add(index)
            self._orphans.append(index)

    def orphan(self) -> int | None:
        with self._lock:
            return self._orphans.pop(0) if self._orphans else None

    def stop(self) -> None:
        self._stop_requested.set()
        self.join()
