"""Crowning a search's best networks (`Crowning`); `towerlab.search.rounds` plays the generations and serves
crowning's trainings from the store, or has them trained.

Re-measuring (`--remeasure K`): a network about to be crowned (the genetic algorithm's elite, the
final top) is trained again with K fresh seeds (`remeasure_seed`) at its rung and ranked by the
mean of its K + 1 fitnesses; if any of them failed, it ranks as failed. Crowning races: the best
n by score are re-measured, the order recomputed, and again, until the best n are all re-measured.

An asynchronous search re-measures ahead (`crown_ahead`): once its budget is spent, the networks certain to
be crowned whatever its last trainings give are re-measured while those run, by the workers that free up; and a
worker that has nothing else to take re-measures the next of the best so far, which a training still running
may yet push out (its re-measures are then rows that crowning never reads: `search show` lists them, and
summary.json's cost counts them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from towerlab.search.candidates import Candidate, remeasure_seed
from towerlab.search.climb import Key
from towerlab.search.history import Generation, Member, TopGenome, mean, rank_key
from towerlab.search.pruners import Ladder
from towerlab.search.store.rows import Evaluation
from towerlab.search.trainers import Prefetching, Trainer


@dataclass(frozen=True)
class _Measurement:
    fitnesses: tuple[Optional[float], ...]  # the evaluation's, then each re-measure's (None: failed)
    seeds: tuple[int, ...]

    @property
    def score(self) -> Optional[float]:
        known = [f for f in self.fitnesses if f is not None]
        if len(known) < len(self.fitnesses):
            return None
        return mean(known)


class Crowning:
    """The re-measures of a search with `remeasure` (K) fresh seeds, over `ladder`: each served through `serve`
    (from the store, or trained through `train`, which may take them ahead: `Prefetching`)."""

    def __init__(self, remeasure: Optional[int], ladder: Ladder,
                 serve: Callable[[list[Candidate], str], dict[Key, Evaluation]], train: Trainer) -> None:
        self.remeasure, self.ladder, self.serve, self.train = remeasure, ladder, serve, train
        self._measured: dict[tuple[str, int], _Measurement] = {}
        self._ahead: set[tuple[str, int, int]] = set()  # (genome hash, rung, replicate) `crown_ahead` queued

    def scored(self, member: Member) -> Member:
        """The member with its score: the mean of its re-measures' fitnesses once crowned, else its own."""
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
            scored = [self.scored(m) for m in unique.values()]
            best = sorted(scored, key=lambda m: rank_key(m.genome, m.score, m.rung))[:n]
            todo = [m for m in best if m.ok and (m.genome_hash, m.rung) not in self._measured]
            if not todo:
                return
            epochs = {m.genome_hash: self.ladder.epochs[m.rung] for m in todo}
            rows = self.serve(self._remeasures(todo, generation), f"the re-measures after generation {generation}")
            for m in todo:
                again = [rows[(m.genome_hash, epochs[m.genome_hash], r)] for r in range(1, self.remeasure + 1)]
                self._measured[m.genome_hash, m.rung] = _Measurement(
                    (m.fitness, *[r.fitness if r.status == "ok" else None for r in again]),
                    (m.seed, *[r.seed for r in again]))

    def _remeasures(self, members: Sequence[Member], generation: int) -> list[Candidate]:
        """The re-measures that crowning `members` after `generation` trains: K fresh seeds each, at its rung."""
        return [Candidate(generation, -1, m.genome, m.genome_hash, remeasure_seed(m.genome_hash, r),
                          self.ladder.epochs[m.rung], r) for m in members for r in range(1, (self.remeasure or 0) + 1)]

    @staticmethod
    def _highest(history: Sequence[Generation]) -> tuple[dict[str, Member], dict[str, int]]:
        """Each genome of the history at the highest rung it reached, and the generation it was first seen in."""
        best: dict[str, Member] = {}
        first_seen: dict[str, int] = {}
        for gen in history:
            for m in gen.members:
                first_seen.setdefault(m.genome_hash, gen.generation)
                if m.genome_hash not in best or m.rung > best[m.genome_hash].rung:
                    best[m.genome_hash] = m
        return best, first_seen

    def crown_ahead(self, told: Sequence[Generation], n: int, in_flight: int, last: int, idle: int = 0) -> None:
        """Put on the queue now, for a trainer that takes work ahead (`Prefetching`), the re-measures that
        crowning the top after generation `last` (`top`) will train whatever the `in_flight` trainings still
        give: those of the best `n` told so far that no training in flight can push out of the best `n`; and,
        one for each of the `idle` workers that have nothing else to take, those of the next of the best `n`,
        best first, which a training in flight may still push out. An asynchronous search's idle workers train
        them while its last trainings run; crowning then finds their rows, which are the very ones it would
        have trained (the same seeds, generation and rung), so the history and its top are those of a search
        that waited. A network pushed out keeps its rows, which crowning never reads: trained by workers that
        would have waited, they cost the search no time."""
        if not self.remeasure or not isinstance(self.train, Prefetching) or (in_flight >= n and idle <= 0):
            return
        ranked = sorted((self.scored(m) for m in self._highest(told)[0].values()),
                        key=lambda m: rank_key(m.genome, m.score, m.rung))
        best = [m for m in ranked[:n] if m.ok and (m.genome_hash, m.rung) not in self._measured]
        sure = {m.genome_hash for m in ranked[:max(0, n - in_flight)]}
        ahead = []
        for m in best:
            for candidate in self._remeasures([m], last):
                key = (m.genome_hash, m.rung, candidate.replicate)
                if key not in self._ahead and (m.genome_hash in sure or idle > 0):  # each queued once
                    idle -= m.genome_hash not in sure
                    self._ahead.add(key)
                    ahead.append((m.rung, candidate))
        for rung in sorted({rung for rung, _ in ahead}):
            self.train.prefetch([c for r, c in ahead if r == rung], self.ladder.hash(rung))

    def crowned(self, generation: Generation, n: int) -> Generation:
        """The generation with its best `n` re-measured and every member's score brought up to date."""
        self.crown(generation.members, n, generation.generation)
        return Generation(generation.generation, tuple(self.scored(m) for m in generation.members),
                          generation.stats)

    def top(self, history: Sequence[Generation], n: int) -> list[TopGenome]:
        """The best `n` successful genomes of the history, each at the highest rung it reached,
        re-measured."""
        best, first_seen = self._highest(history)
        if history:
            self.crown(list(best.values()), n, history[-1].generation)
        ranked = sorted((self.scored(m) for m in best.values()), key=lambda m: rank_key(m.genome, m.score, m.rung))
        top = []
        for m in ranked[:n]:
            if m.score is None:
                break
            measured = self._measured.get((m.genome_hash, m.rung), _Measurement((m.fitness,), (m.seed,)))
            fitnesses = tuple(f for f in measured.fitnesses if f is not None)  # all of them: it has a score
            top.append(TopGenome(m.genome, m.genome_hash, m.score, m.val_loss, m.epochs, m.seed,
                                 first_seen[m.genome_hash], m.rung, fitnesses, measured.seeds, self.ladder.hash(m.rung)))
        return top
