"""A search, resolved once: its settings with every default and sampler setting decided (re-measuring
included), its space, shape, pruner and plan, and once it is in a store, its id, the hash of its
training settings, its rungs (`ladder`: each rung's epochs and the hash its rows are stored under) and
how its workers train (`setup`). It is the only reader of a stored search: the job, every worker,
`towerlab search show`, `search export` and the job's record take this one object, as Optuna's
processes take one Study:

- `Search.resolve(cfg, space)` makes every refusal that needs no store, before anything is written;
- `search.create(store, ...)` records a new search, `search.resume(store, id)` checks that a stored one
  is the same and continues it;
- `Search.open(store, id)` (or `Search.of_row`) rebuilds it from the store alone, as a worker on another
  machine does. Its sampler is built where it proposes (`play`), never to learn its shape.

`search.play(store, train)` is the one loop every search runs: the sampler proposes a generation,
`Rounds` serves it from the store or trains it through the `Trainer` (pruning as asked), the networks
about to be crowned are re-measured, the sampler is told the outcomes; at the end the top is crowned.
`search.finish` writes the summary, `search.run` does both. Playing is a pure function of the search
and what its store holds: replaying a search against its store proposes the same generations and
serves the same rows, which is how a search resumes and how every worker of a search
(`towerlab.search.work.worker`) plays it alike, whoever trained what. No torch here: the training protocol
is in `towerlab.search.candidates`, the counts in `towerlab.search.history`.
"""

from __future__ import annotations

import functools
import math
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.fields import to_dict
from towerlab.search.history import Generation, GenerationStats, SearchResult, TopGenome
from towerlab.search.pruners import Ladder, Pruner, make_pruner
from towerlab.search.rounds import Rounds
from towerlab.search.store.rows import SearchRow
from towerlab.search.samplers import (InFlight, Sampler, Shape, budget_left, resolved_settings, sampler_class,
                                      sampler_shape)
from towerlab.search.space import Space, load_space, space_of
from towerlab.search.store import Store
from towerlab.search.trainers import Trainer

# What every search must keep to resume: it changes what is trained or how it is ranked (the
# space and the training-config hash are checked as well, and each sampler adds what it `reads`).
# Other settings (generations, max_evaluations, top, workers...) may change on resume.
IDENTITY = ("seed", "remeasure", "min_epochs", "prune_factor", "prune_places")

# From this many members on, proposing and looking up a generation takes seconds to minutes:
# the search says what it is doing before it starts.
LARGE_GENERATION = 10_000

# Settings every stored search records (its sampler's, its budget's, its rungs'): a record without one
# was edited, and is named as such (`towerlab.search.store.integrity.records_of`) rather than read with a default.
RECORDED = ("seed", "max_epochs", "top", "generations", "population")

DEFAULT_REMEASURE = 2
# Of a search's trainings, the most that default re-measuring may add: a quarter, because the
# networks it re-measures are the largest ones as often as not, and races re-measure more (a quick
# search of 8 one-epoch MNIST trainings with 2 seeds for its top 2 spent 98 s re-measuring against 92 s
# searching: bench/results/quick-search-mnist-2026-11-25.json).
REMEASURE_SHARE = 0.25


def planned_trainings(cfg: SearchConfig, shape: Shape) -> dict:
    """The most trainings the search's budget holds, by purpose, and their epochs: `search`, members
    trained for the first time (population x generations, or --max-evaluations); `rungs`, a pruned
    search's promotions to its higher rungs (as many as its pruner's `most_promoted`);
    `remeasure`, --remeasure K for the final top and for each later generation's elite; `test`, the
    top once each. A store that serves some of them, early stopping and failures make fewer."""
    generations = 1 if shape.one_generation else cfg.generations
    search = shape.population * generations
    if cfg.max_evaluations is not None:
        search = min(search, cfg.max_evaluations)
        # the generations the budget reaches, each with its promotions and elites (not --generations')
        generations = min(generations, math.ceil(search / shape.population))
    pruner = make_pruner(cfg)
    ladder = pruner.rungs
    promoted = [n * generations for n in pruner.most_promoted(shape.population)]
    top = min(cfg.top, search)
    remeasure = (cfg.remeasure or 0) * (top + min(shape.elite, shape.population) * (generations - 1))
    return {"search": search, "rungs": sum(promoted), "remeasure": remeasure, "test": top,
            "epochs": (search * ladder[0] + sum(n * e for n, e in zip(promoted, ladder[1:]))
                       + (remeasure + top) * cfg.max_epochs)}


