"""The step as one static program over resident data (see step.py's docstring): run op by op, recorded
as a CUDA graph, or compiled with torch.compile; its state lives in tensors allocated up front and
changed in place, so a recorded graph stays valid through checkpoints, resumes and the warm-up's undo.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Generator

import torch
from torch import nn

from towerlab.config import TrainConfig
from towerlab.distributed.group import Context, max_over_ranks, world_group
from towerlab.training.batches import Batches
from towerlab.training.lookahead import lookahead_for
from towerlab.training.optim import parameter_groups, trained_parameters
from towerlab.training.update import Update, schedule_tables, tables_on, uses_momentum
from towerlab.training.step import (WARMUP_STEPS, Steps, Yield, forward_loss, lookahead_state, mixed_precision,
                                    seed_step, uses_dropout)

# torch.compile's settings for --step compiled, by device kind: inductor's default mode (no CUDA
# graphs of its own: on one GPU the program records its graph around the compiled step). Tests swap in
# the aot_eager backend, which traces the same whole graph without inductor's minute of compiling.
COMPILE_OPTIONS: dict[str, dict] = {"cuda": {}, "cpu": {}}


class StepProgram(Steps):
    """The step as one static program over resident data (see the module's docstring). `worst` is
    the divergence watch's device tensor, which each step folds its loss into."""

    def __init__(self, module: nn.Module, cfg: TrainConfig, ctx: Context, batches: Batches, total_steps: int,
                 worst: torch.Tensor):
        self.module, self.cfg, self.ctx, self.batches, self.worst = module, cfg, ctx, batches, worst
        device = ctx.device
        self.params = trained_parameters(module)
        groups = parameter_groups(module, self.params, cfg, batches.steps_per_epoch)
        lrs, momenta = schedule_tables(cfg, groups, total_steps)
        # --whiten-bias-epochs: from step `frozen_from` on, the step neither computes the whitening bias's
        # gradient (and the backward pass it alone needs) nor updates it: a second program, which reads
        # `frozen` (set before each step), recorded or compiled apart.
        whiten = [g for g, group in enumerate(groups) if group.part == "whiten_bias"]
        self.skip_frozen = (whiten[0],) if whiten else ()  # the groups a frozen step leaves alone
        self.frozen_from = groups[whiten[0]].until if whiten else total_steps
        self.frozen = False
        self.still = [not whiten or i not in groups[whiten[0]].positions for i in range(len(self.params))]
        self.live = {False: self.params, True: [p for p, still in zip(self.params, self.still) if still]}
        self.total_steps = total_steps
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
        self.runs: dict[bool, Callable[[], Yield]] = {False: self.program, True: self.program}  # by `frozen`
        self.epoch_loaded: int | None = None
        self.compiled: Callable[[], Yield] | None = None
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
        live = self.live[self.frozen]
        grads = list(torch.autograd.grad(loss, live))
        if self.group is not None:
            grads = self._average(grads, live)
        if self.frozen:  # the frozen parameters stand in for their gradients, which the update skips
            given = iter(grads)
            grads = [next(given) if still else p for p, still in zip(self.params, self.still)]
        lr = self.lr_table.index_select(0, self.t).view(-1)
        momentum = None if self.momentum_table is None else self.momentum_table.index_select(0, self.t).view(-1)
        self.update(grads, lr, momentum, skip=self.skip_frozen if self.frozen else ())
        with torch.no_grad():
            self.worst.copy_(torch.maximum(self.worst, loss.detach().float()))
            self.t.add_(1)
            self.k.add_(1)
        return loss.detach(), logits.detach(), y

    def _average(self, grads: list[torch.Tensor], params: list[torch.Tensor]) -> list[torch.Tensor]:
        from torch.distributed import _functional_collectives as funcol

        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = funcol.all_reduce(flat, "sum", self.group) / self.ctx.world_size  # type: ignore[arg-type]  # run with a group
        return [chunk.view_as(p) for chunk, p in zip(flat.split([p.numel() for p in params]), params)]

    def _broadcast_buffers(self) -> None:
        from torch.distributed import _functional_collectives as funcol

        flat = funcol.broadcast(torch.cat([b.reshape(-1) for b in self.buffers]), 0, self.group)  # type: ignore[arg-type]  # with a group
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
        self.frozen = step >= self.frozen_from

    def _load_epoch(self, epoch: int) -> None:
        if self.epoch_loaded != epoch:
            self.perm.copy_(self.batches.indices(epoch).view_as(self.perm))
            if self.batches.augmentation is not None:
                self.salts.copy_(torch.tensor(self.batches.augmentation.salts(epoch)))
            self.epoch_loaded = epoch

    def epoch(self, epoch: int, start: int) -> Generator[Yield, None, None]:
        self.start(epoch * self.steps_per_epoch + start)
        for step in range(epoch * self.steps_per_epoch + start, (epoch + 1) * self.steps_per_epoch):
            yield self.step(step)

    def step(self, step: int) -> Yield:
        self.frozen = step >= self.frozen_from
        out = self.step_with(self.runs[self.frozen], step)
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
                **lookahead_state(self.lookahead)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Copy `state` into the program's own tensors: no tensor is replaced, so a recorded graph
        stays valid (a checkpoint of the eager step has another form: refused before this)."""
        self.module.load_state_dict(state["model"])
        saved = state["update"]
        self.update.step_count.copy_(saved["step_count"])
        self.update.mu_product.copy_(saved["mu_product"])  # an older checkpoint's single one: every group's
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
        # Each program the run will take, from the first step it takes it: a frozen whitening bias's too.
        starts = {step >= self.frozen_from: step}
        if step < self.frozen_from < self.total_steps:
            starts[True] = self.frozen_from
        try:
            for start in starts.values():
                self._warm(mode, start)
        except Exception as exc:  # noqa: BLE001 - the compiler's and the recorder's errors are many kinds
            failure = _reason(exc)
        if self.group is not None and max_over_ranks(self.ctx, float(failure is not None)) and failure is None:
            failure = "another replica's failed"  # every replica runs alike, or none does
        if failure is not None:
            log(f"towerlab: warning: --step {mode} failed ({failure}); training with the step program uncaptured")
            self.mode, self.runs = "program", {False: self.program, True: self.program}
        else:
            self.mode = mode
        self.restore(snapshot)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return WARMUP_STEPS * len(starts)

    def _warm(self, mode: str, step: int) -> None:
        """Warm up, and record or compile, the program that step `step` takes (`runs[frozen]`)."""
        cuda = self.ctx.device.type == "cuda"
        run: Callable[[], Yield] = self.program
        if mode == "compiled":
            if self.compiled is None:  # one compiled function: a program per `frozen`, each compiled once
                self.compiled = _traced_autograd(torch.compile(self.program, fullgraph=True,
                                                               **COMPILE_OPTIONS[self.ctx.device.type]))
            run = self.compiled
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
            self.runs[self.frozen] = _replay(graph, outputs)
            self.step_with(self.runs[self.frozen], step)
        else:
            self.runs[self.frozen] = run

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

