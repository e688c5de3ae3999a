"""What the genetic search and the grid share: playing one generation through the store (the
cache), the resume checks, the per-generation statistics and the summary. No torch here; the
evaluation protocol is in `towerlab.search.evaluation`.

Counting (per generation; `SearchResult` sums them)
---------------------------------------------------
- evaluated: members whose evaluation this search made for this very generation and position
  (the first occurrence of each genome not served from the store), including evaluations made
  before an interruption and kept by the resume: a resumed search counts what an uninterrupted
  one counts.
- cached: every other member: genomes evaluated by an earlier generation of this search, by
  another search sharing the store, or repeated within the generation. evaluated + cached = size.
- failed: the evaluated members whose evaluation failed (so a failure is counted once, where it
  was trained; the same failed genome served again later is cached).
- best / mean / worst: over the members (duplicates included) whose evaluation succeeded; None
  when none did. train_seconds: the evaluators' seconds summed over the evaluated members.
  seconds: wall-clock seconds of the generation in the process that completed it; never part of
  equality, since it is never reproducible.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

from towerlab.config import SearchConfig, to_dict
from towerlab.errors import UserError
from towerlab.search.evaluation import Candidate, Evaluate, Outcome, candidate_seed
from towerlab.search.space import Space, canonical, genome_hash

if TYPE_CHECKING:
    from towerlab.store import Evaluation, Store

# What must match for --resume to replay the same search (the space and the training-config hash
# are checked as well). Other settings (generations, top, workers...) may change on resume.
_IDENTITY = {"evolve": ("seed", "population", "retain", "random_select", "mutate_chance", "elite"),
             "grid": ("seed", "limit")}


@dataclass(frozen=True)
class Member:
    """One member of a generation and the evaluation it was served from."""

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

    @property
    def ok(self) -> bool:
        return self.status == "ok"


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


@dataclass(frozen=True)
class Generation:
    generation: int
    members: tuple[Member, ...]
    stats: GenerationStats


@dataclass(frozen=True)
class TopGenome:
    genome: dict
    genome_hash: str
    fitness: float
    val_loss: Optional[float]
    epochs: int
    seed: int
    generation: int  # where it first appeared


@dataclass(frozen=True)
class SearchResult:
    """The whole search. `evaluations`, `cache_hits` and `failures` sum the generations'
    evaluated, cached and failed counts."""

    kind: str
    history: tuple[Generation, ...]
    top: tuple[TopGenome, ...]
    evaluations: int
    cache_hits: int
    failures: int
    generations: int
    seconds: float = field(compare=False)
    search_id: int = field(compare=False)


def rank_key(genome: dict, fitness: Optional[float]) -> tuple:
    """Best first: higher fitness, failures (None) after every success, ties by canonical genome."""
    if fitness is None:
        return (1, 0.0, canonical(genome))
    return (0, -fitness, canonical(genome))


# ---------------------------------------------------------------------------------------------
# the search record: open or resume


def open_search(store: Store, kind: str, cfg: SearchConfig, space: Space, train_config_hash: str,
                resume: int | bool | None) -> int:
    """The search id to write under: a new search, or (resume=True: the store's latest search of
    this kind; resume=ID: that one) the search to continue, after checking that it is the same."""
    if cfg.seed < 0:
        raise UserError(f"--seed must be 0 or more, got {cfg.seed}")
    config = to_dict(cfg)
    if resume is None or resume is False:
        return store.begin_search(kind, config, space, train_config_hash)
    row = store.latest_search(kind) if resume is True else store.search(int(resume))
    if row is None:
        which = f"search {resume}" if resume is not True else f"{kind} search"
        raise UserError(f"store {store.path} holds no {which} to resume: start a new search without --resume")
    if row.kind != kind:
        raise UserError(f"search {row.id} in store {store.path} is a {row.kind} search, not {kind}")
    if row.space_fingerprint != space.fingerprint:
        raise UserError(f"store {store.path} was made for space {row.space['name']} "
                        f"({row.space_fingerprint[:12]}), not {space.name} ({space.fingerprint[:12]}): "
                        f"resume with the space it was made with, or start a new search elsewhere")
    if row.train_config_hash != train_config_hash:
        raise UserError(f"store {store.path} was made with other training settings "
                        f"(dataset, val-size, epochs, patience, batch size...): resume with the same ones")
    for name in _IDENTITY[kind]:
        if row.config.get(name) != config[name]:
            raise UserError(f"store {store.path} holds a search with --{name.replace('_', '-')} "
                            f"{row.config.get(name)}, not {config[name]}: resume with the same setting")
    done = sum(g.complete for g in store.generations(row.id))
    if kind == "evolve" and cfg.generations < done:
        raise UserError(f"store {store.path} already holds {done} complete generations: "
                        f"resume with --generations {done} or more")
    store.resume_search(row.id, config)
    return row.id


# ---------------------------------------------------------------------------------------------
# one generation


class _Recorder:
    """The `record` callback given to the evaluator: writes each outcome as it arrives."""

    def __init__(self, store: Store, search_id: int, train_config_hash: str,
                 pending: list[Candidate]) -> None:
        self._store, self._search_id, self._tch = store, search_id, train_config_hash
        self._pending = {c.genome_hash: c for c in pending}
        self.rows: dict[str, Evaluation] = {}
        self._lock = threading.Lock()

    def __call__(self, candidate: Candidate, outcome: Outcome) -> None:
        with self._lock:
            if self._pending.get(candidate.genome_hash) != candidate:
                state = "recorded twice" if candidate.genome_hash in self.rows else "not pending"
                raise ValueError(f"record() got a candidate that is {state}: {candidate}")
            self.rows[candidate.genome_hash] = self._store.record(candidate, outcome, self._tch,
                                                                  self._search_id)
            del self._pending[candidate.genome_hash]

    def missing(self) -> list[Candidate]:
        return list(self._pending.values())


def play_generation(store: Store, search_id: int, search_seed: int, train_config_hash: str,
                    generation: int, genomes: Sequence[dict], evaluate: Evaluate) -> Generation:
    """Evaluate one generation through the store, or replay it when the store already holds it.

    A generation the store holds must have the same members (else the replay diverged: UserError).
    A complete one is returned as recorded; in an incomplete one, evaluations already recorded by
    this search are served from the store and only the rest go to `evaluate`."""
    started = time.perf_counter()
    hashes = [genome_hash(g) for g in genomes]
    stored = store.generation(search_id, generation)
    if stored is not None:
        if [genome_hash(m["genome"]) for m in stored.members] != hashes:
            raise UserError(f"store {store.path}: replaying search {search_id} from its seed gives other "
                            f"members for generation {generation} than it recorded (the search code or "
                            f"space changed since): start a new search instead of resuming")
        if stored.complete:
            members = tuple(Member(**m) for m in stored.results)
            stats = GenerationStats(**stored.stats, replayed=True)
            return Generation(generation, members, stats)
    else:
        store.begin_generation(search_id, generation, [dict(g) for g in genomes], hashes)

    first: dict[str, int] = {}
    for index, h in enumerate(hashes):
        first.setdefault(h, index)
    served: dict[str, Evaluation] = {}
    pending = []
    for h, index in first.items():
        row = store.lookup(h, train_config_hash, search_id)
        if row is not None:
            served[h] = row
        else:
            pending.append(Candidate(generation, index, dict(genomes[index]), h,
                                     candidate_seed(search_seed, generation, index)))
    if pending:
        recorder = _Recorder(store, search_id, train_config_hash, pending)
        evaluate(list(pending), recorder)
        missing = recorder.missing()
        if missing:
            raise RuntimeError(f"the evaluator returned without recording {len(missing)} of "
                               f"{len(pending)} candidates of generation {generation}, "
                               f"e.g. index {missing[0].index}")
        served.update(recorder.rows)

    members = []
    for index, (genome, h) in enumerate(zip(genomes, hashes)):
        row = served[h]
        mine = (row.search_id, row.generation, row.index) == (search_id, generation, index)
        members.append(Member(index, dict(genome), h, row.status, row.fitness, row.val_loss, row.epochs,
                              row.seconds, row.seed, "evaluated" if mine else "cached", row.reason))
    stats = _statistics(generation, members, time.perf_counter() - started)
    store.complete_generation(search_id, generation, [dataclasses.asdict(m) for m in members],
                              stats.to_json())
    return Generation(generation, tuple(members), stats)


def _statistics(generation: int, members: list[Member], seconds: float) -> GenerationStats:
    fitnesses = [m.fitness for m in members if m.ok]
    evaluated = [m for m in members if m.source == "evaluated"]
    return GenerationStats(
        generation=generation,
        size=len(members),
        evaluated=len(evaluated),
        cached=len(members) - len(evaluated),
        failed=sum(not m.ok for m in evaluated),
        best=max(fitnesses) if fitnesses else None,
        mean=math.fsum(fitnesses) / len(fitnesses) if fitnesses else None,
        worst=min(fitnesses) if fitnesses else None,
        train_seconds=math.fsum(m.seconds for m in evaluated),
        seconds=seconds,
    )


def finish_search(store: Store, search_id: int, kind: str, history: list[Generation],
                  top: int) -> SearchResult:
    """The result (the best `top` unique successful genomes of the history), also written to the
    store as the search's summary."""
    seen: dict[str, TopGenome] = {}
    for gen in history:
        for m in gen.members:
            if m.ok and m.genome_hash not in seen:
                seen[m.genome_hash] = TopGenome(m.genome, m.genome_hash, m.fitness, m.val_loss,
                                                m.epochs, m.seed, gen.generation)
    best = sorted(seen.values(), key=lambda t: rank_key(t.genome, t.fitness))[:top]
    result = SearchResult(
        kind=kind,
        history=tuple(history),
        top=tuple(best),
        evaluations=sum(g.stats.evaluated for g in history),
        cache_hits=sum(g.stats.cached for g in history),
        failures=sum(g.stats.failed for g in history),
        generations=len(history),
        seconds=math.fsum(g.stats.seconds for g in history),
        search_id=search_id,
    )
    store.finish_search(search_id, {
        "evaluations": result.evaluations, "cache_hits": result.cache_hits,
        "failures": result.failures, "generations": result.generations, "seconds": result.seconds,
        "top": [t.genome_hash for t in best],
    })
    return result
