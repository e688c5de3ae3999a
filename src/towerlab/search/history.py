"""What a search's history is made of: members, generations, their statistics, the crowned top and
the result (and a play of the search: `Played`), and the one order every part of the search ranks
networks by.

Counting (per generation; `SearchResult` sums them)
---------------------------------------------------
- evaluated: members whose evaluation this search made for this very generation and position
  (the first occurrence of each genome not served from the store), including evaluations made
  before an interruption and kept by the resume: a resumed search counts what an uninterrupted
  one counts. These are the distinct networks `--max-evaluations` counts.
- cached: every other member: genomes evaluated by an earlier generation of this search, by
  another search sharing the store, or repeated within the generation. evaluated + cached = size.
- failed: the evaluated members whose evaluation failed (so a failure is counted once, where it
  was trained; the same failed genome served again later is cached).
- best / mean / worst: over the members (duplicates included) whose evaluation succeeded, each at
  the highest rung it reached; None when none did. train_seconds: the trainers' seconds summed
  over every training this generation made (every rung of a pruned search; not re-measures).
  seconds: wall-clock seconds of the generation in the process that completed it; never part of
  equality, since it is never reproducible.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from towerlab.search.space import canonical


def mean(values: list[float]) -> float:
    """The mean of finite `values`, whatever their size: math.fsum's, bit for bit, where their sum is a float;
    the sum of each over their count where it is not (1e308 twice: fsum overflows)."""
    try:
        return math.fsum(values) / len(values)
    except OverflowError:
        return math.fsum(v / len(values) for v in values)


def spread(values: list[float]) -> float:
    """The standard deviation of `values` (two or more), infinite where it is beyond a float's range."""
    try:
        return statistics.stdev(values)
    except OverflowError:
        return math.inf


def rank_key(genome: dict, fitness: Optional[float], rung: int = 0) -> tuple:
    """Best first: a higher rung (a pruned search's longer training), then higher fitness;
    failures (None) after every success; ties by canonical genome."""
    if fitness is None:
        return (1, 0, 0.0, canonical(genome))
    return (0, -rung, -fitness, canonical(genome))


@dataclass(frozen=True)
class Member:
    """One member of a generation and the evaluation it was served from, at the highest rung it
    reached. `score` is what the search ranks it by: its fitness, or the mean over its re-measures
    once it was crowned; None when it failed."""

    index: int
    genome: dict
    genome_hash: str
    status: str
    fitness: Optional[float]
    val_loss: Optional[float]
    epochs: int
    seconds: float
    seed: int
    source: str  # "evaluated" or "cached" (see the module docstring)
    reason: Optional[str] = None
    rung: int = 0
    score: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict:
        """As the store records it: the score is not, since re-measures come after."""
        data = dataclasses.asdict(self)
        del data["score"]
        return data


@dataclass(frozen=True)
class GenerationStats:
    generation: int
    size: int
    evaluated: int
    cached: int
    failed: int
    best: Optional[float]
    mean: Optional[float]
    worst: Optional[float]
    train_seconds: float
    seconds: float = field(default=0.0, compare=False)
    replayed: bool = field(default=False, compare=False)  # taken from the store on resume

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        del data["replayed"]
        return data

    def record(self) -> dict:
        """As a record shows it (generations.jsonl, summary.json): generations numbered from 1, as the
        console, `search show` and the exports number them (the store counts from 0)."""
        return {**self.to_json(), "generation": self.generation + 1}


def statistics_of(generation: int, members: list[Member], train_seconds: float,
                  seconds: float) -> GenerationStats:
    fitnesses = [m.fitness for m in members if m.ok and m.fitness is not None]  # ok: its fitness is set
    evaluated = [m for m in members if m.source == "evaluated"]
    return GenerationStats(
        generation=generation,
        size=len(members),
        evaluated=len(evaluated),
        cached=len(members) - len(evaluated),
        failed=sum(not m.ok for m in evaluated),
        best=max(fitnesses) if fitnesses else None,
        mean=mean(fitnesses) if fitnesses else None,
        worst=min(fitnesses) if fitnesses else None,
        train_seconds=train_seconds,
        seconds=seconds,
    )


@dataclass(frozen=True)
class Generation:
    generation: int
    members: tuple[Member, ...]
    stats: GenerationStats


@dataclass(frozen=True)
class TopGenome:
    """A crowned network. `fitness` is what it ranks by: the mean of `fitnesses`, its validation
    accuracy under each of `seeds` (the evaluation's first, then the re-measures'), at `rung`,
    whose trainings are stored under `train_config_hash`."""

    genome: dict
    genome_hash: str
    fitness: float
    val_loss: Optional[float]
    epochs: int
    seed: int
    generation: int  # where it first appeared
    rung: int
    fitnesses: tuple[float, ...]
    seeds: tuple[int, ...]
    train_config_hash: str

    @property
    def spread(self) -> Optional[float]:
        """The standard deviation of its fitnesses (None with a single one)."""
        return spread(list(self.fitnesses)) if len(self.fitnesses) > 1 else None

    def to_json(self) -> dict:
        return {"genome_hash": self.genome_hash, "genome": self.genome, "fitness": self.fitness,
                "fitnesses": list(self.fitnesses), "seeds": list(self.seeds), "rung": self.rung,
                "train_config_hash": self.train_config_hash}


def repeated_remeasures(top: Sequence[TopGenome]) -> int:
    """How many re-measures `top` holds where every one gave its network's first fitness again, to the last bit:
    an objective that answers the same whatever the seed, which re-measuring tells nothing (0 where one
    gave another, or none was made)."""
    again = [(t.fitnesses[0], f) for t in top for f in t.fitnesses[1:]]
    return len(again) if all(first == f for first, f in again) else 0


@dataclass(frozen=True)
class SearchResult:
    """The whole search. `evaluations`, `cache_hits` and `failures` sum the generations'
    evaluated, cached and failed counts; `trainings` and `train_seconds` count every training the
    search made (every rung, every re-measure)."""

    sampler: str
    history: tuple[Generation, ...]
    top: tuple[TopGenome, ...]
    evaluations: int
    cache_hits: int
    failures: int
    generations: int
    trainings: int
    train_seconds: float = field(compare=False)
    seconds: float = field(compare=False)
    search_id: int = field(compare=False)
    ended: str = field(default="", compare=False)  # which limit ended it (`Played`)


class Played(NamedTuple):
    """A search played (`Search.play`): its history, its crowned top, and what ended it: "generations",
    "max_evaluations", "budget_epochs", or "sampler" (it had nothing left to propose)."""

    history: list[Generation]
    top: list[TopGenome]
    ended: str
