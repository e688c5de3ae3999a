"""A search's candidates and what training one gave (`Candidate`, `Outcome`), and every seed of a search.

A candidate trains for `max_epochs` (None: the search's --max-epochs; a pruned search's lower
rungs train less, `towerlab.search.pruners`) with `seed`. Every random stream of a search derives from its seed:
`make_rng(seed, *stream)`, a sampler's own from `sampler_rng(seed, name, ...)`, and each
candidate's training seed from (search seed, generation, index), whichever worker trains it. A
re-measure's seed comes from (genome, replicate) alone, so every search sharing a store asks for
the same re-measures and the cache serves them. Who trains a candidate is `towerlab.search.trainers`'.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

# numpy is imported where it is used: the samplers import this module, and the command line imports
# them to build its flags from their settings, where `towerlab --help` answers without numpy.
if TYPE_CHECKING:
    import numpy as np

STATUSES = ("ok", "failed")
# SeedSequence spawn keys keep the streams apart: (0, generation) draws the genetic algorithm's
# generation, (1,) the grid's subset, (2, generation, index) a candidate's training seed, (3,
# replicate) under the genome's own entropy a re-measure's seed, (4, crc32(name), ...) a sampler's.
GENERATION_STREAM, GRID_STREAM, CANDIDATE_STREAM, REMEASURE_STREAM, SAMPLER_STREAM = 0, 1, 2, 3, 4


def make_rng(search_seed: int, *stream: int) -> np.random.Generator:
    """The search's own PCG64 stream `stream` (never the global `random` or `np.random` state)."""
    import numpy as np

    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(search_seed, spawn_key=stream)))


def sampler_rng(search_seed: int, name: str, *stream: int) -> np.random.Generator:
    """A sampler's own stream, apart from every other sampler's without a central list."""
    return make_rng(search_seed, SAMPLER_STREAM, zlib.crc32(name.encode()), *stream)


def _seed_of(seq: np.random.SeedSequence) -> int:
    return int(seq.generate_state(1)[0]) >> 1


def candidate_seed(search_seed: int, generation: int, index: int) -> int:
    """Training seed of the candidate at `index` of `generation`: a Python int in [0, 2**31), the
    same whichever worker trains it."""
    import numpy as np

    return _seed_of(np.random.SeedSequence(search_seed, spawn_key=(CANDIDATE_STREAM, generation, index)))


def remeasure_seed(genome_hash: str, replicate: int) -> int:
    """Training seed of re-measure `replicate` (1, 2, ...) of a genome, in [0, 2**31)."""
    import numpy as np

    return _seed_of(np.random.SeedSequence(int(genome_hash, 16), spawn_key=(REMEASURE_STREAM, replicate)))


@dataclass(frozen=True)
class Candidate:
    """A genome to train: its place in the search, the seed and the epochs to train it with, and
    which measurement it is (replicate 0: the evaluation, 1..: re-measures with fresh seeds). A pruned
    search's promotion continues the training of the genome's lower rung, with the same seed: it
    `starts` from that rung's epochs (0: from scratch), in the lower rung's trial folder."""

    generation: int
    index: int
    genome: dict
    genome_hash: str
    seed: int
    max_epochs: Optional[int] = None
    replicate: int = 0
    starts: int = 0

    def __hash__(self) -> int:
        return hash((self.generation, self.index, self.genome_hash, self.max_epochs, self.replicate))


@dataclass(frozen=True)
class Outcome:
    """What training a candidate gave. `fitness` is the validation accuracy (needed when ok);
    a failed outcome needs a `reason`. A non-finite val_loss is stored as None. `test_accuracy`: its
    network's on the test split, where it was scored there (a test task; a training that entered its
    search's top: `towerlab.search.testing`). `numerics`: what the
    result depends on besides the training's settings and seed (device, threads, precision, torch),
    as the worker that trained it saw it; `provenance`: where it was trained (host, versions, device,
    the data's digest); JSON objects. An objective of yours gives its `metrics` by name (the fitness is
    the searched one, negated where it is minimized) and the `curve` it reported. `continued`: the epochs
    it did not train because it continued its lower rung's training (its candidate's `starts`, where
    the objective takes it), which a budget in epochs does not charge again."""

    status: str
    fitness: Optional[float] = None
    val_loss: Optional[float] = None
    epochs: int = 0
    seconds: float = 0.0
    worker: str = ""
    reason: Optional[str] = None
    numerics: Optional[dict] = field(default=None, compare=False)
    provenance: Optional[dict] = field(default=None, compare=False)
    test_accuracy: Optional[float] = field(default=None, compare=False)  # not what a search ranks by
    metrics: Optional[dict] = field(default=None, compare=False)
    curve: Optional[list] = field(default=None, compare=False)
    continued: int = 0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"outcome status must be one of {STATUSES}, got {self.status!r}")
        if self.fitness is not None:
            object.__setattr__(self, "fitness", float(self.fitness))
        if self.status == "ok" and (self.fitness is None or not math.isfinite(self.fitness)):
            raise ValueError(f"an ok outcome needs a finite fitness, got {self.fitness!r}")
        if self.status == "failed" and not self.reason:
            raise ValueError("a failed outcome needs a reason")
        if self.val_loss is not None:
            loss = float(self.val_loss)
            object.__setattr__(self, "val_loss", loss if math.isfinite(loss) else None)
        object.__setattr__(self, "epochs", int(self.epochs))
        object.__setattr__(self, "continued", int(self.continued))
        object.__setattr__(self, "seconds", float(self.seconds))

    @classmethod
    def ok(cls, fitness: float, **details: Any) -> Outcome:
        return cls("ok", fitness=fitness, **details)

    @classmethod
    def failed(cls, reason: str, **details: Any) -> Outcome:
        """A failed training's Outcome, the one way one is built (its `reason`: `raised` says an exception)."""
        return cls("failed", reason=reason, **details)


def raised(exc: BaseException) -> str:
    """The reason of a training whose code raised `exc`: its type and its message's first line."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
