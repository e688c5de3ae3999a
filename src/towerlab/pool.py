"""Search candidates handed to every worker process through the key-value store of the
torch.distributed process group: no sockets or server of our own.

Rank 0 (the coordinator) publishes a batch of tasks; every rank, the coordinator included, claims
the next unclaimed task with the store's atomic counter (`add`), so a slow candidate never stalls
the fast ones. A collector thread on rank 0 hands each result to the caller the moment it appears,
so a result is in the search's SQLite store within a fraction of a second of its training ending.

Workers beat a heartbeat counter. A task whose worker's heartbeat stops changing for `stale`
seconds (as seen by rank 0's own clock, so machines' clocks need not agree) is run again by the
coordinator; if that fails too, it is recorded as failed.

Keys, under `towerlab/pool/`: `b<B>/task/<i>`, `b<B>/n` (published last), `b<B>/next` (claim
counter), `b<B>/claim/<i>` (claimant rank), `b<B>/result/<i>`, `b<B>/done` (results counter),
`alive/<rank>` (heartbeat), `stop`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

PREFIX = "towerlab/pool/"
POLL = 0.05          # seconds between looks at the store
HEARTBEAT = 1.0      # seconds between a worker's heartbeats


def _key(*parts: Any) -> str:
    return PREFIX + "/".join(str(p) for p in parts)


class Pool:
    def __init__(self, store: Any, rank: int, world_size: int, work: Callable[[dict], dict], *,
                 stale: float = 30.0):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.work = work
        self.stale = stale
        self.batch = 0
        self._beating = threading.Event()
        self._heart = threading.Thread(target=self._beat, name="towerlab-heartbeat", daemon=True)
        self._heart.start()

    def _beat(self) -> None:
        while not self._beating.is_set():
            self.store.add(_key("alive", self.rank), 1)
            self._beating.wait(HEARTBEAT)

    def close(self) -> None:
        self._beating.set()

    # ------------------------------------------------------------------ every rank

    def _run(self, batch: int, index: int) -> None:
        self.store.set(_key(batch, "claim", index), str(self.rank))
        task = json.loads(self.store.get(_key(batch, "task", index)))
        result = self.work(task)
        self.store.set(_key(batch, "result", index), json.dumps(result))
        self.store.add(_key(batch, "done"), 1)

    def _claim(self, batch: int, n: int) -> int | None:
        index = self.store.add(_key(batch, "next"), 1) - 1
        return index if index < n else None

    # ------------------------------------------------------------------ workers (rank > 0)

    def serve(self) -> None:
        """Work batch after batch until the coordinator says stop."""
        batch = 0
        try:
            while True:
                batch += 1
                if not self._wait_for(_key(batch, "n")):
                    return
                n = int(self.store.get(_key(batch, "n")))
                while (index := self._claim(batch, n)) is not None:
                    self._run(batch, index)
        finally:
            self.close()

    def _wait_for(self, key: str) -> bool:
        while not self.store.check([key]):
            if self.store.check([_key("stop")]):
                return False
            time.sleep(POLL)
        return True

    # ------------------------------------------------------------------ the coordinator (rank 0)

    def map(self, tasks: list[dict], on_result: Callable[[int, dict], None]) -> None:
        """Run every task on some rank; `on_result(i, result)` is called once per task, from a
        collector thread, as soon as that task is done."""
        self.batch += 1
        batch, n = self.batch, len(tasks)
        for index, task in enumerate(tasks):
            self.store.set(_key(batch, "task", index), json.dumps(task))
        self.store.set(_key(batch, "n"), str(n))
        collector = _Collector(self, batch, n, on_result)
        collector.start()
        try:
            while (index := self._claim(batch, n)) is not None and collector.error is None:
                self._run(batch, index)
            while not collector.finished.is_set():
                orphan = collector.orphan()
                if orphan is None:
                    collector.finished.wait(POLL)
                else:
                    self._run_again(batch, orphan)
        finally:
            collector.stop()
        if collector.error is not None:
            raise collector.error

    def _run_again(self, batch: int, index: int) -> None:
        try:
            self._run(batch, index)
        except Exception as exc:  # noqa: BLE001 - the retry failed as well: that is the outcome
            failed = {"status": "failed", "reason": f"its worker died and the retry failed: {exc}"}
            self.store.set(_key(batch, "result", index), json.dumps(failed))

    def shutdown(self) -> None:
        self.store.set(_key("stop"), "1")
        self.close()


class _Collector(threading.Thread):
    def __init__(self, pool: Pool, batch: int, n: int, on_result: Callable[[int, dict], None]):
        super().__init__(name="towerlab-collector", daemon=True)
        self.pool, self.batch, self.on_result = pool, batch, on_result
        self.pending = set(range(n))
        self.finished = threading.Event()
        self.error: BaseException | None = None
        self._stop_requested = threading.Event()
        self._retried: set[int] = set()
        self._orphans: list[int] = []
        self._lock = threading.Lock()
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (last heartbeat, when it changed)

    def run(self) -> None:
        store, seen_done = self.pool.store, -1
        try:
            while self.pending and not self._stop_requested.is_set():
                done = store.add(_key(self.batch, "done"), 0)
                if done != seen_done:
                    seen_done = done
                    self._sweep()
                self._watch()
                time.sleep(POLL)
            self._sweep()  # results that landed while stopping are kept too
        except BaseException as exc:  # noqa: BLE001 - handed to the coordinator's thread
            self.error = exc
        finally:
            if not self.pending or self.error is not None:
                self.finished.set()

    def _sweep(self) -> None:
        store = self.pool.store
        for index in sorted(self.pending):
            key = _key(self.batch, "result", index)
            if store.check([key]):
                self.on_result(index, json.loads(store.get(key)))
                self.pending.discard(index)
        if not self.pending:
            self.finished.set()

    def _watch(self) -> None:
        """Find claimed tasks whose worker stopped beating."""
        store, now = self.pool.store, time.monotonic()
        for index in sorted(self.pending - self._retried):
            claim = _key(self.batch, "claim", index)
            if not store.check([claim]):
                continue
            rank = int(store.get(claim))
            if rank == self.pool.rank:
                continue
            beat = store.add(_key("alive", rank), 0)
            last, since = self._beats.get(rank, (-1, now))
            if beat != last:
                self._beats[rank] = (beat, now)
            elif now - since > self.pool.stale:
                with self._lock:
                    self._retried.add(index)
                    self._orphans.append(index)

    def orphan(self) -> int | None:
        with self._lock:
            return self._orphans.pop(0) if self._orphans else None

    def stop(self) -> None:
        self._stop_requested.set()
        self.join()
