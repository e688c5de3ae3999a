"""The training step, eager or as one static program (issue 38).

A small network's step on a GPU is bound by kernel launches, not arithmetic: LeNet-5 at batch 512
launches about 110 kernels in 2.2 ms on an H100, where the same arithmetic replayed as one CUDA graph
takes 0.68 ms (bench/results/gpu/step-gpu-2026-11-25.json). A graph replays fixed kernels on fixed
memory, so the step must be a program that takes no changing Python value and reads nothing back:

- state lives in tensors allocated up front and only changed in place: the model's parameters and
  buffers, the optimizer's state (`update.Update`), the step counters (`t` over the run, `k` within the
  epoch), the learning-rate and momentum tables (`update.schedule_tables`, recorded from torch's own
  schedulers), this rank's permutation of the epoch and the augmentation's salts (both refilled in
  place at each epoch's start), the resident uint8 data;
- a step gathers its batch, augments it (counter-based draws: `batches.Augmentation`), runs forward,
  loss and `torch.autograd.grad`, averages the gradients over the replicas (one flat all-reduce of
  functional collectives), updates, folds the loss into the divergence watch and counts;
- around it, on the host and without reading the device: the step's dropout seed (a generator
  setting, which a graph's replay reads), Lookahead's pull every N steps (its mix is a host number),
  the epoch's refill.

`--step` picks how it runs: `eager` is not the program but the reference step (forward and loss
here, then a strategy's gradient exchange and its torch.optim optimizer and scheduler, set up by
`optim.ScheduledOptimizer`; Lookahead here after it), for every strategy and input mode;
`graph` records the program once as a CUDA graph and replays it; `compiled` runs it through
torch.compile(fullgraph=True), and on one GPU records the compiled step as a graph too; `auto` is
`graph` where one process drives one GPU with resident data and `ddp`, else `eager`. Recording or
compiling happens during the warm-up, timed as setup and undone; where it fails, the run says why in
one line and runs the program op by op ("program" in summary.json).

Here: the `Steps` interface the loop drives and what every kind shares (forward and loss, precision,
dropout seeds, the undone warm-up), and `resolve_step`, which picks the kind a run takes. The kinds:
eager.py (`EagerSteps`) and program.py (`StepProgram`); step_kinds.py builds one (`make_steps`,
`STEP_KINDS`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Callable, Generator

import torch
import torch.nn.functional as F
from torch import nn

from towerlab.config import TrainConfig
from towerlab.distributed.group import Context
from towerlab.errors import UserError
from towerlab.training.batches import mix_seed
from towerlab.training.lookahead import Lookahead

# Warm-up steps before the clock: cuDNN's algorithm search and lazy loading on the first, compilation
# on the first two, a graph recorded after them and replayed once.
WARMUP_STEPS = 3

Yield = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (loss, logits, labels) of one step


def mixed_precision(cfg: TrainConfig, device: torch.device, *, cache_casts: bool = True
                    ) -> contextlib.AbstractContextManager:
    """--precision's context for forward and loss: bf16 autocast, or nothing for fp32."""
    if cfg.precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=cache_casts)


def forward_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainConfig,
                 precision: contextlib.AbstractContextManager) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, logits) of `model` on the batch: cross-entropy with --label-smoothing, under `precision`."""
    with precision:
        logits = model(x)
        loss = F.cross_entropy(logits, y, label_smoothing=cfg.label_smoothing)
    return loss, logits


def uses_dropout(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) for m in module.modules())


def seed_dropout(device: torch.device, seed: int) -> None:
    """Seed the one generator dropout draws from on `device`. Not `torch.manual_seed`, which also
    seeds every CUDA device and, where CUDA is not initialised, records a stack trace to do so
    later: about 95 us per call against 1 us on a CPU (bench/speed/changes.py), paid every step. A CUDA
    graph's replay reads the generator's seed and offset when it starts, so seeding before a replay
    gives the replay's dropout the masks the same seed gives an eager step."""
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device's generator: the session set it to `device`
    else:
        torch.default_generator.manual_seed(seed)


