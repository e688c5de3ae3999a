"""The training step, eager or as one static program (issue 38).

A small network's step on a GPU is bound by kernel launches, not arithmetic: LeNet-5 at batch 512
launches about 110 kernels in 2.2 ms on an H100, where the same arithmetic replayed as one CUDA graph
takes 0.68 ms (bench/results/step-gpu-2026-11-25.json). A graph replays fixed kernels on fixed
memory, so the step must be a program that takes no changing Python value and reads nothing back:

- state lives in tensors allocated up front and only changed in place: the model's parameters and
  buffers, the optimizer's state (`optim.Update`), the step counters (`t` over the run, `k` within the
  epoch), the learning-rate and momentum tables (`optim.schedule_tables`, recorded from torch's own
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
one line and runs the program op by op ("program" in summary.json). `make_steps` builds the kind a
run takes from `STEP_KINDS`.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from towerlab.training.batches import Batches, mix_seed
from towerlab.config import TrainConfig
from towerlab.distributed.group import Context, max_over_ranks, world_group
from towerlab.errors import UserError
from towerlab.training.lookahead import Lookahead, lookahead_for
from towerlab.training.optim import (Update, optimizer_factory, parameter_groups, schedule_tables, tables_on,
                            trained_parameters, uses_momentum)
from towerlab.training.strategies import Strategy, make_strategy

# torch.compile's settings for --step compiled, by device kind: inductor's default mode (no CUDA
# graphs of its own: on one GPU the program records its graph around the compiled step). Tests swap in
# the aot_eager backend, which traces the same whole graph without inductor's minute of compiling.
COMPILE_OPTIONS: dict[str, dict] = {"cuda": {}, "cpu": {}}
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
    later: about 95 us per call against 1 us on a CPU (bench/changes.py), paid every step. A CUDA
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

    def epoch(self, epoch: int, start: int) -> Iterator[Yield]:
        raise NotImplementedError  # and state_dict, load_state_dict, lr: each kind has its own

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


class EagerSteps(Steps):
    """The reference step: batches from `Batches`, forward and loss here, the strategy's gradient
    exchange and torch.optim update, Lookahead after it, dropout seeded per step on the host."""

    mode = "eager"

    def __init__(self, strat: Strategy, batches: Batches, cfg: TrainConfig, ctx: Context, total_steps: int,
                 worst: torch.Tensor):
        self.strat, self.batches, self.cfg, self.ctx, self.worst = strat, batches, cfg, ctx, worst
        self.total_steps = total_steps
        self.steps_per_epoch = batches.steps_per_epoch
        self.dropout = uses_dropout(strat.module)
        self.precision = mixed_precision(cfg, ctx.device)
        self.lookahead = lookahead_for(cfg, strat.module, total_steps)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One update on the batch (x, y); returns its (loss, logits), detached."""
        loss, logits = forward_loss(self.strat.model, x, y, self.cfg, self.precision)
        self.strat.update(loss)
        # Lookahead's pull towards the slow weights, on every replica alike.
        if self.lookahead is not None and self.lookahead.step():
            self.strat.weights_changed()
        return loss.detach(), logits.detach()

    def epoch(self, epoch: int, start: int) -> Iterator[Yield]:
        step = epoch * self.batches.steps_per_epoch + start
        for x, y in self.batches.epoch(epoch, start):
            if self.dropout:
                seed_step(self.cfg, self.ctx, step)
            loss, logits = self.step(x, y)
            torch.maximum(self.worst, loss.float(), out=self.worst)
            step += 1
            yield loss, logits, y

    def prepare(self, mode: str, step: int, log: Callable[[str], None]) -> int:
        return self.warm_up(step, min(WARMUP_STEPS, self.total_steps - step))

    def state_dict(self) -> dict:
        # The layout of every eager checkpoint: {"model", "optimizer", "scheduler"[, "lookahead"]}.
        return {"model": self.strat.module.state_dict(), **self.strat.state_dict(), **_lookahead_state(self.lookahead)}

    def load_state_dict(self, state: dict) -> None:
        self.strat.module.load_state_dict(state["model"])
        self.strat.load_state_dict(state)
        if self.lookahead is not None:
            self.lookahead.load_state_dict(state["lookahead"])

    def lr(self) -> float:
        return self.strat.lr()


