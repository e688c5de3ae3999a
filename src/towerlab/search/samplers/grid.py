"""The brute-force baseline (`--sampler grid`, `towerlab grid`): every genome of a space (or a
seeded random subset) as one generation, through the same store, cache and resume as any search.
A range gene contributes every value it holds (an int or stepped range) or its `points` values (a
float range); a float range without either is refused. Nothing is listed out: a genome is built
from its position in the grid (`Space.grid_genome_at`), so `--limit 1` of a range of 10**18 values
costs what it costs of a list of two. A conditional gene adds its values only where it is active: a
space of a booster (3 values) and a rate (4 values) active for one booster holds 2 + 4 genomes, not 12."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from towerlab.config import MAX_MEMBERS, SamplerSettings, SearchConfig, check_members, setting
from towerlab.errors import UserError
from towerlab.search.candidates import GRID_STREAM, make_rng
from towerlab.search.history import Generation
from towerlab.search.samplers import InFlight, Sampler, Shape
from towerlab.search.ranges import uniform_below
from towerlab.search.space import Space

# numpy's choice() draws positions below 2**63 (int64); a larger grid is drawn by Floyd's algorithm.
_NUMPY_CHOICE = 2**63


def _check(space: Space, size: int, limit: Optional[int]) -> None:
    if (limit is None or limit >= size) and size > MAX_MEMBERS:
        raise UserError(f"space {space.name} has {size} genomes: grid a random subset "
                        f"with --limit N (N up to {MAX_MEMBERS})")


def grid_genomes(space: Space, limit: Optional[int], seed: int) -> list[dict]:
    """All genomes of the grid in `Space.grid_genome_at` order or, with a `limit` below its size,
    that many drawn without replacement by the search RNG, kept in the same order."""
    counts = space.grid_counts()
    size = space.grid_size(counts)
    _check(space, size, limit)
    if limit is None or limit >= size:
        return [space.grid_genome_at(i, counts) for i in range(size)]
    return [space.grid_genome_at(i, counts) for i in sorted(_positions(size, limit, seed))]


def _positions(size: int, limit: int, seed: int) -> list[int]:
    """`limit` distinct positions below `size`, drawn by the grid's stream: numpy's choice() where it
    can (the positions a seed has always drawn), else Floyd's algorithm, in time and memory linear
    in `limit` however large `size` is."""
    rng = make_rng(seed, GRID_STREAM)
    if size < _NUMPY_CHOICE:
        return [int(i) for i in rng.choice(size, size=limit, replace=False)]
    picked: set[int] = set()
    for top in range(size - limit, size):
        pick = uniform_below(rng, top + 1)
        picked.add(top if pick in picked else pick)
    return list(picked)


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
    settings: GridSettings
    one_generation = True

    @classmethod
    def shape(cls, cfg: SearchConfig, space: Space, settings: SamplerSettings) -> Shape:
        shape = super().shape(cfg, space, settings)
        # a float range without points is refused here, before any folder or worker
        size = space.grid_size()
        assert isinstance(settings, GridSettings)
        limit = settings.limit
        _check(space, size, limit)
        return dataclasses.replace(shape, population=min(limit or size, size))  # its one generation

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        return [] if history else grid_genomes(self.space, self.settings.limit, self.cfg.seed)
