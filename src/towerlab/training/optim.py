"""Optimizers and learning-rate schedules, in two forms.

- torch.optim's optimizers (fused or foreach) stepped with torch's schedulers: the eager step, for
  every strategy (`ScheduledOptimizer`, built from the `OPTIMIZERS` and `SCHEDULES` registries): here.
- `update.Update`: the same arithmetic as tensor operations on state allocated up front, for the
  step program (training/update.py), with its tables recorded from the schedulers made here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from towerlab.config import TrainConfig

# Each optimizer's default learning rate (Keras' values, which the original search used); a search
# space without an lr gene trains each optimizer at its own default.
DEFAULT_LR = {"adam": 1e-3, "sgd": 1e-2, "rmsprop": 1e-3, "adagrad": 1e-2, "adadelta": 1.0,
              "adamax": 2e-3, "nadam": 2e-3}

# airbench94's linear schedule (K. Jordan, arXiv 2404.00498): the learning rate starts at 0.2 x its
# peak, reaches the peak after 23% of the steps and ends at 0.07 x the peak.
LINEAR_START, LINEAR_END, LINEAR_WARMUP = 0.2, 0.07, 0.23
ONECYCLE_WARMUP = 0.3  # OneCycleLR's own default


def parameter_groups(module: nn.Module, params: list[torch.Tensor], norm_lr_scale: float) -> list[list[int]]:
    """Positions in `params` (the trained parameters, in the model's order) of the parameters trained
    at the base learning rate, then of those of normalisation layers when `norm_lr_scale` != 1."""
    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    in_norm = {id(p) for m in module.modules() if isinstance(m, norm_types) for p in m.parameters(recurse=False)}
    plain = [i for i, p in enumerate(params) if norm_lr_scale == 1.0 or id(p) not in in_norm]
    scaled = [i for i, p in enumerate(params) if norm_lr_scale != 1.0 and id(p) in in_norm]
    return [plain, scaled] if scaled else [plain]


def group_scales(cfg: TrainConfig, groups: list[list[int]]) -> list[float]:
    """Each group's learning-rate multiplier: 1, then `norm_lr_scale` for normalisation layers."""
    return [1.0, cfg.norm_lr_scale][:len(groups)]


def trained_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The parameters an optimizer steps, in the model's order (what `parameter_groups` indexes)."""
    return [p for p in module.parameters() if p.requires_grad]


def _adam(cfg: TrainConfig, param_groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    cls = torch.optim.AdamW if cfg.weight_decay > 0 else torch.optim.Adam
    return cls(param_groups, lr=cfg.lr, fused=True)


def _sgd(cfg: TrainConfig, param_groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.SGD(param_groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, fused=True)


def _adagrad(cfg: TrainConfig, param_groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
    fast = {"fused": True} if device.type == "cpu" else {"foreach": True}
    return torch.optim.Adagrad(param_groups, lr=cfg.lr, **fast)


def _foreach(cls: Callable[..., torch.optim.Optimizer]) -> Callable[[TrainConfig, list[dict], torch.device],
                                                            torch.optim.Optimizer]:
    def build(cfg: TrainConfig, param_groups: list[dict], device: torch.device) -> torch.optim.Optimizer:
        return cls(param_groups, lr=cfg.lr, foreach=True)
    return build


# --optimizer NAME -> its torch.optim optimizer over prepared parameter groups. One fused kernel per
# step where torch has one: Adam, AdamW and SGD on CPUs and GPUs, Adagrad on CPUs. On a CPU, fused
# Adam steps LeNet-5's parameters 2.6x and CifarNet's 3.1x faster than foreach, whose CPU path still
# loops over the tensors (bench/changes.py). An optimizer is also an `Update` method and a `STATE`
# entry (the step program's form) and a `DEFAULT_LR`; tests hold all four to config.OPTIMIZERS.
OPTIMIZERS: dict[str, Callable[[TrainConfig, list[dict], torch.device], torch.optim.Optimizer]] = {
    "adam": _adam, "sgd": _sgd, "rmsprop": _foreach(torch.optim.RMSprop), "adagrad": _adagrad,
    "adadelta": _foreach(torch.optim.Adadelta), "adamax": _foreach(torch.optim.Adamax),
    "nadam": _foreach(torch.optim.NAdam)}


def make_optimizer(cfg: TrainConfig, params: list[torch.Tensor], groups: list[list[int]],
                   device: torch.device) -> torch.optim.Optimizer:
    """`cfg.optimizer` over `params`; the second of `groups`, if any, learns `cfg.norm_lr_scale` times
    faster with its weight decay divided by as much, so its decay per step stays that of the rest
    (airbench94's BatchNorm biases: 64x)."""
    param_groups = [{"params": [params[i] for i in group], "lr": cfg.lr * scale,
                     "weight_decay": cfg.weight_decay / scale}
                    for group, scale in zip(groups, group_scales(cfg, groups))]
    return OPTIMIZERS[cfg.optimizer](cfg, param_groups, device)


def linear_factor(step: int, total_steps: int, warmup: float) -> float:
    """The --schedule linear multiplier of the peak learning rate before step `step` (0-based)."""
    rise = int(total_steps * warmup)
    if step < rise:
        return LINEAR_START + (1.0 - LINEAR_START) * step / rise
    return 1.0 + (LINEAR_END - 1.0) * (step - rise) / max(1, total_steps - rise)


def _constant(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> None:
    return None  # the optimizer's own learning rate throughout: nothing to step


def _onecycle(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    warmup = ONECYCLE_WARMUP if cfg.warmup is None else cfg.warmup
    # It cycles the momentum too, where the optimizer has one (Adagrad and Adadelta have none).
    cycles = any(key in optimizer.defaults for key in ("momentum", "betas"))
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                               total_steps=max(2, total_steps), pct_start=warmup,
                                               cycle_momentum=cycles)


def _linear(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    warmup = LINEAR_WARMUP if cfg.warmup is None else cfg.warmup
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: linear_factor(step, total_steps, warmup))


# --schedule NAME -> torch's scheduler for it, or None (the step program reads the same values from
# `schedule_tables`, recorded from these).
SCHEDULES: dict[str, Callable[[TrainConfig, torch.optim.Optimizer, int], Any]] = {
    "constant": _constant, "onecycle": _onecycle, "linear": _linear}


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    return SCHEDULES[cfg.schedule](cfg, optimizer, total_steps)


class ScheduledOptimizer:
    """`cfg`'s optimizer and schedule over `params`, set up once for every strategy: `step()` after
    the gradients are in, `lr()` of the next step, and the state a checkpoint keeps
    ({"optimizer", "scheduler"}, the layout of every checkpoint so far)."""

    def __init__(self, cfg: TrainConfig, params: list[torch.Tensor], groups: list[list[int]],
                 device: torch.device, total_steps: int):
        self.optimizer = make_optimizer(cfg, params, groups, device)
        self.scheduler = make_scheduler(cfg, self.optimizer, total_steps)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler else None}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])


# What a strategy is handed: it builds the optimizer over the tensors it steps (the replica's
# parameters, or the parameter server's master copy on the CPU), in the order of the module's
# trained parameters, on their device.
OptimizerFactory = Callable[[list[torch.Tensor], torch.device], ScheduledOptimizer]


def optimizer_factory(cfg: TrainConfig, module: nn.Module, total_steps: int) -> OptimizerFactory:
    groups = parameter_groups(module, trained_parameters(module), cfg.norm_lr_scale)

    def build(params: list[torch.Tensor], device: torch.device) -> ScheduledOptimizer:
        return ScheduledOptimizer(cfg, params, groups, device, total_steps)
    return build
