"""Playing a generation through the store (the cache), rung by rung as its pruner says
(`towerlab.search.pruners`), and re-measuring the networks about to be crowned. No torch here; the
counts are defined in `towerlab.search.history`.

Every unique genome of a generation trains for the first rung's epochs; the pruner promotes some of
them to the next rung, and so on up to `--max-epochs`. A genome the store already holds at the next
rung goes on at no cost, so it keeps the rung it reached in an earlier generation.
A higher rung trains the genome again from scratch, with the same seed, for more epochs. That
costs the lower rungs' epochs once more for the few promoted (about 1/prune_factor extra under
successive halving), and buys exactness: a rung's result is the very training an unpruned search
with that many epochs makes, whichever worker runs it, so it is cached and replayed like any other
evaluation and no weights travel between workers or sit in the store. Each rung's trainings are
stored under their own training-config hash (`rung_hash`); the last rung's is the search's own, so
its rows are shared with unpruned searches of the same settings. A rung's promotions are decided on
all of its results, so the history never depends on which worker finished first. Workers need not
wait for a rung's last trainings, though: a genome whose place is certain already (the pruner's
`sure`) is handed out for the next rung at once, so a trainer that asks for more work as results
come in (`record.more()`, see `towerlab.search.candidates`) keeps its workers busy across the rungs
of a generation, and the history is still the one a rung-by-rung search makes.

Re-measuring (`--remeasure K`): a network about to be crowned (the genetic algorithm's elite, the
final top) is trained again with K fresh seeds (`remeasure_seed`) at its rung and ranked by the
mean of its K + 1 fitnesses; if any of them failed, it ranks as failed. Crowning races: the best
n by score are re-measured, the order recomputed, and again, until the best n are all re-measured.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search.candidates import Candidate, Outcome, Trainer, candidate_seed, remeasure_seed
from towerlab.search.history import Generation, GenerationStats, Member, TopGenome, rank_key, statistics_of
from towerlab.search.pruners import make_pruner
from towerlab.search.space import genome_hash
from towerlab.search.store import Evaluation, GenerationRow, Store

_Key = tuple[str, int, int]  # genome hash, max_epochs, replicate


def rung_hash(train_config_hash: str, epochs: int, max_epochs: int) -> str:
    """The training-config hash a rung's trainings are stored under: the search's own for its last
    rung (`max_epochs`), a derived one for the shorter rungs."""
    if epochs == max_epochs:
        return train_config_hash
    return genome_hash({"train_config_hash": train_config_hash, "max_epochs": epochs})


def _key(candidate: Candidate) -> _Key:
    return (candidate.genome_hash, candidate.max_epochs, candidate.replicate)


class _Recorder:
    """The `record` callback given to the trainer: writes each outcome as it arrives. `more()`
    hands out what the outcomes so far have made trainable (`unlock`), for trainers that take
    work as it comes."""

    def __init__(self, store: Store, search_id: int, hashes: dict[int, str],
                 unlock: Optional[Callable[[], list[Candidate]]] = None,
                 recorded: Optional[Callable[[Candidate, Evaluation], None]] = None) -> None:
        self._store, self._search_id, self._hashes = store, search_id, hashes
        self._unlock, self._recorded = unlock, recorded
        self._pending: dict[_Key, Candidate] = {}
        self.rows: dict[_Key, Evaluation] = {}
        self._lock = threading.RLock()

    def expect(self, candidates: list[Candidate]) -> None:
        with self._lock:
            self._pending.update((_key(c), c) for c in candidates)

    def __call__(self, candidate: Candidate, outcome: Outcome) -> None:
        with self._lock:
            key = _key(candidate)
            if self._pending.get(key) != candidate:
                state = "recorded twice" if key in self.rows else "not pending"
                raise ValueError(f"record() got a candidate that is {state}: {candidate}")
            self._keep(key, candidate, self._store.record(candidate, outcome, self._hashes[candidate.max_epochs],
                                                         self._search_id))

    def served(self, candidate: Candidate, row: Evaluation) -> None:
        """The candidate's row, which is in the store already (a trainer whose workers write their
        results themselves: `towerlab.search.queue`)."""
        with self._lock:
            key = _key(candidate)
            if self._pending.get(key) != candidate:
                raise ValueError(f"served() got a candidate that is not pending: {candidate}")
            self._keep(key, candidate, row)

    def _keep(self, key: _Key, candidate: Candidate, row: Evaluation) -> None:
        self.rows[key] = row
        del self._pending[key]
        if self._recorded is not None:
            self._recorded(candidate, row)

    def train_config_hash(self, candidate: Candidate) -> str:
        """What the candidate's row is stored under (its rung's hash)."""
        return self._hashes[candidate.max_epochs]

    def more(self) -> list[Candidate]:
        """Candidates that became trainable since they were last asked for (each handed out once);
        the trainer trains them as well before it returns."""
        with self._lock:
            if self._unlock is None:
                return []
            new = self._unlock()
            self.expect(new)
            return new

    def missing(self) -> list[Candidate]:
        return list(self._pending.values())


class _Climb:
    """One generation's rungs as work that unlocks as results come in. A rung's promotions are
    decided when all of its results are in, exactly as rung by rung; before that, a genome whose
    place is certain (`_certain`) is handed out for the next rung already."""

    def __init__(self, rounds: Rounds, generation: int, genomes: Sequence[dict], first: dict[str, int]) -> None:
        self.rounds, self.generation, self.genomes, self.first = rounds, generation, genomes, first
        self.rung, self.alive = 0, list(first)
        self.rows: dict[tuple[str, int], Evaluation] = {}  # (genome hash, rung) -> its row
        self.handed: set[tuple[str, int]] = set()  # handed out for training, not recorded yet
        self._open: Optional[set[str]] = None  # the current rung's genomes without a row (None: not looked up)
        self._held: Optional[set[str]] = None  # the current rung's genomes that hold the next one

    def candidate(self, h: str, rung: int) -> Candidate:
        index = self.first[h]
        return Candidate(self.generation, index, dict(self.genomes[index]), h,
                         candidate_seed(self.rounds.seed, self.generation, index), self.rounds.ladder[rung])

    def recorded(self, candidate: Candidate, row: Evaluation) -> None:
        rung = self.rounds.ladder.index(candidate.max_epochs)
        self.handed.discard((candidate.genome_hash, rung))
        self.rows[candidate.genome_hash, rung] = row
        if rung == self.rung and self._open is not None:
            self._open.discard(candidate.genome_hash)

    def _needs(self, h: str, rung: int, new: list[Candidate]) -> None:
        """Serve (h, rung) from the store, or hand it out for training (once)."""
        if (h, rung) in self.rows or (h, rung) in self.handed:
            return
        rounds = self.rounds
        row = rounds.store.lookup(h, rounds.hashes[rounds.ladder[rung]], rounds.search_id,
                                  watermark=rounds.watermarks.get(self.generation))
        if row is not None:
            self.rows[h, rung] = row
        else:
            self.handed.add((h, rung))
            new.append(self.candidate(h, rung))

    def unlock(self) -> list[Candidate]:
        """What can be trained now and was not handed out before; the rungs whose results are all
        in are decided on the way."""
        new: list[Candidate] = []
        last = len(self.rounds.ladder) - 1
        while True:
            if self._open is None:  # the rung's first look: serve or hand out each of its members
                for h in self.alive:
                    self._needs(h, self.rung, new)
                self._open = {h for h in self.alive if (h, self.rung) not in self.rows}
            if self._open:
                if self.rung < last:
                    for h in self._certain():
                        self._needs(h, self.rung + 1, new)
                return new
            if self.rung == last:
                return new
            self._promote()

    def _ranked(self, hashes: list[str]) -> list[str]:
        return sorted(hashes, key=lambda h: rank_key(self.genomes[self.first[h]], self.rows[h, self.rung].fitness))

    def _holding(self) -> set[str]:
        if self._held is None:
            above = self.rounds.hashes[self.rounds.ladder[self.rung + 1]]
            self._held = {h for h in self.alive if self.rounds.holds(h, above, self.generation)}
        return self._held

    def _certain(self) -> list[str]:
        """The genomes of the current rung that will be promoted whatever the trainings still
        running give, and that must train for it (not held)."""
        done = [h for h in self.alive if h not in self._open]
        ok = self._ranked([h for h in done if self.rows[h, self.rung].status == "ok"])
        return self.rounds.pruner.sure(ok, len(done), self._open, self._holding())

    def _promote(self) -> None:
        """Decide the current rung on all its results and move to the next."""
        ok = self._ranked([h for h in self.alive if self.rows[h, self.rung].status == "ok"])
        promoted = self.rounds.pruner.promoted(ok, self._holding())
        early = {h for (h, rung) in (*self.rows, *self.handed) if rung == self.rung + 1}
        if not early <= promoted:
            raise RuntimeError(f"generation {self.generation}: genomes handed out early for rung {self.rung + 1} "
                               f"were not promoted: {sorted(early - promoted)}")
        self.alive = [h for h in ok if h in promoted]
        self.rung, self._open, self._held = self.rung + 1, None, None

    def reached(self, h: str) -> tuple[int, Evaluation]:
        """The highest rung the genome reached, and its row there."""
        rung = max(r for r in range(len(self.rounds.ladder)) if (h, r) in self.rows)
        return rung, self.rows[h, rung]


@dataclass(frozen=True)
class _Measurement:
    fitnesses: tuple[Optional[float], ...]  # the evaluation's, then each re-measure's (None: failed)
    seeds: tuple[int, ...]

    @property
    def score(self) -> Optional[float]:
        if any(f is None for f in self.fitnesses):
            return None
        return math.fsum(self.fitnesses) / len(self.fitnesses)


class Rounds:
    """A search's generations and re-measures, played against its store."""

    def __init__(self, store: Store, search_id: int, cfg: SearchConfig, train_config_hash: str,
                 train: Trainer) -> None:
        self.store, self.search_id, self.seed, self.train = store, search_id, cfg.seed, train
        self.pruner = make_pruner(cfg)
        self.ladder = self.pruner.rungs
        self.hashes = {epochs: rung_hash(train_config_hash, epochs, cfg.max_epochs) for epochs in self.ladder}
        self.remeasure = cfg.remeasure
        # What other searches' rows may serve each generation (and the re-measures after it): those up
        # to its watermark (None: any, as in generations recorded before watermarks), so that every
        # worker replaying the search, whenever it looks, serves it the same rows.
        self.watermarks: dict[int, Optional[int]] = {}
        self._begun: dict[int, tuple[GenerationRow, list[dict], list[str], float]] = {}
        self._measured: dict[tuple[str, int], _Measurement] = {}

    # -- serving ----------------------------------------------------------------------------------

    def _serve(self, candidates: list[Candidate], what: str) -> dict[_Key, Evaluation]:
        """Each candidate's row: from the store, or trained (in one batch) and recorded."""
        served: dict[_Key, Evaluation] = {}
        pending = []
        for c in candidates:
            row = self.store.lookup(c.genome_hash, self.hashes[c.max_epochs], self.search_id, c.replicate,
                                    self.watermarks.get(c.generation))
            if row is None:
                pending.append(c)
            else:
                served[_key(c)] = row
        if pending:
            recorder = _Recorder(self.store, self.search_id, self.hashes)
            recorder.expect(pending)
            self.train(list(pending), recorder)
            self._check(recorder, len(pending), what)
            served.update(recorder.rows)
        return served

    @staticmethod
    def _check(recorder: _Recorder, handed: int, what: str) -> None:
        missing = recorder.missing()
        if missing:
            raise RuntimeError(f"the trainer returned without recording {len(missing)} of {handed} "
                               f"candidates of {what}, e.g. index {missing[0].index}")

    def _within(self, budget: Optional[int], hashes: list[str]) -> int:
        """How many of the proposed members fit in `budget` new trainings (all, without one)."""
        if budget is None:
            return len(hashes)
        first = self.hashes[self.ladder[0]]
        new: set[str] = set()
        for index, h in enumerate(hashes):
            if h not in new and self.store.lookup(h, first, self.search_id) is None:
                if len(new) == budget:
                    return index
                new.add(h)
        return len(hashes)

    # -- a generation -----------------------------------------------------------------------------

    def play(self, generation: int, genomes: Sequence[dict], budget: Optional[int] = None) -> Generation:
        """`begin` the generation, then `finish` it."""
        self.begin(generation, genomes, budget)
        return self.finish(generation)

    def begin(self, generation: int, genomes: Sequence[dict], budget: Optional[int] = None) -> int:
        """Record a generation's members, or check them against those the store recorded: a
        generation the store holds must begin with the same members (else the replay diverged:
        UserError) and keeps the members it was recorded with (a budget may have cut it). Without a
        stored one, the members are cut where `budget` new trainings are reached. Returns the new
        trainings its first rung makes (the budget they take)."""
        started = time.perf_counter()
        hashes = [genome_hash(g) for g in genomes]
        stored = self.store.generation(self.search_id, generation)
        if stored is None:
            n = self._within(budget, hashes)
            stored = self.store.begin_generation(self.search_id, generation, [dict(g) for g in genomes[:n]],
                                                 hashes[:n])
        self.watermarks[generation] = stored.watermark
        n = len(stored.members)
        if [m["genome_hash"] for m in stored.members] != hashes[:n]:
            raise UserError(f"store {self.store.path}: replaying search {self.search_id} from its seed gives other "
                            f"members for generation {generation} than it recorded (the search code or "
                            f"space changed since): start a new search instead of resuming")
        self._begun[generation] = (stored, [dict(g) for g in genomes[:n]], hashes[:n], started)
        if stored.complete:
            return int(stored.stats["evaluated"])
        return sum(row is None or (row.search_id, row.generation) == (self.search_id, generation)
                   for _, row in self._first_rung(generation))

    def _first_rung(self, generation: int) -> list[tuple[Candidate, Optional[Evaluation]]]:
        """Each genome's first candidate of the generation's first rung, and the row the store serves it
        (None: to train)."""
        _, genomes, hashes, _ = self._begun[generation]
        first: dict[str, int] = {}
        for index, h in enumerate(hashes):
            first.setdefault(h, index)
        climb = _Climb(self, generation, genomes, first)
        return [(climb.candidate(h, 0), self.store.lookup(h, self.hashes[self.ladder[0]], self.search_id,
                                                          watermark=self.watermarks.get(generation)))
                for h in first]

    def prefetch(self, generation: int) -> None:
        """Hand the generation's first rung to a trainer that can start work before it is asked to wait
        for it (`prefetch(candidates, train_config_hash)`), while the generation before still trains."""
        prefetch = getattr(self.train, "prefetch", None)
        stored = self._begun[generation][0]
        if prefetch is not None and not stored.complete:
            prefetch([c for c, row in self._first_rung(generation) if row is None], self.hashes[self.ladder[0]])

    def finish(self, generation: int) -> Generation:
        """Play a begun generation through the store: a complete one is returned as recorded; in an
        incomplete one, evaluations already recorded by this search are served from the store and
        only the rest are trained."""
        stored, genomes, hashes, started = self._begun.pop(generation)
        if stored.complete:
            members = [self._scored(Member(**m)) for m in stored.results]
            return Generation(generation, tuple(members), GenerationStats(**stored.stats, replayed=True))

        first: dict[str, int] = {}
        for index, h in enumerate(hashes):
            first.setdefault(h, index)
        climb = _Climb(self, generation, genomes, first)
        recorder = _Recorder(self.store, self.search_id, self.hashes, climb.unlock, climb.recorded)
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
            base = climb.rows[h, 0]
            source = "evaluated" if (base.search_id, base.generation, base.index) == (*mine, index) else "cached"
            members.append(self._scored(Member(index, dict(genome), h, row.status, row.fitness, row.val_loss,
                                               row.epochs, row.seconds, row.seed, source, row.reason, rung)))
        stats = statistics_of(generation, members, math.fsum(train_seconds), time.perf_counter() - started)
        self.store.complete_generation(self.search_id, generation, [m.to_json() for m in members],
                                       stats.to_json())
        return Generation(generation, tuple(members), stats)

    def holds(self, genome_hash: str, rung_config_hash: str, generation: int) -> bool:
        """Whether the store serves this genome a successful training at that rung from before this
        generation (a GA's elite, or a genome proposed again, keeps the rung it reached instead of
        being pruned below it). This search's own row of this very generation does not count: it
        exists only when an interrupted start of the generation already trained the promotion, and
        counting it would change whom a resumed `--prune-places new` rung counts its places over."""
        row = self.store.lookup(genome_hash, rung_config_hash, self.search_id, watermark=self.watermarks.get(generation))
        return (row is not None and row.status == "ok"
                and (row.search_id, row.generation) != (self.search_id, generation))

    # -- crowning ---------------------------------------------------------------------------------

    def _scored(self, member: Member) -> Member:
        measured = self._measured.get((member.genome_hash, member.rung))
        score = measured.score if measured is not None else member.fitness if member.ok else None
        return Member(**{**member.__dict__, "score": score})

    def crown(self, members: Sequence[Member], n: int, generation: int) -> None:
        """Re-measure until the best `n` of `members` (by score) are all re-measured."""
        if not self.remeasure:
            return
        unique: dict[str, Member] = {}
        for m in members:
            unique.setdefault(m.genome_hash, m)
        while True:
            scored = [self._scored(m) for m in unique.values()]
            best = sorted(scored, key=lambda m: rank_key(m.genome, m.score, m.rung))[:n]
            todo = [m for m in best if m.ok and (m.genome_hash, m.rung) not in self._measured]
            if not todo:
                return
            epochs = {m.genome_hash: self.ladder[m.rung] for m in todo}
            rows = self._serve([Candidate(generation, -1, m.genome, m.genome_hash,
                                          remeasure_seed(m.genome_hash, r), epochs[m.genome_hash], r)
                                for m in todo for r in range(1, self.remeasure + 1)],
                               f"the re-measures after generation {generation}")
            for m in todo:
                again = [rows[(m.genome_hash, epochs[m.genome_hash], r)] for r in range(1, self.remeasure + 1)]
                self._measured[m.genome_hash, m.rung] = _Measurement(
                    (m.fitness, *[r.fitness if r.status == "ok" else None for r in again]),
                    (m.seed, *[r.seed for r in again]))

    def crowned(self, generation: Generation, n: int) -> Generation:
        """The generation with its best `n` re-measured and every member's score brought up to date."""
        self.crown(generation.members, n, generation.generation)
        return Generation(generation.generation, tuple(self._scored(m) for m in generation.members),
                          generation.stats)

    def top(self, history: Sequence[Generation], n: int) -> list[TopGenome]:
        """The best `n` successful genomes of the history, each at the highest rung it reached,
        re-measured."""
        best: dict[str, Member] = {}
        first_seen: dict[str, int] = {}
        for gen in history:
            for m in gen.members:
                first_seen.setdefault(m.genome_hash, gen.generation)
                if m.genome_hash not in best or m.rung > best[m.genome_hash].rung:
                    best[m.genome_hash] = m
        if history:
            self.crown(list(best.values()), n, history[-1].generation)
        ranked = sorted((self._scored(m) for m in best.values()), key=lambda m: rank_key(m.genome, m.score, m.rung))
        top = []
        for m in ranked[:n]:
            if m.score is None:
                break
            measured = self._measured.get((m.genome_hash, m.rung), _Measurement((m.fitness,), (m.seed,)))
            top.append(TopGenome(m.genome, m.genome_hash, m.score, m.val_loss, m.epochs, m.seed,
                                 first_seen[m.genome_hash], m.rung, measured.fitnesses, measured.seeds,
                                 self.hashes[self.ladder[m.rung]]))
        return top
