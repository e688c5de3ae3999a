"""The one loop every search runs: the sampler proposes a generation, `Rounds` serves it from the
store or trains it (pruning as asked), the networks about to be crowned are re-measured, the
sampler is told the outcomes; at the end the top is crowned and the summary written. No torch
here: the training protocol is in `towerlab.search.candidates`, the counts in
`towerlab.search.history`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Optional

from towerlab.config import SearchConfig
from towerlab.fields import to_dict
from towerlab.errors import UserError
from towerlab.search.candidates import Trainer
from towerlab.search.history import Generation, GenerationStats, SearchResult, TopGenome
from towerlab.search.pruners import make_pruner
from towerlab.search.rounds import Rounds
from towerlab.search.samplers import Sampler, make_sampler, resolved_settings
from towerlab.search.space import Space
from towerlab.search.store import Store

# What every search must keep to resume: it changes what is trained or how it is ranked (the
# space and the training-config hash are checked as well, and each sampler adds what it `reads`).
# Other settings (generations, max_evaluations, top, workers...) may change on resume.
_IDENTITY = ("seed", "remeasure", "min_epochs", "prune_factor", "prune_places")
# From this many members on, proposing and looking up a generation takes seconds to minutes:
# the search says what it is doing before it starts.
LARGE_GENERATION = 10_000


def open_search(store: Store, cfg: SearchConfig, sampler: Sampler, space: Space, train_config_hash: str,
                resume: int | bool | None) -> int:
    """The search id to write under: a new search, or (resume=True: the store's latest search with
    this sampler; resume=ID: that one) the search to continue, after checking that it is the same."""
    config = to_dict(cfg)
    if resume is None or resume is False:
        return store.begin_search(cfg.sampler, config, space, train_config_hash)
    row = store.latest_search(cfg.sampler) if resume is True else store.search(int(resume))
    if row is None:
        which = f"search {resume}" if resume is not True else f"{cfg.sampler} search"
        raise UserError(f"store {store.path} holds no {which} to resume: start a new search without --resume")
    if row.sampler != cfg.sampler:
        raise UserError(f"search {row.id} in store {store.path} is a {row.sampler} search, not {cfg.sampler}")
    if row.space_fingerprint != space.fingerprint:
        raise UserError(f"store {store.path} was made for space {row.space['name']} "
                        f"({row.space_fingerprint[:12]}), not {space.name} ({space.fingerprint[:12]}): "
                        f"resume with the space it was made with, or start a new search elsewhere")
    if row.train_config_hash != train_config_hash:
        raise UserError(f"store {store.path} was made with other training settings (dataset, val-size, epochs, "
                        f"patience, batch size, device kind, CPU threads per candidate, or an older towerlab's): "
                        f"resume with the same ones")
    for name in (*_IDENTITY, *sampler.reads()):
        if row.config.get(name) != config[name]:
            raise UserError(f"store {store.path} holds a search with --{name.replace('_', '-')} "
                            f"{row.config.get(name)}, not {config[name]}: resume with the same setting")
    done = store.generations(row.id)
    complete = sum(g.complete for g in done)
    if cfg.generations < complete:
        raise UserError(f"store {store.path} already holds {complete} complete generations: "
                        f"resume with --generations {complete} or more")
    trained = sum(g.stats["evaluated"] for g in done if g.complete)
    if cfg.max_evaluations is not None and cfg.max_evaluations < trained:
        raise UserError(f"store {store.path} already holds {trained} evaluations of this search: "
                        f"resume with --max-evaluations {trained} or more")
    store.resume_search(row.id, config)
    return row.id


def planned_trainings(cfg: SearchConfig, space: Space) -> dict:
    """The most trainings the search's budget holds, by purpose, and their epochs: `search`, members
    trained for the first time (population x generations, or --max-evaluations); `rungs`, a pruned
    search's promotions to its higher rungs (as many as its pruner's `most_promoted`);
    `remeasure`, --remeasure K for the final top and for each later generation's elite; `test`, the
    top once each. A store that serves some of them, early stopping and failures make fewer."""
    sampler = make_sampler(cfg, space)
    generations = 1 if sampler.one_generation else cfg.generations
    search = sampler.population * generations
    if cfg.max_evaluations is not None:
        search = min(search, cfg.max_evaluations)
        # the generations the budget reaches, each with its promotions and elites (not --generations')
        generations = min(generations, math.ceil(search / sampler.population))
    pruner = make_pruner(cfg)
    ladder = pruner.rungs
    promoted = [n * generations for n in pruner.most_promoted(sampler.population)]
    top = min(cfg.top, search)
    remeasure = cfg.remeasure * (top + min(sampler.elite, sampler.population) * (generations - 1))
    return {"search": search, "rungs": sum(promoted), "remeasure": remeasure, "test": top,
            "epochs": (search * ladder[0] + sum(n * e for n, e in zip(promoted, ladder[1:]))
                       + (remeasure + top) * cfg.max_epochs)}


DEFAULT_REMEASURE = 2
# Of a search's trainings, the most that default re-measuring may add: a quarter, because the
# networks it re-measures are the largest ones as often as not, and races re-measure more (a quick
# search of 8 one-epoch MNIST trainings with 2 seeds for its top 2 spent 98 s re-measuring against 92 s
# searching: bench/results/quick-search-mnist-2026-11-25.json).
REMEASURE_SHARE = 0.25


def resolved_remeasure(cfg: SearchConfig, space: Space) -> SearchConfig:
    """`cfg` with --remeasure decided: as given, else DEFAULT_REMEASURE fresh seeds, fewer (down to
    none) where those would be more than REMEASURE_SHARE of the search's own trainings: a small
    search should not spend longer re-measuring its winners than finding them."""
    if cfg.remeasure is not None:
        return cfg
    per_seed = planned_trainings(replace(cfg, remeasure=1), space)
    most = int(per_seed["search"] * REMEASURE_SHARE // max(1, per_seed["remeasure"]))
    return replace(cfg, remeasure=min(DEFAULT_REMEASURE, most))


def run_search(cfg: SearchConfig, space: Space, train: Trainer, store: Store, train_config_hash: str,
               on_generation: Optional[Callable[[GenerationStats], None]] = None,
               *, resume: int | bool | None = None, on_progress: Optional[Callable[[str], None]] = None,
               ) -> SearchResult:
    """Search `space` with the sampler `cfg.sampler`, for at most `cfg.generations` generations
    and `cfg.max_evaluations` distinct trainings, or until the sampler has nothing left.

    `train(candidates, record)` trains what the store (keyed by genome hash and
    `train_config_hash`) cannot serve. `on_generation(stats)` is called after each generation,
    replayed ones included (`stats.replayed`); `on_progress(line)` hears what a large generation
    is doing before it is trained. `resume` continues a search of the store (True:
    its latest search with this sampler; an int: that search id) instead of starting a new one:
    finished generations are replayed and checked, finished evaluations are kept, and the result
    equals an uninterrupted run's.
    """
    cfg = resolved_settings(resolved_remeasure(cfg, space))  # recorded with every setting the sampler reads
    sampler = make_sampler(cfg, space)
    search_id = open_search(store, cfg, sampler, space, train_config_hash, resume)
    rounds = Rounds(store, search_id, cfg, train_config_hash, train)
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
    return finish_search(store, search_id, cfg.sampler, history, rounds.top(history, cfg.top))


def finish_search(store: Store, search_id: int, sampler: str, history: list[Generation],
                  top: list[TopGenome]) -> SearchResult:
    """The result, also written to the store as the search's summary."""
    trainings = store.evaluations(search_id)
    result = SearchResult(
        sampler=sampler,
        history=tuple(history),
        top=tuple(top),
        evaluations=sum(g.stats.evaluated for g in history),
        cache_hits=sum(g.stats.cached for g in history),
        failures=sum(g.stats.failed for g in history),
        generations=len(history),
        trainings=len(trainings),
        train_seconds=math.fsum(e.seconds for e in trainings),
        seconds=math.fsum(g.stats.seconds for g in history),
        search_id=search_id,
    )
    store.finish_search(search_id, {
        "evaluations": result.evaluations, "cache_hits": result.cache_hits, "failures": result.failures,
        "generations": result.generations, "trainings": result.trainings, "train_seconds": result.train_seconds,
        "seconds": result.seconds, "top": [t.to_json() for t in top],
    })
    return result
