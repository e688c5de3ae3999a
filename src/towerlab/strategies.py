"""How the replicas' gradients meet. Both strategies are synchronous: every replica computes
gradients on its own slice of the global batch, the gradients are averaged, one update is applied,
and every replica starts the next step with the same parameters.

- `AllReduce` (`--strategy ddp`): DistributedDataParallel; gradients are all-reduced in buckets
  while backward still runs, and every replica steps its own (identical) optimizer.
- `ParameterServer` (`--strategy ps`): the seeds' towers design. The master copy of the parameters
  and the optimizer state live on rank 0's CPU; each step the gradients are summed there, the
  optimizer steps on the CPU, and the fresh parameters are broadcast to every replica. On GPUs this
  runs over a gloo side group, since NCCL cannot move CPU tensors.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from towerlab.config import TrainConfig
from towerlab.distributed import Context, cpu_group
from towerlab.lookahead import Lookahead

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


def make_optimizer(cfg: TrainConfig, params: list[torch.Tensor], groups: list[list[int]],
                   device: torch.device) -> torch.optim.Optimizer:
    """`cfg.optimizer` over `params`; the second of `groups`, if any, learns `cfg.norm_lr_scale` times
    faster with its weight decay divided by as much, so its decay per step stays that of the rest
    (airbench94's BatchNorm biases: 64x)."""
    name, lr, weight_decay = cfg.optimizer, cfg.lr, cfg.weight_decay
    scales = [1.0, cfg.norm_lr_scale]
    param_groups = [{"params": [params[i] for i in group], "lr": lr * scale, "weight_decay": weight_decay / scale}
                    for group, scale in zip(groups, scales)]
    # One fused kernel per step where torch has one: Adam, AdamW and SGD on CPUs and GPUs, Adagrad on
    # CPUs. On a CPU, fused Adam steps LeNet-5's parameters 2.6x and CifarNet's 3.1x faster than
    # foreach, whose CPU path still loops over the tensors (bench/changes.py).
    fused = {"fused": True}
    if name == "adam":
        cls = torch.optim.AdamW if weight_decay > 0 else torch.optim.Adam
        return cls(param_groups, lr=lr, **fused)
    if name == "sgd":
        return torch.optim.SGD(param_groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, **fused)
    if name == "adagrad" and device.type == "cpu":
        return torch.optim.Adagrad(param_groups, lr=lr, **fused)
    classes = {"rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad,
               "adadelta": torch.optim.Adadelta, "adamax": torch.optim.Adamax, "nadam": torch.optim.NAdam}
    return classes[name](param_groups, lr=lr, foreach=True)


def linear_factor(step: int, total_steps: int, warmup: float) -> float:
    """The --schedule linear multiplier of the peak learning rate before step `step` (0-based)."""
    rise = int(total_steps * warmup)
    if step < rise:
        return LINEAR_START + (1.0 - LINEAR_START) * step / rise
    return 1.0 + (LINEAR_END - 1.0) * (step - rise) / max(1, total_steps - rise)


def make_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    if cfg.schedule == "onecycle":
        warmup = ONECYCLE_WARMUP if cfg.warmup is None else cfg.warmup
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[g["lr"] for g in optimizer.param_groups],
                                                   total_steps=max(2, total_steps), pct_start=warmup)
    if cfg.schedule == "linear":
        warmup = LINEAR_WARMUP if cfg.warmup is None else cfg.warmup
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: linear_factor(step, total_steps, warmup))
    return None


def uses_cuda_graphs(ctx: Context) -> bool:
    """--compile replays each step as CUDA graphs where one process drives one GPU: a small
    network's step there is bounded by kernel launches (LeNet-5: ~60 kernels of a few microseconds),
    which a graph replay removes. Not under DDP, whose all-reduce hooks run between the graphs."""
    return ctx.device.type == "cuda" and not ctx.distributed


class Strategy:
    """One synchronous update per `step(x, y)`; nothing in it waits for the host."""

    name = ""

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: Context, total_steps: int,
                 compile_model: bool = False):
        self.module = module
        self.cfg = cfg
        self.ctx = ctx
        self.total_steps = total_steps
        self.compile_model = compile_model
        self._autocast = (torch.autocast(ctx.device.type, dtype=torch.bfloat16)
                          if cfg.precision == "bf16" else contextlib.nullcontext())
        self.cuda_graphs = compile_model and uses_cuda_graphs(ctx)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.groups = parameter_groups(module, self.params, cfg.norm_lr_scale)
        self.lookahead = (Lookahead(module, cfg.lookahead, cfg.lookahead_decay, total_steps)
                          if cfg.lookahead else None)

    def set_model(self, model: nn.Module) -> None:
        """The model the step calls: `model`, or with --compile its compiled form (compiled lazily,
        on its first call); `plain_model` keeps `model` for a fallback."""
        self.plain_model = model
        self.model = (torch.compile(model, mode="reduce-overhead" if self.cuda_graphs else None)
                      if self.compile_model else model)

    def use_plain_step(self) -> None:
        """Leave the compiled step for the plain one (its compilation failed)."""
        self.model = self.plain_model
        self.compile_model = self.cuda_graphs = False

    def begin_step(self) -> None:
        # CUDA graphs reuse their output memory: tell them a new step starts, so the previous step's
        # (already read) loss and logits may be overwritten.
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()

    def forward_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with self._autocast:
            logits = model(x)
            loss = F.cross_entropy(logits, y, label_smoothing=self.cfg.label_smoothing)
        return loss, logits

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def end_step(self) -> None:
        """After the update: Lookahead's pull towards the slow weights, on every replica alike."""
        if self.lookahead is not None and self.lookahead.step():
            self.weights_changed()

    def weights_changed(self) -> None:
        """The replica's weights were changed outside the optimizer."""

    def averaging_state(self) -> dict:
        return {"lookahead": self.lookahead.state_dict()} if self.lookahead is not None else {}

    def load_averaging_state(self, state: dict) -> None:
        if self.lookahead is not None:
            self.lookahead.load_state_dict(state["lookahead"])

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError


