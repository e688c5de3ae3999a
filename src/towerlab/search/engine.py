"""The one loop every search runs: the sampler proposes a generation, `Rounds` serves it from the
store or trains it (pruning as asked), the networks about to be crowned are re-measured, the
sampler is told the outcomes; at the end the top is crowned and the summary written. No torch
here: the training protocol is in `towerlab.search.candidates`, the counts in
`towerlab.search.history`, the search itself (settings, space, plan) in `towerlab.search.search`.

Playing is a pure function of the search and what its store holds: replaying a search against its
store proposes the same generations and serves the same rows, which is how a search resumes and how
every worker of a search (`towerlab.search.queue`) plays it alike, whoever trained what.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from towerlab.config import SearchConfig
from towerlab.fields import to_dict
from towerlab.search.candidates import Trainer
from towerlab.search.history import Generation, GenerationStats, SearchResult, TopGenome
from towerlab.search.rounds import Rounds
from towerlab.search.search import Search
from towerlab.search.space import Space
from towerlab.search.store import Store

# From this many members on, proposing and looking up a generation takes seconds to minutes:
# the search says what it is doing before it starts.
LARGE_GENERATION = 10_000


def play(search: Search, store: Store, train: Trainer,
         on_generation: Optional[Callable[[GenerationStats], None]] = None,
         on_progress: Optional[Callable[[str], None]] = None) -> tuple[list[Generation], list[TopGenome]]:
    """Play `search` (in `store`) for at most its generations and --max-evaluations distinct
    trainings, or until the sampler has nothing left; the history and the crowned top.

    `train(candidates, record)` trains what the store cannot serve. `on_generation(stats)` is called
    after each generation, replayed ones included (`stats.replayed`); `on_progress(line)` hears what
    a large generation is doing before it is trained. Finished generations are replayed and
    checked, finished evaluations are kept, and the result equals an uninterrupted run's."""
    assert search.id is not None and search.train_config_hash is not None, "play a search that is in a store"
    cfg = search.cfg
    sampler = search.new_sampler()
    rounds = Rounds(store, search.id, cfg, search.train_config_hash, train)
    history: list[Generation] = []
    while len(history) < cfg.generations:
        budget = (None if cfg.max_evaluations is None
                  else cfg.max_evaluations - sum(g.stats.evaluated for g in history))
        if budget == 0:
            break
        if history and sampler.elite:
            history[-1] = rounds.crowned(history[-1], sampler.elite)
        if on_progress is not None and sampler.population >= LARGE_GENERATION:
            on_progress(f"Generation {len(history) + 1}: proposing {sampler.population} candidates and looking "
                        "them up in the store ...")
        genomes = sampler.propose(history)
        if not genomes:
            break
        generation = rounds.play(len(history), genomes, budget)
        sampler.tell(generation)
        history.append(generation)
        if on_generation is not None:
            on_generation(generation.stats)
    return history, rounds.top(history, cfg.top)


def run_search(cfg: SearchConfig, space: Space, train: Trainer, store: Store, train_config_hash: str,
               on_generation: Optional[Callable[[GenerationStats], None]] = None,
               *, resume: int | bool | None = None, on_progress: Optional[Callable[[str], None]] = None,
               ) -> SearchResult:
    """Search `space` with the sampler `cfg.sampler` in this process: the search resolved, recorded in
    `store` (or, with `resume`, the store's latest search with this sampler (True) or search `resume`,
    checked to be the same), then played with `train` and its summary written (see `play`)."""
    search = Search.resolve(cfg, space)
    search = (search.create(store, train_config_hash) if resume is None or resume is False
              else search.resume(store, resume, train_config_hash))
    return search.run(store, train, on_generation, on_progress)


def finish_search(store: Store, search: Search, history: list[Generation], top: list[TopGenome]) -> SearchResult:
    """The result, also written to the store as the search's summary (by the first process to finish it)."""
    assert search.id is not None
    trainings = store.evaluations(search.id)
    result = SearchResult(
        sampler=search.cfg.sampler,
        history=tuple(history),
        top=tuple(top),
        evaluations=sum(g.stats.evaluated for g in history),
        cache_hits=sum(g.stats.cached for g in history),
        failures=sum(g.stats.failed for g in history),
        generations=len(history),
        trainings=len(trainings),
        train_seconds=math.fsum(e.seconds for e in trainings),
        seconds=math.fsum(g.stats.seconds for g in history),
        search_id=search.id,
    )
    store.finish_search(search.id, {
        "evaluations": result.evaluations, "cache_hits": result.cache_hits, "failures": result.failures,
        "generations": result.generations, "trainings": result.trainings, "train_seconds": result.train_seconds,
        "seconds": result.seconds, "top": [t.to_json() for t in top],
    }, to_dict(search.cfg))
    return result