def seed_step(cfg: TrainConfig, ctx: Context, step: int) -> None:
    """Seed dropout for step `step` of this replica: a function of (seed, rank, step) alone, so a
    resumed or warmed-up run draws the masks an uninterrupted one draws."""
    seed_dropout(ctx.device, mix_seed(cfg.seed, ctx.rank, step))


def resolve_step(requested: str, device_type: str, world_size: int, strategy: str, input_mode: str) -> str:
    """The step a run takes: "eager", "graph" or "compiled" ("program", the step program run op by
    op, is asked for by tests only). `auto` takes a graph where one is possible; an explicit mode that
    cannot run is one clear error."""
    reasons = []
    if strategy != "ddp":
        reasons.append(f"--strategy {strategy} sends gradients through the host, which only the eager step does")
    if input_mode != "resident":
        reasons.append(f"--input {input_mode} feeds batches from the host; the step program gathers its batch "
                       "from resident data")
    if requested == "graph":
        if device_type != "cuda":
            reasons.append("a CUDA graph needs a GPU (on a CPU: --step eager or compiled)")
        if world_size > 1:
            reasons.append(f"{world_size} replicas: the all-reduce inside a recorded graph is not proven yet "
                           "(use --step compiled or eager)")
    if requested == "auto":
        return "graph" if device_type == "cuda" and world_size == 1 and not reasons else "eager"
    if requested in ("graph", "compiled", "program") and reasons:
        raise UserError(f"--step {requested} cannot run here: {reasons[0]}")
    return requested


class Steps:
    """What the training loop drives: `epoch(epoch, start)` runs that epoch's steps from `start`,
    yielding (loss, logits, labels) of each; `state_dict` / `load_state_dict` for checkpoints and
    the warm-up's undo; `lr()`, the learning rate of the next step, read on the host."""

    mode = ""
    ctx: Context
    worst: torch.Tensor  # the divergence watch's running maximum of the loss, on the device
    steps_per_epoch: int

    def epoch(self, epoch: int, start: int) -> Generator[Yield, None, None]:
        raise NotImplementedError  # as state_dict, load_state_dict and lr below: each kind has its own

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError

    def prepare(self, mode: str, step: int, log: Callable[[str], None]) -> int:
        """Warm up on the steps from `step` before the clock, as `mode` (resolve_step's answer) runs
        them, and undo them exactly; returns how many warm-up steps ran."""
        raise NotImplementedError

    def snapshot(self) -> dict:
        return {"state": copy.deepcopy(self.state_dict()), "worst": self.worst.clone()}

    def restore(self, snapshot: dict) -> None:
        self.load_state_dict(snapshot["state"])
        self.worst.copy_(snapshot["worst"])

    def warm_up(self, step: int, count: int) -> int:
        """Run steps `step` .. `step + count - 1` (at most to the end of their epoch) as the training
        loop will, then restore the state before them exactly; returns how many ran. Dropout and
        augmentation are drawn per step and per example, so no random state carries over."""
        snapshot = self.snapshot()
        epoch, start = divmod(step, self.steps_per_epoch)
        ran = 0
        with contextlib.closing(self.epoch(epoch, start)) as source:  # stops a queue's thread
            for _ in itertools.islice(source, count):
                ran += 1
        self.restore(snapshot)
        return ran


def warms_up(device: torch.device, mode: str) -> bool:
    """Whether a run warms its step up before the clock: on CUDA (cuDNN's algorithm search, lazy
    loading), and wherever a step is recorded or compiled. A plain CPU step costs the same from its
    first call, so an eager CPU run skips it (no extra cost)."""
    return device.type == "cuda" or mode in ("graph", "compiled")


def lookahead_state(lookahead: Lookahead | None) -> dict:
    return {"lookahead": lookahead.state_dict()} if lookahead is not None else {}
