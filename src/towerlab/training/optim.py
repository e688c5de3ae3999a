"""Optimizers and learning-rate schedules, in two forms.

- torch.optim's optimizers (fused or foreach) stepped with torch's schedulers: the eager step, for
  every strategy (`ScheduledOptimizer`, built from the `OPTIMIZERS` and `SCHEDULES` registries): here.
- `update.Update`: the same arithmetic as tensor operations on state allocated up front, for the
  step program (training/update.py), with its tables recorded from the schedulers made here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from towerlab.catalog import models as model_catalog
from towerlab.config import TrainConfig
from towerlab.training.muon import FilterMuon

# Each optimizer's default learning rate (Keras' values, which the original search used); a search
# space without an lr gene trains each optimizer at its own default.
DEFAULT_LR = {"adam": 1e-3, "sgd": 1e-2, "rmsprop": 1e-3, "adagrad": 1e-2, "adadelta": 1.0,
              "adamax": 2e-3, "nadam": 2e-3, "muon": 1e-2}  # muon: its SGD side's (--muon-lr: the filters')

# airbench94's linear schedule (K. Jordan, arXiv 2404.00498): the learning rate starts at 0.2 x its
# peak, reaches the peak after 23% of the steps and ends at 0.07 x the peak.
LINEAR_START, LINEAR_END, LINEAR_WARMUP = 0.2, 0.07, 0.23
ONECYCLE_WARMUP = 0.3  # OneCycleLR's own default


@dataclass(frozen=True)
class Group:
    """One parameter group: `positions` in the trained parameters (`trained_parameters`); `scale`, its
    learning rate's multiplier of --lr, by which its weight decay is divided (so it decays as much per
    step as the rest); `part`, what steps it: "main" (--optimizer under --schedule; SGD for muon),
    "whiten_bias" (the same optimizer, at a rate falling linearly to 0 over its first `until` steps,
    --whiten-bias-epochs) or "muon" (Muon at --muon-lr under --schedule)."""

    positions: list[int]
    scale: float = 1.0
    part: str = "main"
    until: int = 0


PARTS = ("main", "whiten_bias", "muon")  # in this order in every list of groups and of optimizers


def parameter_groups(module: nn.Module, params: list[torch.Tensor], cfg: TrainConfig,
                     steps_per_epoch: int = 1) -> list[Group]:
    """`params` (the trained parameters, in the model's order) in groups, in `PARTS` order: those at
    the base learning rate; those of normalisation layers when --norm-lr-scale != 1; the whitening
    layer's bias under --whiten-bias-epochs (at the normalisation layers' rate, over its first epochs of
    `steps_per_epoch` steps); the convolution filters (4-D weights) under --optimizer muon."""
    muon = [i for i, p in enumerate(params) if cfg.optimizer == "muon" and p.dim() == 4]
    bias = model_catalog.hooks(cfg.model).whitening_bias if cfg.whiten_bias_epochs else None
    whiten = [i for i, p in enumerate(params) if bias is not None and p is bias(module)]
    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    in_norm = {id(p) for m in module.modules() if isinstance(m, norm_types) for p in m.parameters(recurse=False)}
    rest = [i for i in range(len(params)) if i not in muon and i not in whiten]
    scaled = [i for i in rest if cfg.norm_lr_scale != 1.0 and id(params[i]) in in_norm]
    groups = [Group([i for i in rest if i not in scaled]), Group(scaled, cfg.norm_lr_scale),
              Group(whiten, cfg.norm_lr_scale, "whiten_bias", cfg.whiten_bias_epochs * steps_per_epoch),
              Group(muon, part="muon")]
    return [groups[0]] + [g for g in groups[1:] if g.positions]


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


# --optimizer NAME -> its torch.optim optimizer over prepared parameter groups (muon: SGD, over the
# parameters that are not filters; its filters are `FilterMuon`'s). One fused kernel per
# step where torch has one: Adam, AdamW and SGD on CPUs and GPUs, Adagrad on CPUs. On a CPU, fused
# Adam steps LeNet-5's parameters 2.6x and CifarNet's 3.1x faster than foreach, whose CPU path still
# loops over the tensors (bench/speed/changes.py). An optimizer is also an `Update` method and a `STATE`
# entry (the step program's form) and a `DEFAULT_LR`; tests hold all four to config.OPTIMIZERS.
OPTIMIZERS: dict[str, Callable[[TrainConfig, list[dict], torch.device], torch.optim.Optimizer]] = {
    "adam": _adam, "sgd": _sgd, "rmsprop": _foreach(torch.optim.RMSprop), "adagrad": _adagrad,
    "adadelta": _foreach(torch.optim.Adadelta), "adamax": _foreach(torch.optim.Adamax),
    "nadam": _foreach(torch.optim.NAdam), "muon": _sgd}


def make_optimizer(cfg: TrainConfig, params: list[torch.Tensor], groups: list[Group],
                   device: torch.device) -> torch.optim.Optimizer:
    """The torch.optim optimizer of `groups` (of one part) over `params`: --optimizer (SGD for muon's
    "main" and "whiten_bias" parts; the main part's second group, if any, learns `cfg.norm_lr_scale`
    times faster with its weight decay divided by as much, airbench94's BatchNorm biases: 64x), or
    Muon over the filters of a "muon" group."""
    if groups and groups[0].part == "muon":
        return FilterMuon([params[i] for i in groups[0].positions], cfg.muon_lr, cfg.muon_momentum,
                          cfg.muon_ns_steps, cfg.muon_normalize)
    param_groups = [{"params": [params[i] for i in g.positions], "lr": cfg.lr * g.scale,
                     "weight_decay": cfg.weight_decay / g.scale} for g in groups]
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


def _decay(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: decay_factor(step, total_steps))


def decay_factor(step: int, steps: int) -> float:
    """The --schedule decay multiplier before step `step` (0-based) of `steps`: 1 down to 1/steps, 0 after
    (airbench94_muon's, and its whitening bias's over its first epochs)."""
    return max(0.0, 1.0 - step / steps)


# --schedule NAME -> torch's scheduler for it, or None (the step program reads the same values from
# `schedule_tables`, recorded from these).
SCHEDULES: dict[str, Callable[[TrainConfig, torch.optim.Optimizer, int], Any]] = {
    "constant": _constant, "onecycle": _onecycle, "linear": _linear, "decay": _decay}


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    return SCHEDULES[cfg.schedule](cfg, optimizer, total_steps)


def _part_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int, group: Group) -> Any:
    """A part's scheduler: --schedule's, or the whitening bias's own decay over its first steps."""
    if group.part == "whiten_bias":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: decay_factor(step, group.until))
    return make_scheduler(cfg, optimizer, total_steps)


