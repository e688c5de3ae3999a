"""Genetic network search and the grid baseline: pure Python and numpy, never torch.

The torch side supplies `evaluate(candidates, record)` (see `towerlab.search.evaluation`) and a
`towerlab.store.Store`; everything random comes from the search seed, so a search can be resumed
by replaying it against its store.
"""

from towerlab.search.engine import Generation, GenerationStats, Member, SearchResult, TopGenome, rank_key
from towerlab.search.evaluation import Candidate, Evaluate, Outcome, Record, candidate_seed, make_rng, serial
from towerlab.search.ga import (
    breed,
    initial_population,
    mutate,
    next_generation,
    random_genome,
    run_evolution,
)
from towerlab.search.grid import grid_genomes, run_grid
from towerlab.search.show import format_search
from towerlab.search.space import (
    BUILTIN_SPACES,
    GENE_RULES,
    GeneRule,
    Space,
    canonical,
    genome_hash,
    load_space,
)

__all__ = [
    "BUILTIN_SPACES", "GENE_RULES", "Candidate", "Evaluate", "GeneRule", "Generation",
    "GenerationStats", "Member", "Outcome", "Record", "SearchResult", "Space", "TopGenome",
    "breed", "candidate_seed", "canonical", "format_search", "genome_hash", "grid_genomes", "initial_population",
    "load_space", "make_rng", "mutate", "next_generation", "random_genome", "rank_key",
    "run_evolution", "run_grid", "serial",
]
