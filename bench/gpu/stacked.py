"""Several small networks trained in one step (issue 57): K `mlp` networks of one shape, each layer's
weights stacked (K, out, in) and run for all K as one batched matrix product, so that a GPU works on
K candidates' layers at once where one network alone leaves it idle.

Each network keeps everything a separate training gives it: its initialisation (built from its own
seed), its data order (its seed's permutation), its dropout masks (drawn from its own generator,
seeded per step as a separate training seeds its step's), its learning rate and optimizer (one
`update.Update` per optimizer over the networks that use it, one group each, with the tables its own
settings record). So on a CPU the K trainings end exactly where K separate trainings with the step
program end, in float64 bit for bit (tests/test_stacked.py): the batched products
(`torch.baddbmm`, `torch.bmm`) sum each network's terms as the single products do. In float32 one
product can differ in its last bits (a 10-wide head's weight gradient: MKL's batched and single
kernels round apart), so float32 runs agree to rounding. On a GPU the dropout masks are drawn as
torch.bernoulli_ draws them, not as CUDA's fused dropout kernel does, so a stacked candidate trains as
a separate one would only on a CPU.

What may differ between the stacked networks: their seeds, learning rates and optimizers. What they
share: the layers (`layers`, `neurons`, `activation`, `dropout`), the batch size, the number of steps,
the schedule, label smoothing, weight decay and momentum settings (`stack_key`). fp32, no augmentation.
`bench/gpu/stacked_mlps.py` measures it on a GPU. It lives beside that benchmark, not in towerlab: nothing of
towerlab's uses it (the search trains one candidate a step); were the search to stack its candidates, it
would move back to towerlab.training.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from towerlab.config import TrainConfig
from towerlab.distributed.group import Context
from towerlab.errors import UserError
from towerlab.models.preprocessing import Normalizer
from towerlab.training.batches import Batches, mix_seed, steps_per_epoch
from towerlab.training.evaluation import loss_and_accuracy
from towerlab.training.network import build
from towerlab.training.optim import Group
from towerlab.training.update import Update, schedule_tables, tables_on, uses_momentum

if TYPE_CHECKING:
    from towerlab.data.load import Dataset

# What may differ between stacked trainings (the rest of their TrainConfig must be the same).
OWN = ("seed", "lr", "optimizer")


def stack_key(cfg: TrainConfig) -> tuple:
    """Trainings with the same key can share a step."""
    return tuple(sorted((k, repr(v)) for k, v in dataclasses.asdict(cfg).items() if k not in OWN))


class _StackedLinear(torch.autograd.Function):
    """K linear layers at once: x (K, B, in), weight (K, out, in), bias (K, out). Each product is the one
    `nn.Linear` computes for one network, forward (addmm(bias, x, weight.T)) and backward (the input's
    gradient grad @ weight, the weight's grad.T @ x, the bias's grad summed over the batch)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None  # not for the images
        return grad_x, torch.bmm(grad.transpose(1, 2), x), grad.sum(1)


@dataclasses.dataclass
class StackedResult:
    """One network of a stack, trained: the module (its own, its weights copied from the stack), its
    scores and the stack's training seconds (shared by all K)."""

    model: nn.Module
    val_loss: Optional[float]
    val_accuracy: Optional[float]
    test_loss: Optional[float]
    test_accuracy: Optional[float]
    train_seconds: float