class AllReduce(Strategy):
    name = "ddp"

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: Context, total_steps: int,
                 compile_model: bool = False):
        super().__init__(module, cfg, ctx, total_steps, compile_model)
        model: nn.Module = module
        if ctx.distributed:
            # Buckets as views of the gradients (no copy) and a static graph (buckets rebuilt once).
            model = nn.parallel.DistributedDataParallel(
                module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                gradient_as_bucket_view=True, static_graph=True)
        self.set_model(model)
        self.optimizer = make_optimizer(cfg, self.params, self.groups, ctx.device)
        self.scheduler = make_scheduler(cfg, self.optimizer, total_steps)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.begin_step()
        loss, logits = self.forward_loss(self.model, x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.end_step()
        return loss.detach(), logits.detach()

    def state_dict(self) -> dict:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler else None, **self.averaging_state()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        self.load_averaging_state(state)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])


class ParameterServer(Strategy):
    name = "ps"

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: Context, total_steps: int,
                 compile_model: bool = False):
        super().__init__(module, cfg, ctx, total_steps, compile_model)
        self.set_model(module)
        self.group = cpu_group(ctx) if ctx.distributed else None
        self.buffers = list(module.buffers())
        self.sizes = [p.numel() for p in self.params]
        pin = ctx.device.type == "cuda"
        total = sum(self.sizes)
        self.grad_flat = torch.zeros(total, pin_memory=pin)
        self.param_flat = torch.zeros(total, pin_memory=pin)
        self.master: list[torch.Tensor] = []
        self.optimizer = None
        self.scheduler = None
        if ctx.is_main:
            # Contiguous, like the flat buffer whose views are their gradients: the fused optimizer
            # walks parameter, gradient and state memory in step, so their strides must agree (a
            # channels-last replica weight copied as is would be updated with scrambled gradients).
            self.master = [p.detach().to("cpu", torch.float32, copy=True, memory_format=torch.contiguous_format)
                           .requires_grad_() for p in self.params]
            # The master's gradients are views of the reduced flat buffer: no copy per parameter.
            for m, g in zip(self.master, self._views(self.grad_flat)):
                m.grad = g
            self.optimizer = make_optimizer(cfg, self.master, self.groups, torch.device("cpu"))
            self.scheduler = make_scheduler(cfg, self.optimizer, total_steps)

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [chunk.view_as(p) for chunk, p in zip(torch.split(flat, self.sizes), self.params)]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.begin_step()
        loss, logits = self.forward_loss(self.model, x, y)
        for p in self.params:
            p.grad = None
        loss.backward()
        # Replica gradients -> one CPU buffer -> summed on rank 0.
        self.grad_flat.copy_(torch.cat([p.grad.reshape(-1) for p in self.params]))
        if self.ctx.distributed:
            dist.reduce(self.grad_flat, dst=0, op=dist.ReduceOp.SUM, group=self.group)
        if self.ctx.is_main:
            if self.ctx.world_size > 1:
                self.grad_flat.div_(self.ctx.world_size)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            torch.cat([m.detach().reshape(-1) for m in self.master], out=self.param_flat)
        if self.ctx.distributed:
            dist.broadcast(self.param_flat, src=0, group=self.group)
        with torch.no_grad():
            for p, fresh in zip(self.params, self._views(self.param_flat)):
                p.copy_(fresh, non_blocking=True)
            self._sync_buffers()
        self.end_step()
        return loss.detach(), logits.detach()

    def weights_changed(self) -> None:
        # Every replica applied the same Lookahead step; the master copy follows rank 0's replica.
        if self.ctx.is_main:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    m.copy_(p)

    def _sync_buffers(self) -> None:
        # BatchNorm statistics follow rank 0's replica, as DDP's broadcast_buffers does.
        if not self.ctx.distributed or not self.buffers:
            return
        flat = torch.cat([b.detach().reshape(-1).float().cpu() for b in self.buffers])
        dist.broadcast(flat, src=0, group=self.group)
        for b, chunk in zip(self.buffers, torch.split(flat, [b.numel() for b in self.buffers])):
            b.copy_(chunk.view_as(b))

    def state_dict(self) -> dict:
        # Rank 0 holds the only optimizer; its replica equals the master after every step.
        return {"model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None, **self.averaging_state()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        if self.ctx.is_main:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    m.copy_(p.detach().cpu())
            self.optimizer.load_state_dict(state["optimizer"])
            for m, g in zip(self.master, self._views(self.grad_flat)):
                m.grad = g
            if self.scheduler is not None and state.get("scheduler"):
                self.scheduler.load_state_dict(state["scheduler"])
        self.load_averaging_state(state)

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else float("nan")


STRATEGIES = {"ddp": AllReduce, "ps": ParameterServer}


def make_strategy(name: str, module: nn.Module, cfg: TrainConfig, ctx: Context, total_steps: int,
                  compile_model: bool = False) -> Strategy:
    return STRATEGIES[name](module, cfg, ctx, total_steps, compile_model)
