"""The store is the queue: every worker, on any machine, plays the search against its store and trains
the tasks it claims there. No process coordinates the others, and nothing a worker holds only in memory
is needed by anyone else.

A worker is one process with two kinds of thread:

- its main thread claims a task (`Store.claim`: one transaction, a lease on the database's clock),
  trains it while a helper thread renews the lease, and writes the result and closes the task in one
  transaction (`Store.complete`), only while it still holds the lease;
- one driver thread per search it works on plays the search (`Search.play`) through a
  `QueueTrainer`: the candidates that the store cannot serve go on the queue (each once, whoever puts
  them there first), and the trainer returns when the store holds a result for each, whoever trained
  it. A pruned rung's sure promotions go on the queue as results come in. When the search's top is
  crowned, the retrainings that give it its test accuracy go on the queue too, and the first driver to
  see them done writes the summary: the search is finished.

Every driver of a search plays the same game: the sampler proposes from the seed and the stored
history in a fixed order, the first driver to record a generation's members records them (the others
check that theirs are the same), the cache serves a generation only rows older than it (its
watermark), so the history is the same whoever proposed, trained or died, and however many workers
joined. A worker that starts late claims open tasks at once while its driver catches up.

Faults: a worker that dies holding a task stops renewing its lease; after `lease` seconds any worker
claims the task again (a local launcher that sees its worker die puts the task back at once). A worker
that comes back after its lease lapsed cannot write a result. A task whose workers were lost
MAX_ATTEMPTS times (an out-of-memory kill that recurs) is recorded as failed, with that reason, and
the search goes on. No torch here: what trains a task is given by the job (`trainer_for`).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from towerlab.distributed.signals import alive
from towerlab.errors import UserError
from towerlab.search.candidates import Candidate, Outcome
from towerlab.search.database import StoreLost
from towerlab.search.history import TopGenome
from towerlab.search.search import Search
from towerlab.search.store import Evaluation, Store, Task
from towerlab.search.tasks import MAX_LEASE

LEASE_ENV = "TOWERLAB_LEASE_SECONDS"
DEFAULT_LEASE = 30.0  # seconds a claim holds without renewal; renewed every third of it
MIN_LEASE = 3.0
# Claims of one task by workers that were lost before it is recorded as failed: a killed worker's
# candidate is retried, one that kills every worker that trains it (out of memory) is not, forever.
MAX_ATTEMPTS = 3
POLL = (0.05, 1.0)  # seconds between looks at the store for new results or tasks: first, at most
SEARCHES_EVERY = 2.0  # seconds between looks for new searches to join


def lease_seconds() -> float:
    """Seconds a claimed task stays a worker's without renewal: $TOWERLAB_LEASE_SECONDS, else 30."""
    text = os.environ.get(LEASE_ENV, "").strip()
    if not text:
        return DEFAULT_LEASE
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not MIN_LEASE <= value <= MAX_LEASE:  # NaN included
        raise UserError(f"{LEASE_ENV}={text!r}: give a number of seconds from {MIN_LEASE:g} to {MAX_LEASE:g} "
                        "(a worker renews its lease every third of it)")
    return value


def worker_name(device: str, pid: int, token: str) -> str:
    """A worker's name, unique in a store: its host, its process, its device, and the random `token`
    of what started it (a `search run`, a `search worker`, a torchrun rank). Host and pid alone are
    not unique: workers in containers, or under `unshare --pid`, on one host have the same pids."""
    return f"{socket.gethostname()}:{pid}:{device}:{token}"


