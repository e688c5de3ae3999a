"""The kinds of step a run can take (`resolve_step`'s answers) and how each is built: one line each
in `STEP_KINDS`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from towerlab.config import TrainConfig
from towerlab.distributed.group import Context
from towerlab.training.batches import Batches
from towerlab.training.eager import EagerSteps
from towerlab.training.optim import optimizer_factory
from towerlab.training.program import StepProgram
from towerlab.training.step import Steps
from towerlab.training.strategies import make_strategy


def make_steps(mode: str, strategy: str, module: nn.Module, cfg: TrainConfig, ctx: Context, batches: Batches,
               total_steps: int) -> Steps:
    """The steps a run of `mode` (resolve_step's answer) drives, over `strategy` where the step is eager;
    their `worst` is the divergence watch's running maximum of the loss, on the device."""
    return STEP_KINDS[mode](strategy, module, cfg, ctx, batches, total_steps, torch.zeros((), device=ctx.device))


def _eager(strategy: str, module: nn.Module, cfg: TrainConfig, ctx: Context, batches: Batches,
           total_steps: int, worst: torch.Tensor) -> Steps:
    strat = make_strategy(strategy, module, ctx, optimizer_factory(cfg, module, total_steps, batches.steps_per_epoch))
    return EagerSteps(strat, batches, cfg, ctx, total_steps, worst)


def _program(strategy: str, module: nn.Module, cfg: TrainConfig, ctx: Context, batches: Batches,
             total_steps: int, worst: torch.Tensor) -> Steps:
    # Its own all-reduce: resolve_step let only --strategy ddp through.
    return StepProgram(module, cfg, ctx, batches, total_steps, worst)


# resolve_step's answers (--step's choices but auto, and "program", the tests' uncaptured program)
# -> how their steps are built; the program's kinds differ in what `prepare` records or compiles.
STEP_KINDS: dict[str, Callable[..., Steps]] = {"eager": _eager, "program": _program, "graph": _program,
                                               "compiled": _program}