class ScheduledOptimizer:
    """`cfg`'s optimizer and schedule over `params`, set up once for every strategy: `step()` after
    the gradients are in, `lr()` of the next step, and the state a checkpoint keeps. One torch.optim
    optimizer and scheduler per part of `groups` (`PARTS`); the main part's are the checkpoint's
    {"optimizer", "scheduler"} (the layout of every checkpoint so far), another part's sit beside
    them under its name."""

    def __init__(self, cfg: TrainConfig, params: list[torch.Tensor], groups: list[Group],
                 device: torch.device, total_steps: int):
        self.parts: dict[str, tuple[torch.optim.Optimizer, Any]] = {}
        for part in PARTS:
            mine = [g for g in groups if g.part == part]
            if mine:
                optimizer = make_optimizer(cfg, params, mine, device)
                self.parts[part] = (optimizer, _part_scheduler(cfg, optimizer, total_steps, mine[0]))

    def param_groups(self) -> list[dict]:
        """Every part's torch.optim groups, in the order of the groups it was made from."""
        return [g for optimizer, _ in self.parts.values() for g in optimizer.param_groups]

    def zero_grad(self) -> None:
        for optimizer, _ in self.parts.values():
            optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        for optimizer, scheduler in self.parts.values():
            optimizer.step()
            if scheduler is not None:
                scheduler.step()

    def lr(self) -> float:
        return float(self.param_groups()[0]["lr"])

    def state_dict(self) -> dict:
        parts = {part: {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict() if scheduler else None}
                 for part, (optimizer, scheduler) in self.parts.items()}
        return {**parts.pop("main"), **parts}

    def load_state_dict(self, state: dict) -> None:
        for part, (optimizer, scheduler) in self.parts.items():
            saved = state if part == "main" else state[part]
            optimizer.load_state_dict(saved["optimizer"])
            if scheduler is not None and saved.get("scheduler"):
                scheduler.load_state_dict(saved["scheduler"])


# What a strategy is handed: it builds the optimizer over the tensors it steps (the replica's
# parameters, or the parameter server's master copy on the CPU), in the order of the module's
# trained parameters, on their device.
OptimizerFactory = Callable[[list[torch.Tensor], torch.device], ScheduledOptimizer]


def optimizer_factory(cfg: TrainConfig, module: nn.Module, total_steps: int, steps_per_epoch: int) -> OptimizerFactory:
    groups = parameter_groups(module, trained_parameters(module), cfg, steps_per_epoch)

    def build(params: list[torch.Tensor], device: torch.device) -> ScheduledOptimizer:
        return ScheduledOptimizer(cfg, params, groups, device, total_steps)
    return build
