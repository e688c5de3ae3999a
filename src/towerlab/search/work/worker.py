"""The store is the queue: every worker, on any machine, plays the search against its store and trains
the tasks it claims there. No process coordinates the others, and nothing a worker holds only in memory
is needed by anyone else.

A worker is one process with two kinds of thread:

- its main thread (`Worker`) claims a task (`TaskQueue.claim`: one transaction, a lease on the
  database's clock), trains it while a helper thread renews the lease, and writes the result and closes
  the task in one transaction (`TaskQueue.complete`), only while it still holds the lease (the queue's
  rules: `towerlab.search.store.queue`);
- one driver thread per search it works on (`towerlab.search.work.driver.Driver`) plays the search
  (`Search.play`) through a `QueueTrainer`: the candidates that the store cannot serve go on the queue,
  and the trainer returns when the store holds a result for each, whoever trained it. When the
  search's top is crowned, the retrainings that give it its test accuracy go on the queue too, and the
  first driver to see them done writes the summary: the search is finished.

Every driver of a search plays the same game: the sampler proposes from the seed and the stored
history in a fixed order, the first driver to record a generation's members records them (the others
check that theirs are the same), the cache serves a generation only rows older than it (its
watermark), so the history is the same whoever proposed, trained or died, and however many workers
joined. A worker that starts late claims open tasks at once while its driver catches up.

Faults: a worker that dies holding a task stops renewing its lease, as does one whose task is past its
objective's timeout (`lapses`); after `lease` seconds any worker claims the task again (a local launcher
that sees its worker die puts the task back at once). A worker that comes back after its lease lapsed
cannot write a result. A task whose workers were lost MAX_ATTEMPTS times (an out-of-memory kill that
recurs) is recorded as failed, with that reason, and the search goes on. No torch here: what trains a
task is the search's `Objective` (`objective_for`: `towerlab.search.work.objective`).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, TypeVar

from towerlab.checks import env_number
from towerlab.distributed.signals import alive
from towerlab.errors import UserError
from towerlab.report import printable
from towerlab.search.candidates import Candidate, Outcome
from towerlab.search.store.database import StoreLost
from towerlab.search.testing import test_from
from towerlab.search.work.driver import Driver, Poll
from towerlab.search.work.objective import Assignment, Objective, lapses
from towerlab.search.search import Search
from towerlab.search.space import Space, genome_hash
from towerlab.search.store import Store, Task
from towerlab.search.store.queue import MAX_LEASE

T = TypeVar("T")

LEASE_ENV = "TOWERLAB_LEASE_SECONDS"
DEFAULT_LEASE = 30.0  # seconds a claim holds without renewal; renewed every third of it
MIN_LEASE = 3.0
# Claims of one task by workers that were lost before it is recorded as failed: a killed worker's
# candidate is retried, one that kills every worker that trains it (out of memory) is not, forever.
MAX_ATTEMPTS = 3
SEARCHES_EVERY = 2.0  # seconds between looks for new searches to join


def lease_seconds() -> float:
    """Seconds a claimed task stays a worker's without renewal: $TOWERLAB_LEASE_SECONDS, else 30."""
    return env_number(LEASE_ENV, DEFAULT_LEASE, lambda seconds: MIN_LEASE <= seconds <= MAX_LEASE,
                      f"{LEASE_ENV}={{text}}: give a number of seconds from {MIN_LEASE:g} to {MAX_LEASE:g} (a worker "
                      "renews its lease every third of it)")


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
    for w in store.queue.workers():
        if w["host"] == space and w["left_at"] is None and not alive(int(w["pid"])):
            freed += store.queue.release(w["id"], "ended without a word (its process is gone)")
    return freed


def unusable(task: Task, space: Space) -> Optional[str]:
    """Why a task's row cannot be trained (an edited row: a genome not of its search's `space`, or not the one
    its hash names; no positive budget, a seed out of range), or None. Such a task fails, with that reason,
    before anything of it runs (any kind of training), as a network that cannot be built: the worker goes on."""
    outside = space.outside(task.candidate.genome)
    if outside is None and genome_hash(task.candidate.genome) != task.candidate.genome_hash:
        outside = "it is not the genome its hash names"
    if outside is not None:
        return (f"its task's row gives a genome that is not its search's ({printable(outside)}): the row was edited, "
                "or written by another program")
    budget, seed = task.candidate.max_epochs, task.candidate.seed
    if budget is not None and (type(budget) is not int or budget < 1):
        return (f"its task's row gives max_epochs = {budget!r}, not a number of epochs of at least 1 (the row "
                "was edited, or written by another program)")
    if type(seed) is not int or not 0 <= seed < 2**63:
        return (f"its task's row gives seed = {seed!r}, outside 0 to 2**63 - 1 (the row was edited, or written by "
                "another program)")
    return None


