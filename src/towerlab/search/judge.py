"""The pruner's judge: whether a pruned search's lower rungs rank its networks as its last rung does, learned
from the search's own history, so that a rung is pruned at only where it has been shown to rank, and a
search costs what an unpruned one does where none is.

Evidence, one pair per genome: its fitness at rung r's epochs and its fitness at the last rung. The
fitness at rung r's epochs is read first from the learning curve its last-rung training reported (free:
the point after that many epochs, its metric read as the search's goal reads it), else from the training
the search made of it at rung r. Only the search's own successful evaluations (replicate 0) of the
complete generations before count (`towerlab.search.rounds.Rounds.judged` says which), so that a replay, a resume and every worker judge
alike, whoever trained what.

The rule: rung r is used (its members trained there and the best 1/--prune-factor promoted, as successive
halving does) where at least MIN_PAIRS pairs show a Spearman rank correlation of at least MIN_CORRELATION,
and, once the better half of them (by their last rung) are MIN_PAIRS or more, where that half's do too;
otherwise it is skipped, and its members go on to the next rung used. A search's promotions choose among
candidates a model proposed where it found good ones: a rung that tells good networks from bad ones but
not the best from the good costs it the best (on LCBench, from 1 epoch, epoch 9's correlation with epoch 52
was 0.87 over every candidate of a pruned search, 0.57 over their better half, and 17% of the best tenth
were outside epoch 9's best third). The last rung is always trained. A
generation without evidence (the first) skips every rung below the last: an unpruned generation, whose
curves are the evidence for the next.

Where no curve reaches rung r (the last rung's trainings reported none, or none that long: an objective that
returns its score alone, or a fidelity that is no training's length, such as a share of the data), the pairs
can come only from trainings at the rung: rung r is probed, its members trained there and every one of them
going on, until MIN_PAIRS genomes were (the evidence then judges it as above). A probed genome costs the
rung's training more where its training starts again at the next rung, nothing where it continues.
No numpy, no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from towerlab.search.goal import Goal
from towerlab.search.store.rows import Evaluation

# A rung is pruned at only where this many pairs show it ranks. With 8 pairs, a correlation of 0.8 comes
# by chance, from rungs unrelated to the last, about once in a hundred (Spearman's one-sided 1 % point at
# n = 8 is 0.83); fewer pairs cannot tell a rung that ranks from one that does not.
MIN_PAIRS = 8
# ... and that correlation at least: the best third of 12 at a rung that ranks at 0.8 holds the last rung's
# best about 9 times in 10 (drawn from a bivariate normal of that rank correlation; at 0.5, 7 in 10; at
# LCBench's first epoch against its 52nd, 0.02, a third of the time: chance).
MIN_CORRELATION = 0.8


def spearman(pairs: Sequence[tuple[float, float]]) -> Optional[float]:
    """The rank correlation of the pairs (ties at their mean rank); None with fewer than two, or where
    either side is constant."""
    if len(pairs) < 2:
        return None
    xs, ys = _ranks([x for x, _ in pairs]), _ranks([y for _, y in pairs])
    mx, my = math.fsum(xs) / len(xs), math.fsum(ys) / len(ys)
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx, syy = math.fsum((x - mx) ** 2 for x in xs), math.fsum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in order[i:j + 1]:
            ranks[k] = (i + j) / 2
        i = j + 1
    return ranks


def curve_fitness(row: Evaluation, epochs: int, goal: Goal) -> Optional[float]:
    """The fitness `row`'s learning curve gives after `epochs` epochs of training (None: it gives none). A
    curve is numbered from 1 (the point after the first epoch is epoch 1: the training's last point is at
    the epochs it trained) or from 0 (its last point one below them); any other curve (steps, a
    training that reported fewer points) is not read."""
    points = {p["epoch"]: p.get(goal.metric) for p in row.curve or [] if isinstance(p, dict)
              and isinstance(p.get("epoch"), int)}
    if not points:
        return None
    offset = row.epochs - max(points)  # 0: numbered from 1, 1: from 0
    if offset not in (0, 1):
        return None
    value = points.get(epochs - offset)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return goal.fitness(float(value))


@dataclass(frozen=True)
class Verdict:
    """How the judge sees one rung below the last: its `rung` (0: the first) and `epochs`, the rank
    `correlation` of its pairs with the last rung (None: too few to tell) over `pairs` of them, and `better`,
    that of the better half of them (None: fewer than MIN_PAIRS there); `probed`, whether the generation trains
    it to gather pairs that no curve gives (every member going on; never a rung it uses)."""

    rung: int
    epochs: int
    correlation: Optional[float]
    pairs: int
    probed: bool = False
    better: Optional[float] = None

    @property
    def halves(self) -> bool:
        """Whether the better half of its pairs is judged too: MIN_PAIRS or more of them."""
        return self.pairs // 2 >= MIN_PAIRS

    @property
    def used(self) -> bool:
        return (self.pairs >= MIN_PAIRS and self.correlation is not None and self.correlation >= MIN_CORRELATION
                and (not self.halves or self.better is not None and self.better >= MIN_CORRELATION))

    def text(self) -> str:
        """"rung 1 (1 epoch): rank correlation 0.02 over 12 pairs, skipped" (rungs counted from 1)."""
        what = f"rung {self.rung + 1} ({self.epochs} epoch{'' if self.epochs == 1 else 's'}): "
        if self.probed:
            return what + (f"no learning curve reaches it, trained to see how it ranks ({self.pairs} of the "
                           f"{MIN_PAIRS} genomes it takes to judge), none pruned")
        if self.pairs < MIN_PAIRS:
            return what + f"{self.pairs} of the {MIN_PAIRS} genomes it takes to judge, skipped"
        if self.correlation is None:
            return what + f"no rank correlation over {self.pairs} pairs (all alike), skipped"
        better = ("" if not self.halves else f", {self.better:.2f} over their better half"
                  if self.better is not None else ", none over their better half (all alike)")
        return what + (f"rank correlation {self.correlation:.2f} over {self.pairs} pairs{better}, "
                       f"{'pruning' if self.used else 'skipped'}")

    def to_json(self) -> dict:
        return {"rung": self.rung, "epochs": self.epochs, "correlation": self.correlation, "pairs": self.pairs,
                "better_half_correlation": self.better, "used": self.used, "probed": self.probed}


@dataclass(frozen=True)
class Judgement:
    """The verdicts on a ladder's rungs below the last (none for an unpruned search's one rung)."""

    verdicts: tuple[Verdict, ...]

    @property
    def used(self) -> list[int]:
        """The rungs a generation trains at, rising: those shown to rank, those probed, and the last."""
        return [v.rung for v in self.verdicts if v.used or v.probed] + [len(self.verdicts)]

    @property
    def probed(self) -> set[int]:
        """The rungs a generation trains at that promote every member (probed, not shown to rank)."""
        return {v.rung for v in self.verdicts if v.probed}

    @property
    def decided(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What it decides, its counts aside: the rungs trained at, and those of them probed."""
        return tuple(self.used), tuple(sorted(self.probed))

    def text(self) -> str:
        return "; ".join(v.text() for v in self.verdicts)

    def to_json(self) -> list[dict]:
        """As summary.json records it ("pruning"): each verdict's rung (from 0), epochs, correlation, pairs,
        better_half_correlation, used, probed."""
        return [v.to_json() for v in self.verdicts]


