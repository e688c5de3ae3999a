"""Network search: samplers (the genetic algorithm, the grid, random, TPE) run by one engine loop,
with a store (an SQLite file or a PostgreSQL database) that caches every evaluation, replays a search
on resume, and queues its work. Pure Python and numpy (Optuna for TPE), never torch.

A search is resolved once into a `Search` (`towerlab.search.search`) that any process can open from
its store. The torch side supplies a `Trainer`, `train(candidates, record)` (see
`towerlab.search.trainers`); a pruner (`towerlab.search.pruners`) says what a generation's rungs are
and whom each promotes; the store (`towerlab.search.store.Store`, SQLite or PostgreSQL: its records and
its queue) keeps every result and is the queue that workers on any machine claim their work from
(`towerlab.search.work.worker`).
Everything random comes from the search seed, so a search can be resumed, or played by any number of
workers, by replaying it against its store.
"""

from towerlab.search.candidates import Candidate, Outcome, candidate_seed, make_rng, remeasure_seed
from towerlab.search.history import Generation, GenerationStats, Member, SearchResult, TopGenome, rank_key
from towerlab.search.pruners import Ladder, Pruner, SuccessiveHalving, make_pruner, rung_epochs, rung_hash
from towerlab.search.plan import planned_trainings, resolved_remeasure
from towerlab.search.search import Search, run_search
from towerlab.search.samplers import (SAMPLERS, Sampler, Shape, make_sampler, random_genome,
                                      refuse_unused_settings, resolved_settings, sampler_class, sampler_shape,
                                      settings_classes, settings_of_others)
from towerlab.search.samplers.ga import breed, initial_population, mutate, next_generation
from towerlab.search.samplers.grid import grid_genomes
from towerlab.search.views.show import evaluation_records, format_search
from towerlab.search.space import BUILTIN_SPACES, Space, canonical, genome_hash, load_space
from towerlab.search.store import Store
from towerlab.search.trainers import Prefetching, Record, Trainer, serial

__all__ = [
    "BUILTIN_SPACES", "SAMPLERS", "Candidate", "Generation", "GenerationStats", "Ladder", "Member",
    "Outcome", "Prefetching", "Pruner", "Record", "Sampler", "Search", "SearchResult", "Shape", "Space", "Store",
    "SuccessiveHalving", "TopGenome",
    "Trainer", "breed", "candidate_seed", "canonical", "evaluation_records", "format_search", "genome_hash",
    "grid_genomes", "initial_population", "load_space", "make_pruner", "make_rng", "make_sampler", "mutate",
    "next_generation", "planned_trainings", "random_genome", "rank_key",
    "refuse_unused_settings", "remeasure_seed", "resolved_remeasure", "resolved_settings", "rung_epochs", "rung_hash",
    "run_search", "sampler_class", "sampler_shape", "serial", "settings_classes", "settings_of_others",
]
