"""Network search: samplers (the genetic algorithm, the grid, random, TPE) run by one engine loop,
with a SQLite store that caches every evaluation and replays a search on resume. Pure Python and
numpy (Optuna for TPE), never torch.

The torch side supplies a `Trainer`, `train(candidates, record)` (see `towerlab.search.candidates`);
a pruner (`towerlab.search.pruners`) says what a generation's rungs are and whom each promotes; the
store is `towerlab.search.store.Store`, and `towerlab.search.pool` hands candidates to worker
processes. Everything random comes from the search seed, so a search can be resumed by replaying
it against its store.
"""

from towerlab.search.candidates import (Candidate, Outcome, Record, Trainer, candidate_seed, make_rng,
                                        remeasure_seed, serial)
from towerlab.search.engine import open_search, planned_trainings, resolved_remeasure, run_search
from towerlab.search.history import Generation, GenerationStats, Member, SearchResult, TopGenome, rank_key
from towerlab.search.pruners import Pruner, SuccessiveHalving, make_pruner, rung_epochs
from towerlab.search.rounds import rung_hash
from towerlab.search.samplers import (SAMPLERS, Sampler, make_sampler, own_settings, random_genome,
                                      refuse_unused_settings, resolved_settings, sampler_class, settings_classes,
                                      settings_of_others)
from towerlab.search.samplers.ga import breed, initial_population, mutate, next_generation
from towerlab.search.samplers.grid import grid_genomes
from towerlab.search.show import evaluation_records, format_search
from towerlab.search.space import BUILTIN_SPACES, Space, canonical, genome_hash, load_space
from towerlab.search.store import Store

__all__ = [
    "BUILTIN_SPACES", "SAMPLERS", "Candidate", "Generation", "GenerationStats", "Member",
    "Outcome", "Pruner", "Record", "Sampler", "SearchResult", "Space", "Store", "SuccessiveHalving", "TopGenome",
    "Trainer", "breed", "candidate_seed", "canonical", "evaluation_records", "format_search", "genome_hash",
    "grid_genomes", "initial_population", "load_space", "make_pruner", "make_rng", "make_sampler", "mutate",
    "next_generation", "open_search", "own_settings", "planned_trainings", "random_genome", "rank_key",
    "refuse_unused_settings", "remeasure_seed", "resolved_remeasure", "resolved_settings", "rung_epochs", "rung_hash",
    "run_search", "sampler_class", "serial", "settings_classes", "settings_of_others",
]
