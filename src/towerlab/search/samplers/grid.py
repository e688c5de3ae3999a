"""The brute-force baseline (`--sampler grid`, `towerlab grid`): every genome of a space (or a
seeded random subset) as one generation, through the same store, cache and resume as any search.
A range gene contributes every value it holds (an int or stepped range) or its `points` values (a
float range); a float range without either is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from towerlab.config import MAX_MEMBERS, SamplerSettings, SearchConfig, check_members, setting
from towerlab.errors import UserError
from towerlab.search.candidates import GRID_STREAM, make_rng
from towerlab.search.history import Generation
from towerlab.search.samplers import Sampler
from towerlab.search.space import Space


def _check(space: Space, limit: Optional[int]) -> None:
    if (limit is None or limit >= space.size) and space.size > MAX_MEMBERS:
        raise UserError(f"space {space.name} has {space.size} genomes: grid a random subset "
                        f"with --limit N (N up to {MAX_MEMBERS})")


def grid_genomes(space: Space, limit: Optional[int], seed: int) -> list[dict]:
    """All genomes in `space.gridded().all_genomes()` order or, with a `limit` below the space size,
    that many drawn without replacement by the search RNG, kept in the same order."""
    space = space.gridded()
    _check(space, limit)
    if limit is None or limit >= space.size:
        return list(space.all_genomes())
    picks = make_rng(seed, GRID_STREAM).choice(space.size, size=limit, replace=False)
    return [space.genome_at(int(i)) for i in sorted(picks)]


@dataclass(frozen=True)
class GridSettings(SamplerSettings):
    """The grid's settings (grid, towerlab grid)."""

    limit: Optional[int] = setting(None, "grid only: evaluate a random subset of this many genomes")

    def check(self) -> None:
        check_members("limit", self.limit)
        if self.limit is not None and self.limit <= 0:
            raise UserError(f"--limit must be positive, got {self.limit}")


class GridSampler(Sampler):
    identity = ()
    Settings = GridSettings
    one_generation = True

    def __init__(self, cfg: SearchConfig, space: Space) -> None:
        super().__init__(cfg, space)
        grid = space.gridded()  # a float range without points is refused here, before any folder or worker
        limit = self.settings.limit
        _check(grid, limit)
        self.population = min(limit or grid.size, grid.size)  # its one generation

    def propose(self, history: Sequence[Generation]) -> list[dict]:
        return [] if history else grid_genomes(self.space, self.settings.limit, self.cfg.seed)
