"""train(cfg, ctx, data, options) -> TrainResult: the synchronous data-parallel training loop,
evaluation and checkpoints. `cfg` (a TrainConfig) is what the run computes; `options` (LoopOptions)
how the loop runs: input mode, strategy, step mode, what it reports, where it saves, whether it tests.
No argv, no process spawning: the caller places this process in its group, and checks the setup
once per run (`network.check_setup`) before it trains.

The step itself never waits for the host: losses and accuracies are read (and reduced over the
ranks) only at display steps and evaluations.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from towerlab.config import RunConfig, TrainConfig
from towerlab.distributed.group import Context, max_over_ranks, sum_over_ranks
from towerlab.distributed.signals import Interrupted, StopFlag
from towerlab.models.custom import NetworkSource
from towerlab.models.preprocessing import Normalizer
from towerlab.report import Reporter, format_epoch, format_step
from towerlab.training import checkpoint
from towerlab.training.batches import Batches
from towerlab.training.divergence import DivergenceWatch
from towerlab.training.evaluation import loss_and_accuracy
from towerlab.training.network import build, fit_to_data, uses_channels_last
from towerlab.training.progress import Progress, checkpoint_state, final_val_scores, restore, step_name
from towerlab.training.step import Steps, resolve_step, warms_up
from towerlab.training.step_kinds import make_steps

if TYPE_CHECKING:
    from towerlab.data.load import Dataset

# What a step mode's warm-up does before the clock starts (named when it lasts: towerlab.report.phase).
SETUP_PHASES = {"graph": "recording the step as a CUDA graph", "compiled": "compiling the step with torch.compile",
                "program": "warming the step program up", "eager": "warming the step up"}
STOP_CHECK_EVERY = 10  # steps between the ranks' agreement on a Ctrl-C (a tiny all-reduce)


@dataclass(frozen=True)
class LoopOptions:
    """How the loop runs, apart from what it computes (the TrainConfig), as accelerate keeps run
    options apart from a model's settings. `input_mode`, `strategy`, `step_mode` and `display_step`
    are --input, --strategy, --step and --display-step; `reporter` says and records (None: nothing);
    `checkpoint_path` is saved each epoch and on a stop (None: never); `stop` asks the run to stop,
    saving first; `test` scores the test split at the end, and so does `test_from` (None: never) where
    the final validation accuracy reaches it (a search scores a network that may enter its top so at
    once, rather than retraining it for its test accuracy later: the bar is decided before the
    training starts); `setup_apart` warms the step up before the
    clock where that pays, to report setup apart from training (a search candidate reports no setup,
    so it spends warm-up steps only where its step is recorded or compiled, which needs them)."""

    input_mode: str = "resident"
    strategy: str = "ddp"
    step_mode: str = "auto"
    display_step: int = 100
    reporter: Optional[Reporter] = None
    checkpoint_path: Optional[Path] = None
    stop: Optional[StopFlag] = None
    test: bool = True
    test_from: Optional[float] = None
    setup_apart: bool = True

    @classmethod
    def of(cls, run: RunConfig, **rest: Any) -> LoopOptions:
        """The options a `towerlab train` run's settings give, with `rest` (the other fields) besides."""
        return cls(input_mode=run.input, strategy=run.strategy, step_mode=run.step, display_step=run.display_step,
                   **rest)


@dataclass
class TrainResult:
    steps: int
    epochs: float                      # steps / steps_per_epoch
    steps_per_epoch: int
    train_seconds: float               # optimizer steps only: no evaluation, no checkpoints, no setup
    examples_per_sec: float            # global examples per training second
    val_loss: float | None
    val_accuracy: float | None         # of the returned model (the best epoch under --patience)
    test_loss: float | None
    test_accuracy: float | None
    best_epoch: int | None
    stopped: str | None                # None, "patience" or "target_accuracy"
    # Recording, compiling and warming up the step before the clock starts (towerlab.training.step), over
    # every attempt of a resumed run; 0.0 where nothing is warmed up (an eager run on a CPU).
    setup_seconds: float = 0.0
    step_mode: str = "eager"           # how the steps ran: eager, graph, compiled, or program (towerlab.training.step)
    eval_seconds: float = 0.0          # this attempt's validation and test passes (each ends in a host read)
    test_seconds: float = 0.0          # ... and the final test pass alone
    history: list[dict] = field(default_factory=list)
    model: nn.Module | None = None


