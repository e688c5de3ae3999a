"""Playing a generation through the store (the cache), rung by rung as its pruner says
(`towerlab.search.pruners`, `towerlab.search.climb`), and re-measuring the networks about to be
crowned. No torch here; the counts are defined in `towerlab.search.history`.

Every unique genome of a generation trains for the first rung's epochs that the pruner's judge uses
(`used`: the rungs the search's own earlier generations showed to rank as the last does, and those it
probes, `towerlab.search.judge`; the last always); the pruner promotes some of them to the next rung used
(at a probed rung, all), and so on up to `--max-epochs`. An asynchronous generation's one member is ranked
against the trainings at its rung of the generations complete before the first one in flight when it was
proposed (`peers`, as its store records them), and climbs as its results come in (`waiting`). A genome
the store already holds at the next rung goes on at no cost, so it keeps the rung it reached in an
earlier generation.
A higher rung is the training with the same seed for more epochs, continued from the rung below where it
can be (`Candidate.starts`), to the numbers a training started again gives: a rung's result is the very
training an unpruned search with that many epochs makes, whichever worker runs it, so it is cached and
replayed like any other evaluation and no weights travel between workers or sit in the store. Each rung's
trainings are stored under their own training-config hash (`towerlab.search.pruners.Ladder`).

A generation's members are cut where --max-evaluations' budget of new trainings is reached, or the
first rungs that --budget-epochs leaves it (`begin`, `epochs_left`); a generation the store holds keeps
the members it was recorded with, and is never proposed again (`recorded`): the store's members are the
generation's, whoever proposed them and whatever another process would propose now.

Re-measuring the networks about to be crowned: `towerlab.search.crowning` (`Rounds.crowning`).
"""

from __future__ import annotations

import math
import time
from typing import Optional, Sequence

from towerlab.config import SearchConfig
from towerlab.search.candidates import Candidate
from towerlab.search.climb import Climb, Key, Recorder, key_of
from towerlab.search.crowning import Crowning
from towerlab.search.goal import Goal
from towerlab.search.history import Generation, GenerationStats, Member, statistics_of
from towerlab.search.judge import Evidence, Judgement
from towerlab.search.plan import crowning_epochs
from towerlab.search.pruners import Ladder
from towerlab.search.store.rows import Evaluation, GenerationRow
from towerlab.search.space import genome_hash
from towerlab.search.store import Store
from towerlab.search.trainers import Prefetching, Trainer


