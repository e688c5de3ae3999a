"""A worker's driver threads (`towerlab.search.work.worker`): each plays one search (`Search.play`) through a
`QueueTrainer`, so that the candidates the store cannot serve go on the queue (each once, whoever puts
them there first) and the trainer returns when the store holds a result for each, whoever trained it.
A pruned rung's sure promotions go on the queue as results come in. When the search's top is crowned,
the retrainings that give it its test accuracy go on the queue too (`towerlab.search.testing`), and the first
driver to see them done writes the summary: the search is finished.

Every wait for the store, here and in the worker's own loop, is a `Poll`: woken at once by what this
process wrote, else looking again after POLL[0] seconds, twice as long each time nothing came, up to
POLL[1].
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Sequence

from towerlab.search.candidates import Candidate
from towerlab.search.history import TopGenome
from towerlab.search.store.rows import Evaluation
from towerlab.search.search import Search
from towerlab.search.store import Store
from towerlab.search.testing import retrainings, tested
from towerlab.search.trainers import Record

POLL = (0.05, 1.0)  # seconds between looks at the store for new results or tasks: first, at most


class Stopping(Exception):
    """Raised in a driver thread when its worker stops: the search is left as the store holds it."""


class Poll:
    """A thread's wait for the store (see the module's docstring): `wait()` until `wake` is set or the
    interval passes (Stopping first where `stopping` is set), `found()` when a look found something."""

    def __init__(self, wake: threading.Event, stopping: Optional[threading.Event] = None) -> None:
        self.wake, self.stopping, self.seconds = wake, stopping, POLL[0]

    def wait(self) -> None:
        if self.stopping is not None and self.stopping.is_set():
            raise Stopping
        self.wake.wait(self.seconds)
        self.wake.clear()
        self.seconds = min(2 * self.seconds, POLL[1])

    def found(self) -> None:
        self.seconds = POLL[0]


class QueueTrainer:
    """A `Trainer` whose candidates are trained by whichever worker claims them from the store: it puts
    on the queue those that no result serves yet and returns once each has one."""

    def __init__(self, store: Store, search: Search, priority: Callable[[Candidate], float], driver: Driver) -> None:
        self.store, self.search, self.priority, self.driver = store, search, priority, driver

    def put(self, kind: str, candidates: list[tuple[Candidate, str]]) -> None:
        """Candidates on the queue, at once, then ranked (a cost estimate's first use in a process takes
        seconds: the workers start on the tasks meanwhile); only the worker that put a task there ranks it."""
        assert self.search.id is not None
        new = self.store.queue.enqueue(self.search.id, kind, candidates)
        if new:
            self.driver.worker_wake.set()
            self.store.queue.prioritize({task_id: self.priority(c) for task_id, c in new.items()})

    def __call__(self, candidates: list[Candidate], record: Record) -> None:
        search_id = self.search.id
        assert search_id is not None
        pending: dict[tuple[str, str, int], Candidate] = {}

        def add(new: Sequence[Candidate]) -> list[tuple[Candidate, Evaluation]]:
            keys = {(c.genome_hash, record.train_config_hash(c), c.replicate): c for c in new}
            found = self.store.records.own_rows(search_id, list(keys))
            self.put("train", [(c, key[1]) for key, c in keys.items() if key not in found])
            pending.update((key, c) for key, c in keys.items() if key not in found)
            return [(keys[key], row) for key, row in found.items()]

        ready = add(candidates)
        poll = self.driver.poll()
        while True:
            while ready:
                candidate, row = ready.pop(0)
                record.served(candidate, row)
                ready.extend(add(record.more()))
            if not pending:
                return
            poll.wait()
            # By key, not "rows newer than the last seen": PostgreSQL numbers rows as they are written,
            # and transactions may commit out of that order.
            found = self.store.records.own_rows(search_id, list(pending))
            ready.extend((pending.pop(key), row) for key, row in found.items())
            if found:
                poll.found()

    def prefetch(self, candidates: list[Candidate], train_config_hash: str) -> None:
        """Put candidates on the queue now, before anyone waits for them (the next generation's first
        rung, while this one trains)."""
        assert self.search.id is not None
        keys = {(c.genome_hash, train_config_hash, c.replicate): c for c in candidates}
        found = self.store.records.own_rows(self.search.id, list(keys))
        self.put("train", [(c, key[1]) for key, c in keys.items() if key not in found])


class Driver(threading.Thread):
    """Plays one search in a worker (see the module's docstring) until it is finished: `done`; or
    records what stopped it: `error`."""

    def __init__(self, store: Store, search_id: int, priority: Callable[[Search], Callable[[Candidate], float]],
                 worker_wake: threading.Event, log: Optional[Callable[[str], None]] = None) -> None:
        super().__init__(name=f"towerlab-search-{search_id}", daemon=True)
        self.store, self.search_id, self.priority, self.worker_wake, self.log = (store, search_id, priority,
                                                                                 worker_wake, log)
        self.wake, self.stopping = threading.Event(), threading.Event()
        self.done = False
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            while not self.store.records.finished(self.search_id):
                search = Search.open(self.store, self.search_id)
                trainer = QueueTrainer(self.store, search, self.priority(search), self)
                played = search.play(self.store, trainer, on_progress=self.log)
                self._test(search, played.top, trainer)
                # Written only under the settings it was played with: a resume that changed them
                # (more generations) has the search played again.
                search.finish(self.store, *played)
            self.done = True
        except Stopping:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the worker's main thread
            self.error = exc
        finally:
            self.worker_wake.set()

    def poll(self) -> Poll:
        """A wait for the store on this driver's thread: woken by its worker, stopped with it."""
        return Poll(self.wake, self.stopping)

    def _test(self, search: Search, top: list[TopGenome], trainer: QueueTrainer) -> None:
        """Give the crowned networks their test accuracy (`towerlab.search.testing`): queue the retrainings
        that need one, and wait until each is done."""
        wanted = retrainings(self.store, search, top)
        if not wanted:
            return
        trainer.put("test", wanted)
        poll = self.poll()
        while not tested(self.store, search, wanted):
            poll.wait()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
