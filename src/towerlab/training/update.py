"""The step program's optimizer: `Update`, torch.optim's arithmetic as tensor operations on state
allocated up front, with the learning rate and the momentum (Adam's beta1) read from schedule tables
by a step counter on the device. It takes no changing Python value and never reads a value back, so
a CUDA graph can replay it and torch.compile can take it whole (training/program.py). Its tables are
recorded from torch's own schedulers (`schedule_tables`), so they hold the values torch.optim would
use; tests hold `Update` to torch.optim, optimizer by optimizer.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Union, cast

import torch

from towerlab.config import TrainConfig
from towerlab.training.muon import lr_ratio, matrix, normalize_, orthogonalize
from towerlab.training.optim import Group, ScheduledOptimizer

Tensors = Union[list[torch.Tensor], tuple[torch.Tensor, ...]]  # a group's, as torch._foreach_* takes them


def _momentum(group: dict) -> float | None:
    """The momentum a group steps with (Adam's family: beta1), which OneCycleLR cycles; None for
    optimizers without one."""
    if "betas" in group:
        return float(group["betas"][0])
    if "momentum" in group:
        return float(group["momentum"])
    return None


def schedule_tables(cfg: TrainConfig, groups: list[Group], total_steps: int
                    ) -> tuple[list[list[float]], list[list[float]] | None]:
    """(lr[s][g], momentum[s][g] or None) for steps s = 0 .. total_steps - 1: the values torch's
    optimizers and schedulers for `cfg` hold when they take step s. Recorded by stepping them over one
    stand-in parameter per group, so every schedule is torch's own to the last bit."""
    params = [torch.zeros((1, 1, 1, 1) if g.part == "muon" else (1,)) for g in groups]
    stand_ins = [dataclasses.replace(g, positions=[i]) for i, g in enumerate(groups)]
    optimizer = ScheduledOptimizer(cfg, params, stand_ins, torch.device("cpu"), total_steps)
    lrs, momenta = [], []
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": no step is taken here
        warnings.simplefilter("ignore", UserWarning)
        for s in range(total_steps):
            lrs.append([float(g["lr"]) for g in optimizer.param_groups()])
            momenta.append([_momentum(g) for g in optimizer.param_groups()])
            if s + 1 < total_steps:
                for _, scheduler in optimizer.parts.values():
                    if scheduler is not None:
                        scheduler.step()
    has_momentum = momenta and momenta[0][0] is not None
    return lrs, (cast(list[list[float]], momenta) if has_momentum else None)  # no None where one is a number


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
         "adadelta": ("square_avg", "acc_delta"), "muon": ("momentum_buffer",)}