class Rounds:
    """A search's generations and re-measures, played against its store: search `search_id` of `store`,
    with `cfg`'s seed and re-measures, over `ladder` (its rungs), training through `train`; its rungs judged by
    `goal` (what it ranks by) on its generations up to `lag` before each (1 where the next generation begins
    while the one before still trains: only complete generations are judged on, whatever the timing), or,
    `asynchronous`, on those complete before the first one in flight when it was proposed (`_before`), whose
    rows are also the peers its one member is promoted against (`peers`)."""

    def __init__(self, store: Store, search_id: int, cfg: SearchConfig, ladder: Ladder, train: Trainer,
                 goal: Goal = Goal(), lag: int = 0, asynchronous: bool = False) -> None:
        self.records, self.where = store.records, store.path
        self.search_id, self.seed, self.train = search_id, cfg.seed, train
        self.ladder = ladder
        self.crowning = Crowning(cfg.remeasure, ladder, self._serve, train)
        self.budget_epochs = None if cfg.budget_epochs is None else cfg.budget_epochs - crowning_epochs(cfg)
        # What other searches' rows may serve each generation (and the re-measures after it): those up
        # to its watermark (None: any, as in generations recorded before watermarks), so that every
        # worker replaying the search, whenever it looks, serves it the same rows.
        self.watermarks: dict[int, Optional[int]] = {}
        self._begun: dict[int, tuple[GenerationRow, list[dict], list[str], float]] = {}
        # The generations the store holds, read once (a search of 100,000 generations is read in one query).
        self._stored = {row.generation: row for row in self.records.generations(search_id)}
        self._waiting: dict[int, list[tuple[str, str, int]]] = {}  # an asynchronous generation's unserved keys
        # an asynchronous pruned generation's climb, and the candidates it handed out that `_waiting` waits for
        self._climbs: dict[int, tuple[Climb, list[Candidate]]] = {}
        self.lag, self.asynchronous, self._befores = lag, asynchronous, dict[int, int]()
        self._judged = dict[int, Judgement]()  # by the generations judged on (`_before`)
        self._evidence, self._read = Evidence(ladder.epochs, ladder.hashes, goal), 0  # read generations < _read
        self._rows: list[Evaluation] = []  # those rows, where asynchronous and pruned: the peers

    # -- serving ----------------------------------------------------------------------------------

    def _serve(self, candidates: list[Candidate], what: str) -> dict[Key, Evaluation]:
        """Each candidate's row: from the store, or trained (in one batch) and recorded."""
        served: dict[Key, Evaluation] = {}
        pending = []
        for c in candidates:
            row = self.records.lookup(c.genome_hash, self.ladder.hash_of(c.max_epochs), self.search_id, c.replicate,
                                      self.watermarks.get(c.generation))
            if row is None:
                pending.append(c)
            else:
                served[key_of(c)] = row
        if pending:
            recorder = Recorder(self.records, self.search_id, self.ladder)
            recorder.expect(pending)
            self.train(list(pending), recorder)
            self._check(recorder, len(pending), what)
            served.update(recorder.rows)
        return served

    @staticmethod
    def _check(recorder: Recorder, handed: int, what: str) -> None:
        missing = recorder.missing()
        if missing:
            raise RuntimeError(f"the trainer returned without recording {len(missing)} of {handed} "
                               f"candidates of {what}, e.g. index {missing[0].index}")

    def _within(self, budget: Optional[int], hashes: list[str], generation: int) -> int:
        """How many of the proposed members fit in `budget` new trainings (all, without one)."""
        if budget is None:
            return len(hashes)
        first = self.ladder.hash(self.used(generation)[0])
        new: set[str] = set()
        for index, h in enumerate(hashes):
            if h not in new and self.records.lookup(h, first, self.search_id) is None:
                if len(new) == budget:
                    return index
                new.add(h)
        return len(hashes)

    def epochs_left(self, generation: int, in_flight: int = 0, following: bool = False,
                    flying: int = 0) -> Optional[int]:
        """How many new first rungs --budget-epochs leaves `generation` (None: no such budget): what is
        left of it, less what crowning the top takes (`crowning_epochs`), once the search's own trainings of
        the generations before were charged (each the epochs it was given, its whole rung whatever it
        trained: every rung and re-measure) and, where the generation before is still `in_flight`, its
        `in_flight` new first rungs, in first rungs (the last one may pass the budget), and the `flying` epochs of
        the asynchronous trainings still waited for (`waiting`). `following`: for the generation after
        `generation`, which is the one still in flight. A first rung is what each new member of its generation
        is sure to train (`sure`)."""
        if self.budget_epochs is None:
            return None
        first = self.sure(generation + 1 if following else generation)
        charged = self.sure(generation if following else max(0, generation - 1))
        given = self.records.epochs_given(self.search_id, generation, self.ladder.epochs[-1]) + in_flight * charged
        given += flying
        return max(0, -(-(self.budget_epochs - given) // first))

    def sure(self, generation: int) -> int:
        """The epochs each new member of `generation` trains whatever its results: the first rung it trains,
        and each one after a probed rung (every member goes on from one: `towerlab.search.judge`)."""
        judged = self.judged(generation)
        sure = 0
        for rung in judged.used:
            sure += self.ladder.epochs[rung]
            if rung not in judged.probed:
                return sure
        return sure

    # -- a generation -----------------------------------------------------------------------------

    def play(self, generation: int, genomes: Sequence[dict], budget: Optional[int] = None) -> Generation:
        """`begin` the generation, then `finish` it."""
        self.begin(generation, genomes, budget)
        return self.finish(generation)

    def recorded(self, generation: int) -> Optional[list[dict]]:
        """The members of a generation the store holds (None: it holds none yet), which `begin` takes as
        they are: a recorded generation is never proposed again."""
        stored = self._stored.get(generation)
        return None if stored is None else [dict(m["genome"]) for m in stored.members]

    def begin(self, generation: int, genomes: Sequence[dict], budget: Optional[int] = None,
              proposed: Optional[dict] = None) -> int:
        """Record a generation's members, cut where `budget` new trainings are reached, with what they were
        `proposed` from; or, where the store holds the generation (another process began it first), take the
        members it recorded. Returns the new trainings its first rung makes (the budget they take)."""
        started = time.perf_counter()
        stored = self._stored.pop(generation, None)
        if stored is None:
            hashes = [genome_hash(g) for g in genomes]
            n = self._within(budget, hashes, generation)
            stored = self.records.begin_generation(self.search_id, generation, [dict(g) for g in genomes[:n]],
                                                   hashes[:n], proposed)
        self.watermarks[generation] = stored.watermark
        if self.asynchronous:  # judged on the generations complete before the first then in flight
            self._befores[generation] = min([*(stored.proposed or {}).get("in_flight", self._begun), generation])
        self._begun[generation] = (stored, [dict(m["genome"]) for m in stored.members],
                                   [m["genome_hash"] for m in stored.members], started)
        if stored.complete:
            return int(stored.final_stats["evaluated"])
        first = self._first_rung(generation)
        if self.asynchronous and len(self.ladder.epochs) > 1:  # it climbs as its results come in (`waiting`)
            self._climb(generation, Climb(self, generation, self.members(generation), self._firsts(generation)))
        else:
            start = self.ladder.hash(self.used(generation)[0])
            self._waiting[generation] = [(c.genome_hash, start, c.replicate) for c, row in first if row is None]
        return sum(row is None or (row.search_id, row.generation) == (self.search_id, generation) for _, row in first)

    def _climb(self, generation: int, climb: Climb) -> None:
        """Hand out what `climb` can train now (deciding the rungs whose results are in), at once to a trainer
        that takes work ahead (`Prefetching`: a resumed climb's next rung too, whose queueing a process that
        stopped may never have done), and wait for it."""
        handed = climb.unlock()
        self._climbs[generation] = (climb, handed)
        self._waiting[generation] = [self._key(c) for c in handed]
        if isinstance(self.train, Prefetching):
            for h in sorted({key[1] for key in self._waiting[generation]}):
                self.train.prefetch([c for c in handed if self._key(c)[1] == h], h)

    def _key(self, c: Candidate) -> tuple[str, str, int]:
        return c.genome_hash, self.ladder.hash_of(c.max_epochs), c.replicate

    def members(self, generation: int) -> list[dict]:
        """A begun generation's members, as the store holds them."""
        return self._begun[generation][1]

    def waiting(self, generations: Sequence[int]) -> tuple[set[int], int]:
        """Of these begun generations (an asynchronous search's), those whose every training the store holds
        now (a complete one: at once), and the epochs of the trainings the others still wait for (one query
        for them all). A pruned one climbs on the way: each rung decided as its result comes in, and its
        member's next rung handed to the trainer (`Prefetching`) at once."""
        keys = [key for g in generations for key in self._waiting.get(g, ())]
        found = self.records.own_rows(self.search_id, keys) if keys else {}
        ready = set()
        for g in generations:
            if any(key not in found for key in self._waiting.get(g, ())):
                continue
            if g not in self._climbs:
                ready.add(g)
                continue
            climb, handed = self._climbs[g]
            for c in handed:
                climb.recorded(c, found[self._key(c)])
            self._climb(g, climb)
            if not self._climbs[g][1]:
                ready.add(g)
        flying = [key for g in generations for key in self._waiting.get(g, ()) if key not in found]
        return ready, sum(self.ladder.epochs[self.ladder.hashes.index(h)] for _, h, _ in flying)

    def _firsts(self, generation: int) -> dict[str, int]:
        """Each distinct genome of a begun generation, and its first index there."""
        first: dict[str, int] = {}
        for index, h in enumerate(self._begun[generation][2]):
            first.setdefault(h, index)
        return first

    def _first_rung(self, generation: int) -> list[tuple[Candidate, Optional[Evaluation]]]:
        """Each genome's first candidate of the generation's first rung, and the row the store serves it
        (None: to train)."""
        first = self._firsts(generation)
        climb = Climb(self, generation, self._begun[generation][1], first)
        start = climb.used[0]
        return [(climb.candidate(h, start), self.served(h, start, generation)) for h in first]

    def prefetch(self, generation: int) -> None:
        """Hand the generation's first rung to a trainer that can start work before it is asked to wait
        for it (`Prefetching`), while the generation before still trains (a climbing one's went at once)."""
        stored = self._begun[generation][0]
        if isinstance(self.train, Prefetching) and not stored.complete and generation not in self._climbs:
            self.train.prefetch([c for c, row in self._first_rung(generation) if row is None],
                                self.ladder.hash(self.used(generation)[0]))

    def finish(self, generation: int) -> Generation:
        """Play a begun generation through the store: a complete one is returned as recorded; in an
        incomplete one, evaluations already recorded by this search are served from the store and
        only the rest are trained."""
        stored, genomes, hashes, started = self._begun.pop(generation)
        self._waiting.pop(generation, None)
        self._climbs.pop(generation, None)
        if stored.complete:
            members = [self.crowning.scored(Member(**m)) for m in stored.final_results]
            return Generation(generation, tuple(members), GenerationStats(**stored.final_stats, replayed=True))

        first: dict[str, int] = {}
        for index, h in enumerate(hashes):
            first.setdefault(h, index)
        climb = Climb(self, generation, genomes, first)
        recorder = Recorder(self.records, self.search_id, self.ladder, climb.unlock, climb.recorded)
        pending = recorder.more()
        while pending:
            self.train(list(pending), recorder)
            self._check(recorder, len(pending), f"generation {generation}")
            pending = recorder.more()

        mine = (self.search_id, generation)
        train_seconds = [row.seconds for (h, _), row in climb.rows.items()
                         if (row.search_id, row.generation, row.index) == (*mine, first[h])]
        members = []
        for index, (genome, h) in enumerate(zip(genomes, hashes)):
            rung, row = climb.reached(h)
            base = climb.rows[h, climb.used[0]]
            source = "evaluated" if (base.search_id, base.generation, base.index) == (*mine, index) else "cached"
            members.append(self.crowning.scored(Member(index, dict(genome), h, row.status, row.fitness, row.val_loss,
                                               row.epochs, row.seconds, row.seed, source, row.reason, rung)))
        stats = statistics_of(generation, members, math.fsum(train_seconds), time.perf_counter() - started)
        self.records.complete_generation(self.search_id, generation, [m.to_json() for m in members], stats.to_json())
        return Generation(generation, tuple(members), stats)

    def judged(self, generation: int) -> Judgement:
        """How the pruner's judge sees the rungs in `generation`: on the search's own evaluations of the
        generations before it (`_before`: complete when it begins, whatever the timing), read once."""
        before = self._before(generation)
        if before not in self._judged:
            self._read_to(before)
            self._judged[before] = self._evidence.judge()
        return self._judged[before]

    def _before(self, generation: int) -> int:
        """The generations `generation` is judged on are those before this one: `lag` before it, or where
        asynchronous, the first in flight when it was proposed (as recorded; not begun yet, those in flight now)."""
        if not self.asynchronous:
            return max(0, generation - self.lag)
        if generation not in self._befores:
            return min([*self._begun, generation])
        return self._befores[generation]

    def _read_to(self, before: int) -> None:
        """Read the search's own evaluations of the generations before `before` into the judge's evidence
        (and, asynchronous, `_rows`)."""
        if before < self._read:  # asked out of order: read again from the start
            self._evidence, self._read = Evidence(self.ladder.epochs, self.ladder.hashes, self._evidence.goal), 0
            self._rows = []
        if len(self.ladder.epochs) > 1 and before > self._read:
            rows = self.records.own_history(self.search_id, self._read, before)
            self._evidence.add(rows)
            if self.asynchronous:
                self._rows.extend(rows)
            self._read = before

    def peers(self, generation: int, rung: int) -> Optional[list[Evaluation]]:
        """What the member of an asynchronous generation is ranked against at `rung` (None: in generations,
        its generation's other members alone): the successful trainings at that rung of the generations it
        is judged on (`_before`), complete when it was proposed, so that every process decides alike."""
        if not self.asynchronous:
            return None
        before = self._before(generation)
        if before > self._read:
            self._read_to(before)
        h = self.ladder.hash(rung)
        return [row for row in self._rows if row.generation < before and row.train_config_hash == h
                and row.status == "ok"]

    def used(self, generation: int) -> list[int]:
        """The rungs `generation` trains at, rising: those its judge showed to rank or probes, and the last."""
        return self.judged(generation).used

    def served(self, genome_hash: str, rung: int, generation: int) -> Optional[Evaluation]:
        """The row the store serves the genome at `rung` in `generation` (None: it must be trained)."""
        return self.records.lookup(genome_hash, self.ladder.hash(rung), self.search_id,
                                   watermark=self.watermarks.get(generation))

    def holds(self, genome_hash: str, rung: int, generation: int) -> bool:
        """Whether the store serves this genome a successful training at `rung` from before this
        generation (a GA's elite, or a genome proposed again, keeps the rung it reached instead of
        being pruned below it). This search's own row of this very generation does not count: it
        exists only when an interrupted start of the generation already trained the promotion, and
        counting it would change whom a resumed `--prune-places new` rung counts its places over."""
        row = self.served(genome_hash, rung, generation)
        return (row is not None and row.status == "ok"
                and (row.search_id, row.generation) != (self.search_id, generation))
