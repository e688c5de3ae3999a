"""One `towerlab train` job: pick how its processes start (alone, spawned locally, or under
torchrun), load the data, train, and write the run's record. Only rank 0 writes files.

The output folder holds config.json (fully resolved), metrics.jsonl, checkpoint.pt (each epoch,
atomically replaced, with checkpoint.pt.prev), model.pt and summary.json.

Under torchrun with --max-restarts, a restarted worker group (TORCHELASTIC_RESTART_COUNT > 0)
continues from the folder's last checkpoint on its own, when the folder is that same torchrun
job's (config.json records its TORCHELASTIC_RUN_ID) and holds the same training config; without a
checkpoint yet, it starts over in the folder. Any other existing folder is refused, as without
torchrun.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

import towerlab
from towerlab import atomic, checkpoint
from towerlab.config import RunConfig, TrainConfig, dataset_label, from_dict, parse_shape, replace, to_dict
from towerlab.distributed import (Context, StopFlag, barrier, broadcast_object, default_threads, device_type,
                                  local_processes, resolve_devices, session, torchrun_restart, torchrun_world_size,
                                  under_torchrun)
from towerlab.errors import UserError
from towerlab.job import (OutputFolder, require_out_under_torchrun, restarted_by_torchrun, save_model, start_job,
                          write_config)
from towerlab.report import Reporter, format_final, require_tensorboard, truncate_metrics
from towerlab.train import TrainResult, check_setup, train

CHECKPOINT = "checkpoint.pt"
# What train() restores from a checkpoint (train._state writes them).
RESUME_KEYS = ("step", "train_seconds", "history", "best_val_loss", "best_epoch", "best_state", "since_best",
               "stopped", "strategy")


def stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def load_data(cfg: TrainConfig, run: RunConfig, *, download: bool, log: Any = stderr_line) -> Any:
    from towerlab.data import load_dataset

    # The synthetic set is one fixed dataset (seed 0): the run's seed varies the training, not the data.
    return load_dataset(cfg.dataset, run.data_dir, cfg.val_size, download=download,
                        synthetic_shape=parse_shape(cfg.synthetic_shape), synthetic_train=cfg.synthetic_train,
                        synthetic_test=max(1, cfg.synthetic_train // 6), seed=0, log=log)


def default_out(cfg: TrainConfig) -> Path:
    return Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{cfg.model}-{dataset_label(cfg.dataset)}"


def read_run_config(folder: Path) -> tuple[TrainConfig, RunConfig]:
    path = folder / "config.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        return from_dict(TrainConfig, stored["train"]), from_dict(RunConfig, stored["run"])
    except FileNotFoundError:
        raise UserError(f"{folder} is not a towerlab run (no config.json): check the --resume path") from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise UserError(f"{path} is unreadable ({type(exc).__name__}): it was not written by towerlab train") from None


def start(cfg: TrainConfig, run: RunConfig) -> int:
    """Run the job; returns its exit status."""
    started = time.time()  # the summary's wall_seconds run from here (the command line read) to its writing
    if run.tensorboard:
        require_tensorboard()
    require_out_under_torchrun(run)
    if not under_torchrun():
        run = replace(run, device=device_type(run.device), devices=resolve_devices(run.devices, run.device))
    out = Path(run.resume or run.out or default_out(cfg))

    def resume_hint() -> str:
        return f"Continue from the last checkpoint with: towerlab train --resume {out}" \
            if checkpoint.exists(out / CHECKPOINT) else ""

    # Under torchrun, rank 0 decides in _decide_start whether the folder is its own restart.
    return start_job(out, resume=run.resume is not None, new=not under_torchrun(),
                     run_here=lambda: _process(0, torchrun_world_size(), None, cfg, run, str(out), started),
                     processes=run.devices, spawned=_spawned, args=(cfg, run, str(out), started),
                     preflight=lambda: _preflight(cfg, run), hint=resume_hint)


def _preflight(cfg: TrainConfig, run: RunConfig) -> None:
    """Every mistake (and the download) once, here, before any worker starts."""
    check_setup(cfg, run.devices, load_data(cfg, run, download=run.download))


def _spawned(rank: int, world_size: int, store_path: str, cfg: TrainConfig, run: RunConfig, out: str,
             started: float) -> None:
    status = _process(rank, world_size, store_path, cfg, run, out, started)
    if status:
        sys.exit(status)


def _process(rank: int, world_size: int, store_path: str | None, cfg: TrainConfig, run: RunConfig,
             out_dir: str, started: float) -> int:
    torch.set_num_threads(run.threads or default_threads(local_processes(run)))
    out = Path(out_dir)
    with StopFlag() as stop, session(rank=rank, world_size=world_size, store_path=store_path,
                                     timeout=run.timeout, device=run.device) as ctx:
        data = _load_in_order(cfg, run, ctx)
        check_setup(cfg, ctx.world_size, data)
        resume_state = _start_state(cfg, run, ctx, out)
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            if resume_state is None:
                (out / "metrics.jsonl").unlink(missing_ok=True)  # left by a restarted attempt, if any
                _write_config(out, cfg, run, ctx)
            else:
                truncate_metrics(out / "metrics.jsonl", resume_state["step"])
        barrier(ctx)
        reporter = Reporter(out if ctx.is_main else None, enabled=ctx.is_main, progress=run.progress,
                            tensorboard=run.tensorboard)
        try:
            if ctx.is_main:
                reporter.line(f"towerlab: {cfg.model} on {cfg.dataset} ({data.n_train} train / {data.n_val} val / "
                              f"{data.n_test} test), {ctx.world_size} x {ctx.device.type} replica(s), "
                              f"strategy {run.strategy}, input {run.input}, global batch "
                              f"{cfg.batch_size * ctx.world_size} -> {out}")
            result = train(cfg, ctx, data, input_mode=run.input, strategy=run.strategy, reporter=reporter,
                           display_step=run.display_step, checkpoint_path=out / CHECKPOINT,
                           resume_state=resume_state, compile_model=run.compile, stop=stop)
            if ctx.is_main:
                summary = _summary(cfg, run, ctx, data, result, out, time.time() - started)
                save_model(out / "model.pt", result.model, cfg, data)
                atomic.write_json(out / "summary.json", summary)
                reporter.record("test", step=result.steps, test_loss=result.test_loss,
                                test_accuracy=result.test_accuracy)
                reporter.line(format_final(summary))
                reporter.line(f"Wrote {out / 'summary.json'} and {out / 'model.pt'}")
        finally:
            reporter.close()
    return 0


def _load_in_order(cfg: TrainConfig, run: RunConfig, ctx: Context) -> Any:
    """The first process of each machine loads first (and downloads if it must); the others wait, then
    read what it fetched. Only rank 0 prints data warnings."""
    log = stderr_line if ctx.is_main else (lambda _line: None)
    if ctx.local_rank == 0:
        data = load_data(cfg, run, download=run.download, log=log)
    barrier(ctx)
    if ctx.local_rank != 0:
        data = load_data(cfg, run, download=False, log=log)
    return data


def _start_state(cfg: TrainConfig, run: RunConfig, ctx: Context, out: Path) -> dict | None:
    """The checkpoint this run continues from, or None for a new run. Rank 0 decides (only it may
    see the folder); every rank gets the same answer, or the same UserError."""
    decision: dict = {}
    if ctx.is_main:
        try:
            decision["state"] = _decide_start(cfg, run, ctx, out)
        except UserError as exc:
            decision["error"] = str(exc)
    decision = broadcast_object(ctx, decision)
    if "error" in decision:
        raise UserError(decision["error"])
    return decision["state"]


def _decide_start(cfg: TrainConfig, run: RunConfig, ctx: Context, out: Path) -> dict | None:
    if run.resume:
        return _resume_state(cfg, ctx, out)
    restarts = torchrun_restart()[1]
    if restarts_here(out, cfg):
        if not checkpoint.exists(out / CHECKPOINT):
            stderr_line(f"towerlab: torchrun restart {restarts}: no checkpoint in {out} yet, starting over")
            return None
        state = _resume_state(cfg, ctx, out)
        stderr_line(f"towerlab: torchrun restart {restarts}: continuing from the checkpoint of step "
                    f"{state['step']} in {out}")
        return state
    if under_torchrun():
        OutputFolder(out).require_new()
    return None


def restarts_here(out: Path, cfg: TrainConfig) -> bool:
    """Whether this torchrun attempt restarts the very job that made `out`, with this training config."""
    return restarted_by_torchrun(out, lambda stored: from_dict(TrainConfig, stored["train"]) == cfg)


def _resume_state(cfg: TrainConfig, ctx: Context, out: Path) -> dict:
    state = checkpoint.load(out / CHECKPOINT, log=stderr_line)
    checkpoint.check_compatible(state, {"model": cfg.model, "dataset": cfg.dataset,
                                        "world_size": ctx.world_size, "config": to_dict(cfg)}, out)
    missing = [k for k in RESUME_KEYS if k not in state]
    if missing:
        raise UserError(f"checkpoint in {out} lacks {', '.join(missing)}: it was not written by this towerlab "
                        "train; start a new run")
    return state


def _write_config(out: Path, cfg: TrainConfig, run: RunConfig, ctx: Context) -> None:
    write_config(out, {"train": to_dict(cfg), "run": to_dict(run), "world_size": ctx.world_size,
                       "device_type": ctx.device.type, "global_batch_size": cfg.batch_size * ctx.world_size})


def _summary(cfg: TrainConfig, run: RunConfig, ctx: Context, data: Any, result: TrainResult, out: Path,
             wall_seconds: float) -> dict:
    return {
        "dataset": cfg.dataset, "data_source": data.source, "data_fallback": bool(data.source.get("fallback")),
        "n_train": data.n_train, "n_val": data.n_val, "n_test": data.n_test,
        "model": cfg.model, "model_options": cfg.model_options, "strategy": run.strategy, "input": run.input,
        "world_size": ctx.world_size, "device_type": ctx.device.type,
        "batch_size_per_replica": cfg.batch_size, "global_batch_size": cfg.batch_size * ctx.world_size,
        "epochs": result.epochs, "steps": result.steps, "steps_per_epoch": result.steps_per_epoch,
        "train_seconds": result.train_seconds, "setup_seconds": result.setup_seconds, "wall_seconds": wall_seconds,
        "examples_per_sec": result.examples_per_sec,
        "val_loss": result.val_loss, "val_accuracy": result.val_accuracy,
        "test_loss": result.test_loss, "test_accuracy": result.test_accuracy,
        "best_epoch": result.best_epoch, "stopped": result.stopped,
        "optimizer": cfg.optimizer, "lr": cfg.lr, "schedule": cfg.schedule, "precision": cfg.precision,
        "seed": cfg.seed, "threads_per_process": torch.get_num_threads(),
        "torch_version": torch.__version__, "towerlab_version": towerlab.__version__, "out": str(out),
    }