class Evidence:
    """What a search's history shows of its rungs (`epochs`: each rung's, the last's last; `hashes`: each
    rung's training-config hash), read in as rows come (`add`), judged at any point (`judge`)."""

    def __init__(self, epochs: Sequence[int], hashes: Sequence[str], goal: Goal) -> None:
        self.epochs, self.hashes, self.goal = list(epochs), list(hashes), goal
        self.final: dict[str, float] = {}  # genome hash -> fitness at the last rung
        self.curves: dict[str, list[Optional[float]]] = {}  # ... at each lower rung's epochs, by its curve
        self.trained: dict[tuple[str, int], float] = {}  # (genome hash, rung) -> the rung's training's fitness
        self.tried: list[set[str]] = [set() for _ in self.epochs[:-1]]  # each rung's genomes trained there, any end

    def add(self, rows: Iterable[Evaluation]) -> None:
        """The search's own evaluations (replicate 0; the successful ones are evidence), any order."""
        last = len(self.epochs) - 1
        for row in rows:
            if row.replicate != 0 or row.train_config_hash not in self.hashes:
                continue
            rung = self.hashes.index(row.train_config_hash)
            if rung < last:
                self.tried[rung].add(row.genome_hash)
            if row.status != "ok" or row.fitness is None:
                continue
            if rung == last:
                self.final[row.genome_hash] = row.fitness
                self.curves[row.genome_hash] = [curve_fitness(row, e, self.goal) for e in self.epochs[:-1]]
            else:
                self.trained[row.genome_hash, rung] = row.fitness

    def pairs(self, rung: int) -> list[tuple[float, float]]:
        """Each genome's (fitness at `rung`'s epochs, fitness at the last rung), by genome hash."""
        found = []
        for h in sorted(self.final):
            early = self.curves[h][rung]
            if early is None:
                early = self.trained.get((h, rung))
            if early is not None:
                found.append((early, self.final[h]))
        return found

    def judge(self) -> Judgement:
        verdicts = []
        for rung, epochs in enumerate(self.epochs[:-1]):
            pairs = self.pairs(rung)
            verdict = Verdict(rung, epochs, spearman(pairs), len(pairs))
            if verdict.halves:  # the better half, by the last rung
                better = sorted(pairs, key=lambda pair: pair[1], reverse=True)[:len(pairs) // 2]
                verdict = dataclasses.replace(verdict, better=spearman(better))
            verdicts.append(dataclasses.replace(verdict, probed=not verdict.used and self._probed(rung)))
        return Judgement(tuple(verdicts))

    def _probed(self, rung: int) -> bool:
        """Whether `rung` is probed: the last rung was trained, no curve of it reaches the rung, and fewer than
        MIN_PAIRS genomes were trained at the rung."""
        return bool(self.final) and all(self.curves[h][rung] is None for h in self.final) \
            and len(self.tried[rung]) < MIN_PAIRS
