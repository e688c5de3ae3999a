"""The brute-force baseline: every genome of a space (or a seeded random subset), evaluated as one
generation through the same store, cache and resume as the genetic search."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search.engine import GenerationStats, SearchResult, finish_search, open_search, play_generation
from towerlab.search.evaluation import GRID_STREAM, Evaluate, make_rng
from towerlab.search.space import Space

if TYPE_CHECKING:
    from towerlab.store import Store

# A grid lists its genomes in the store; beyond this, ask for a --limit.
MAX_GRID = 1_000_000


def grid_genomes(space: Space, limit: Optional[int], seed: int) -> list[dict]:
    """All genomes in `space.all_genomes()` order or, with a `limit` below the space size, that
    many drawn without replacement by the search RNG, kept in the same order."""
    if limit is None or limit >= space.size:
        if space.size > MAX_GRID:
            raise UserError(f"space {space.name} has {space.size} genomes: grid a random subset "
                            f"with --limit N (N up to {MAX_GRID})")
        return list(space.all_genomes())
    if limit > MAX_GRID:
        raise UserError(f"--limit {limit} is too many genomes for a grid: use at most {MAX_GRID}")
    picks = make_rng(seed, GRID_STREAM).choice(space.size, size=limit, replace=False)
    return [space.genome_at(int(i)) for i in sorted(picks)]


def run_grid(cfg: SearchConfig, space: Space, evaluate: Evaluate, store: Store, train_config_hash: str,
             on_generation: Optional[Callable[[GenerationStats], None]] = None,
             *, resume: int | bool | None = None) -> SearchResult:
    """Evaluate the grid as generation 0 of a "grid" search. Each evaluation is recorded as it
    finishes, so a resumed grid (`resume` as in `run_evolution`) trains only what was unfinished."""
    search_id = open_search(store, "grid", cfg, space, train_config_hash, resume)
    generation = play_generation(store, search_id, cfg.seed, train_config_hash, 0,
                                 grid_genomes(space, cfg.limit, cfg.seed), evaluate)
    if on_generation is not None:
        on_generation(generation.stats)
    return finish_search(store, search_id, "grid", [generation], cfg.top)