class StepProgram(Steps):
    """The step as one static program over resident data (see the module's docstring). `worst` is
    the divergence watch's device tensor, which each step folds its loss into."""

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: Context, batches: Batches, total_steps: int,
                 worst: torch.Tensor):
        self.module, self.cfg, self.ctx, self.batches, self.worst = module, cfg, ctx, batches, worst
        device = ctx.device
        self.params = trained_parameters(module)
        self.sizes = [p.numel() for p in self.params]
        groups = parameter_groups(module, self.params, cfg.norm_lr_scale)
        lrs, momenta = schedule_tables(cfg, groups, total_steps)
        self.lr_host = [row[0] for row in lrs]
        self.lr_table, self.momentum_table = tables_on(device, lrs, momenta)
        self.update = Update(cfg, self.params, groups, uses_momentum(cfg.optimizer, momenta))
        self.lookahead = lookahead_for(cfg, module, total_steps)
        self.steps_per_epoch = batches.steps_per_epoch
        self.perm = torch.zeros(batches.steps_per_epoch, cfg.batch_size, dtype=torch.long, device=device)
        self.salts = torch.zeros(3, dtype=torch.long, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)   # the step about to run, over the run
        self.k = torch.zeros(1, dtype=torch.long, device=device)   # ... and within its epoch
        self.group = world_group(ctx) if ctx.distributed else None
        # DDP's broadcast_buffers: every replica starts each forward with rank 0's BatchNorm statistics.
        self.buffers = [b for b in module.buffers() if b.is_floating_point()] if self.group is not None else []
        self.dropout = uses_dropout(module)
        self.mode = "program"
        self.run: Callable[[], Yield] = self.program
        self.epoch_loaded: int | None = None
        self.next_step = 0

    # --- the program -------------------------------------------------------------------------------

    def program(self) -> Yield:
        """One step: no argument, no value read back, every tensor it writes written in place."""
        rows = self.perm.index_select(0, self.k).view(-1)
        x = self.batches.x.index_select(0, rows)
        y = self.batches.y.index_select(0, rows)
        if self.batches.augmentation is not None:
            x = self.batches.augmentation(x, rows, self.salts)
        x = self.batches.normalize(x)
        if self.buffers:
            self._broadcast_buffers()
        # Made each call (a compiled program would otherwise hold this object's identity, and a
        # process training many programs would compile each anew); no cast cache in a graph.
        precision = mixed_precision(self.cfg, self.ctx.device, cache_casts=False)
        loss, logits = forward_loss(self.module, x, y, self.cfg, precision)
        grads = list(torch.autograd.grad(loss, self.params))
        if self.group is not None:
            grads = self._average(grads)
        lr = self.lr_table.index_select(0, self.t).view(-1)
        momentum = None if self.momentum_table is None else self.momentum_table.index_select(0, self.t).view(-1)
        self.update(grads, lr, momentum)
        with torch.no_grad():
            self.worst.copy_(torch.maximum(self.worst, loss.detach().float()))
            self.t.add_(1)
            self.k.add_(1)
        return loss.detach(), logits.detach(), y

    def _average(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        from torch.distributed import _functional_collectives as funcol

        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = funcol.all_reduce(flat, "sum", self.group) / self.ctx.world_size
        return [chunk.view_as(p) for chunk, p in zip(flat.split(self.sizes), self.params)]

    def _broadcast_buffers(self) -> None:
        from torch.distributed import _functional_collectives as funcol

        flat = funcol.broadcast(torch.cat([b.reshape(-1) for b in self.buffers]), 0, self.group)
        with torch.no_grad():
            for b, chunk in zip(self.buffers, flat.split([b.numel() for b in self.buffers])):
                b.copy_(chunk.view_as(b))

    # --- around it, on the host --------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Point the program at `step` of the run (its epoch's permutation and salts, both counters)."""
        epoch, start = divmod(step, self.steps_per_epoch)
        self._load_epoch(epoch)
        self.k.fill_(start)
        self.t.fill_(step)
        self.next_step = step

    def _load_epoch(self, epoch: int) -> None:
        if self.epoch_loaded != epoch:
            self.perm.copy_(self.batches.indices(epoch).view_as(self.perm))
            if self.batches.augmentation is not None:
                self.salts.copy_(torch.tensor(self.batches.augmentation.salts(epoch)))
            self.epoch_loaded = epoch

    def epoch(self, epoch: int, start: int) -> Iterator[Yield]:
        self.start(epoch * self.steps_per_epoch + start)
        for step in range(epoch * self.steps_per_epoch + start, (epoch + 1) * self.steps_per_epoch):
            yield self.step(step)

    def step(self, step: int) -> Yield:
        out = self.step_with(self.run, step)
        if self.lookahead is not None:
            self.lookahead.step()
        self.next_step = step + 1
        return out

    def lr(self) -> float:
        """The learning rate of the next step (a host number: no device read)."""
        return self.lr_host[min(self.next_step, len(self.lr_host) - 1)]

    # --- state: saved, restored and undone in place ------------------------------------------------

    def state_dict(self) -> dict:
        update = self.update
        return {"model": self.module.state_dict(),
                "update": {"step_count": update.step_count, "mu_product": update.mu_product, "state": update.state},
                **_lookahead_state(self.lookahead)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy `state` into the program's own tensors: no tensor is replaced, so a recorded graph
        stays valid (a checkpoint of the eager step has another form: refused before this)."""
        self.module.load_state_dict(state["model"])
        saved = state["update"]
        self.update.step_count.copy_(saved["step_count"])
        self.update.mu_product.copy_(saved["mu_product"])
        for key, tensors in self.update.state.items():
            torch._foreach_copy_(tensors, [t.to(tensors[0].device) for t in saved["state"][key]])
        if self.lookahead is not None:
            self.lookahead.load_state_dict(state["lookahead"])

    # --- recording and compiling, during the warm-up -----------------------------------------------

    def prepare(self, mode: str, step: int, log: Callable[[str], None]) -> int:
        """Make `mode` ("program", "graph" or "compiled") this program's way to run, warming it up on
        step `step` (run WARMUP_STEPS times, then undone); returns the warm-up steps run. A failure to
        record or compile leaves the program running op by op, with one line."""
        snapshot = self.snapshot()
        failure = None
        try:
            self._warm(mode, step)
        except Exception as exc:  # noqa: BLE001 - the compiler's and the recorder's errors are many kinds
            failure = _reason(exc)
        if self.group is not None and max_over_ranks(self.ctx, float(failure is not None)) and failure is None:
            failure = "another replica's failed"  # every replica runs alike, or none does
        if failure is not None:
            log(f"towerlab: warning: --step {mode} failed ({failure}); training with the step program uncaptured")
            self.mode, self.run = "program", self.program
        else:
            self.mode = mode
        self.restore(snapshot)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return WARMUP_STEPS

    def _warm(self, mode: str, step: int) -> None:
        cuda = self.ctx.device.type == "cuda"
        run: Callable[[], Yield] = self.program
        if mode == "compiled":
            run = _traced_autograd(torch.compile(self.program, fullgraph=True, **COMPILE_OPTIONS[self.ctx.device.type]))
        record = cuda and mode in ("graph", "compiled") and self.group is None
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for _ in range(WARMUP_STEPS - (1 if record else 0)):
                self.start(step)
                self.step_with(run, step)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        if record:
            self.start(step)
            if self.dropout:  # before recording: a seed cannot be set while a graph records
                seed_step(self.cfg, self.ctx, step)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = run()
            self.run = _replay(graph, outputs)
            self.step_with(self.run, step)
        else:
            self.run = run

    def step_with(self, run: Callable[[], Yield], step: int) -> Yield:
        """`run` as step `step`: its dropout seeded on the host first."""
        if self.dropout:
            seed_step(self.cfg, self.ctx, step)
        return run()

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the program keeps between steps (what a recorded graph holds the addresses of)."""
        own = [self.perm, self.salts, self.t, self.k, self.lr_table, self.worst, *self.update.tensors()]
        if self.momentum_table is not None:
            own.append(self.momentum_table)
        slow = self.lookahead.slow if self.lookahead is not None else []
        return [*self.module.state_dict(keep_vars=True).values(), *own, *slow]


def _lookahead_state(lookahead: Lookahead | None) -> dict:
    return {"lookahead": lookahead.state_dict()} if lookahead is not None else {}


def make_steps(mode: str, strategy: str, module: nn.Module, cfg: TrainConfig, ctx: Context, batches: Batches,
               total_steps: int, worst: torch.Tensor) -> Steps:
    """The steps a run of `mode` (resolve_step's answer) drives, over `strategy` where the step is eager."""
    return STEP_KINDS[mode](strategy, module, cfg, ctx, batches, total_steps, worst)


def _eager(strategy: str, module: nn.Module, cfg: TrainConfig, ctx: Context, batches: Batches,
           total_steps: int, worst: torch.Tensor) -> Steps:
    strat = make_strategy(strategy, module, ctx, optimizer_factory(cfg, module, total_steps))
    return EagerSteps(strat, batches, cfg, ctx, total_steps, worst)


def _program(strategy: str, module: nn.Module, cfg: TrainConfig, ctx: Context, batches: Batches,
             total_steps: int, worst: torch.Tensor) -> Steps:
    # Its own all-reduce: resolve_step let only --strategy ddp through.
    return StepProgram(module, cfg, ctx, batches, total_steps, worst)


# resolve_step's answers (--step's choices but auto, and "program", the tests' uncaptured program)
# -> how their steps are built; the program's kinds differ in what `prepare` records or compiles.
STEP_KINDS: dict[str, Callable[..., Steps]] = {"eager": _eager, "program": _program, "graph": _program,
                                               "compiled": _program}


def _traced_autograd(compiled: Callable[[], Yield]) -> Callable[[], Yield]:
    """`compiled`, called where dynamo traces `torch.autograd.grad` into the graph (torch's switch for
    it, off by default; older torch traces it without one): its compilation and any recompilation."""
    import torch._dynamo

    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        return compiled

    def run() -> Yield:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled()
    return run


def _replay(graph: Any, outputs: Yield) -> Callable[[], Yield]:
    def replay() -> Yield:
        graph.replay()
        return outputs
    return replay


def _reason(exc: Exception) -> str:
    """The first line of an error that says what went wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if not line.endswith("raised:")]
    return said[0] if said else type(exc).__name__

