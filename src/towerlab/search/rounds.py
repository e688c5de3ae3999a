"""Playing a generation through the store (the cache), with early pruning, and re-measuring the
networks about to be crowned. No torch here; the counts are defined in `towerlab.search.history`.

Pruning (successive halving, `--min-epochs`): every unique genome of a generation trains for the
first rung's epochs; the best 1/`prune_factor` of those that succeeded go on to the next rung, and
so on up to `--max-epochs`. A genome the store already holds at the next rung (the genetic
algorithm's elite, a genome proposed again) goes on as well, at no cost, so it keeps the rung it
reached in an earlier generation. `--prune-places all` counts a rung's places over every member
that succeeded at it, such held genomes included (they take places, and usually the first ones);
`new` counts them over, and gives them to, the members that do not hold the next rung yet.
A higher rung trains the genome again from scratch, with the same seed, for more epochs. That
costs the lower rungs' epochs once more for the few promoted (about 1/prune_factor extra), and buys
exactness: a rung's result is the very training an unpruned search with that many epochs makes,
whichever worker runs it, so it is cached and replayed like any other evaluation and no weights
travel between workers or sit in the store. Each rung's trainings are
stored under their own training-config hash (`rung_hash`); the last rung's is the search's own, so
its rows are shared with unpruned searches of the same settings. A rung's promotions are decided on
all of its results, so the history never depends on which worker finished first; the price is that
workers wait at the end of a rung for its last trainings (the costliest are handed out first).

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
from typing import Optional, Sequence

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search.evaluation import Candidate, Evaluate, Outcome, candidate_seed, remeasure_seed, rung_epochs
from towerlab.search.history import Generation, GenerationStats, Member, TopGenome, rank_key, statistics_of
from towerlab.search.space import genome_hash
from towerlab.search.store import Evaluation, Store

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
    """The `record` callback given to the evaluator: writes each outcome as it arrives."""

    def __init__(self, store: Store, search_id: int, hashes: dict[int, str], pending: list[Candidate]) -> None:
        self._store, self._search_id, self._hashes = store, search_id, hashes
        self._pending = {_key(c): c for c in pending}
        self.rows: dict[_Key, Evaluation] = {}
        self._lock = threading.Lock()

    def __call__(self, candidate: Candidate, outcome: Outcome) -> None:
        with self._lock:
            key = _key(candidate)
            if self._pending.get(key) != candidate:
                state = "recorded twice" if key in self.rows else "not pending"
                raise ValueError(f"record() got a candidate that is {state}: {candidate}")
            self.rows[key] = self._store.record(candidate, outcome, self._hashes[candidate.max_epochs],
                                                self._search_id)
            del self._pending[key]

    def missing(self) -> list[Candidate]:
        return list(self._pending.values())


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
                 evaluate: Evaluate) -> None:
        self.store, self.search_id, self.seed, self.evaluate = store, search_id, cfg.seed, evaluate
        self.ladder = rung_epochs(cfg.max_epochs, cfg.min_epochs, cfg.prune_factor)
        self.hashes = {epochs: rung_hash(train_config_hash, epochs, cfg.max_epochs) for epochs in self.ladder}
        self.prune_factor, self.prune_places, self.remeasure = cfg.prune_factor, cfg.prune_places, cfg.remeasure
        self._measured: dict[tuple[str, int], _Measurement] = {}

    # -- serving ----------------------------------------------------------------------------------

    def _serve(self, candidates: list[Candidate], what: str) -> dict[_Key, Evaluation]:
        """Each candidate's row: from the store, or trained (in one batch) and recorded."""
        served: dict[_Key, Evaluation] = {}
        pending = []
        for c in candidates:
            row = self.store.lookup(c.genome_hash, self.hashes[c.max_epochs], self.search_id, c.replicate)
            if row is None:
                pending.append(c)
            else:
                served[_key(c)] = row
        if pending:
            recorder = _Recorder(self.store, self.search_id, self.hashes, pending)
            self.evaluate(list(pending), recorder)
            missing = recorder.missing()
            if missing:
                raise RuntimeError(f"the evaluator returned without recording {len(missing)} of {len(pending)} "
                                   f"candidates of {what}, e.g. index {missing[0].index}")
            served.update(recorder.rows)
        return served

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
        """Evaluate one generation through the store, or replay it when the store already holds it.

        A generation the store holds must begin with the same members (else the replay diverged:
        UserError); it keeps the members it was recorded with (a budget may have cut it). A complete
        one is returned as recorded; in an incomplete one, evaluations already recorded by this
        search are served from the store and only the rest are trained. Without a stored one, the
        members are cut where `budget` new trainings are reached."""
        started = time.perf_counter()
        hashes = [genome_hash(g) for g in genomes]
        stored = self.store.generation(self.search_id, generation)
        if stored is None:
            n = self._within(budget, hashes)
            stored = self.store.begin_generation(self.search_id, generation, [dict(g) for g in genomes[:n]],
                                                 hashes[:n])
        n = len(stored.members)
        if [m["genome_hash"] for m in stored.members] != hashes[:n]:
            raise UserError(f"store {self.store.path}: replaying search {self.search_id} from its seed gives other "
                            f"members for generation {generation} than it recorded (the search code or "
                            f"space changed since): start a new search instead of resuming")
        genomes, hashes = genomes[:n], hashes[:n]
        if stored.complete:
            members = [self._scored(Member(**m)) for m in stored.results]
            return Generation(generation, tuple(members), GenerationStats(**stored.stats, replayed=True))

        first: dict[str, int] = {}
        for index, h in enumerate(hashes):
            first.setdefault(h, index)
        reached: dict[str, tuple[int, Evaluation]] = {}  # the highest rung and its row
        firsts: dict[str, Evaluation] = {}  # the first rung's row: whose evaluation the member is
        alive = list(first)
        mine, train_seconds = (self.search_id, generation), []
        for rung, epochs in enumerate(self.ladder):
            rows = self._serve([Candidate(generation, first[h], dict(genomes[first[h]]), h,
                                          candidate_seed(self.seed, generation, first[h]), epochs)
                                for h in alive], f"generation {generation}")
            for h in alive:
                row = rows[(h, epochs, 0)]
                reached[h] = (rung, row)
                if (row.search_id, row.generation, row.index) == (*mine, first[h]):
                    train_seconds.append(row.seconds)
                firsts.setdefault(h, row)
            if rung + 1 == len(self.ladder):
                break
            ok = [h for h in alive if reached[h][1].status == "ok"]
            ok.sort(key=lambda h: rank_key(genomes[first[h]], reached[h][1].fitness))
            above = self.hashes[self.ladder[rung + 1]]
            held = {h for h in ok if self._holds(h, above, generation)}  # they go on for free
            contenders = ok if self.prune_places == "all" else [h for h in ok if h not in held]
            promoted = held | set(contenders[:math.ceil(len(contenders) / self.prune_factor)])
            alive = [h for h in ok if h in promoted]

        members = []
        for index, (genome, h) in enumerate(zip(genomes, hashes)):
            rung, row = reached[h]
            base = firsts[h]
            source = "evaluated" if (base.search_id, base.generation, base.index) == (*mine, index) else "cached"
            members.append(self._scored(Member(index, dict(genome), h, row.status, row.fitness, row.val_loss,
                                               row.epochs, row.seconds, row.seed, source, row.reason, rung)))
        stats = statistics_of(generation, members, math.fsum(train_seconds), time.perf_counter() - started)
        self.store.complete_generation(self.search_id, generation, [m.to_json() for m in members],
                                       stats.to_json())
        return Generation(generation, tuple(members), stats)

    def _holds(self, genome_hash: str, rung_config_hash: str, generation: int) -> bool:
        """Whether the store serves this genome a successful training at that rung from before this
        generation (a GA's elite, or a genome proposed again, keeps the rung it reached instead of
        being pruned below it). This search's own row of this very generation does not count: it
        exists only when an interrupted start of the generation already trained the promotion, and
        counting it would change whom a resumed `--prune-places new` rung counts its places over."""
        row = self.store.lookup(genome_hash, rung_config_hash, self.search_id)
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
