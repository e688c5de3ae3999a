"""Optimizers and learning-rate schedules, in two forms.

- torch.optim's optimizers (fused or foreach) stepped with torch's schedulers: the eager step, for
  every strategy (`ScheduledOptimizer`, built from the `OPTIMIZERS` and `SCHEDULES` registries).
- `Update`: the same arithmetic as tensor operations on state allocated up front, with the
  learning rate and the momentum (Adam's beta1) read from schedule tables by a step counter on the
  device. It takes no changing Python value and never reads a value back, so a CUDA graph can
  replay it and torch.compile can take it whole: the step program's update (towerlab.training.step). Its
  tables are recorded from torch's own schedulers (`schedule_tables`), so they hold the values
  torch.optim would use; tests hold `Update` to torch.optim, optimizer by optimizer.
"""

from __future__ import annotations

import warnings
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


def _foreach(cls: type[torch.optim.Optimizer]) -> Callable[[TrainConfig, list[dict], torch.device],
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


def _momentum(group: dict) -> float | None:
    """The momentum a group steps with (Adam's family: beta1), which OneCycleLR cycles; None for
    optimizers without one."""
    if "betas" in group:
        return float(group["betas"][0])
    if "momentum" in group:
        return float(group["momentum"])
    return None


def schedule_tables(cfg: TrainConfig, groups: list[list[int]], total_steps: int
                    ) -> tuple[list[list[float]], list[list[float]] | None]:
    """(lr[s][g], momentum[s][g] or None) for steps s = 0 .. total_steps - 1: the values torch's
    optimizer and scheduler for `cfg` hold when they take step s. Recorded by stepping them over one
    stand-in parameter per group, so every schedule is torch's own to the last bit."""
    params = [torch.zeros(1) for _ in groups]
    optimizer = make_optimizer(cfg, params, [[i] for i in range(len(groups))], torch.device("cpu"))
    scheduler = make_scheduler(cfg, optimizer, total_steps)
    lrs, momenta = [], []
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": no step is taken here
        warnings.simplefilter("ignore", UserWarning)
        for s in range(total_steps):
            lrs.append([float(g["lr"]) for g in optimizer.param_groups])
            momenta.append([_momentum(g) for g in optimizer.param_groups])
            if scheduler is not None and s + 1 < total_steps:
                scheduler.step()
    has_momentum = momenta and momenta[0][0] is not None
    return lrs, (momenta if has_momentum else None)


# torch.optim's defaults for what towerlab leaves at its default (make_optimizer passes lr, weight
# decay, and SGD's momentum and nesterov only).
BETA2, ADAM_EPS = 0.999, 1e-8
NADAM_MOMENTUM_DECAY = 4e-3
RMSPROP_ALPHA, RMSPROP_EPS = 0.99, 1e-8
ADAGRAD_EPS = 1e-10
ADADELTA_RHO, ADADELTA_EPS = 0.9, 1e-6

# The state torch.optim keeps per parameter, by optimizer (besides its step count).
STATE = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"), "nadam": ("exp_avg", "exp_avg_sq"),
         "adamax": ("exp_avg", "exp_inf"), "rmsprop": ("square_avg", "momentum_buffer"), "adagrad": ("sum",),
         "adadelta": ("square_avg", "acc_delta")}