class StackedMLPs:
    """K mlp networks of `cfgs` (one stack_key) on `ctx`'s device, their weights stacked; `step()` trains
    all K one step; `networks()` gives each as its own module."""

    def __init__(self, cfgs: list[TrainConfig], data: Dataset, ctx: Context, normalize: Normalizer,
                 total_steps: int, dtype: torch.dtype = torch.float32):
        check_stack(cfgs)
        self.cfgs, self.ctx, self.normalize, self.dtype = cfgs, ctx, normalize, dtype
        self.modules = [build(cfg, data.input_shape, data.num_classes, ctx).to(dtype) for cfg in cfgs]
        body = list(self.modules[0].modules())[2:]  # MLP, its Sequential; Flatten, (Linear, activation, Dropout)...
        self.activation = body[2]  # models/mlp.py: Flatten, then (Linear, activation, Dropout) x layers, Linear
        self.dropout = next((m.p for m in body if isinstance(m, nn.Dropout)), 0.0)
        linears = [[m for m in module.modules() if isinstance(m, nn.Linear)] for module in self.modules]
        self.layers = [(torch.stack([lin[i].weight.detach() for lin in linears]).requires_grad_(),
                        torch.stack([lin[i].bias.detach() for lin in linears]).requires_grad_())
                       for i in range(len(linears[0]))]
        self.stacked = [t for layer in self.layers for t in layer]
        self.batches = [Batches(data.x_train, data.y_train, ctx, cfg.batch_size, cfg.seed, "resident", normalize)
                        for cfg in cfgs]
        self.generators = [torch.Generator(device=ctx.device) for _ in cfgs]
        self.updates = self._updates(total_steps)
        self.epoch_rows: list[torch.Tensor] = []

    def _updates(self, total_steps: int) -> list[tuple[Update, torch.Tensor, Optional[torch.Tensor]]]:
        """One Update per optimizer over the views of its networks' parameters, one group each, with each
        network's own learning-rate and momentum tables as its group's column."""
        updates = []
        for name in dict.fromkeys(cfg.optimizer for cfg in self.cfgs):
            members = [k for k, cfg in enumerate(self.cfgs) if cfg.optimizer == name]
            views = [t[k] for k in members for t in self.stacked]
            count = len(self.stacked)
            groups = [Group(list(range(i * count, (i + 1) * count))) for i in range(len(members))]
            tables = [schedule_tables(self.cfgs[k], [Group(list(range(count)))], total_steps) for k in members]
            lrs = [[row[0] for row in lr] for lr, _ in tables]
            momenta = None if tables[0][1] is None else [[row[0] for row in m] for _, m in tables]  # type: ignore[union-attr]  # a table where the first has one
            lr, momentum = tables_on(self.ctx.device, [list(step) for step in zip(*lrs)],
                                     None if momenta is None else [list(step) for step in zip(*momenta)])
            update = Update(self.cfgs[members[0]], views, groups, uses_momentum(name, momenta))
            updates.append((update, lr, momentum))
        return updates

    def step(self, step: int) -> torch.Tensor:
        """Step `step` of every network; returns their K losses."""
        steps_per_epoch = self.batches[0].steps_per_epoch
        epoch, within = divmod(step, steps_per_epoch)
        if within == 0 or not self.epoch_rows:
            self.epoch_rows = [b.indices(epoch).view(steps_per_epoch, -1) for b in self.batches]
        rows = [r[within] for r in self.epoch_rows]
        x = torch.stack([self.normalize(b.x[r]) for b, r in zip(self.batches, rows)]).flatten(2).to(self.dtype)
        y = [b.y[r] for b, r in zip(self.batches, rows)]
        for cfg, generator in zip(self.cfgs, self.generators):  # as a separate training seeds its step
            generator.manual_seed(mix_seed(cfg.seed, self.ctx.rank, step))
        logits = self.forward(x, self.generators)
        losses = [F.cross_entropy(logits[k], y[k], label_smoothing=cfg.label_smoothing)
                  for k, cfg in enumerate(self.cfgs)]
        grads = torch.autograd.grad(torch.stack(losses).sum(), self.stacked)
        for update, lr, momentum in self.updates:
            members = [k for k, cfg in enumerate(self.cfgs) if cfg.optimizer == update.name]
            update([g[k] for k in members for g in grads], lr[step],
                   None if momentum is None else momentum[step])
        return torch.stack([loss.detach() for loss in losses])

    def forward(self, x: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """All K networks' logits of their batches x (K, B, features); dropout masks from `generators`."""
        for i, (weight, bias) in enumerate(self.layers):
            x = _StackedLinear.apply(x, weight, bias)
            if i + 1 < len(self.layers):
                x = self.activation(x)
                if self.dropout > 0:  # F.dropout's arithmetic: a bernoulli mask divided by 1 - p, multiplied in
                    masks = [torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
                             .bernoulli_(1 - self.dropout, generator=g).div_(1 - self.dropout) for g in generators]
                    x = x * torch.stack(masks)
        return x

    def networks(self) -> list[nn.Module]:
        """Each network as its own module, holding its trained weights."""
        for k, module in enumerate(self.modules):
            linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
            with torch.no_grad():
                for linear, (weight, bias) in zip(linears, self.layers):
                    linear.weight.copy_(weight[k])
                    linear.bias.copy_(bias[k])
        return self.modules


def check_stack(cfgs: list[TrainConfig]) -> None:
    """What stacking takes: mlp networks of one stack_key, fp32, no augmentation, no Lookahead."""
    if not cfgs:
        raise UserError("no trainings to stack")
    if len({stack_key(cfg) for cfg in cfgs}) > 1:
        raise UserError("stacked trainings must share everything but their seed, learning rate and optimizer")
    cfg = cfgs[0]
    if cfg.model != "mlp" or cfg.precision != "fp32" or cfg.augment or cfg.lookahead or cfg.optimizer == "muon" or any(
            c.optimizer == "muon" for c in cfgs):
        raise UserError("stacked trainings are mlp networks in fp32, without augmentation, Lookahead or Muon")


def train_stacked(cfgs: list[TrainConfig], data: Dataset, ctx: Context = Context(), *,
                  normalize: Optional[Normalizer] = None, dtype: torch.dtype = torch.float32,
                  test: bool = False) -> list[StackedResult]:
    """Train the networks of `cfgs` (see the module's docstring) on `data`, all in each step, and score
    each on the validation split (and the test split, with `test`) as a separate training would.
    `dtype` with a `normalize` that gives it: another precision (the tests' float64)."""
    norm = normalize or Normalizer(data.mean, data.std, ctx.device)
    total_steps = cfgs[0].steps or cfgs[0].epochs * steps_per_epoch(data.n_train, ctx.world_size, cfgs[0].batch_size)
    stack = StackedMLPs(cfgs, data, ctx, norm, total_steps, dtype)
    started = time.perf_counter()
    for step in range(total_steps):
        stack.step(step)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    seconds = time.perf_counter() - started
    results = []
    for module, cfg in zip(stack.networks(), cfgs):
        splits = [(data.x_val, data.y_val, data.n_val > 0), (data.x_test, data.y_test, test and data.n_test > 0)]
        scores = [loss_and_accuracy(module, x.to(ctx.device), y.to(ctx.device), ctx, norm, cfg.precision, cfg.tta)
                  if wanted else (None, None) for x, y, wanted in splits]
        (val_loss, val_accuracy), (test_loss, test_accuracy) = scores
        results.append(StackedResult(module, val_loss, val_accuracy, test_loss, test_accuracy, seconds))
    return results
