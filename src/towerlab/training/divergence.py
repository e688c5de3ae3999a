"""A run whose loss became NaN or infinite stops with `Diverged`, which says where and the likely cause;
`DivergenceWatch` sees it without a host sync per step.
"""

from __future__ import annotations

import math

import torch

from towerlab.config import TrainConfig
from towerlab.distributed.group import Context, sum_over_ranks
from towerlab.errors import UserError


class Diverged(UserError):
    """The loss became NaN or infinite: the run cannot succeed, and must not look as if it had."""


class DivergenceWatch:
    """Watches the loss for NaN / inf without a host sync per step: each step folds its loss into a
    running maximum on the device (one tiny kernel; NaN and inf propagate through it), which is read
    only where the host reads anyway (display steps, evaluations, epoch ends, a save on Ctrl-C)."""

    def __init__(self, cfg: TrainConfig, ctx: Context, step: int, worst: torch.Tensor):
        self.cfg, self.ctx = cfg, ctx
        self.worst = worst  # folded into by every step (its `Steps.worst`)
        self.checked = step  # the loss was finite up to this step

    def flag(self) -> torch.Tensor:
        """1.0 when a non-finite loss was seen since the last check (reduce it over the ranks)."""
        return (~torch.isfinite(self.worst)).to(torch.float64)

    def check(self, step: int, flagged: float | None = None, val_loss: float | None = None) -> None:
        """Raise Diverged when any rank saw a non-finite loss (`flagged`: the flag already summed
        over the ranks; else it is reduced here, a collective) or the validation loss is not finite."""
        if flagged is None:
            flagged = float(sum_over_ranks(self.ctx, self.flag().reshape(1)).item())
        if flagged == 0 and (val_loss is None or math.isfinite(val_loss)):
            self.checked = step
            return
        if flagged and step == 1:  # the loss of the initial weights: no update, no learning rate, has run yet
            raise Diverged("the model's output is not finite: the loss of the first step, on the initial weights "
                           "before any update, is NaN or infinite, so the learning rate is not the cause: check "
                           "the model (its initialisation, or the forward of a module of your own)")
        if not flagged:
            what = f"the validation loss after step {step} is NaN or infinite"
        elif step == self.checked + 1:
            what = f"the training loss became NaN or infinite at step {step}"
        else:
            what = f"the training loss became NaN or infinite between steps {self.checked + 1} and {step}"
        raise Diverged(f"training diverged: {what}; likely cause: the learning rate (--lr {self.cfg.lr:g}, "
                       f"{self.cfg.optimizer}) is too high for this model and data, or the data holds values it "
                       "cannot fit: lower --lr")
