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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from towerlab.config import TrainConfig
from towerlab.distributed.group import Context, cpu_group
from towerlab.lookahead import Lookahead
from towerlab.optim import make_optimizer, make_scheduler, parameter_groups


class Strategy:
    """One synchronous update per `step(x, y)`; nothing in it waits for the host."""

    name = ""

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: Context, total_steps: int):
        self.module = module
        self.cfg = cfg
        self.ctx = ctx
        self.total_steps = total_steps
        self._autocast = (torch.autocast(ctx.device.type, dtype=torch.bfloat16)
                          if cfg.precision == "bf16" else contextlib.nullcontext())
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.groups = parameter_groups(module, self.params, cfg.norm_lr_scale)
        self.lookahead = (Lookahead(module, cfg.lookahead, cfg.lookahead_decay, total_steps)
                          if cfg.lookahead else None)

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

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: Context, total_steps: int):
        super().__init__(module, cfg, ctx, total_steps)
        model: nn.Module = module
        if ctx.distributed:
            # Buckets as views of the gradients (no copy) and a static graph (buckets rebuilt once).
            model = nn.parallel.DistributedDataParallel(
                module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                gradient_as_bucket_view=True, static_graph=True)
        self.model = model
        self.optimizer = make_optimizer(cfg, self.params, self.groups, ctx.device)
        self.scheduler = make_scheduler(cfg, self.optimizer, total_steps)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: Context, total_steps: int):
        super().__init__(module, cfg, ctx, total_steps)
        self.model = module
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


def make_strategy(name: str, module: nn.Module, cfg: TrainConfig, ctx: Context, total_steps: int) -> Strategy:
    return STRATEGIES[name](module, cfg, ctx, total_steps)