class _Clock:
    """Training time only; synchronises the device at the edges so GPU time is counted in full."""

    def __init__(self, device: torch.device):
        self.device = device
        self.started: float | None = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self.started = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        elapsed = time.perf_counter() - self.started if self.started is not None else 0.0
        self.started = None
        return elapsed


def make_batches(cfg: TrainConfig, ctx: Context, data: Dataset, input_mode: str) -> Batches:
    """This rank's minibatches of the training split, normalised as the model takes them."""
    normalize = Normalizer(data.mean, data.std, ctx.device, uses_channels_last(cfg))
    return Batches(data.x_train, data.y_train, ctx, cfg.batch_size, cfg.seed, input_mode, normalize,
                   augment_images=cfg.augment, translate=cfg.translate)


def train(cfg: TrainConfig, ctx: Context, data: Dataset, options: LoopOptions = LoopOptions(), *,
          source: NetworkSource | None = None, resume_state: dict | None = None) -> TrainResult:
    """Train `cfg.model` (or `source`, a module of your own or its factory) on `data` over the
    replicas of `ctx`, as `options` says; from `resume_state` (a checkpoint) where given."""
    return _Training(cfg, ctx, data, options, source, resume_state).run()


class _Training:
    """One call of `train`: the run's state, and one method per part of the loop."""

    def __init__(self, cfg: TrainConfig, ctx: Context, data: Dataset, options: LoopOptions,
                 source: NetworkSource | None, resume_state: dict | None):
        self.cfg, self.ctx, self.data, self.options = cfg, ctx, data, options
        self.reporter = options.reporter or Reporter(None, enabled=False)
        if ctx.device.type == "cuda":
            # Every training batch has the same shape, so cuDNN's one-off search for the fastest
            # convolution algorithm pays back within a few steps.
            torch.backends.cudnn.benchmark = True
        self.batches = make_batches(cfg, ctx, data, options.input_mode)
        self.steps_per_epoch = self.batches.steps_per_epoch
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        self.epochs_total = -(-self.total_steps // self.steps_per_epoch)
        self.global_batch = cfg.batch_size * ctx.world_size
        self.module = build(cfg, data.input_shape, data.num_classes, ctx, source)
        self.clock = _Clock(ctx.device)
        self.progress = Progress()
        if resume_state is None:
            # Part of training, as in airbench94's timing: a pass over training images.
            self.clock.start()
            with self.reporter.phase(f"Setup: initialising {cfg.model} from the training images"):
                fit_to_data(cfg, self.module, self.batches.x, self.batches.normalize)  # resident: on the device
            self.progress.train_seconds += self.clock.stop()
        self.mode = resolve_step(options.step_mode, ctx.device.type, ctx.world_size, options.strategy,
                                 options.input_mode)
        with self.reporter.phase(f"Setup: building the {step_name(self.mode)} (the optimizer, and the replicas' "
                                 "gradient exchange)"):
            self.steps: Steps = make_steps(self.mode, options.strategy, self.module, cfg, ctx, self.batches,
                                           self.total_steps)
        if resume_state is not None:
            self.progress = restore(resume_state, self.steps)
        self.val = self._split(data.x_val, data.y_val)
        self.divergence = DivergenceWatch(cfg, ctx, self.progress.step, self.steps.worst)
        self.curve_every = 0
        self.last_display = (self.progress.step, 0.0)
        self.eval_seconds = 0.0

    def _split(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An evaluation split, on the device where the training data is."""
        return (x.to(self.ctx.device), y.to(self.ctx.device)) if self.options.input_mode == "resident" else (x, y)

    def run(self) -> TrainResult:
        progress, reporter = self.progress, self.reporter
        self.module.train()
        if progress.step < self.total_steps and progress.stopped is None and (
                self.mode != "eager" or (self.options.setup_apart and warms_up(self.ctx.device, self.mode))):
            self._warm_up()
        reporter.start_progress(self.total_steps, progress.step, lines=True)
        self.curve_every = reporter.curve_every(self.total_steps, self.options.display_step)  # the same on every rank
        self.last_display = (progress.step, time.perf_counter())
        while progress.step < self.total_steps and progress.stopped is None:
            self._epoch()
        reporter.end_progress()
        return self._result()

    def _warm_up(self) -> None:
        self.clock.start()
        with self.reporter.phase(f"Setup: {SETUP_PHASES.get(self.mode, 'warming the step up')}, before the clock"):
            ran = self.steps.prepare(self.mode, self.progress.step, self.reporter.line)
        seconds = self.clock.stop()
        self.progress.setup_seconds += seconds
        self.reporter.line(f"Setup: {seconds:.1f} s before training ({ran} warm-up steps, undone)")

    def _epoch(self) -> None:
        progress = self.progress
        epoch, start = divmod(progress.step, self.steps_per_epoch)
        self.clock.start()
        for loss, logits, y in self.steps.epoch(epoch, start):
            if self._after_step(loss, logits, y):
                break
        if self.clock.started is not None:
            progress.train_seconds += self.clock.stop()
        if progress.stopped is None:
            scores = self._val_scores(progress.step)
            self.divergence.check(progress.step, val_loss=scores[0])
            self._after_eval(progress.step, scores, end_of_epoch=True)
            self._save(progress.step)

    def _after_step(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> bool:
        """What follows a step on the host (reports, a stop, an evaluation); True: the epoch ends here."""
        cfg, progress, stop = self.cfg, self.progress, self.options.stop
        progress.step += 1
        self.reporter.advance()
        step = progress.step
        if step == 1:  # one host read per run: a loss already NaN here is the model's, not the lr's
            self.divergence.check(step)
        if step % self.options.display_step == 0:
            self._display(step, loss, logits, y)
        elif self.curve_every and step % self.curve_every == 0:  # --tensorboard: the curve between display steps
            loss_value, accuracy = self._reduced(step, loss, logits, y)
            self.reporter.scalars("step", step, loss=loss_value, accuracy=accuracy, lr=self.steps.lr())
        if stop is not None and (self.ctx.world_size == 1 or step % STOP_CHECK_EVERY == 0):
            self._stop_if_asked(step, stop)
        if cfg.eval_every and step % cfg.eval_every == 0 and step % self.steps_per_epoch:
            progress.train_seconds += self.clock.stop()
            scores = self._val_scores(step)
            self.divergence.check(step, val_loss=scores[0])
            self._after_eval(step, scores, end_of_epoch=False)
            self.clock.start()
            if progress.stopped:
                return True
        return step >= self.total_steps

    def _stop_if_asked(self, step: int, stop: StopFlag) -> None:
        """A Ctrl-C or SIGTERM on any rank: every rank saves at this step and raises Interrupted."""
        signum = int(max_over_ranks(self.ctx, stop.signum))
        if signum:
            self.progress.train_seconds += self.clock.stop()
            self.divergence.check(step)  # never save NaN weights over the last good checkpoint
            self._save(step)
            self.reporter.line(f"Interrupted at step {step}: checkpoint saved")
            raise Interrupted(signum)

    def _val_scores(self, step: int) -> tuple[float | None, float | None]:
        if self.data.n_val == 0:
            return None, None
        return self._scores(f"Validating on {self.data.n_val:,} images after step {step}", *self.val)

    def _scores(self, what: str, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """`loss_and_accuracy` of a split, its seconds counted among the evaluations'."""
        started = time.perf_counter()
        with self.reporter.phase(what):
            scores = loss_and_accuracy(self.module, x, y, self.ctx, self.batches.normalize, self.cfg.precision,
                                       self.cfg.tta)
        self.eval_seconds += time.perf_counter() - started
        return scores

    def _save(self, step: int) -> None:
        path = self.options.checkpoint_path
        if path is not None and self.ctx.is_main:
            with self.reporter.phase(f"Saving the checkpoint of step {step}"):
                checkpoint.save(path, checkpoint_state(self.cfg, self.ctx, self.progress, self.steps, step))

    def _reduced(self, step: int, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """The step's loss and accuracy, averaged over the ranks (a host sync and one tiny all-reduce,
        which also checks the divergence flag)."""
        stats = torch.stack([loss.float(), (logits.argmax(1) == y).float().mean()]).to(torch.float64)
        stats = torch.cat([stats, self.divergence.flag().reshape(1)])  # one reduction for both
        loss_value, accuracy, flagged = (sum_over_ranks(self.ctx, stats) / self.ctx.world_size).tolist()
        self.divergence.check(step, flagged)
        return loss_value, accuracy

    def _display(self, step: int, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        loss_value, accuracy = self._reduced(step, loss, logits, y)
        now = time.perf_counter()
        rate = (step - self.last_display[0]) * self.global_batch / max(now - self.last_display[1], 1e-9)
        self.reporter.line(format_step(step, loss_value, accuracy, rate))
        # lr: the learning rate the schedule set for the next step (a host float: no device sync)
        self.reporter.record("step", step=step, loss=loss_value, accuracy=accuracy, examples_per_sec=rate,
                             lr=self.steps.lr())
        self.last_display = (step, now)

    def _after_eval(self, step: int, scores: tuple[float | None, float | None], *, end_of_epoch: bool) -> None:
        cfg, progress, reporter = self.cfg, self.progress, self.reporter
        val_loss, val_acc = scores
        epoch = -(-step // self.steps_per_epoch)
        seconds = progress.train_seconds
        record = {"epoch": epoch, "step": step, "val_loss": val_loss, "val_accuracy": val_acc,
                  "train_seconds": seconds,
                  "examples_per_sec": step * self.global_batch / seconds if seconds else 0.0}
        progress.history.append(record)
        reporter.record("epoch" if end_of_epoch else "eval", **record)
        if end_of_epoch:
            # Under --steps the budget is counted in steps, and the last evaluation may fall mid-epoch.
            where = f"Step {step}/{cfg.steps} (epoch {step / self.steps_per_epoch:.2f})" if cfg.steps \
                else f"Epoch {epoch}/{self.epochs_total}"
            reporter.line(format_epoch(where, val_loss, val_acc, seconds))
        if val_loss is None:
            return
        if val_loss < progress.best_val_loss:
            progress.best_val_loss, progress.best_epoch, progress.since_best = val_loss, epoch, 0
            if cfg.patience:
                progress.best_state = copy.deepcopy(self.module.state_dict())
        elif end_of_epoch:
            progress.since_best += 1
        if cfg.target_accuracy is not None and val_acc is not None and val_acc >= cfg.target_accuracy:
            progress.stopped = "target_accuracy"
            reporter.line(f"Reached the target validation accuracy {cfg.target_accuracy} at step {step}")
        elif cfg.patience and progress.since_best >= cfg.patience:
            progress.stopped = "patience"
            reporter.line(f"Stopping: no lower validation loss for {cfg.patience} epochs")

    def _result(self) -> TrainResult:
        cfg, data, progress, module = self.cfg, self.data, self.progress, self.module
        if cfg.patience and progress.best_state is not None:
            module.load_state_dict(progress.best_state)  # the weights of the best validation loss
        val_loss, val_acc = final_val_scores(progress)
        test_loss = test_acc = None
        bar = self.options.test_from
        tests = self.options.test or (bar is not None and val_acc is not None and val_acc >= bar)
        before_test = self.eval_seconds
        if tests and data.n_test > 0:
            test_loss, test_acc = self._scores(f"Testing on {data.n_test:,} images",
                                               *self._split(data.x_test, data.y_test))
        seconds = progress.train_seconds
        return TrainResult(
            steps=progress.step, epochs=progress.step / self.steps_per_epoch, steps_per_epoch=self.steps_per_epoch,
            train_seconds=seconds,
            examples_per_sec=progress.step * self.global_batch / seconds if seconds else 0.0,
            val_loss=val_loss, val_accuracy=val_acc, test_loss=test_loss, test_accuracy=test_acc,
            best_epoch=progress.best_epoch, stopped=progress.stopped, setup_seconds=progress.setup_seconds,
            step_mode=self.steps.mode, history=progress.history, model=module,
            eval_seconds=self.eval_seconds, test_seconds=self.eval_seconds - before_test)
