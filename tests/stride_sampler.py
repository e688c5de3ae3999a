"""A sampler with a setting of its own, added as towerlab.search.samplers says: this one file, and
its line in SAMPLERS ("stride": "stride_sampler:StrideSampler"; test_search_new_sampler.py adds
it at test time). It proposes every `--stride`-th genome of the space, in the space's order."""

from __future__ import annotations

from dataclasses import dataclass

from towerlab.config import SamplerSettings, setting
from towerlab.errors import UserError
from towerlab.search.samplers import Sampler


@dataclass(frozen=True)
class StrideSettings(SamplerSettings):
    """The stride sampler's settings."""

    stride: int = setting(2, "stride: propose every N-th genome of the space")

    def check(self) -> None:
        if self.stride < 1:
            raise UserError(f"--stride must be at least 1, got {self.stride}")


class StrideSampler(Sampler):
    Settings = StrideSettings

    def propose(self, history):
        step = self.settings.stride
        start = sum(len(g.members) for g in history) * step
        end = min(start + self.population * step, self.space.size)
        return [self.space.genome_at(i) for i in range(start, end, step)]
