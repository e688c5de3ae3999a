"""Lookahead on the weights, as airbench94 uses it (K. Jordan, arXiv 2404.00498; the Lookahead
optimizer of M. Zhang et al., arXiv 1907.08610).

A slow copy of every floating-point tensor of the model's state (parameters and BatchNorm
statistics) follows the trained ("fast") weights: every `every` steps,

    slow = d * slow + (1 - d) * fast;  fast = slow,   with d = decay ** every * (step / total_steps) ** 3,

so early on (d near 0) it only copies, and towards the end it averages over more and more steps.
After the last step the model takes the slow weights. Nothing here reads a value back to the host.
"""

from __future__ import annotations

import torch
from torch import nn

from towerlab.config import TrainConfig


class Lookahead:
    def __init__(self, module: nn.Module, every: int, decay: float, total_steps: int):
        self.every = every
        self.decay = decay
        self.total_steps = total_steps
        self.fast = [t.detach() for t in module.state_dict(keep_vars=True).values() if t.is_floating_point()]
        self.slow = [t.clone() for t in self.fast]
        self.steps = 0

    @torch.no_grad()
    def step(self) -> bool:
        """Count one optimizer step; True when the model's weights were changed."""
        self.steps += 1
        changed = False
        if self.steps % self.every == 0:
            mix = self.decay ** self.every * (self.steps / self.total_steps) ** 3
            torch._foreach_lerp_(self.slow, self.fast, 1.0 - mix)
            torch._foreach_copy_(self.fast, self.slow)
            changed = True
        if self.steps == self.total_steps:
            torch._foreach_copy_(self.fast, self.slow)
            changed = True
        return changed

    def state_dict(self) -> dict:
        return {"steps": self.steps, "slow": [t.clone() for t in self.slow]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]
        for slow, saved in zip(self.slow, state["slow"], strict=True):
            slow.copy_(saved)


def lookahead_for(cfg: TrainConfig, module: nn.Module, total_steps: int) -> Lookahead | None:
    """`--lookahead`'s averaging of `module` over a run of `total_steps`, or None when it is off."""
    return Lookahead(module, cfg.lookahead, cfg.lookahead_decay, total_steps) if cfg.lookahead else None
