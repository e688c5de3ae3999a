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

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from towerlab.distributed.group import Context, cpu_group
from towerlab.training.optim import OptimizerFactory, ScheduledOptimizer, trained_parameters


class Strategy:
    """The wrapping of the module (`model`, what the forward runs through), the gradient exchange
    and the optimizer step, with their state. The step around it (forward, loss, Lookahead) is the
    caller's (towerlab.training.step); nothing here waits for the host. A strategy is one subclass plus its
    line in `STRATEGIES` (and its name in config.STRATEGIES, which a test holds them to)."""

    name = ""

    def __init__(self, module: nn.Module, ctx: Context):
        self.module = module
        self.model = module
        self.ctx = ctx
        self.params = trained_parameters(module)

    def update(self, loss: torch.Tensor) -> None:
        """From this replica's loss to the next parameters, the same on every replica: the gradients
        (computed here, so that each strategy decides where they land), their exchange, one
        optimizer step."""
        raise NotImplementedError

    def weights_changed(self) -> None:
        """The replica's weights were changed outside the optimizer (Lookahead's pull, a checkpoint)."""

    def state_dict(self) -> dict:
        """The optimizer's state, {"optimizer", "scheduler"} (the model's weights are the caller's)."""
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        """Load the optimizer's state; the module holds the saved weights already."""
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError


class AllReduce(Strategy):
    name = "ddp"

    def __init__(self, module: nn.Module, ctx: Context, new_optimizer: OptimizerFactory):
        super().__init__(module, ctx)
        if ctx.distributed:
            # Buckets as views of the gradients (no copy) and a static graph (buckets rebuilt once).
            self.model = nn.parallel.DistributedDataParallel(
                module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                gradient_as_bucket_view=True, static_graph=True)
        self.optimizer = new_optimizer(self.params, ctx.device)

    def update(self, loss: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss.backward()  # DDP all-reduces the gradients' buckets while it runs
        self.optimizer.step()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)

    def lr(self) -> float:
        return self.optimizer.lr()


class ParameterServer(Strategy):
    name = "ps"

    def __init__(self, module: nn.Module, ctx: Context, new_optimizer: OptimizerFactory):
        super().__init__(module, ctx)
        self.group = cpu_group(ctx) if ctx.distributed else None
        self.buffers = list(module.buffers())
        self.sizes = [p.numel() for p in self.params]
        pin = ctx.device.type == "cuda"
        total = sum(self.sizes)
        self.grad_flat = torch.zeros(total, pin_memory=pin)
        self.param_flat = torch.zeros(total, pin_memory=pin)
        self.master: list[torch.Tensor] = []
        self.optimizer: ScheduledOptimizer | None = None
        if ctx.is_main:
            # Contiguous, like the flat buffer whose views are their gradients: the fused optimizer
            # walks parameter, gradient and state memory in step, so their strides must agree (a
            # channels-last replica weight copied as is would be updated with scrambled gradients).
            self.master = [p.detach().to("cpu", torch.float32, copy=True, memory_format=torch.contiguous_format)
                           .requires_grad_() for p in self.params]
            self._attach_gradients()
            self.optimizer = new_optimizer(self.master, torch.device("cpu"))

    def _attach_gradients(self) -> None:
        # The master's gradients are views of the reduced flat buffer: no copy per parameter.
        for m, g in zip(self.master, self._views(self.grad_flat)):
            m.grad = g

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [chunk.view_as(p) for chunk, p in zip(torch.split(flat, self.sizes), self.params)]

    def update(self, loss: torch.Tensor) -> None:
        for p in self.params:
            p.grad = None
        loss.backward()
        # Replica gradients -> one CPU buffer -> summed on rank 0.
        self.grad_flat.copy_(torch.cat([p.grad.reshape(-1) for p in self.params]))  # type: ignore[union-attr]  # all set by backward
        if self.ctx.distributed:
            dist.reduce(self.grad_flat, dst=0, op=dist.ReduceOp.SUM, group=self.group)
        if self.optimizer is not None:
            if self.ctx.world_size > 1:
                self.grad_flat.div_(self.ctx.world_size)
            self.optimizer.step()
            torch.cat([m.detach().reshape(-1) for m in self.master], out=self.param_flat)
        if self.ctx.distributed:
            dist.broadcast(self.param_flat, src=0, group=self.group)
        with torch.no_grad():
            for p, fresh in zip(self.params, self._views(self.param_flat)):
                p.copy_(fresh, non_blocking=True)
            self._sync_buffers()

    def weights_changed(self) -> None:
        # Every replica changed its weights alike; the master copy follows rank 0's replica.
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
        # Rank 0 holds the only optimizer.
        if self.optimizer is None:
            return {"optimizer": None, "scheduler": None}
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None:
            self.weights_changed()
            self.optimizer.load_state_dict(state)
            self._attach_gradients()

    def lr(self) -> float:
        return self.optimizer.lr() if self.optimizer is not None else float("nan")


# --strategy NAME -> its class (a test holds these names to config.STRATEGIES).
STRATEGIES: dict[str, Callable[[nn.Module, Context, OptimizerFactory], Strategy]] = {"ddp": AllReduce, "ps": ParameterServer}


def make_strategy(name: str, module: nn.Module, ctx: Context, new_optimizer: OptimizerFactory) -> Strategy:
    return STRATEGIES[name](module, ctx, new_optimizer)
