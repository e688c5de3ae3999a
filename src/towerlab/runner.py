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
from towerlab.config import RunConfig, TrainConfig, dataset_label, from_dict, parse_shape, to_dict
from towerlab.distributed import (Context, StopFlag, barrier, broadcast_object, check_devices,
                                  default_threads, launch, local_processes, session, torchrun_restart,
                                  torchrun_world_size, under_torchrun)
from towerlab.errors import UserError
from towerlab.models import model_record
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


def check_new_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output folder {out} already holds files: continue that run with --resume {out}, "
                        "or choose another --out")


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
    if run.tensorboard:
        require_tensorboard()
    if under_torchrun():
        out = Path(run.resume or run.out or default_out(cfg))
        if run.resume is None and run.out is None:
            raise UserError("under torchrun every rank must agree on the output folder: pass --out")
        return _process(0, torchrun_world_size(), None, cfg, run, str(out))
    check_devices(run.devices)
    out = Path(run.resume or run.out or default_out(cfg))
    if run.resume is None:
        check_new_out(out)
    if run.devices == 1:
        return _process(0, 1, None, cfg, run, str(out))
    # Find every mistake (and download the data) once, here, before any worker starts.
    _preflight(cfg, run)
    return launch(_spawned, run.devices, (cfg, run, str(out)),
                  hint=f"Continue from the last checkpoint with: towerlab train --resume {out}")


def _preflight(cfg: TrainConfig, run: RunConfig) -> None:
    check_setup(cfg, run.devices, load_data(cfg, run, download=run.download))


def _spawned(rank: int, world_size: int, store_path: str, cfg: TrainConfig, run: RunConfig, out: str) -> None:
    status = _process(rank, world_size, store_path, cfg, run, out)
    if status:
        sys.exit(status)


def _process(rank: int, world_size: int, store_path: str | None, cfg: TrainConfig, run: RunConfig,
             out_dir: str) -> int:
    torch.set_num_threads(run.threads or default_threads(local_processes(run)))
    out = Path(out_dir)
    with StopFlag() as stop, session(rank=rank, world_size=world_size, store_path=store_path,
                                     timeout=run.timeout) as ctx:
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
            started = time.time()
            result = train(cfg, ctx, data, input_mode=run.input, strategy=run.strategy, reporter=reporter,
                           display_step=run.display_step, checkpoint_path=out / CHECKPOINT,
                           resume_state=resume_state, compile_model=run.compile, stop=stop)
            if ctx.is_main:
                summary = _summary(cfg, run, ctx, data, result, out, time.time() - started)
                atomic.write_bytes(out / "model.pt", _model_bytes(result, cfg, data))
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
    run_id, restarts = torchrun_restart()
    if restarts > 0 and _same_torchrun_job(out, cfg, run_id):
        if not checkpoint.exists(out / CHECKPOINT):
            stderr_line(f"towerlab: torchrun restart {restarts}: no checkpoint in {out} yet, starting over")
            return None
        state = _resume_state(cfg, ctx, out)
        stderr_line(f"towerlab: torchrun restart {restarts}: continuing from the checkpoint of step "
                    f"{state['step']} in {out}")
        return state
    if under_torchrun():
        check_new_out(out)
    return None


def _same_torchrun_job(out: Path, cfg: TrainConfig, run_id: str | None) -> bool:
    """Whether `out` was started by this very torchrun job with this training config."""
    try:
        stored = json.loads((out / "config.json").read_text(encoding="utf-8"))
        same_config = from_dict(TrainConfig, stored["train"]) == cfg
    except (OSError, ValueError, KeyError, TypeError, UserError):
        return False
    return run_id is not None and stored.get("torchelastic_run_id") == run_id and same_config


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
    atomic.write_json(out / "config.json", {
        "train": to_dict(cfg), "run": to_dict(run), "world_size": ctx.world_size,
        "device_type": ctx.device.type, "global_batch_size": cfg.batch_size * ctx.world_size,
        "torch_version": torch.__version__, "towerlab_version": towerlab.__version__,
        "torchelastic_run_id": torchrun_restart()[0],
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]]})


def _model_bytes(result: TrainResult, cfg: TrainConfig, data: Any) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(model_record(result.model, cfg.model, data.input_shape, data.num_classes, cfg.model_options,
                            config=to_dict(cfg), mean=list(data.mean), std=list(data.std)), buffer)
    return buffer.getvalue()


def _summary(cfg: TrainConfig, run: RunConfig, ctx: Context, data: Any, result: TrainResult, out: Path,
             wall_seconds: float) -> dict:
    return {
        "dataset": cfg.dataset, "data_source": data.source, "data_fallback": bool(data.source.get("fallback")),
        "n_train": data.n_train, "n_val": data.n_val, "n_test": data.n_test,
        "model": cfg.model, "model_options": cfg.model_options, "strategy": run.strategy, "input": run.input,
        "world_size": ctx.world_size, "device_type": ctx.device.type,
        "batch_size_per_replica": cfg.batch_size, "global_batch_size": cfg.batch_size * ctx.world_size,
        "epochs": result.epochs, "steps": result.steps, "steps_per_epoch": result.steps_per_epoch,
        "train_seconds": result.train_seconds, "wall_seconds": wall_seconds,
        "examples_per_sec": result.examples_per_sec,
        "val_loss": result.val_loss, "val_accuracy": result.val_accuracy,
        "test_loss": result.test_loss, "test_accuracy": result.test_accuracy,
        "best_epoch": result.best_epoch, "stopped": result.stopped,
        "optimizer": cfg.optimizer, "lr": cfg.lr, "schedule": cfg.schedule, "precision": cfg.precision,
        "seed": cfg.seed, "threads_per_process": torch.get_num_threads(),
        "torch_version": torch.__version__, "towerlab_version": towerlab.__version__, "out": str(out),
    }