@dataclass(frozen=True)
class WorkerOptions:
    """How a `Worker` works, besides its store, name, device and objectives: `search_ids`, the searches to work
    on (None: every unfinished search of the store that admits it); `priority(search)`, a task's rank among its
    generation's (its cost); `lease`, seconds a claim holds (None: `lease_seconds()`); `wait`: stay for new work
    when there is none; `check_stop`, called between tasks, raises to stop; a worker that `speaks` says why a
    search refused it (and its drivers what a large generation is doing), one that `tells` prints a line per
    task it trained and one when it leaves, through `log` (None: stderr); `timed(call, seconds, started)` hears
    how long each of its own store calls took (claim, complete, put_back: a benchmark's breakdown of its time)."""

    search_ids: Optional[Sequence[int]] = None
    priority: Callable[[Search], Callable[[Candidate], float]] = lambda search: lambda c: 0.0
    lease: Optional[float] = None
    wait: bool = False
    speaks: bool = False
    tells: bool = False
    check_stop: Callable[[], None] = lambda: None
    log: Optional[Callable[[str], None]] = None
    timed: Optional[Callable[[str, float, float], None]] = None


class Worker:
    """One worker process's loop (see the module's docstring). `objective_for(search)` is what trains that search's
    tasks in this process (`towerlab.search.work.objective`), made once per search; a UserError from it says why
    this worker may not train the search, which it then leaves to others. The worker leaves when no search is left
    to work on (`options`), unless it waits, and between tasks whenever its `check_stop` raises; one that joined
    nothing because every search refused it leaves with a UserError giving each reason."""

    def __init__(self, store: Store, name: str, device: str, objective_for: Callable[[Search], Objective],
                 options: WorkerOptions = WorkerOptions()) -> None:
        self.store, self.name, self.device, self.objective_for = store, name, device, objective_for
        self.search_ids = None if options.search_ids is None else list(options.search_ids)
        self.priority = options.priority
        self.lease = lease_seconds() if options.lease is None else options.lease
        self.wait, self.speaks, self.tells, self.check_stop = options.wait, options.speaks, options.tells, \
            options.check_stop
        self.log = options.log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.timed = options.timed
        self.drivers: dict[int, Driver] = {}
        self.searches: dict[int, Search] = {}
        self.objectives: dict[int, Objective] = {}
        self.refused: dict[int, str] = {}
        self._unsaid: list[int] = []  # refusals not yet said
        self.trained = 0
        self._failed, self._seconds = 0, 0.0  # of the tasks trained: the leaving line's (no outcome is kept)
        self._wake = threading.Event()
        self._looked = -math.inf
        self._seen = time.monotonic()  # when the store last heard from this worker
        self.shown = printable(name)  # its name in lines (a host's name may hold a terminal's escape codes)

    def run(self) -> int:
        """Work until nothing is left; returns how many tasks this worker trained."""
        self.store.queue.join(self.name, pid_space() or socket.gethostname(), os.getpid(), self.device)
        started = time.monotonic()
        poll = Poll(self._wake)
        try:
            while True:
                self.check_stop()
                self._follow()
                task = self._timing("claim", lambda: self.store.queue.claim(self.name, list(self.drivers), self.lease,
                                                                            MAX_ATTEMPTS))
                if task is None and not self.drivers and not self.wait and self._nothing_to_join():
                    if self.refused and not self.searches:
                        raise UserError(f"worker {self.shown} joined no search of {printable(self.store.path)}: " + "; ".join(
                            f"search {i}: {why}" for i, why in self.refused.items()))
                    return self.trained
                self._say_refusals()
                if task is not None:
                    self._work(task)
                    self._seen = time.monotonic()
                    poll.found()
                    continue
                self._idle()
                poll.wait()
        finally:
            for driver in self.drivers.values():
                driver.stop()
            for driver in self.drivers.values():
                driver.join(timeout=5)  # one inside a long proposal holds nothing the store lacks
            self.store.queue.leave(self.name)
            if self.tells and self.searches:
                self.log(self._summary(time.monotonic() - started))

    def _idle(self) -> None:
        """Holding no task (waiting for work, or for a search's next generation): tell the store now and
        then that this worker is alive, so that `search show` does not call it silent (a claim says so too)."""
        if time.monotonic() - self._seen > self.lease / 3:
            self.store.queue.seen(self.name)
            self._seen = time.monotonic()

    def _timing(self, call: str, do: Callable[[], T]) -> T:
        """`do()`, one of this worker's own store calls, its seconds told to `timed`."""
        started = time.perf_counter()
        try:
            return do()
        finally:
            if self.timed is not None:
                self.timed(call, time.perf_counter() - started, started)

    def _say_refusals(self) -> None:
        for search_id in self._unsaid:
            if self.speaks:
                self.log(f"towerlab: worker {self.shown}: not joining search {search_id} of "
                         f"{printable(self.store.path)}: {self.refused[search_id]}")
        self._unsaid.clear()

    def _summary(self, seconds: float) -> str:
        """The line a worker that `tells` leaves with: what it trained, of which searches, in how long."""
        return (f"towerlab: worker {self.shown}: leaving after {self.trained} task(s) ({self._failed} failed) of "
                f"search(es) {', '.join(map(str, sorted(self.searches)))}: "
                f"{self._seconds:.1f} s training in {seconds:.1f} s")

    def _nothing_to_join(self) -> bool:
        """Whether every search this worker would join is finished (or refused it)."""
        if self.search_ids is not None:
            return all(self.store.records.finished(i) or i in self.refused for i in self.search_ids)
        return all(row.id in self.refused for row in self.store.records.unfinished_searches())

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
            candidates = [i for i in self.search_ids if not self.store.records.finished(i)]
        else:
            candidates = [row.id for row in self.store.records.unfinished_searches()]
        for search_id in candidates:
            if search_id in self.drivers or search_id in self.refused:
                continue
            search = Search.open(self.store, search_id)
            try:
                self.objectives[search_id] = self.objective_for(search)
                search.prepare()  # its sampler's imports, before its driver thread may import the same
            except UserError as exc:
                self.refused[search_id] = str(exc)
                self._unsaid.append(search_id)
                continue
            self.searches[search_id] = search
            self.drivers[search_id] = driver = Driver(self.store, search_id, self.priority, self._wake,
                                                      self.log if self.speaks else None, self.name, self.lease)
            driver.start()

    def _work(self, task: Task) -> None:
        search = self.searches[task.search_id]
        if task.lost:
            self.log(f"towerlab: worker {self.shown}: training a task of search {task.search_id} again, "
                     f"attempt {task.attempts} ({printable(task.lost)})")
        problem = unusable(task, search.space)
        if problem is not None:
            outcome = Outcome.failed(problem, worker=self.name)
        else:
            renewing = _Renewal(self.store, task, self.name, self.lease, lapses(self.objectives[task.search_id]))
            try:
                # Whether its network is scored on the test split is decided now, before it trains.
                assignment = Assignment(task.candidate, test_from(self.store, search, task.kind))
                outcome = self.objectives[task.search_id](assignment)
            except BaseException as exc:
                renewing.stop()
                if not isinstance(exc, StoreLost):  # out of reach past its retries: the lease lapses instead
                    self._timing("put_back", lambda: self.store.queue.put_back(task, self.name))
                raise
            renewing.stop()
        done, _ = self._timing("complete", lambda: self.store.queue.complete(task, self.name, outcome))
        if done:
            self.trained += 1
            self._failed += outcome.status == "failed"
            self._seconds += outcome.seconds
            if self.tells:
                self.log(self._told(task, outcome))
        else:
            self.log(f"towerlab: warning: worker {self.shown} lost its lease on a task of search {task.search_id} "
                     f"(generation {task.candidate.generation + 1}, member {task.candidate.index}) while training "
                     "it: another worker took it over, and this result is dropped")
        driver = self.drivers.get(task.search_id)
        if driver is not None:
            driver.wake.set()

    def _told(self, task: Task, outcome: Outcome) -> str:
        """A task's line: which search and candidate, its result, its seconds."""
        c = task.candidate
        which = f"member {c.index}" if c.index >= 0 else f"a re-measure (replicate {c.replicate})"
        if outcome.status != "ok":
            result = f"failed ({outcome.reason})"
        elif task.kind == "test":
            result = f"test accuracy {outcome.test_accuracy:.4f}" if outcome.test_accuracy is not None else "tested"
        else:
            search = self.searches[task.search_id]
            result = f"{printable(search.metric_label)} {search.reads(outcome.fitness)} after {outcome.epochs} epoch(s)"
        return (f"towerlab: worker {self.shown}: search {task.search_id}, generation {c.generation + 1}, {which}: "
                f"{result} in {outcome.seconds:.1f} s")


class _Renewal(threading.Thread):
    """Renews a worker's lease on its task every third of the lease, until stopped, or past `lapses` seconds (its
    objective's timeout and the grace to stop it; None: never): a training that will never end keeps no lease."""

    def __init__(self, store: Store, task: Task, worker: str, lease: float, lapses: Optional[float] = None) -> None:
        super().__init__(name="towerlab-lease", daemon=True)
        self.store, self.task, self.worker, self.lease = store, task, worker, lease
        self.until = math.inf if lapses is None else time.monotonic() + lapses
        self._stopped = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stopped.wait(self.lease / 3) and time.monotonic() < self.until:
            try:
                if not self.store.queue.renew(self.task, self.worker, self.lease):
                    return  # lost: `complete` will say so
            except Exception:  # noqa: BLE001 - the store is out of reach: the lease may lapse, a result is never doubled
                continue

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread():
            self.join(timeout=60)