def resolved_remeasure(cfg: SearchConfig, shape: Shape) -> SearchConfig:
    """`cfg` with --remeasure decided: as given, else DEFAULT_REMEASURE fresh seeds, fewer (down to
    none) where those would be more than REMEASURE_SHARE of the search's own trainings: a small
    search should not spend longer re-measuring its winners than finding them."""
    if cfg.remeasure is not None:
        return cfg
    per_seed = planned_trainings(replace(cfg, remeasure=1), shape)
    most = int(per_seed["search"] * REMEASURE_SHARE // max(1, per_seed["remeasure"]))
    return replace(cfg, remeasure=min(DEFAULT_REMEASURE, most))


@dataclass(frozen=True)
class Search:
    """One search (see the module's docstring). `cfg` is resolved; `id`, `train_config_hash` and
    `setup` are set once the search is in a store."""

    cfg: SearchConfig
    space: Space
    id: Optional[int] = None
    train_config_hash: Optional[str] = None
    setup: dict = field(default_factory=dict)
    where: str = ""  # the store it is in, as messages name it

    @classmethod
    def resolve(cls, cfg: SearchConfig, space: Optional[Space] = None) -> Search:
        """The search `cfg` describes, once every setting it would refuse has been (an unknown sampler,
        a setting it refuses, a budget its generations cannot hold): a UserError, before anything is
        written. Re-measuring and the sampler's own settings are decided here, as the search records them."""
        space = space if space is not None else load_space(cfg.space)
        sampler = sampler_class(cfg.sampler)
        return cls(resolved_settings(resolved_remeasure(cfg, sampler_shape(cfg, space, sampler)), sampler), space)

    @classmethod
    def open(cls, store: Store, search_id: int) -> Search:
        """A stored search, from the store alone (its settings were resolved when it was created)."""
        row = store.records.search(search_id)
        if row is None:
            raise UserError(f"store {store.path} holds no search {search_id}")
        return cls.of_row(row, str(store.path))

    @classmethod
    def of_row(cls, row: SearchRow, where: str) -> Search:
        """The search a store's row records (`where`: the store, as messages name it)."""
        missing = [name for name in RECORDED if name not in row.config]
        if missing:
            raise KeyError(f"search {row.id}'s settings lack {missing[0]}")
        space = space_of({"model": row.space["model"], "genes": row.space["genes"]}, row.space["name"],
                         f"search {row.id} of store {where}")
        return cls(SearchConfig(**row.config), space, row.id, row.train_config_hash, row.setup or {}, where)

    # -- what the settings decide --------------------------------------------------------------------

    @property
    def stored_id(self) -> int:
        """Its id in its store (a search that is in one)."""
        assert self.id is not None, "the id of a search in a store"
        return self.id

    @functools.cached_property
    def sampler_type(self) -> type[Sampler]:
        """Its sampler's class, looked up once by its name."""
        return sampler_class(self.cfg.sampler)

    @functools.cached_property
    def shape(self) -> Shape:
        """Its sampler's shape (`sampler_shape`: the sampler is not built)."""
        return sampler_shape(self.cfg, self.space, self.sampler_type)

    @functools.cached_property
    def pruner(self) -> Pruner:
        return make_pruner(self.cfg)

    @functools.cached_property
    def ladder(self) -> Ladder:
        """Its rungs in its store: each one's epochs and the training-config hash its rows are stored under."""
        assert self.train_config_hash is not None, "the ladder of a search in a store"
        return Ladder(self.pruner, self.train_config_hash)

    @functools.cached_property
    def plan(self) -> dict:
        """`planned_trainings` of this search."""
        return planned_trainings(self.cfg, self.shape)

    @property
    def generations(self) -> int:
        """The generations it may run (1 for a sampler that proposes everything at once)."""
        return 1 if self.shape.one_generation else self.cfg.generations

    @property
    def tests_top(self) -> bool:
        """Whether its top networks get a test accuracy: its data has a test split (as its setup records;
        a search recorded before setups were is tested)."""
        return bool(self.setup.get("test", True))

    def recorded(self, key: str) -> Any:
        """What it recorded of how its workers train (its setup) under `key`: the device kind, the CPU threads
        per candidate, the model, the data's format, whether it has a test split, and what identifies its
        software, data and model file (`towerlab.jobs.search.identity`); None where it recorded none."""
        return self.setup.get(key)

    def new_sampler(self) -> Sampler:
        """A sampler in its initial state, for one play of the search (samplers keep what they were told)."""
        return self.sampler_type(self.cfg, self.space, len(self.pruner.rungs))

    # -- in a store ------------------------------------------------------------------------------------

    def create(self, store: Store, train_config_hash: str, setup: Optional[dict] = None,
               token: Optional[str] = None) -> Search:
        """This search recorded as a new search of `store`."""
        setup = setup or {}
        search_id = store.records.begin_search(self.cfg.sampler, to_dict(self.cfg), self.space, train_config_hash,
                                               setup, token or uuid.uuid4().hex)
        return replace(self, id=search_id, train_config_hash=train_config_hash, setup=setup, where=str(store.path))

    def resume(self, store: Store, resume: int | bool, train_config_hash: str) -> Search:
        """The stored search to continue (resume=True: the store's latest search with this sampler;
        resume=ID: that one), after checking that it is this one; its budget may grow."""
        cfg = self.cfg
        row = store.records.latest_search(cfg.sampler) if resume is True else store.records.search(int(resume))
        if row is None:
            which = f"search {resume}" if resume is not True else f"{cfg.sampler} search"
            raise UserError(f"store {store.path} holds no {which} to resume: start a new search without --resume")
        if row.sampler != cfg.sampler:
            raise UserError(f"search {row.id} in store {store.path} is a {row.sampler} search, not {cfg.sampler}")
        if row.space_fingerprint != self.space.fingerprint:
            raise UserError(f"store {store.path} was made for space {row.space['name']} "
                            f"({row.space_fingerprint[:12]}), not {self.space.name} ({self.space.fingerprint[:12]}): "
                            f"resume with the space it was made with, or start a new search elsewhere")
        if row.train_config_hash != train_config_hash:
            raise UserError(f"store {store.path} was made with other training settings (dataset, val-size, epochs, "
                            f"patience, batch size, device kind, CPU threads per candidate, the model function's "
                            f"source, or an older towerlab's): resume with the same ones")
        config = to_dict(cfg)
        for name in (*IDENTITY, *self.sampler_type.reads()):
            if row.config.get(name) != config[name]:
                raise UserError(f"store {store.path} holds a search with --{name.replace('_', '-')} "
                                f"{row.config.get(name)}, not {config[name]}: resume with the same setting")
        done = store.records.generations(row.id)
        complete = sum(g.complete for g in done)
        if cfg.generations < complete:
            raise UserError(f"store {store.path} already holds {complete} complete generations: "
                            f"resume with --generations {complete} or more")
        trained = sum(g.final_stats["evaluated"] for g in done if g.complete)
        if cfg.max_evaluations is not None and cfg.max_evaluations < trained:
            raise UserError(f"store {store.path} already holds {trained} evaluations of this search: "
                            f"resume with --max-evaluations {trained} or more")
        if row.config != config or row.finished is None:
            store.records.resume_search(row.id, config)
        return replace(self, id=row.id, train_config_hash=row.train_config_hash, setup=row.setup or {},
                       where=str(store.path))

    def adopt(self, store: Store, setup: dict) -> Search:
        """This search, recording `setup` besides what it recorded of how its workers train, from now on (a
        resume by another towerlab or torch records its own)."""
        merged = {**self.setup, **setup}
        store.records.update_setup(self.stored_id, merged)
        return replace(self, setup=merged)

    def play(self, store: Store, train: Trainer, on_generation: Optional[Callable[[GenerationStats], None]] = None,
             on_progress: Optional[Callable[[str], None]] = None) -> tuple[list[Generation], list[TopGenome]]:
        """Play the search (in `store`) for at most its generations and --max-evaluations distinct
        trainings, or until the sampler has nothing left; the history and the crowned top.

        `train(candidates, record)` trains what the store cannot serve. `on_generation(stats)` is called
        after each generation, replayed ones included (`stats.replayed`); `on_progress(line)` hears what
        a large generation is doing before it is trained. Finished generations are replayed and
        checked, finished evaluations are kept, and the result equals an uninterrupted run's."""
        assert self.id is not None and self.train_config_hash is not None, "play a search that is in a store"
        cfg = self.cfg
        sampler = self.new_sampler()
        rounds = Rounds(store, self.id, cfg, self.ladder, train)
        history: list[Generation] = []
        ahead: Optional[InFlight] = None  # the next generation, begun while the one before trained
        while len(history) < cfg.generations:
            g = len(history)
            budget = budget_left(cfg, history)
            if budget == 0:
                break
            if history and sampler.elite:
                history[-1] = rounds.crowned(history[-1], sampler.elite)
            queued = ahead is not None  # its first rung is on the queue already
            if ahead is not None:
                current, ahead = ahead, None
            else:
                if on_progress is not None and sampler.population >= LARGE_GENERATION:
                    on_progress(f"Generation {g + 1}: proposing {sampler.population} candidates and looking "
                                "them up in the store ...")
                genomes = sampler.propose(history)
                if not genomes:
                    break
                current = InFlight(tuple(genomes), rounds.begin(g, genomes, budget))
            if sampler.overlaps and not sampler.elite and g + 1 < cfg.generations and (budget is None or budget > current.new):
                # The next generation is proposed now, with this one in flight, and its first rung goes on
                # the queue: a worker that finishes before this generation's last training takes it. This
                # one's first rung goes there first, so that no worker takes the next one's before it.
                if not queued:
                    rounds.prefetch(g)
                following = sampler.propose(history, current)
                if following:
                    ahead = InFlight(tuple(following), rounds.begin(g + 1, following, budget_left(cfg, history, current)))
                    rounds.prefetch(g + 1)
            generation = rounds.finish(g)
            sampler.tell(generation)
            history.append(generation)
            if on_generation is not None:
                on_generation(generation.stats)
        return history, rounds.top(history, cfg.top)

    def finish(self, store: Store, history: list[Generation], top: list[TopGenome]) -> SearchResult:
        """The result, also written to the store as the search's summary (by the first process to finish
        it, and only under the settings it was played with: a resume that changed them has it played again)."""
        assert self.id is not None
        trainings = store.records.evaluations(self.id)
        result = SearchResult(
            sampler=self.cfg.sampler,
            history=tuple(history),
            top=tuple(top),
            evaluations=sum(g.stats.evaluated for g in history),
            cache_hits=sum(g.stats.cached for g in history),
            failures=sum(g.stats.failed for g in history),
            generations=len(history),
            trainings=len(trainings),
            train_seconds=math.fsum(e.seconds for e in trainings),
            seconds=math.fsum(g.stats.seconds for g in history),
            search_id=self.id,
        )
        store.records.finish_search(self.id, {
            "evaluations": result.evaluations, "cache_hits": result.cache_hits, "failures": result.failures,
            "generations": result.generations, "trainings": result.trainings, "train_seconds": result.train_seconds,
            "seconds": result.seconds, "top": [t.to_json() for t in top],
        }, to_dict(self.cfg))
        return result

    def run(self, store: Store, train: Trainer, on_generation: Optional[Callable[[GenerationStats], None]] = None,
            on_progress: Optional[Callable[[str], None]] = None) -> SearchResult:
        """`play`, then `finish`."""
        history, top = self.play(store, train, on_generation, on_progress)
        return self.finish(store, history, top)

def run_search(cfg: SearchConfig, space: Space, train: Trainer, store: Store, train_config_hash: str,
               on_generation: Optional[Callable[[GenerationStats], None]] = None,
               *, resume: int | bool | None = None, on_progress: Optional[Callable[[str], None]] = None,
               ) -> SearchResult:
    """Search `space` with the sampler `cfg.sampler` in this process: the search resolved, recorded in
    `store` (or, with `resume`, the store's latest search with this sampler (True) or search `resume`,
    checked to be the same), then played with `train` and its summary written (see `Search.play`)."""
    search = Search.resolve(cfg, space)
    search = (search.create(store, train_config_hash) if resume is None or resume is False
              else search.resume(store, resume, train_config_hash))
    return search.run(store, train, on_generation, on_progress)
