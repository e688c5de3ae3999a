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

It is over 350 lines: it is also what a search's views, record and workers' lines read of what it ranks
by: its `aim` (its objective's kind and goal, decided when it was made: `towerlab.search.goal`) and how its
values read (`metric_label`, `reads`, `shown`).
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
from towerlab.search.game import asynchronously, in_generations
from towerlab.search.goal import Aim, Goal
from towerlab.search.history import Generation, GenerationStats, Played, SearchResult, TopGenome
from towerlab.search.judge import Evidence, Judgement
from towerlab.search.pruners import Ladder, Pruner, make_pruner
from towerlab.search.plan import crowning_epochs, generations_of, planned_trainings, resolved_remeasure
from towerlab.search.rounds import Rounds
from towerlab.search.store.rows import SearchRow
from towerlab.search.samplers import Sampler, Shape, resolved_settings, sampler_class, sampler_shape
from towerlab.search.space import Space, load_space, space_of
from towerlab.search.store import Store
from towerlab.search.trainers import Trainer

# What every search must keep to resume: it changes what is trained or how it is ranked (the
# space and the training-config hash are checked as well, and each sampler adds what it `reads`).
# Other settings (generations, max_evaluations, top, workers...) may change on resume.
IDENTITY = ("seed", "remeasure", "min_epochs", "prune_factor", "prune_places")

# Settings every stored search records (its sampler's, its budget's, its rungs'): a record without one
# was edited, and is named as such (`towerlab.search.store.integrity.records_of`) rather than read with a default.
RECORDED = ("seed", "max_epochs", "top", "generations", "population")

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
    aim: Aim = Aim()  # what trains its tasks and what it ranks by: decided when it is made, recorded in its setup

    @classmethod
    def resolve(cls, cfg: SearchConfig, space: Optional[Space] = None, aim: Aim = Aim()) -> Search:
        """The search `cfg` describes, once every setting it would refuse has been (an unknown sampler,
        a setting it refuses, a budget its generations cannot hold): a UserError, before anything is
        written. --generations, re-measuring and the sampler's own settings are decided here, as the search
        records them; `aim`, what trains its tasks and what it ranks by, as its objective's kind decided
        (`towerlab.objective.resolve`; by default towerlab's own training)."""
        space = space if space is not None else load_space(cfg.space)
        sampler = sampler_class(cfg.sampler)
        cfg = replace(cfg, generations=sampler.generations(cfg, space))
        shape = sampler_shape(cfg, space, sampler)
        if cfg.min_epochs is not None and shape.population < 2 and not (shape.one_generation or shape.asynchronous):
            raise UserError(f"--min-epochs prunes the members of a generation against each other: it needs a "
                            f"--population of 2 or more, got {shape.population} (or none: then each candidate "
                            f"is pruned against the trainings before it)")
        cfg = resolved_remeasure(cfg, shape)
        if cfg.budget_epochs is not None and cfg.budget_epochs <= crowning_epochs(cfg):
            raise UserError(f"--budget-epochs {cfg.budget_epochs} leaves the search nothing once its top is "
                            f"re-measured (--remeasure {cfg.remeasure} x --top {cfg.top} x {cfg.max_epochs} epochs = "
                            f"{crowning_epochs(cfg)}): raise it, or lower --remeasure")
        sampler.needs(cfg, space)  # last: a command line its settings refuse imports nothing heavy
        return cls(resolved_settings(cfg, sampler), space, aim=aim)

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
        setup = row.setup or {}
        return cls(SearchConfig(**row.config), space, row.id, row.train_config_hash, setup, where, Aim.of_setup(setup))

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
        return planned_trainings(self.cfg, self.shape, self.tests_top, probes=self.own)

    @property
    def generations(self) -> int:
        """The generations it may run (1 for a sampler that proposes everything at once)."""
        return 1 if self.shape.one_generation else generations_of(self.cfg)

    @property
    def tests_top(self) -> bool:
        """Whether its top networks get a test accuracy: its data has a test split (as its setup records;
        a search recorded before setups were is tested). A search of your own objective has none."""
        return bool(self.setup.get("test", not self.own))

    @property
    def goal(self) -> Goal:
        """What it ranks by (its `aim`'s): a metric and its direction; a fitness is the metric's value,
        negated where it is minimized (`Goal.fitness`, `Goal.value`)."""
        return self.aim.goal

    @property
    def own(self) -> bool:
        """Whether it searches an objective of yours (any kind but towerlab's own training: `Aim.own`)."""
        return self.aim.own

    @property
    def metric_label(self) -> str:
        """Its metric as a line names it: towerlab's "validation accuracy", or your metric's own name."""
        return self.goal.metric.replace("val_accuracy", "validation accuracy")

    def reads(self, fitness: Optional[float]) -> str:
        """A `fitness` as its metric's value reads in a line ("-" for none): an accuracy to 4 places, a metric
        of yours (a loss of 1e-5, a reward of 2,000) to 6 significant digits."""
        value = self.goal.value(fitness)
        return "-" if value is None else f"{value:.6g}" if self.own else f"{value:.4f}"

    def shown(self, stats: GenerationStats) -> GenerationStats:
        """A generation's `stats` with best, mean and worst as values of its metric (a minimized one's best is
        its lowest), as its records show them."""
        if not self.goal.minimizes:
            return stats
        value = self.goal.value
        return replace(stats, best=value(stats.best), mean=value(stats.mean), worst=value(stats.worst))

    def recorded(self, key: str) -> Any:
        """What it recorded of how its workers train (its setup) under `key`: the device kind, the CPU threads
        per candidate, the model, the data's format, whether it has a test split, and what identifies its
        software, data and model file (`towerlab.objective.admission`); None where it recorded none."""
        return self.setup.get(key)

    def new_sampler(self) -> Sampler:
        """A sampler in its initial state, for one play of the search (samplers keep what they were told)."""
        return self.sampler_type(self.cfg, self.space, len(self.pruner.rungs))

    def prepare(self) -> None:
        """Import and set up what its sampler proposes with (`Sampler.prepare`), in this thread: a worker does it
        before its driver thread starts, since two threads importing at once can meet a module half-initialised
        (SciPy's scipy.stats, met by a driver's first proposal while the worker's objective imported it)."""
        self.new_sampler().prepare()

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
        if generations_of(cfg) < complete:
            raise UserError(f"store {store.path} already holds {complete} complete generations: "
                            f"resume with --generations {complete} or more")
        trained = sum(g.final_stats["evaluated"] for g in done if g.complete)
        if cfg.max_evaluations is not None and cfg.max_evaluations < trained:
            raise UserError(f"store {store.path} already holds {trained} evaluations of this search: "
                            f"resume with --max-evaluations {trained} or more")
        given = store.records.epochs_given(row.id, len(done), cfg.max_epochs)
        if cfg.budget_epochs is not None and cfg.budget_epochs < given:
            raise UserError(f"store {store.path} holds trainings of this search given {given} epochs: resume with "
                            f"--budget-epochs {given} or more")
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

    def evidence(self) -> Optional[Evidence]:
        """Its pruner's judge's evidence, empty, to `add` its evaluations to and `judge` (None: it is not pruned)."""
        return Evidence(self.ladder.epochs, self.ladder.hashes, self.goal) if len(self.pruner.rungs) > 1 else None

    def judgement(self, store: Store) -> Optional[Judgement]:
        """How its pruner's judge sees its rungs on every generation it completed (None: it is not pruned)."""
        evidence = self.evidence()
        if evidence is None:
            return None
        complete = sum(g.complete for g in store.records.generations(self.stored_id))
        evidence.add(store.records.own_history(self.stored_id, 0, complete))
        return evidence.judge()

    @property
    def asynchronous(self) -> bool:
        """Whether it proposes one candidate at a time, as workers need them (`towerlab.search.game`)."""
        return self.shape.asynchronous

    def play(self, store: Store, train: Trainer, on_generation: Optional[Callable[[GenerationStats], None]] = None,
             on_progress: Optional[Callable[[str], None]] = None) -> Played:
        """Play the search (in `store`) for at most its generations, --max-evaluations distinct
        trainings and --budget-epochs epochs, or until the sampler has nothing left; the history, the
        crowned top, and which of those ended it. In generations or asynchronously, as its shape says
        (`towerlab.search.game`); a generation the store holds is read, never proposed again.

        --budget-epochs is decided as --max-evaluations is: before a generation is proposed, the epochs
        its earlier generations' trainings were given (`Rounds.epochs_left`: every rung and re-measure,
        each charged its whole length) and the first rungs of those in flight leave it so many new
        first rungs, and it is cut there; the crowning at the end keeps what its re-measures take at
        least (`crowning_epochs`). A generation once begun is played whole: its promotions, and a
        crowning that races (re-measures more where they reorder the top), may pass the budget by what
        they need.

        `train(candidates, record)` trains what the store cannot serve. `on_generation(stats)` is called
        after each generation, replayed ones included (`stats.replayed`); `on_progress(line)` hears what
        a large generation is doing before it is trained. Finished evaluations are kept, and a finished
        search is read, not played."""
        assert self.id is not None and self.train_config_hash is not None, "play a search that is in a store"
        sampler = self.new_sampler()
        # its pruner's judge reads the generations complete when each begins: the one before, where it still
        # trains as the next begins, left out (`Rounds.judged`)
        lag = 1 if sampler.overlaps and not sampler.elite else 0
        rounds = Rounds(store, self.id, self.cfg, self.ladder, train, self.goal, lag, self.asynchronous)
        replay = store.records.finished(self.id)
        if self.asynchronous:
            return asynchronously(self.cfg, sampler, rounds, train, replay, on_generation)
        return in_generations(self.cfg, sampler, rounds, replay, on_generation, on_progress)

    def finish(self, store: Store, history: list[Generation], top: list[TopGenome], ended: str = "") -> SearchResult:
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
            ended=ended,
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
        return self.finish(store, *self.play(store, train, on_generation, on_progress))

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
