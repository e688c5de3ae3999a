"""The eager step, the reference every other kind must equal: batches from `Batches`, forward and
loss, a strategy's gradient exchange and its torch.optim optimizer and scheduler, Lookahead after it.
Every strategy and every input mode runs it.
"""

from __future__ import annotations

from typing import Callable, Generator

import torch

from towerlab.config import TrainConfig
from towerlab.distributed.group import Context
from towerlab.training.batches import Batches
from towerlab.training.lookahead import lookahead_for
from towerlab.training.step import (WARMUP_STEPS, Steps, Yield, forward_loss, lookahead_state, mixed_precision,
                                    seed_step, uses_dropout)
from towerlab.training.strategies import Strategy


class EagerSteps(Steps):
    """The reference step: batches from `Batches`, forward and loss here, the strategy's gradient
    exchange and torch.optim update, Lookahead after it, dropout seeded per step on the host."""

    mode = "eager"

    def __init__(self, strat: Strategy, batches: Batches, cfg: TrainConfig, ctx: Context, total_steps: int,
                 worst: torch.Tensor):
        self.strat, self.batches, self.cfg, self.ctx, self.worst = strat, batches, cfg, ctx, worst
        self.total_steps = total_steps
        self.steps_per_epoch = batches.steps_per_epoch
        self.dropout = uses_dropout(strat.module)
        self.precision = mixed_precision(cfg, ctx.device)
        self.lookahead = lookahead_for(cfg, strat.module, total_steps)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One update on the batch (x, y); returns its (loss, logits), detached."""
        loss, logits = forward_loss(self.strat.model, x, y, self.cfg, self.precision)
        self.strat.update(loss)
        # Lookahead's pull towards the slow weights, on every replica alike.
        if self.lookahead is not None and self.lookahead.step():
            self.strat.weights_changed()
        return loss.detach(), logits.detach()

    def epoch(self, epoch: int, start: int) -> Generator[Yield, None, None]:
        step = epoch * self.batches.steps_per_epoch + start
        for x, y in self.batches.epoch(epoch, start):
            if self.dropout:
                seed_step(self.cfg, self.ctx, step)
            loss, logits = self.step(x, y)
            torch.maximum(self.worst, loss.float(), out=self.worst)
            step += 1
            yield loss, logits, y

    def prepare(self, mode: str, step: int, log: Callable[[str], None]) -> int:
        return self.warm_up(step, min(WARMUP_STEPS, self.total_steps - step))

    def state_dict(self) -> dict:
        # The layout of every eager checkpoint: {"model", "optimizer", "scheduler"[, "lookahead"]}.
        return {"model": self.strat.module.state_dict(), **self.strat.state_dict(), **lookahead_state(self.lookahead)}

    def load_state_dict(self, state: dict) -> None:
        self.strat.module.load_state_dict(state["model"])
        self.strat.load_state_dict(state)
        if self.lookahead is not None:
            self.lookahead.load_state_dict(state["lookahead"])

    def lr(self) -> float:
        return self.strat.lr()