def pid_space() -> str:
    """Where a pid names one process, as a worker records it (its `host`): this host, its boot and
    this process's PID namespace; "" where the system does not say (not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{socket.gethostname()} boot {boot} {namespace}"


def release_the_dead(store: Store) -> int:
    """Put back at once the tasks held by workers whose process is certainly gone (killed with their
    launcher, say), rather than wait for their leases; how many. Certainly: a worker of this host,
    boot and PID namespace whose pid runs no process; any other worker's task waits for its lease
    (a pid in another namespace names another process, or none: freeing on it reopened the live
    tasks of workers in other containers)."""
    space, freed = pid_space(), 0
    if not space:
        return 0
    for w in store.workers():
        if w["host"] == space and w["left_at"] is None and not alive(int(w["pid"])):
            freed += store.release(w["id"], "ended without a word (its process is gone)")
    return freed


def unusable(task: Task) -> Optional[str]:
    """Why the numbers of a task's row cannot be trained (an edited row: no positive budget, a seed
    out of range), or None. Such a task fails, with that reason, as a network that cannot be built
    does: the worker goes on."""
    budget, seed = task.candidate.max_epochs, task.candidate.seed
    if budget is not None and (type(budget) is not int or budget < 1):
        return (f"its task's row gives max_epochs = {budget!r}, not a number of epochs of at least 1 (the row "
                "was edited, or written by another program)")
    if type(seed) is not int or not 0 <= seed < 2**63:
        return (f"its task's row gives seed = {seed!r}, outside 0 to 2**63 - 1 (the row was edited, or written by "
                "another program)")
    return None


class Stopping(Exception):
    """Raised in a driver thread when its worker stops: the search is left as the store holds it."""


TaskTrainer = Callable[[Task], "tuple[Outcome, Optional[float]]"]


class QueueTrainer:
    """A `Trainer` whose candidates are trained by whichever worker claims them from the store: it puts
    on the queue those that no result serves yet and returns once each has one."""

    def __init__(self, store: Store, search: Search, priority: Callable[[Candidate], float],
                 wake: threading.Event, stopping: threading.Event, worker_wake: threading.Event) -> None:
        self.store, self.search, self.priority, self.wake, self.stopping = store, search, priority, wake, stopping
        self.worker_wake = worker_wake

    def put(self, kind: str, candidates: list[tuple[Candidate, str]]) -> None:
        """Candidates on the queue, at once, then ranked (a cost estimate's first use in a process takes
        seconds: the workers start on the tasks meanwhile); only the worker that put a task there ranks it."""
        assert self.search.id is not None
        new = self.store.enqueue(self.search.id, kind, candidates)
        if new:
            self.worker_wake.set()
            self.store.prioritize({task_id: self.priority(c) for task_id, c in new.items()})

    def __call__(self, candidates: list[Candidate], record: object) -> None:
        served: Callable[[Candidate, Evaluation], None] = getattr(record, "served")
        more: Callable[[], list[Candidate]] = getattr(record, "more", lambda: [])
        hash_of: Callable[[Candidate], str] = getattr(record, "train_config_hash")
        search_id = self.search.id
        assert search_id is not None
        pending: dict[tuple[str, str, int], Candidate] = {}

        def add(new: Sequence[Candidate]) -> list[tuple[Candidate, Evaluation]]:
            keys = {(c.genome_hash, hash_of(c), c.replicate): c for c in new}
            found = self.store.own_rows(search_id, list(keys))
            self.put("train", [(c, key[1]) for key, c in keys.items() if key not in found])
            pending.update((key, c) for key, c in keys.items() if key not in found)
            return [(keys[key], row) for key, row in found.items()]

        ready = add(candidates)
        wait = POLL[0]
        while True:
            while ready:
                candidate, row = ready.pop(0)
                served(candidate, row)
                ready.extend(add(more()))
            if not pending:
                return
            if self.stopping.is_set():
                raise Stopping
            self.wake.wait(wait)
            self.wake.clear()
            # By key, not "rows newer than the last seen": PostgreSQL numbers rows as they are written,
            # and transactions may commit out of that order.
            found = self.store.own_rows(search_id, list(pending))
            ready.extend((pending.pop(key), row) for key, row in found.items())
            wait = POLL[0] if found else min(2 * wait, POLL[1])


    def prefetch(self, candidates: list[Candidate], train_config_hash: str) -> None:
        """Put candidates on the queue now, before anyone waits for them (the next generation's first
        rung, while this one trains)."""
        assert self.search.id is not None
        keys = {(c.genome_hash, train_config_hash, c.replicate): c for c in candidates}
        found = self.store.own_rows(self.search.id, list(keys))
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
            while not self._finished():
                search = Search.open(self.store, self.search_id)
                trainer = QueueTrainer(self.store, search, self.priority(search), self.wake, self.stopping,
                                       self.worker_wake)
                history, top = search.play(self.store, trainer, on_progress=self.log)
                self._test(search, top, trainer)
                # Written only under the settings it was played with: a resume that changed them
                # (more generations) has the search played again.
                search.finish(self.store, history, top)
            self.done = True
        except Stopping:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the worker's main thread
            self.error = exc
        finally:
            self.worker_wake.set()

    def _finished(self) -> bool:
        row = self.store.search(self.search_id)
        return row is None or row.finished is not None

    def _test(self, search: Search, top: list[TopGenome], trainer: QueueTrainer) -> None:
        """Give each top network whose test accuracy is unknown the one its own training took, where it
        took one (a network is scored on the test split as it ends its training when it enters the top
        then: `Trainers`); queue the retraining of the others, with the seed of their evaluation (the
        same network, scored on the test split), and wait until each is done."""
        if not search.setup.get("test", True):
            return
        assert search.id is not None
        untested = [(t, row) for t in top
                    for row in [self.store.lookup(t.genome_hash, t.train_config_hash, search.id)]
                    if row is not None and row.test_accuracy is None]
        if not untested:
            return
        tested = {(t.candidate.genome_hash, t.train_config_hash, t.candidate.seed, t.candidate.max_epochs):
                  t.result["test_accuracy"] for t in self.store.tasks(search.id, "train")
                  if t.result and t.result.get("status") == "ok" and t.result.get("test_accuracy") is not None}
        wanted = []
        for t, row in untested:
            early = tested.get((t.genome_hash, t.train_config_hash, t.seed, row.max_epochs))
            if early is not None:
                self.store.set_test_accuracy(row.id, early)
            else:
                wanted.append((Candidate(t.generation, row.index, t.genome, t.genome_hash, t.seed, row.max_epochs),
                               t.train_config_hash))
        if not wanted:
            return
        trainer.put("test", wanted)
        keys = {(c.genome_hash, training_hash) for c, training_hash in wanted}
        wait = POLL[0]
        while True:
            open_ = [t for t in self.store.tasks(search.id, "test")
                     if (t.candidate.genome_hash, t.train_config_hash) in keys and t.state != "done"]
            if not open_:
                return
            if self.stopping.is_set():
                raise Stopping
            self.wake.wait(wait)
            self.wake.clear()
            wait = min(2 * wait, POLL[1])

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()


class Worker:
    """One worker process's loop (see the module's docstring). `trainer_for(search)` trains a task of
    that search in this process, returning its outcome and, for a test task, the test accuracy; a
    candidate's failure is a failed outcome, an exception escaping it stops the worker. `search_ids`:
    the searches to work on (None: every unfinished search of the store that `joinable(search)`
    admits; it returns why not, or None). The worker leaves when none is left to work on, unless
    `wait`, and between tasks whenever `check_stop` raises; one that joined nothing because every search
    refused it leaves with a UserError giving each reason. A worker that `speaks` says why a search
    refused it (and its drivers say what a large generation is doing); one that `tells` prints a line per
    task it trained and one when it leaves."""

    def __init__(self, store: Store, name: str, device: str, trainer_for: Callable[[Search], TaskTrainer], *,
                 search_ids: Optional[Sequence[int]] = None,
                 joinable: Callable[[Search], Optional[str]] = lambda search: None,
                 priority: Callable[[Search], Callable[[Candidate], float]] = lambda search: lambda c: 0.0,
                 lease: Optional[float] = None, wait: bool = False, speaks: bool = False, tells: bool = False,
                 check_stop: Callable[[], None] = lambda: None,
                 log: Optional[Callable[[str], None]] = None) -> None:
        self.store, self.name, self.device, self.trainer_for = store, name, device, trainer_for
        self.search_ids = None if search_ids is None else list(search_ids)
        self.joinable, self.priority = joinable, priority
        self.lease = lease_seconds() if lease is None else lease
        self.wait, self.speaks, self.tells, self.check_stop = wait, speaks, tells, check_stop
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.drivers: dict[int, Driver] = {}
        self.searches: dict[int, Search] = {}
        self.refused: dict[int, str] = {}
        self._unsaid: list[int] = []  # refusals not yet said
        self.trained = 0
        self._outcomes: list[Outcome] = []
        self._wake = threading.Event()
        self._looked = -math.inf

    def run(self) -> int:
        """Work until nothing is left; returns how many tasks this worker trained."""
        self.store.join(self.name, pid_space() or socket.gethostname(), os.getpid(), self.device)
        started = time.monotonic()
        try:
            wait = POLL[0]
            while True:
                self.check_stop()
                self._follow()
                task = self.store.claim(self.name, list(self.drivers), self.lease, MAX_ATTEMPTS)
                if task is None and not self.drivers and not self.wait and self._nothing_to_join():
                    if self.refused and not self.searches:
                        raise UserError(f"worker {self.name} joined no search of {self.store.path}: " + "; ".join(
                            f"search {i}: {why}" for i, why in self.refused.items()))
                    return self.trained
                self._say_refusals()
                if task is not None:
                    self._work(task)
                    wait = POLL[0]
                    continue
                self._wake.wait(wait)
                self._wake.clear()
                wait = min(2 * wait, POLL[1])
        finally:
            for driver in self.drivers.values():
                driver.stop()
            for driver in self.drivers.values():
                driver.join(timeout=5)  # one inside a long proposal holds nothing the store lacks
            self.store.leave(self.name)
            if self.tells and self.searches:
                self.log(self._summary(time.monotonic() - started))

    def _say_refusals(self) -> None:
        for search_id in self._unsaid:
            if self.speaks:
                self.log(f"towerlab: worker {self.name}: not joining search {search_id} of {self.store.path}: "
                         f"{self.refused[search_id]}")
        self._unsaid.clear()

    def _summary(self, seconds: float) -> str:
        """The line a worker that `tells` leaves with: what it trained, of which searches, in how long."""
        failed = sum(o.status == "failed" for o in self._outcomes)
        return (f"towerlab: worker {self.name}: leaving after {len(self._outcomes)} task(s) ({failed} failed) of "
                f"search(es) {', '.join(map(str, sorted(self.searches)))}: "
                f"{math.fsum(o.seconds for o in self._outcomes):.1f} s training in {seconds:.1f} s")

    def _nothing_to_join(self) -> bool:
        """Whether every search this worker would join is finished (or refused it)."""
        if self.search_ids is not None:
            return all(self._finished(i) or i in self.refused for i in self.search_ids)
        return all(row.id in self.refused for row in self.store.unfinished_searches())

    def _finished(self, search_id: int) -> bool:
        row = self.store.search(search_id)
        return row is None or row.finished is not None

    def _follow(self) -> None:
        """Start a driver for each search to join, drop those whose search is finished; a driver's
        error stops the worker."""
        for search_id, driver in list(self.drivers.items()):
            if driver.error is not None:
                raise driver.error
            if driver.done:
                del self.drivers[search_id]
        now = time.monotonic()
        if now - self._looked < SEARCHES_EVERY and (self.drivers or self.search_ids is None):
            return
        self._looked = now
        if self.search_ids is not None:
            candidates = [i for i in self.search_ids if not self._finished(i)]
        else:
            candidates = [row.id for row in self.store.unfinished_searches()]
        for search_id in candidates:
            if search_id in self.drivers or search_id in self.refused:
                continue
            search = Search.open(self.store, search_id)
            why = self.joinable(search)
            if why is not None:
                self.refused[search_id] = why
                self._unsaid.append(search_id)
                continue
            self.searches[search_id] = search
            driver = Driver(self.store, search_id, self.priority, self._wake, self.log if self.speaks else None)
            self.drivers[search_id] = driver
            driver.start()

    def _work(self, task: Task) -> None:
        search = self.searches[task.search_id]
        if task.lost:
            self.log(f"towerlab: worker {self.name}: training a task of search {task.search_id} again, "
                     f"attempt {task.attempts} ({task.lost})")
        problem = unusable(task)
        if problem is not None:
            outcome, test_accuracy = Outcome.failed(problem, worker=self.name), None
        else:
            renewing = _Renewal(self.store, task, self.name, self.lease)
            try:
                outcome, test_accuracy = self.trainer_for(search)(task)
            except BaseException as exc:
                renewing.stop()
                if not isinstance(exc, StoreLost):  # out of reach past its retries: the lease lapses instead
                    self.store.put_back(task, self.name)
                raise
            renewing.stop()
        done, _ = self.store.complete(task, self.name, outcome, test_accuracy)
        if done:
            self.trained += 1
            self._outcomes.append(outcome)
            if self.tells:
                self.log(self._told(task, outcome, test_accuracy))
        else:
            self.log(f"towerlab: warning: worker {self.name} lost its lease on a task of search {task.search_id} "
                     f"(generation {task.candidate.generation + 1}, member {task.candidate.index}) while training "
                     "it: another worker took it over, and this result is dropped")
        driver = self.drivers.get(task.search_id)
        if driver is not None:
            driver.wake.set()

    def _told(self, task: Task, outcome: Outcome, test_accuracy: Optional[float]) -> str:
        """A task's line: which search and candidate, its result, its seconds."""
        c = task.candidate
        which = f"member {c.index}" if c.index >= 0 else f"a re-measure (replicate {c.replicate})"
        if outcome.status != "ok":
            result = f"failed ({outcome.reason})"
        elif task.kind == "test":
            result = f"test accuracy {test_accuracy:.4f}" if test_accuracy is not None else "tested"
        else:
            result = f"validation accuracy {outcome.fitness:.4f} after {outcome.epochs} epoch(s)"
        return (f"towerlab: worker {self.name}: search {task.search_id}, generation {c.generation + 1}, {which}: "
                f"{result} in {outcome.seconds:.1f} s")


class _Renewal(threading.Thread):
    """Renews a worker's lease on its task every third of the lease, until stopped."""

    def __init__(self, store: Store, task: Task, worker: str, lease: float) -> None:
        super().__init__(name="towerlab-lease", daemon=True)
        self.store, self.task, self.worker, self.lease = store, task, worker, lease
        self._stopped = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stopped.wait(self.lease / 3):
            try:
                if not self.store.renew(self.task, self.worker, self.lease):
                    return  # lost: `complete` will say so
            except Exception:  # noqa: BLE001 - the store is out of reach: the lease may lapse, a result is never doubled
                continue

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread():
            self.join(timeout=60)