class Update:
    """One optimizer step of `cfg.optimizer` as tensor arithmetic (torch.optim's algorithms with
    their defaults; AdamW's decoupled decay for adam with weight decay, L2 in the gradient for the
    rest; for muon, torch.optim.Muon's on the filters and SGD's on the rest). All state is allocated
    here, once, and only ever changed in place; `lr` and `momentum` come in as device tensors of one
    value per group. What torch.optim decides from a Python number (whether SGD or RMSprop keep a
    momentum buffer) is decided once, from the momentum table."""

    def __init__(self, cfg: TrainConfig, params: list[torch.Tensor], groups: list[Group], uses_momentum: bool):
        self.name = cfg.optimizer
        self.params = params
        self.groups = groups
        self.weight_decay = [0.0 if g.part == "muon" else cfg.weight_decay / g.scale for g in groups]
        self.decoupled = self.name == "adam" and cfg.weight_decay > 0
        self.nesterov = cfg.nesterov
        self.muon_steps = cfg.muon_ns_steps
        self.muon_normalize = cfg.muon_normalize
        self.uses_momentum = uses_momentum
        # One count serves every parameter, in their precision (torch.optim's capturable count is a
        # float32 tensor; its bias corrections are Python doubles, which float64 parameters match).
        self.step_count = torch.zeros((), dtype=params[0].dtype, device=params[0].device)
        # NAdam's product of momenta, one per group (torch.optim keeps one per parameter; a part's groups
        # share their momenta, and a whitening bias's part has its own), in float32 whatever the
        # parameters' precision, as torch.optim keeps it.
        self.mu_product = torch.ones(len(groups), dtype=torch.float32, device=params[0].device)
        keys = STATE[self.name]
        if self.name in ("sgd", "rmsprop") and not uses_momentum:
            keys = tuple(k for k in keys if k != "momentum_buffer")
        self.state = {key: [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params] for key in keys}

    def tensors(self) -> list[torch.Tensor]:
        """Every state tensor, in a fixed order."""
        return [self.step_count, self.mu_product] + [t for key in sorted(self.state) for t in self.state[key]]

    @torch.no_grad()
    def __call__(self, grads: list[torch.Tensor], lr: torch.Tensor, momentum: torch.Tensor | None,
                 skip: tuple[int, ...] = ()) -> None:
        """Step every group but those in `skip` (positions in the group list), whose parameters and state
        stay as they are (as torch.optim leaves a parameter without a gradient); `grads` has a tensor
        for each parameter, and is not read for those."""
        self.step_count.add_(1)
        if self.name == "nadam":
            mu = momentum * (1.0 - 0.5 * torch.pow(0.96, self.step_count * NADAM_MOMENTUM_DECAY))  # type: ignore[operator]  # NAdam has a beta1 table
            self.mu_product.mul_(mu.float())  # a float32 product, as torch.optim's
        for g, group in enumerate(self.groups):
            if g in skip:
                continue
            params = [self.params[i] for i in group.positions]
            group_grads: Tensors = [grads[i] for i in group.positions]
            state = {key: [tensors[i] for i in group.positions] for key, tensors in self.state.items()}
            decay = self.weight_decay[g]
            if decay and not self.decoupled:
                group_grads = torch._foreach_add(group_grads, params, alpha=decay)
            method = "muon" if group.part == "muon" else "sgd" if self.name == "muon" else self.name
            own = {"mu_product": self.mu_product[g]} if method == "nadam" else {}
            getattr(self, "_" + method)(params, group_grads, state, lr[g], None if momentum is None else momentum[g],
                                        decay, **own)

    def _muon(self, params: Tensors, grads: Tensors, state: dict[str, Tensors], lr: torch.Tensor,
              momentum: torch.Tensor, decay: float) -> None:
        """torch.optim.Muon's step (Nesterov, no weight decay) on each filter's matrix (muon.matrix),
        after airbench94_muon's rescaling where --muon-normalize asks for it."""
        if self.muon_normalize:
            normalize_(params)
        for p, grad, buffer in zip(params, grads, state["momentum_buffer"]):
            weights, buf, g = matrix(p), matrix(buffer), matrix(grad, p)
            buf.lerp_(g, 1 - momentum)
            update = orthogonalize(g.lerp(buf, momentum), self.muon_steps)
            weights.sub_(update.to(weights.dtype).mul_(lr * lr_ratio(weights.shape)))

    def _sgd(self, params: Tensors, grads: Tensors, state: dict[str, Tensors], lr: torch.Tensor,
             momentum: torch.Tensor, decay: float) -> None:
        if self.uses_momentum:
            buffers = state["momentum_buffer"]
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, grads)
            if self.nesterov:
                grads = torch._foreach_add(grads, torch._foreach_mul(buffers, momentum))
            else:
                grads = buffers
        torch._foreach_sub_(params, torch._foreach_mul(grads, lr))

    def _adam(self, params: Tensors, grads: Tensors, state: dict[str, Tensors], lr: torch.Tensor,
              beta1: torch.Tensor, decay: float) -> None:
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

    def _nadam(self, params: Tensors, grads: Tensors, state: dict[str, Tensors], lr: torch.Tensor,
               beta1: torch.Tensor, decay: float, mu_product: torch.Tensor) -> None:
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        _moments(exp_avg, exp_avg_sq, grads, beta1)
        step = self.step_count
        mu = beta1 * (1.0 - 0.5 * torch.pow(0.96, step * NADAM_MOMENTUM_DECAY))
        mu_next = beta1 * (1.0 - 0.5 * torch.pow(0.96, (step + 1) * NADAM_MOMENTUM_DECAY))
        denom = torch._foreach_sqrt(exp_avg_sq)
        torch._foreach_div_(denom, torch.sqrt(1.0 - torch.pow(BETA2, step)))
        torch._foreach_add_(denom, ADAM_EPS)
        mu_product = mu_product.to(lr.dtype)  # read in the parameters' precision, as torch.optim reads it
        from_grad = torch._foreach_div(grads, denom)
        torch._foreach_mul_(from_grad, lr * (1.0 - mu) / (1.0 - mu_product))
        from_avg = torch._foreach_div(exp_avg, denom)
        torch._foreach_mul_(from_avg, lr * mu_next / (1.0 - mu_product * mu_next))
        torch._foreach_sub_(params, from_grad)
        torch._foreach_sub_(params, from_avg)

    def _adamax(self, params: Tensors, grads: Tensors, state: dict[str, Tensors], lr: torch.Tensor,
                beta1: torch.Tensor, decay: float) -> None:
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

    def _rmsprop(self, params: Tensors, grads: Tensors, state: dict[str, Tensors], lr: torch.Tensor,
                 momentum: torch.Tensor, decay: float) -> None:
        square_avg = state["square_avg"]
        torch._foreach_mul_(square_avg, RMSPROP_ALPHA)
        torch._foreach_addcmul_(square_avg, grads, grads, value=1.0 - RMSPROP_ALPHA)
        avg = torch._foreach_sqrt(square_avg)
        torch._foreach_add_(avg, RMSPROP_EPS)
        scaled: Tensors = torch._foreach_div(grads, avg)
        if self.uses_momentum:
            buffers = state["momentum_buffer"]
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, scaled)
            scaled = buffers
        torch._foreach_sub_(params, torch._foreach_mul(scaled, lr))

    def _adagrad(self, params: Tensors, grads: Tensors, state: dict[str, Tensors], lr: torch.Tensor,
                 momentum: torch.Tensor | None, decay: float) -> None:
        sums = state["sum"]
        torch._foreach_addcmul_(sums, grads, grads)
        std = torch._foreach_sqrt(sums)
        torch._foreach_add_(std, ADAGRAD_EPS)
        steps = torch._foreach_div(grads, std)
        torch._foreach_sub_(params, torch._foreach_mul(steps, lr))

    def _adadelta(self, params: Tensors, grads: Tensors, state: dict[str, Tensors], lr: torch.Tensor,
                  momentum: torch.Tensor | None, decay: float) -> None:
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


def _moments(exp_avg: Tensors, exp_avg_sq: Tensors, grads: Tensors,
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
    momentum is not 0 (OneCycleLR cycles it for both); Muon keeps one always, and muon's SGD side
    shares its buffers (with momentum 0 a buffer is the gradient: the same numbers)."""
    if name == "muon":
        return True
    if name not in ("sgd", "rmsprop"):
        return False
    return momenta is not None and any(m != 0 for row in momenta for m in row)

