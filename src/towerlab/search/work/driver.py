"""A worker's driver threads (`towerlab.search.work.worker`): one per search the worker works on. One
driver at a time leads a search (`TaskQueue.lead`: a lease on the database's clock, renewed every third of
it while it leads) and plays it (`Search.play`) through a `QueueTrainer`, so that the candidates the store
cannot serve go on the queue (each once, whoever puts them there first) and the trainer returns when the
store holds a result for each, whoever trained it; the others stand by, reading nothing but who leads,
and one of them takes over where the lease lapses (its worker died) or is given up (its worker stopped).
So a search's proposals are made once, by its leader, whatever the number of workers, and a worker that
joins trains at once without replaying anything. A leader that takes over reads the generations the
store holds (never proposing them again) and goes on from there.

In an asynchronous search the trainer paces the proposals (`QueueTrainer.pace`): one for each idle
worker, and a spare few ready for the workers about to free up, as many as finish while a proposal is
made, at most one a worker (none where a worker waits less than SPARE_SHARE of a training for its next
candidate, so that each proposal is made with every outcome there is); and where fewer candidates wait
than the workers idle now and those that free up while the model proposes, the next one is proposed
quickly (`Sampler.propose_quickly`) if the model's would keep a worker waiting more than QUICK_SHARE of a
training (`Pace.quickly`), but not where a training is shorter than a proposal (nothing keeps the workers
busy there: the model proposes all). A training's length is the mean of the latest the search told
(`QueueTrainer.trained`), a proposal's a running mean of its own.
A pruned rung's sure promotions go on the queue as results come in. When the search's top is crowned, the
retrainings that give it its test accuracy go on the queue too (`towerlab.search.testing`), and the
leader, once they are done, writes the summary: the search is finished.

Every wait for the store, here and in the worker's own loop, is a `Poll`: woken at once by what this
process wrote, else looking again after POLL[0] seconds, twice as long each time nothing came, up to
POLL[1].
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Callable, Optional, Sequence

from towerlab.search.candidates import Candidate
from towerlab.search.history import TopGenome
from towerlab.search.store.rows import Evaluation
from towerlab.search.search import Search
from towerlab.search.store import Store
from towerlab.search.testing import retrainings, tested
from towerlab.search.trainers import Pace, Record

POLL = (0.05, 1.0)  # seconds between looks at the store for new results or tasks: first, at most
PACE_POLL = 0.25  # at most, between an asynchronous search's looks for results: a worker waits on it
STAND_BY = 1.0  # seconds between a standing-by driver's looks at who leads its search
SPARE_SHARE = 0.01  # a worker may wait this share of a training for its next candidate (see the docstring)
QUICK_SHARE = 0.05  # a worker with nothing to take gets a quick proposal where the next would take longer


class Stopping(Exception):
    """Raised in a driver thread when its worker stops: the search is left as the store holds it."""


class LostLead(Exception):
    """Raised in a driver thread whose lead lapsed (it could not renew it in time): another worker leads the
    search now, from what the store holds; this one stands by."""


class Poll:
    """A thread's wait for the store (see the module's docstring): `wait()` until `wake` is set or the
    interval passes (Stopping first where `stopping` is set), `found()` when a look found something."""

    def __init__(self, wake: threading.Event, stopping: Optional[threading.Event] = None,
                 lost: Optional[threading.Event] = None, most: float = POLL[1]) -> None:
        self.wake, self.stopping, self.lost, self.most, self.seconds = wake, stopping, lost, most, POLL[0]

    def wait(self) -> None:
        if self.stopping is not None and self.stopping.is_set():
            raise Stopping
        if self.lost is not None and self.lost.is_set():
            raise LostLead
        self.wake.wait(self.seconds)
        self.wake.clear()
        self.seconds = min(2 * self.seconds, self.most)

    def found(self) -> None:
        self.seconds = POLL[0]


class QueueTrainer:
    """A `Trainer` whose candidates are trained by whichever worker claims them from the store: it puts
    on the queue those that no result serves yet and returns once each has one."""

    def __init__(self, store: Store, search: Search, priority: Callable[[Candidate], float], driver: Driver) -> None:
        self.store, self.search, self.priority, self.driver = store, search, priority, driver
        self._poll = Poll(driver.wake, driver.stopping, driver.lost, PACE_POLL)
        self._proposal: Optional[float] = None  # seconds a proposal takes (a running mean)
        self._trainings: deque[float] = deque(maxlen=20)  # seconds of the latest trainings
        self._doing = ""

    def pace(self) -> Pace:
        """How many candidates the search should propose now (`Pace`): one for each idle worker of the store
        and a spare few (`spare`), less those waiting on the queue for a worker."""
        assert self.search.id is not None
        busy, idle, waiting = self.store.queue.pace(self.search.id, self.driver.lease)
        spare = self._spare(busy + idle)
        return Pace(max(0, idle + spare - waiting), busy, idle, waiting, spare, self.driver.worker,
                    idle + self._freeing(busy) > waiting and self._slow())

    def _freeing(self, busy: int) -> int:
        """How many of the `busy` workers finish their training while the model makes its next proposal and
        the leader notices (none while the lengths are not known): with fewer candidates waiting, a proposal
        of the model would keep them waiting for it. (On 32 workers of trainings of 3 s, the model's proposals
        took 0.4 s with 32 in flight: more than half the trainings started a third of a second late.)"""
        lag = self._lag()
        return 0 if lag is None else math.floor(busy * lag)

    def _slow(self) -> bool:
        """Whether a worker with nothing to take would wait long for the next proposal: more than QUICK_SHARE
        of a training (or a training's length is not known yet), where a training takes longer than a proposal.
        A training shorter than the model's proposal (a surrogate's query, a model fitted in milliseconds) keeps
        no worker busy whatever proposes, and a quick proposal would spend the search's budget on TPE's
        guesses to save seconds: there the model proposes every candidate, at its own pace. Not while the
        model's proposal has not been timed: only the model's proposals tell it (a quick one tells nothing, and
        the start-up's draws, milliseconds, are not counted), so the model proposes once to tell it."""
        training = self._training()
        if self._proposal is None:
            return False
        if training is None:
            return True
        return self._proposal <= training and self._proposal + PACE_POLL > QUICK_SHARE * training

    def _spare(self, workers: int) -> int:
        """The candidates to keep ready beyond the idle workers: as many as finish their training while the
        next proposal is made and noticed (their expected count and its spread, as for a Poisson count: at
        least one, at most one a worker: where trainings are shorter than a proposal, a surrogate's query,
        more would be proposed from ever fewer outcomes, and the workers wait for proposals all the same),
        or none where waiting for it costs a worker less than SPARE_SHARE of a training. One until both
        lengths are known."""
        lag = self._lag()
        if lag is None:
            return 1
        if lag < SPARE_SHARE:
            return 0
        finishing = workers * lag
        return max(1, min(workers, math.ceil(finishing + math.sqrt(finishing))))

    def _lag(self) -> Optional[float]:
        """The share of a training that the model's next proposal and the leader's look at the store take: how
        many trainings a busy worker finishes meanwhile (None: a length is not known yet)."""
        training = self._training()
        if self._proposal is None or training is None:
            return None
        return (self._proposal + PACE_POLL) / max(training, 1e-3)

    def _training(self) -> Optional[float]:
        """A training's length as the leader takes it: the mean of the latest told (None: none yet)."""
        return sum(self._trainings) / len(self._trainings) if self._trainings else None

    def wait(self) -> None:
        self._poll.wait()

    def proposed(self, seconds: float) -> None:
        self._proposal = seconds if self._proposal is None else 0.7 * self._proposal + 0.3 * seconds
        self._poll.found()

    def trained(self, seconds: Sequence[float]) -> None:
        self._trainings.extend(seconds)

    def doing(self, activity: str) -> None:
        if activity != self._doing:
            assert self.search.id is not None
            self.store.queue.tell_activity(self.search.id, self.driver.worker, activity)
            self._doing = activity

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
                if row.search_id == search_id and row.status == "ok":
                    self._poll.found()
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
    """Leads one search of a worker named `worker`, or stands by to (see the module's docstring), until it
    is finished: `done`; or records what stopped it: `error`. `lease`: the seconds a lead holds unrenewed."""

    def __init__(self, store: Store, search_id: int, priority: Callable[[Search], Callable[[Candidate], float]],
                 worker_wake: threading.Event, log: Optional[Callable[[str], None]] = None, worker: str = "",
                 lease: float = 30.0) -> None:
        super().__init__(name=f"towerlab-search-{search_id}", daemon=True)
        self.store, self.search_id, self.priority, self.worker_wake, self.log = (store, search_id, priority,
                                                                                 worker_wake, log)
        self.worker, self.lease = worker or f"driver-{id(self)}", lease
        self.wake, self.stopping, self.lost = threading.Event(), threading.Event(), threading.Event()
        self.done = False
        self.led = 0  # how many times it took the lead
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            while not self.store.records.finished(self.search_id):
                if self.store.queue.leader(self.search_id) not in (None, self.worker) or not self.store.queue.lead(
                        self.search_id, self.worker, self.lease):
                    self._stand_by()
                    continue
                self.led += 1
                self.lost.clear()
                renewal = _Renewal(self)
                try:
                    self._lead()
                except LostLead:
                    continue
                finally:
                    renewal.stop()
            self.done = True
        except Stopping:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the worker's main thread
            self.error = exc
        finally:
            try:
                self.store.queue.step_down(self.search_id, self.worker)
            except Exception:  # noqa: BLE001 - the store out of reach: the lease lapses instead
                pass
            self.worker_wake.set()

    def _lead(self) -> None:
        """Play the search from what the store holds until it is finished (LostLead where another took over)."""
        search = Search.open(self.store, self.search_id)
        trainer = QueueTrainer(self.store, search, self.priority(search), self)
        played = search.play(self.store, trainer, on_progress=self.log)
        self._test(search, played.top, trainer)
        # Written only under the settings it was played with: a resume that changed them
        # (more generations) has the search played again.
        search.finish(self.store, *played)

    def _stand_by(self) -> None:
        """Wait while another worker leads the search (or until this worker stops)."""
        if self.stopping.wait(STAND_BY):
            raise Stopping

    def poll(self) -> Poll:
        """A wait for the store on this driver's thread: woken by its worker, stopped with it, and left where
        its lead lapsed (LostLead)."""
        return Poll(self.wake, self.stopping, self.lost)

    def _test(self, search: Search, top: list[TopGenome], trainer: QueueTrainer) -> None:
        """Give the crowned networks their test accuracy (`towerlab.search.testing`): queue the retrainings
        that need one, and wait until each is done."""
        wanted = retrainings(self.store, search, top)
        if not wanted:
            return
        trainer.doing(f"testing the top: {len(wanted)} retraining(s)")
        trainer.put("test", wanted)
        poll = self.poll()
        while not tested(self.store, search, wanted):
            poll.wait()

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()


class _Renewal(threading.Thread):
    """Renews a driver's lead every third of its lease, until stopped; where it could not (another worker
    took the lead after it lapsed), tells the driver (`lost`), which stops leading at its next wait."""

    def __init__(self, driver: Driver) -> None:
        super().__init__(name=f"towerlab-lead-{driver.search_id}", daemon=True)
        self.driver = driver
        self._stopped = threading.Event()
        self.start()

    def run(self) -> None:
        driver = self.driver
        while not self._stopped.wait(driver.lease / 3):
            try:
                held = driver.store.queue.lead(driver.search_id, driver.worker, driver.lease)
            except Exception:  # noqa: BLE001 - the store out of reach: the lead may lapse, never doubled
                continue
            if not held and not driver.store.records.finished(driver.search_id):
                driver.lost.set()
                driver.wake.set()
                return

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread():
            self.join(timeout=60)
