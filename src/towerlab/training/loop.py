"""train(cfg, ctx, data) -> TrainResult: the synchronous data-parallel training loop, evaluation
and checkpoints. No argv, no process spawning: the caller places this process in its group.

The step itself never waits for the host: losses and accuracies are read (and reduced over the
ranks) only at display steps and evaluations.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from towerlab.training import checkpoint
from towerlab.catalog import models as model_catalog
from towerlab.models.preprocessing import Normalizer, tta_logits
from towerlab.training.batches import Batches, eval_batches
from towerlab.config import TrainConfig
from towerlab.fields import to_dict
from towerlab.distributed.env import machine_memory
from towerlab.distributed.group import Context, max_over_ranks, sum_over_ranks, world_group
from towerlab.distributed.signals import Interrupted, StopFlag
from towerlab.errors import UserError
from towerlab.models import build_model
from towerlab.models.custom import instantiate
from towerlab.report import Reporter, format_epoch, format_step
from towerlab.training.step import Steps, resolve_step, warms_up
from towerlab.training.step_kinds import make_steps

EVAL_BATCH = 1024
# What a step mode's warm-up does before the clock starts (named when it lasts: towerlab.report.phase).
SETUP_PHASES = {"graph": "recording the step as a CUDA graph", "compiled": "compiling the step with torch.compile",
                "program": "warming the step program up", "eager": "warming the step up"}
STOP_CHECK_EVERY = 10  # steps between the ranks' agreement on a Ctrl-C (a tiny all-reduce)


class Diverged(UserError):
    """The loss became NaN or infinite: the run cannot succeed, and must not look as if it had."""


class _Divergence:
    """Watches the loss for NaN / inf without a host sync per step: each step folds its loss into a
    running maximum on the device (one tiny kernel; NaN and inf propagate through it), which is read
    only where the host reads anyway (display steps, evaluations, epoch ends, a save on Ctrl-C)."""

    def __init__(self, cfg: TrainConfig, ctx: Context, step: int, worst: torch.Tensor):
        self.cfg, self.ctx = cfg, ctx
        self.worst = worst  # folded into by every step (towerlab.training.step)
        self.checked = step  # the loss was finite up to this step

    def flag(self) -> torch.Tensor:
        """1.0 when a non-finite loss was seen since the last check (reduce it over the ranks)."""
        return (~torch.isfinite(self.worst)).to(torch.float64)

    def check(self, step: int, flagged: float | None = None, val_loss: float | None = None) -> None:
        """Raise Diverged when any rank saw a non-finite loss (`flagged`: the flag already summed
        over the ranks; else it is reduced here, a collective) or the validation loss is not finite."""
        if flagged is None:
            flagged = float(sum_over_ranks(self.ctx, self.flag().reshape(1)).item())
        if flagged == 0 and (val_loss is None or math.isfinite(val_loss)):
            self.checked = step
            return
        if flagged and step == 1:  # the loss of the initial weights: no update, no learning rate, has run yet
            raise Diverged("the model's output is not finite: the loss of the first step, on the initial weights "
                           "before any update, is NaN or infinite, so the learning rate is not the cause: check "
                           "the model (its initialisation, or the forward of a module of your own)")
        if not flagged:
            what = f"the validation loss after step {step} is NaN or infinite"
        elif step == self.checked + 1:
            what = f"the training loss became NaN or infinite at step {step}"
        else:
            what = f"the training loss became NaN or infinite between steps {self.checked + 1} and {step}"
        raise Diverged(f"training diverged: {what}; likely cause: the learning rate (--lr {self.cfg.lr:g}, "
                       f"{self.cfg.optimizer}) is too high for this model and data, or the data holds values it "
                       "cannot fit: lower --lr")


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
    history: list[dict] = field(default_factory=list)
    model: nn.Module | None = None


@dataclass
class _Progress:
    step: int = 0
    train_seconds: float = 0.0
    setup_seconds: float = 0.0
    history: list = field(default_factory=list)
    best_val_loss: float = float("inf")
    best_epoch: int | None = None
    best_state: dict | None = None
    since_best: int = 0
    stopped: str | None = None


def loss_and_accuracy(module: nn.Module, x: torch.Tensor, y: torch.Tensor, ctx: Context, normalize: Normalizer,
                      precision: str = "fp32", tta: str = "none") -> tuple[float, float]:
    """(mean loss, accuracy) over a whole split, of the logits averaged over the `tta` views; each
    rank scores its shard, the sums are reduced."""
    was_training = module.training
    module.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=ctx.device)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    with torch.no_grad(), autocast:
        for xb, yb in eval_batches(x, y, ctx, EVAL_BATCH, normalize):
            logits = tta_logits(module, xb, tta).float()
            totals[0] += F.cross_entropy(logits, yb, reduction="sum")
            totals[1] += (logits.argmax(1) == yb).sum()
            totals[2] += yb.numel()
    module.train(was_training)
    loss_sum, correct, count = sum_over_ranks(ctx, totals).tolist()
    if count == 0:
        return float("nan"), float("nan")
    return loss_sum / count, correct / count


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


def build(cfg: TrainConfig, input_shape: tuple[int, int, int], num_classes: int, ctx: Context,
          source: Any = None) -> nn.Module:
    """The model, identically initialised on every rank (seeded before it is built); its BatchNorm
    layers that can take their statistics over all replicas do. `source` is a module of your own or
    its factory (`cfg.model` "custom")."""
    torch.manual_seed(cfg.seed)
    module = build_model(cfg.model, input_shape, num_classes, **cfg.model_options) if source is None \
        else instantiate(source)
    module = module.to(ctx.device)
    if uses_channels_last(cfg):
        module = module.to(memory_format=torch.channels_last)
    model_catalog.hooks(cfg.model).share_batch_statistics(module, world_group(ctx))
    return module


def fit_to_data(cfg: TrainConfig, module: nn.Module, x_train: torch.Tensor, normalize: Normalizer) -> None:
    """A model whose first layer is computed from the training images (whitenet's patch whitening)
    gets them here, before the first step: the same leading images, so every rank computes the same
    layer."""
    hooks = model_catalog.hooks(cfg.model)
    if hooks.fit is not None:
        hooks.fit(module, normalize(x_train[:hooks.fit_images].to(normalize.scale.device)))


def uses_channels_last(cfg: TrainConfig) -> bool:
    return model_catalog.uses_channels_last(cfg.model)


def train(cfg: TrainConfig, ctx: Context, data: Any, *, input_mode: str = "resident", strategy: str = "ddp",
          reporter: Reporter | None = None, display_step: int = 100, checkpoint_path: Path | None = None,
          resume_state: dict | None = None, test: bool = True, step_mode: str = "auto",
          stop: StopFlag | None = None, source: Any = None, setup_apart: bool = True) -> TrainResult:
    """Train `cfg.model` (or `source`, a module of your own or its factory) on `data` (a
    towerlab.data.Dataset) over the replicas of `ctx`. `step_mode`: --step (towerlab.training.step).
    `setup_apart`: warm the step up before the clock where that pays, to report setup apart from
    training; a search candidate reports no setup, so it spends warm-up steps only where its step is
    recorded or compiled, which needs them."""
    reporter = reporter or Reporter(None, enabled=False)
    if ctx.device.type == "cuda":
        # Every training batch has the same shape, so cuDNN's one-off search for the fastest
        # convolution algorithm pays back within a few steps.
        torch.backends.cudnn.benchmark = True
    batches = _make_batches(cfg, ctx, data, input_mode, source)
    steps_per_epoch = batches.steps_per_epoch
    total_steps = cfg.steps or cfg.epochs * steps_per_epoch
    epochs_total = -(-total_steps // steps_per_epoch)
    module = build(cfg, data.input_shape, data.num_classes, ctx, source)
    clock = _Clock(ctx.device)
    progress = _Progress()
    if resume_state is None:
        # Part of training, as in airbench94's timing: a pass over training images.
        clock.start()
        with reporter.phase(f"Setup: initialising {cfg.model} from the training images"):
            fit_to_data(cfg, module, batches.x, batches.normalize)  # resident: already on the device
        progress.train_seconds += clock.stop()
    mode = resolve_step(step_mode, ctx.device.type, ctx.world_size, strategy, input_mode)
    with reporter.phase(f"Setup: building the {_step_name(mode)} (the optimizer, and the replicas' gradient "
                        "exchange)"):
        steps = make_steps(mode, strategy, module, cfg, ctx, batches, total_steps)
    if resume_state is not None:
        progress = _restore(resume_state, steps)
    resident = input_mode == "resident"
    val = (data.x_val.to(ctx.device), data.y_val.to(ctx.device)) if resident else (data.x_val, data.y_val)
    global_batch = cfg.batch_size * ctx.world_size

    def val_scores(step: int) -> tuple[float | None, float | None]:
        if data.n_val == 0:
            return None, None
        with reporter.phase(f"Validating on {data.n_val:,} images after step {step}"):
            return loss_and_accuracy(module, *val, ctx, batches.normalize, cfg.precision, cfg.tta)

    def save(step: int) -> None:
        if checkpoint_path is not None and ctx.is_main:
            with reporter.phase(f"Saving the checkpoint of step {step}"):
                checkpoint.save(checkpoint_path, _state(cfg, ctx, progress, steps, step))

    module.train()
    if progress.step < total_steps and progress.stopped is None and (
            mode != "eager" or (setup_apart and warms_up(ctx.device, mode))):
        clock.start()
        with reporter.phase(f"Setup: {SETUP_PHASES.get(mode, 'warming the step up')}, before the clock"):
            ran = steps.prepare(mode, progress.step, reporter.line)
        seconds = clock.stop()
        progress.setup_seconds += seconds
        reporter.line(f"Setup: {seconds:.1f} s before training ({ran} warm-up steps, undone)")
    reporter.start_progress(total_steps, progress.step, lines=True)
    curve_every = reporter.curve_every(total_steps, display_step)  # the same on every rank
    last_display = (progress.step, time.perf_counter())
    divergence = _Divergence(cfg, ctx, progress.step, steps.worst)
    while progress.step < total_steps and progress.stopped is None:
        epoch, start = divmod(progress.step, steps_per_epoch)
        clock.start()
        for loss, logits, y in steps.epoch(epoch, start):
            progress.step += 1
            reporter.advance()
            step = progress.step
            if step == 1:  # one host read per run: a loss already NaN here is the model's, not the lr's
                divergence.check(step)
            if step % display_step == 0:
                last_display = _display(reporter, ctx, step, loss, logits, y, last_display, global_batch,
                                        steps.lr(), divergence)
            elif curve_every and step % curve_every == 0:  # --tensorboard: the curve between display steps
                loss_value, accuracy = _reduced(ctx, step, loss, logits, y, divergence)
                reporter.scalars("step", step, loss=loss_value, accuracy=accuracy, lr=steps.lr())
            if stop is not None and (ctx.world_size == 1 or step % STOP_CHECK_EVERY == 0):
                signum = int(max_over_ranks(ctx, stop.signum))
                if signum:
                    progress.train_seconds += clock.stop()
                    divergence.check(step)  # never save NaN weights over the last good checkpoint
                    save(step)
                    reporter.line(f"Interrupted at step {step}: checkpoint saved")
                    raise Interrupted(signum)
            if cfg.eval_every and step % cfg.eval_every == 0 and step % steps_per_epoch:
                progress.train_seconds += clock.stop()
                scores = val_scores(step)
                divergence.check(step, val_loss=scores[0])
                _after_eval(cfg, progress, reporter, step, steps_per_epoch, scores, module, epochs_total,
                            global_batch, end_of_epoch=False)
                clock.start()
                if progress.stopped:
                    break
            if step >= total_steps:
                break
        if clock.started is not None:
            progress.train_seconds += clock.stop()
        if progress.stopped is None:
            scores = val_scores(progress.step)
            divergence.check(progress.step, val_loss=scores[0])
            _after_eval(cfg, progress, reporter, progress.step, steps_per_epoch, scores, module,
                        epochs_total, global_batch, end_of_epoch=True)
            save(progress.step)
    reporter.end_progress()
    if cfg.patience and progress.best_state is not None:
        module.load_state_dict(progress.best_state)  # the weights of the best validation loss
    val_loss, val_acc = _final_val(progress)
    test_loss = test_acc = None
    if test and data.n_test > 0:
        test_data = (data.x_test.to(ctx.device), data.y_test.to(ctx.device)) if resident else (data.x_test, data.y_test)
        with reporter.phase(f"Testing on {data.n_test:,} images"):
            test_loss, test_acc = loss_and_accuracy(module, *test_data, ctx, batches.normalize, cfg.precision, cfg.tta)
    seconds = progress.train_seconds
    return TrainResult(
        steps=progress.step, epochs=progress.step / steps_per_epoch, steps_per_epoch=steps_per_epoch,
        train_seconds=seconds, examples_per_sec=progress.step * global_batch / seconds if seconds else 0.0,
        val_loss=val_loss, val_accuracy=val_acc, test_loss=test_loss, test_accuracy=test_acc,
        best_epoch=progress.best_epoch, stopped=progress.stopped, setup_seconds=progress.setup_seconds,
        step_mode=steps.mode, history=progress.history, model=module)


def check_setup(cfg: TrainConfig, world_size: int, data: Any, source: Any = None) -> nn.Module:
    """Every mistake that would otherwise surface mid-run, found before anything is written: the
    model and its options (built on the meta device, so nothing is allocated; a model whose weights,
    gradients and optimizer state cannot fit in this machine's memory is refused), a module of your
    own (`source`: it must take a batch of the data's images and return one logit per class), and
    the batch size. Returns the network as checked (on the meta device, for a named model)."""
    if source is None:
        options = " ".join(f"{k}={v}" for k, v in cfg.model_options.items()) or "default options"
        try:
            with torch.device("meta"):
                module = build_model(cfg.model, data.input_shape, data.num_classes, **cfg.model_options)
        except RuntimeError as exc:  # sizes torch cannot even describe ("Storage size calculation overflowed")
            raise UserError(f"model {cfg.model} ({options}) cannot be built: {str(exc).splitlines()[0]}: use "
                            "smaller model options") from None
        need = 16 * sum(p.numel() for p in module.parameters())  # fp32 weights, gradients, 2 optimizer moments
        if need > machine_memory():
            raise UserError(f"model {cfg.model} ({options}) needs {need / 2**30:,.0f} GiB for its weights, gradients "
                            f"and optimizer state, more than this machine's {machine_memory() / 2**30:.0f} GiB: use "
                            "smaller model options")
    else:
        module = instantiate(source)
        check_module(module, data.input_shape, data.num_classes)
    if cfg.translate >= min(data.input_shape[1:]):
        raise UserError(f"--translate {cfg.translate} shifts images by their whole size "
                        f"{data.input_shape[1]}x{data.input_shape[2]}: use fewer pixels")
    if (data.n_train // world_size) // cfg.batch_size == 0:
        raise UserError(f"--batch-size {cfg.batch_size} x {world_size} replica(s) is more than the "
                        f"{data.n_train} training examples: lower --batch-size or --devices")
    return module


def check_module(module: nn.Module, input_shape: tuple[int, int, int], num_classes: int) -> None:
    """A module of your own, tried on two zero images where its parameters are."""
    device = next(module.parameters(), torch.zeros(0)).device
    try:
        with torch.no_grad():
            out = module.eval()(torch.zeros(2, *input_shape, device=device))
    except SystemExit as exc:  # sys.exit() in its forward: a failure of that code, not an end of towerlab
        raise UserError(f"your module fails on a batch of images of shape {tuple(input_shape)} (C, H, W): its "
                        f"forward called sys.exit({'' if exc.code is None else repr(exc.code)})") from None
    except Exception as exc:  # noqa: BLE001 - whatever the module raises, it cannot train on this data
        raise UserError(f"your module fails on a batch of images of shape {tuple(input_shape)} (C, H, W): "
                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, num_classes):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise UserError(f"your module returns {shape} for 2 images; it must return logits of shape "
                        f"(N, {num_classes}), one per class of the data")
    if not out.is_floating_point():  # the cross-entropy loss and its gradient need real numbers
        raise UserError(f"your module returns {str(out.dtype).removeprefix('torch.')} logits; they must be "
                        "floating point (the cross-entropy loss is computed on them)")
    if not any(p.requires_grad for p in module.parameters()):
        raise UserError("your module has no trainable parameters (none, or all with requires_grad=False): "
                        "training would change nothing")


def _make_batches(cfg: TrainConfig, ctx: Context, data: Any, input_mode: str, source: Any = None) -> Batches:
    check_setup(cfg, ctx.world_size, data, source)
    normalize = Normalizer(data.mean, data.std, ctx.device, uses_channels_last(cfg))
    return Batches(data.x_train, data.y_train, ctx, cfg.batch_size, cfg.seed, input_mode, normalize,
                   augment_images=cfg.augment, translate=cfg.translate)


def _reduced(ctx: Context, step: int, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor,
             divergence: _Divergence) -> tuple[float, float]:
    """The step's loss and accuracy, averaged over the ranks (a host sync and one tiny all-reduce,
    which also checks the divergence flag)."""
    stats = torch.stack([loss.float(), (logits.argmax(1) == y).float().mean()]).to(torch.float64)
    stats = torch.cat([stats, divergence.flag().reshape(1)])  # one reduction for both
    loss_value, accuracy, flagged = (sum_over_ranks(ctx, stats) / ctx.world_size).tolist()
    divergence.check(step, flagged)
    return loss_value, accuracy


def _display(reporter: Reporter, ctx: Context, step: int, loss: torch.Tensor, logits: torch.Tensor,
             y: torch.Tensor, last: tuple[int, float], global_batch: int, lr: float,
             divergence: _Divergence) -> tuple[int, float]:
    loss_value, accuracy = _reduced(ctx, step, loss, logits, y, divergence)
    now = time.perf_counter()
    rate = (step - last[0]) * global_batch / max(now - last[1], 1e-9)
    reporter.line(format_step(step, loss_value, accuracy, rate))
    # lr: the learning rate the schedule set for the next step (a host float: no device sync)
    reporter.record("step", step=step, loss=loss_value, accuracy=accuracy, examples_per_sec=rate, lr=lr)
    return step, now


def _after_eval(cfg: TrainConfig, progress: _Progress, reporter: Reporter, step: int, steps_per_epoch: int,
                scores: tuple[float | None, float | None], module: nn.Module, epochs_total: int,
                global_batch: int, *, end_of_epoch: bool) -> None:
    val_loss, val_acc = scores
    epoch = -(-step // steps_per_epoch)
    seconds = progress.train_seconds
    record = {"epoch": epoch, "step": step, "val_loss": val_loss, "val_accuracy": val_acc,
              "train_seconds": seconds, "examples_per_sec": step * global_batch / seconds if seconds else 0.0}
    progress.history.append(record)
    reporter.record("epoch" if end_of_epoch else "eval", **record)
    if end_of_epoch:
        # Under --steps the budget is counted in steps, and the last evaluation may fall mid-epoch.
        where = f"Step {step}/{cfg.steps} (epoch {step / steps_per_epoch:.2f})" if cfg.steps \
            else f"Epoch {epoch}/{epochs_total}"
        reporter.line(format_epoch(where, val_loss, val_acc, seconds))
    if val_loss is None:
        return
    if val_loss < progress.best_val_loss:
        progress.best_val_loss, progress.best_epoch, progress.since_best = val_loss, epoch, 0
        if cfg.patience:
            progress.best_state = copy.deepcopy(module.state_dict())
    elif end_of_epoch:
        progress.since_best += 1
    if cfg.target_accuracy is not None and val_acc >= cfg.target_accuracy:
        progress.stopped = "target_accuracy"
        reporter.line(f"Reached the target validation accuracy {cfg.target_accuracy} at step {step}")
    elif cfg.patience and progress.since_best >= cfg.patience:
        progress.stopped = "patience"
        reporter.line(f"Stopping: no lower validation loss for {cfg.patience} epochs")


def _final_val(progress: _Progress) -> tuple[float | None, float | None]:
    if not progress.history:
        return None, None
    if progress.best_epoch is not None and progress.best_state is not None:
        best = [r for r in progress.history if r["epoch"] == progress.best_epoch and r["val_loss"] is not None]
        record = min(best, key=lambda r: r["val_loss"])
    else:
        record = progress.history[-1]
    return record["val_loss"], record["val_accuracy"]


def _state(cfg: TrainConfig, ctx: Context, progress: _Progress, steps: Steps, step: int) -> dict:
    return {"config": to_dict(cfg), "model": cfg.model, "dataset": cfg.dataset, "world_size": ctx.world_size,
            "step": step, "train_seconds": progress.train_seconds, "setup_seconds": progress.setup_seconds,
            "history": progress.history, "best_val_loss": progress.best_val_loss, "best_epoch": progress.best_epoch,
            "best_state": progress.best_state, "since_best": progress.since_best, "stopped": progress.stopped,
            "step_mode": steps.mode, "strategy": steps.state_dict()}


def _step_name(mode: str) -> str:
    return "eager step" if mode == "eager" else "step program"


def _restore(state: dict, steps: Steps) -> _Progress:
    saved = state.get("step_mode", "eager")  # a checkpoint from before the step program: eager
    if (saved == "eager") != (steps.mode == "eager"):
        how = "--step eager" if saved == "eager" else "--input resident, --strategy ddp and its --step"
        raise UserError(f"the checkpoint was written by the {_step_name(saved)}, and this run would take the "
                        f"{_step_name(steps.mode)}, whose optimizer state has another form: resume with {how}")
    steps.load_state_dict(state["strategy"])
    # A checkpoint written before setup was timed apart has no setup_seconds.
    return _Progress(step=state["step"], train_seconds=state["train_seconds"],
                     setup_seconds=state.get("setup_seconds", 0.0), history=list(state["history"]),
                     best_val_loss=state["best_val_loss"], best_epoch=state["best_epoch"],
                     best_state=state["best_state"], since_best=state["since_best"], stopped=state["stopped"])
