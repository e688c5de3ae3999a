"""A generation's trainings as they come in: `Climb`, its rungs as work that unlocks with each result
(the pruner's promotions: `towerlab.search.pruners`), and `Recorder`, the `Record` a trainer is handed
(`towerlab.search.trainers`), which writes each outcome as it arrives and hands out what it made
trainable. `towerlab.search.rounds` plays a generation through them.

A rung's promotions are decided on all of its results, so the history never depends on which worker
finished first. Workers need not wait for a rung's last trainings, though: a genome whose place is
certain already (the pruner's `sure`) is handed out for the next rung at once, so a trainer that asks for
more work as results come in (`record.more()`) keeps its workers busy across the rungs of a generation,
and the history is still the one a rung-by-rung search makes.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Protocol, Sequence

from towerlab.search.candidates import Candidate, Outcome, candidate_seed
from towerlab.search.history import rank_key
from towerlab.search.judge import Judgement
from towerlab.search.pruners import Ladder
from towerlab.search.store.records import Records
from towerlab.search.store.rows import Evaluation

Key = tuple[str, Optional[int], int]  # genome hash, max_epochs, replicate


def key_of(candidate: Candidate) -> Key:
    return (candidate.genome_hash, candidate.max_epochs, candidate.replicate)


class Recorder:
    """The `record` callback given to the trainer: writes each outcome as it arrives. `more()`
    hands out what the outcomes so far have made trainable (`unlock`), for trainers that take
    work as it comes."""

    def __init__(self, records: Records, search_id: int, ladder: Ladder,
                 unlock: Optional[Callable[[], list[Candidate]]] = None,
                 recorded: Optional[Callable[[Candidate, Evaluation], None]] = None) -> None:
        self._records, self._search_id, self._ladder = records, search_id, ladder
        self._unlock, self._recorded = unlock, recorded
        self._pending: dict[Key, Candidate] = {}
        self.rows: dict[Key, Evaluation] = {}
        self._lock = threading.RLock()

    def expect(self, candidates: list[Candidate]) -> None:
        with self._lock:
            self._pending.update((key_of(c), c) for c in candidates)

    def __call__(self, candidate: Candidate, outcome: Outcome) -> None:
        with self._lock:
            key = key_of(candidate)
            if self._pending.get(key) != candidate:
                state = "recorded twice" if key in self.rows else "not pending"
                raise ValueError(f"record() got a candidate that is {state}: {candidate}")
            self._keep(key, candidate, self._records.record(candidate, outcome, self.train_config_hash(candidate),
                                                            self._search_id))

    def served(self, candidate: Candidate, row: Evaluation) -> None:
        """The candidate's row, which is in the store already (a trainer whose workers write their
        results themselves: `towerlab.search.work.worker`)."""
        with self._lock:
            key = key_of(candidate)
            if self._pending.get(key) != candidate:
                raise ValueError(f"served() got a candidate that is not pending: {candidate}")
            self._keep(key, candidate, row)

    def _keep(self, key: Key, candidate: Candidate, row: Evaluation) -> None:
        self.rows[key] = row
        del self._pending[key]
        if self._recorded is not None:
            self._recorded(candidate, row)

    def train_config_hash(self, candidate: Candidate) -> str:
        """What the candidate's row is stored under (its rung's hash)."""
        return self._ladder.hash_of(candidate.max_epochs)

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


class Played(Protocol):
    """What a climb asks of the search it climbs for (`towerlab.search.rounds.Rounds`)."""

    seed: int
    ladder: Ladder
    search_id: int

    def served(self, genome_hash: str, rung: int, generation: int) -> Optional[Evaluation]:
        """The row the store serves the genome at `rung` in `generation` (None: to train)."""

    def holds(self, genome_hash: str, rung: int, generation: int) -> bool:
        """Whether the genome holds `rung` from before `generation`, at no cost."""

    def judged(self, generation: int) -> Judgement:
        """How the pruner's judge sees the rungs in `generation`: the rungs it trains at (`used`: the last
        always) and those of them that promote every member (`probed`)."""

    def peers(self, generation: int, rung: int) -> Optional[list[Evaluation]]:
        """The trainings at `rung` of other generations that `generation`'s members are ranked against there
        (None: none, its own members alone)."""


class Climb:
    """One generation's rungs as work that unlocks as results come in. A rung's promotions are
    decided when all of its results are in, exactly as rung by rung; before that, a genome whose
    place is certain (`_certain`) is handed out for the next rung already. `first`: each distinct
    genome's first index in the generation. It climbs the rungs its judge uses (`used`) alone: from
    one, the promoted go on to the next one used (from a probed one, every member that succeeded)."""

    def __init__(self, rounds: Played, generation: int, genomes: Sequence[dict], first: dict[str, int]) -> None:
        self.rounds, self.generation, self.genomes, self.first = rounds, generation, genomes, first
        judged = rounds.judged(generation)
        self.used, self.probed = judged.used, judged.probed
        self.rung, self.alive = self.used[0], list(first)
        self.rows: dict[tuple[str, int], Evaluation] = {}  # (genome hash, rung) -> its row
        self.handed: set[tuple[str, int]] = set()  # handed out for training, not recorded yet
        self._open: Optional[set[str]] = None  # the current rung's genomes without a row (None: not looked up)
        self._held: Optional[set[str]] = None  # the current rung's genomes that hold the next one

    def candidate(self, h: str, rung: int) -> Candidate:
        index = self.first[h]
        return Candidate(self.generation, index, dict(self.genomes[index]), h,
                         candidate_seed(self.rounds.seed, self.generation, index), self.rounds.ladder.epochs[rung],
                         starts=self._starts(h, rung))

    def _starts(self, h: str, rung: int) -> int:
        """The epochs a training of `h` at `rung` continues from: its row at the rung used below, where this
        very generation trained it (the same seed: a held or cached row's training was another), else 0."""
        below = [r for r in self.used if r < rung]
        row = self.rows.get((h, below[-1])) if below else None
        if row is None or row.status != "ok" or \
                (row.search_id, row.generation, row.index) != (self.rounds.search_id, self.generation, self.first[h]):
            return 0
        return self.rounds.ladder.epochs[below[-1]]

    def recorded(self, candidate: Candidate, row: Evaluation) -> None:
        rung = self.rounds.ladder.rung(candidate.max_epochs)
        self.handed.discard((candidate.genome_hash, rung))
        self.rows[candidate.genome_hash, rung] = row
        if rung == self.rung and self._open is not None:
            self._open.discard(candidate.genome_hash)

    def _needs(self, h: str, rung: int, new: list[Candidate]) -> None:
        """Serve (h, rung) from the store, or hand it out for training (once)."""
        if (h, rung) in self.rows or (h, rung) in self.handed:
            return
        row = self.rounds.served(h, rung, self.generation)
        if row is not None:
            self.rows[h, rung] = row
        else:
            self.handed.add((h, rung))
            new.append(self.candidate(h, rung))

    def unlock(self) -> list[Candidate]:
        """What can be trained now and was not handed out before; the rungs whose results are all
        in are decided on the way."""
        new: list[Candidate] = []
        last = len(self.rounds.ladder.epochs) - 1
        while True:
            if self._open is None:  # the rung's first look: serve or hand out each of its members
                for h in self.alive:
                    self._needs(h, self.rung, new)
                self._open = {h for h in self.alive if (h, self.rung) not in self.rows}
            if self._open:
                if self.rung < last:
                    for h in self._certain(self._open):
                        self._needs(h, self._next, new)
                return new
            if self.rung == last:
                return new
            self._promote()

    @property
    def _next(self) -> int:
        """The rung used after the current one (not the last)."""
        return self.used[self.used.index(self.rung) + 1]

    def _ranked(self, hashes: list[str]) -> list[str]:
        return sorted(hashes, key=lambda h: rank_key(self.genomes[self.first[h]], self.rows[h, self.rung].fitness))

    def _holding(self) -> set[str]:
        if self._held is None:
            self._held = {h for h in self.alive if self.rounds.holds(h, self._next, self.generation)}
        return self._held

    def _certain(self, running: set[str]) -> list[str]:
        """The genomes of the current rung that will be promoted whatever the trainings still
        `running` give, and that must train for it (not held)."""
        done = [h for h in self.alive if h not in running]
        ok = self._ranked([h for h in done if self.rows[h, self.rung].status == "ok"])
        if self.rung in self.probed:  # every member goes on
            return [h for h in ok if h not in self._holding()]
        return self.rounds.ladder.pruner.sure(ok, len(done), running, self._holding())

    def _promote(self) -> None:
        """Decide the current rung on all its results and move to the next: among its members, or where the
        generation has peers (an asynchronous one), among them and its members, who alone go on."""
        ok = self._ranked([h for h in self.alive if self.rows[h, self.rung].status == "ok"])
        peers = self.rounds.peers(self.generation, self.rung)
        if self.rung in self.probed:
            promoted = set(ok)
        elif peers is None:
            promoted = self.rounds.ladder.pruner.promoted(ok, self._holding())
        else:
            keys = {**{h: rank_key(self.genomes[self.first[h]], self.rows[h, self.rung].fitness) for h in ok},
                    **{f"peer {row.id}": rank_key(row.genome, row.fitness) for row in peers}}
            ranked = sorted(keys, key=keys.__getitem__)
            promoted = self.rounds.ladder.pruner.promoted(ranked, self._holding()) & set(ok)
        following = self._next
        early = {h for (h, rung) in (*self.rows, *self.handed) if rung == following}
        if not early <= promoted:
            raise RuntimeError(f"generation {self.generation}: genomes handed out early for rung {following} "
                               f"were not promoted: {sorted(early - promoted)}")
        self.alive = [h for h in ok if h in promoted]
        self.rung, self._open, self._held = following, None, None

    def reached(self, h: str) -> tuple[int, Evaluation]:
        """The highest rung the genome reached, and its row there."""
        rung = max(r for r in self.used if (h, r) in self.rows)
        return rung, self.rows[h, rung]