class Update:
    """One optimizer step of `cfg.optimizer` as tensor arithmetic (torch.optim's algorithms with
    their defaults; AdamW's decoupled decay for adam with weight decay, L2 in the gradient for the
    rest). All state is allocated here, once, and only ever changed in place; `lr` and `momentum`
    come in as device tensors of one value per group. What torch.optim decides from a Python number
    (whether SGD or RMSprop keep a momentum buffer) is decided once, from the momentum table."""

    def __init__(self, cfg: TrainConfig, params: list[torch.Tensor], groups: list[list[int]], uses_momentum: bool):
        self.name = cfg.optimizer
        self.params = params
        self.groups = groups
        scales = group_scales(cfg, groups)
        self.weight_decay = [cfg.weight_decay / s for s in scales]
        self.decoupled = self.name == "adam" and cfg.weight_decay > 0
        self.nesterov = cfg.nesterov
        self.uses_momentum = uses_momentum
        # One count serves every parameter, in their precision (torch.optim's capturable count is a
        # float32 tensor; its bias corrections are Python doubles, which float64 parameters match).
        like = {"dtype": params[0].dtype, "device": params[0].device}
        self.step_count = torch.zeros((), **like)
        # NAdam's product of momenta: torch.optim keeps it in float32 whatever the parameters' precision.
        self.mu_product = torch.ones((), dtype=torch.float32, device=params[0].device)
        keys = STATE[self.name]
        if self.name in ("sgd", "rmsprop") and not uses_momentum:
            keys = tuple(k for k in keys if k != "momentum_buffer")
        self.state = {key: [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params] for key in keys}

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor, in a fixed order."""
        return [self.step_count, self.mu_product] + [t for key in sorted(self.state) for t in self.state[key]]

    @torch.no_grad()
    def __call__(self, grads: list[torch.Tensor], lr: torch.Tensor, momentum: torch.Tensor | None) -> None:
        self.step_count.add_(1)
        if self.name == "nadam":  # torch keeps one product per parameter; every group has the same beta1
            mu = momentum[0] * (1.0 - 0.5 * torch.pow(0.96, self.step_count * NADAM_MOMENTUM_DECAY))
            self.mu_product.mul_(mu.float())  # a float32 product, as torch.optim's
        for g, group in enumerate(self.groups):
            params = [self.params[i] for i in group]
            group_grads = [grads[i] for i in group]
            state = {key: [tensors[i] for i in group] for key, tensors in self.state.items()}
            decay = self.weight_decay[g]
            if decay and not self.decoupled:
                group_grads = torch._foreach_add(group_grads, params, alpha=decay)
            getattr(self, "_" + self.name)(params, group_grads, state, lr[g], None if momentum is None else momentum[g],
                                          decay)

    def _sgd(self, params, grads, state, lr, momentum, decay) -> None:  # noqa: ANN001
        if self.uses_momentum:
            buffers = state["momentum_buffer"]
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, grads)
            if self.nesterov:
                grads = torch._foreach_add(grads, torch._foreach_mul(buffers, momentum))
            else:
                grads = buffers
        torch._foreach_sub_(params, torch._foreach_mul(grads, lr))

    def _adam(self, params, grads, state, lr, beta1, decay) -> None:  # noqa: ANN001
        if self.decoupled:
            torch._foreach_mul_(params, 1.0 - lr * decay)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        _moments(exp_avg, exp_avg_sq, grads, beta1)
        step = self.step_count
        bias1 = 1.0 - torch.pow(beta1, step)
        bias2_sqrt = torch.sqrt(1.0 - torch.pow(BETA2, step))
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, bias2_sqrt)
        torch._foreach_add_(denom, ADAM_EPS)
        steps = torch._foreach_div(exp_avg, denom)
        torch._foreach_mul_(steps, lr / bias1)
        torch._foreach_sub_(params, steps)

    def _nadam(self, params, grads, state, lr, beta1, decay) -> None:  # noqa: ANN001
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        _moments(exp_avg, exp_avg_sq, grads, beta1)
        step = self.step_count
        mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, step * NADAM_MOMENTUM_DECAY))
        mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (step + 1) * NADAM_MOMENTUM_DECAY))
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, torch.sqrt(1.0 - torch.pow(BETA2, step)))
        torch._foreach_add_(denom, ADAM_EPS)
        mu_product = self.mu_product.to(lr.dtype)  # read in the parameters' precision, as torch.optim reads it
        from_grad = torch._foreach_div(grads, denom)
        torch._foreach_mul_(from_grad, lr * (1.0 - mu) / (1.0 - mu_product))
        from_avg = torch._foreach_div(exp_avg, denom)
        torch._foreach_mul_(from_avg, lr * mu_next / (1.0 - mu_product * mu_next))
        torch._foreach_sub_(params, from_grad)
        torch._foreach_sub_(params, from_avg)

    def _adamax(self, params, grads, state, lr, beta1, decay) -> None:  # noqa: ANN001
        exp_avg, exp_inf = state["exp_avg"], state["exp_inf"]
        torch._foreach_mul_(exp_avg, beta1)
        torch._foreach_add_(exp_avg, torch._foreach_mul(grads, 1.0 - beta1))
        torch._foreach_mul_(exp_inf, BETA2)
        magnitude = torch._foreach_abs(grads)
        torch._foreach_add_(magnitude, ADAM_EPS)
        torch._foreach_maximum_(exp_inf, magnitude)
        steps = torch._foreach_div(exp_avg, exp_inf)
        torch._foreach_mul_(steps, lr / (1.0 - torch.pow(beta1, self.step_count)))
        torch._foreach_sub_(params, steps)

    def _rmsprop(self, params, grads, state, lr, momentum, decay) -> None:  # noqa: ANN001
        square_avg = state["square_avg"]
        torch._foreach_mul_(square_avg, RMSPROP_ALPHA)
        torch._foreach_addcmul_(square_avg, grads, grads, value=1.0 - RMSPROP_ALPHA)
        avg = torch._foreach_sqrt(square_avg)
        torch._foreach_add_(avg, RMSPROP_EPS)
        scaled = torch._foreach_div(grads, avg)
        if self.uses_momentum:
            buffers = state["momentum_buffer"]
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, scaled)
            scaled = buffers
        torch._foreach_sub_(params, torch._foreach_mul(scaled, lr))

    def _adagrad(self, params, grads, state, lr, momentum, decay) -> None:  # noqa: ANN001
        sums = state["sum"]
        torch._foreach_addcmul_(sums, grads, grads)
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, ADAGRAD_EPS)
        steps = torch._foreach_div(grads, std)
        torch._foreach_sub_(params, torch._foreach_mul(steps, lr))

    def _adadelta(self, params, grads, state, lr, momentum, decay) -> None:  # noqa: ANN001
        square_avg, acc_delta = state["square_avg"], state["acc_delta"]
        torch._foreach_mul_(square_avg, ADADELTA_RHO)
        torch._foreach_addcmul_(square_avg, grads, grads, value=1.0 - ADADELTA_RHO)
        std = torch._foreach_add(square_avg, ADADELTA_EPS)
        torch._foreach_sqrt_(std)
        delta = torch._foreach_add(acc_delta, ADADELTA_EPS)
        torch._foreach_sqrt_(delta)
        torch._foreach_div_(delta, std)
        torch._foreach_mul_(delta, grads)
        torch._foreach_mul_(acc_delta, ADADELTA_RHO)
        torch._foreach_addcmul_(acc_delta, delta, delta, value=1.0 - ADADELTA_RHO)
        torch._foreach_sub_(params, torch._foreach_mul(delta, lr))


def _moments(exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor], grads: list[torch.Tensor],
             beta1: torch.Tensor) -> None:
    """Adam's first and second moments, in place: m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2."""
    torch._foreach_mul_(exp_avg, beta1)
    torch._foreach_add_(exp_avg, torch._foreach_mul(grads, 1.0 - beta1))
    torch._foreach_mul_(exp_avg_sq, BETA2)
    torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1.0 - BETA2)


def tables_on(device: torch.device, lrs: list[list[float]], momenta: list[list[float]] | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The schedule tables as float32 device tensors (steps x groups)."""
    lr = torch.tensor(lrs, dtype=torch.float32, device=device)
    return lr, (torch.tensor(momenta, dtype=torch.float32, device=device) if momenta is not None else None)


def uses_momentum(name: str, momenta: list[list[float]] | None) -> bool:
    """Whether SGD and RMSprop keep a momentum buffer: torch.optim keeps one while the group's
    momentum is not 0 (OneCycleLR cycles it for both)."""
    if name not in ("sgd", "rmsprop"):
        return False
    return momenta is not None and any(m != 0 for row in momenta for m in row)

