"""`--sampler auto`, the default: the sampler that fits the space, by the rule the Optuna team gives its
own AutoSampler (OptunaHub's samplers/auto_sampler), adapted to a search whose workers propose while
others train:

- a space with a numeric range that every trial holds (not conditional): gp (Optuna's Gaussian process),
  for its first GP_OUTCOMES outcomes; past them Optuna's TPE proposes from the same history. A Gaussian
  process is the most sample-efficient model of a few numeric hyperparameters, where a search has some
  hundreds of trainings at most: on LCBench (7 numeric genes, 100 trainings) it reached a regret 4 to 8
  times lower than TPE's at the same budget (docs/benchmarks.md). Listed genes beside the ranges do not
  change that: its kernel takes them as categories, and a conditional gene is told it with a stand-in
  where it is inactive (towerlab.search.samplers.gp), so it models every gene; on rbv2_xgboost
  (XGBoost's 14 hyperparameters, 2 listed and 8 conditional, 150 trainings) it reached a quarter of
  TPE's regret at half the budget and was ahead of SMAC3's random forest at all of it (docs/benchmarks.md,
  rbv2_xgboost), where TPE, one density a gene, kept drawing the first booster that scored well. A pruned
  search (--min-epochs) runs it too, 2 a generation racing through the rungs its judge keeps
  (towerlab.search.judge): the Gaussian process reads only the trainings
  that reached the last rung, TPE the pruned ones too, yet on LCBench pruned from 1 epoch and from 4
  TPE's regret was 2 to 20 times gp's at every point of the budget (docs/benchmarks.md, pruning). Its
  cost grows with the cube of the outcomes (CPU seconds a proposal: about 0.7 at 100 outcomes, see
  gp's module), TPE's linearly: past some hundreds, the model's gain no longer pays for its time,
  which is where Optuna's AutoSampler leaves it too (250).
- a space of listed genes alone (the built-in spaces: a model's name, an activation, a list of sizes),
  or whose every range is conditional: tpe, as before this sampler existed. The Gaussian process would
  have only categories to model, where TPE models each value's density and each conditional gene from
  the trials of its branch.

`choice` says which and why, in words that `search run`'s first lines and `search show` print
(`described`).

The choice reads the space alone, which a resumed search keeps (its budget may grow): every worker
and every resume of an auto search makes the same choice, from the store's record.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from towerlab.config import SamplerSettings, SearchConfig
from towerlab.search.history import Generation
from towerlab.search.samplers import InFlight, Sampler, Shape, sampler_class
from towerlab.search.samplers.gp import GPSampler
from towerlab.search.space import Range, Space

GP_OUTCOMES = 250


class _GaussianThenTPE(GPSampler):
    tpe_after = GP_OUTCOMES


def choice(space: Space) -> tuple[str, str]:
    """The sampler an auto search of `space` runs, gp or tpe (see the module's docstring), and why, in a few
    words."""
    ranges = [name for name, gene in space.genes.items() if isinstance(gene, Range) and name not in space.when]
    if not ranges:
        listed = next(name for name in space.genes if name not in space.when)  # a range would be in `ranges`
        return "tpe", (f"gene {listed!r} is a list of values, which TPE models value by value"
                       + (", and no range is in every trial" if space.conditional else ""))
    if len(ranges) == len(space.genes):
        return "gp", f"every gene is a numeric range: a Gaussian process, TPE after {GP_OUTCOMES} outcomes"
    return "gp", (f"gene {ranges[0]!r} is a numeric range in every trial: a Gaussian process (listed genes its "
                  f"categories, conditional ones where they are active), TPE after {GP_OUTCOMES} outcomes")


def described(cfg: SearchConfig, space: Space) -> str:
    """The sampler a search runs, as its first lines and `search show` name it: auto's choice with its reason."""
    if cfg.sampler != "auto":
        return cfg.sampler
    name, why = choice(space)
    return f"auto (chose {name}: {why})"


def _inner(cfg: SearchConfig, space: Space) -> tuple[type[Sampler], SearchConfig]:
    name = choice(space)[0]
    return (_GaussianThenTPE if name == "gp" else sampler_class(name)), dataclasses.replace(cfg, sampler=name)


class AutoSampler(Sampler):
    @classmethod
    def shape(cls, cfg: SearchConfig, space: Space, settings: SamplerSettings) -> Shape:
        inner, inner_cfg = _inner(cfg, space)
        return inner.shape(inner_cfg, space, inner.own(inner_cfg))

    @classmethod
    def generations(cls, cfg: SearchConfig, space: Space) -> int:
        inner, inner_cfg = _inner(cfg, space)
        return inner.generations(inner_cfg, space)

    @classmethod
    def needs(cls, cfg: SearchConfig, space: Space) -> None:
        inner, inner_cfg = _inner(cfg, space)
        inner.needs(inner_cfg, space)

    def __init__(self, cfg: SearchConfig, space: Space, rungs: int) -> None:
        super().__init__(cfg, space, rungs)
        inner, inner_cfg = _inner(cfg, space)
        self._sampler = inner(inner_cfg, space, rungs)
        self.overlaps, self.startup = self._sampler.overlaps, self._sampler.startup

    def propose(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        return self._sampler.propose(history, in_flight)

    def propose_quickly(self, history: Sequence[Generation], in_flight: Optional[InFlight] = None) -> list[dict]:
        return self._sampler.propose_quickly(history, in_flight)

    def tell(self, generation: Generation) -> None:
        self._sampler.tell(generation)

    def prepare(self) -> None:
        self._sampler.prepare()
