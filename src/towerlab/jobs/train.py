"""One `towerlab train` job: pick how its processes start (alone, spawned locally, or under
torchrun), load the data, train, and write the run's record. Only rank 0 writes files.

The output folder holds config.json (fully resolved), metrics.jsonl, checkpoint.pt (each epoch,
atomically replaced, with checkpoint.pt.prev), model.pt and summary.json.

Under torchrun with --max-restarts, a restarted worker group (TORCHELASTIC_RESTART_COUNT > 0)
continues from the folder's last checkpoint on its own, when the folder is that same torchrun
job's (config.json records its TORCHELASTIC_RUN_ID) and holds the same training config; without a
checkpoint yet, it starts over in the folder. Any other existing folder is refused, as without
torchrun (train_resume.py decides where a run starts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

import towerlab
from towerlab import atomic
from towerlab.catalog.models import keyword_options, not_taken
from towerlab.config import CUSTOM_MODEL, RunConfig, TrainConfig
from towerlab.checks import dataset_label
from towerlab.data.digest import content_digest
from towerlab.data.load import Dataset, load_data
from towerlab.distributed.env import (check_capacity, default_threads, local_processes, sharing_cores,
                                     torchrun_world_size, under_torchrun)
from towerlab.distributed.group import Context, barrier, broadcast_object, session
from towerlab.distributed.launch import start_method_for
from towerlab.distributed.signals import StopFlag
from towerlab.errors import UserError
from towerlab.fields import replace, to_dict
from towerlab.jobs.handover import handover, worker_data
from towerlab.jobs.job import Job, require_out_under_torchrun, resolved_run, start_job
from towerlab.jobs.provenance import read_config, write_config
from towerlab.jobs.train_resume import CHECKPOINT, check_same_data, decide_start, resumes_from
from towerlab.models.custom import ModelFunction, NetworkSource, network_name
from towerlab.models.files import save_model
from towerlab.report import (Reporter, discard_line, format_final, phase, require_tensorboard, stderr_line,
                             truncate_metrics)
from towerlab.training import checkpoint
from towerlab.training.loop import LoopOptions, TrainResult, train
from towerlab.training.network import check_setup
from towerlab.training.step import resolve_step

FITTED_STEPS = 4  # the fewest steps an epoch a batch size fitted to small data gives each replica


def train_data(cfg: TrainConfig, run: RunConfig, **loading: Any) -> Dataset:
    """The data `cfg` trains on (`loading`: as `towerlab.data.load.load_data` takes it)."""
    from towerlab.data.folders import FolderOptions
    from towerlab.data.synthetic import SyntheticOptions

    return load_data(cfg.dataset, cfg.val_size, run, synthetic=SyntheticOptions.of(cfg),
                     **{"folder": FolderOptions.of(cfg), **loading})


def default_out(cfg: TrainConfig) -> Path:
    return Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{cfg.model}-{dataset_label(cfg.dataset)}"


def start(cfg: TrainConfig, run: RunConfig, *, data: Optional[Dataset] = None, module: Optional[NetworkSource] = None,
          function: Optional[ModelFunction] = None, start_method: str | None = None, fit_batch: bool = False) -> int:
    """Run the job; returns its exit status. `data` (a towerlab.data.Dataset) replaces loading
    `cfg.dataset`; `module` (an nn.Module or a factory of one), or `function` (a model function,
    `function(input_shape, num_classes) -> nn.Module`, called with the data's) trains in place of
    `cfg.model` ("custom"); `start_method` as in `distributed.launch` (None:
    `distributed.start_method_for` the run's device); `fit_batch`: the batch size is towerlab's, not
    the user's (`settings.batch_size_chosen`), and is lowered where the data is too small for it."""
    started = time.time()  # the summary's wall_seconds run from here to its writing
    if run.tensorboard:
        require_tensorboard()
    require_out_under_torchrun(run)
    require_module(cfg, module, function)
    run = resolved_run(run)
    start_method = start_method or start_method_for(run.device)
    devices = run.devices or 1  # resolved above; under torchrun each rank is one process
    if not under_torchrun():
        # Recorded as resolved: a resume (maybe on another machine) computes with as many threads.
        threads = run.threads or default_threads(devices)
        run = replace(run, threads=threads)
        check_capacity(devices, threads, f"--devices {devices}")
        warning = sharing_cores(devices, run.device, f"--devices {devices}")
        if warning:
            stderr_line(warning)
        resolve_step(run.step, run.device, devices, run.strategy, run.input)  # an impossible --step: refused now
    out = Path(run.resume or run.out or default_out(cfg))
    # Under torchrun, rank 0 decides in train_resume.decide_start whether the folder is its own restart.
    return start_job(TrainJob(out=out, resume=run.resume is not None, new=not under_torchrun(), processes=devices,
                              start_method=start_method, timeout=run.timeout, cfg=cfg, run=run, data=data,
                              module=module, function=function, started=started, fit_batch=fit_batch))


@dataclass(kw_only=True)
class TrainJob(Job):
    """The train job: one replica per process (see `job.Job` for the hooks). `data` replaces loading
    `cfg.dataset`; `module` (a module of yours or its factory) or `function` (a model function) trains
    in place of `cfg.model`; `started` is when the job started (time.time()). The setup is checked once
    per run (`checked`): by the launcher before its workers start, else by the process that trains.
    A worker gets the job itself, without its data, and what the launcher hands over of it."""

    cfg: TrainConfig
    run: RunConfig
    data: Optional[Dataset] = None
    module: Optional[NetworkSource] = None
    function: Optional[ModelFunction] = None
    started: float
    # The largest checkpoint this run's model can have (`checkpoint.size_limit`), set by `checked`.
    checkpoint_bytes: Optional[int] = None
    fit_batch: bool = False  # the batch size is towerlab's default: `checked` fits it to the data

    def run_here(self) -> int:
        self.replica(0, torchrun_world_size(), None, self.data, None)
        return 0

    def preflight(self) -> tuple[TrainJob, Optional[Dataset], Optional[bool]]:
        """Every mistake (and the download, or the offline fallback) once, here, before any worker
        starts; the workers read the very data loaded here (see `handover`)."""
        data = self.data
        if data is None:
            with phase(f"Setup: reading {self.cfg.dataset}", stdout_line):
                data = train_data(self.cfg, self.run)
        return (dataclasses.replace(self.checked(data, self.processes, stderr_line), data=None),
                *handover(data, self.start_method))

    @staticmethod
    def worker(rank: int, world_size: int, store_path: str, job: TrainJob, data: Optional[Dataset],
               fallback: Optional[bool]) -> None:
        job.replica(rank, world_size, store_path, data, fallback)

    def hint(self) -> str:
        return f"Continue from the last checkpoint with: towerlab train --resume {self.out}" \
            if checkpoint.exists(self.out / CHECKPOINT) else ""

    def name(self, rank: int) -> str:
        return f"replica rank {rank}" + (", the parameter server," if self.run.strategy == "ps" and rank == 0 else "")

    def network_source(self, data: Dataset) -> Optional[NetworkSource]:
        return network_source(self.module, self.function, data, self.cfg.model_options)

    def checked(self, data: Dataset, world_size: int, say: Callable[[str], None]) -> TrainJob:
        """This job with its setup checked for `world_size` replicas on `data` (`check_setup`), its batch
        size fitted to the data where it is towerlab's default and too large for it (`say`s so)."""
        cfg = self.cfg
        if self.fit_batch and (data.n_train // world_size) // cfg.batch_size == 0:
            cfg = replace(cfg, batch_size=fitted_batch_size(data.n_train // world_size))
        network = check_setup(cfg, world_size, data, self.network_source(data))
        if cfg.batch_size != self.cfg.batch_size:
            say(f"towerlab: the default --batch-size {self.cfg.batch_size} x {world_size} replica(s) is more than the "
                f"{data.n_train} training examples: training with --batch-size {cfg.batch_size} (give --batch-size "
                "to choose)")
        return dataclasses.replace(self, cfg=cfg, checkpoint_bytes=checkpoint.size_limit(network))

    def replica(self, rank: int, world_size: int, store_path: Optional[str], data: Optional[Dataset],
                fallback: Optional[bool]) -> None:
        """One replica of the run in this process (rank `rank` of `world_size`; `store_path`: the
        local launcher's rendezvous, None alone or under torchrun): its data as handed over (`data`,
        or the source the launcher read: `fallback`), or as `load_everywhere` decides."""
        run = self.run
        torch.set_num_threads(run.threads or default_threads(local_processes(run)))
        with _exit_is_failure(), StopFlag() as stop, session(rank=rank, world_size=world_size, store_path=store_path,
                                                             timeout=run.timeout, device=run.device) as ctx:
            with phase(f"Setup: reading {self.cfg.dataset}", stdout_line) if ctx.is_main and data is None \
                    else contextlib.nullcontext():
                data = worker_data(ctx, functools.partial(train_data, self.cfg, run), data, fallback)
            job = self if self.checkpoint_bytes is not None else \
                self.checked(data, ctx.world_size, stderr_line if ctx.is_main else discard_line)
            job.fitted_to(data, ctx)._train(ctx, data, stop)

    def fitted_to(self, data: Dataset, ctx: Context) -> TrainJob:
        """This job, its --input resident become queue where the data is an image folder's memory-mapped
        cache too large for the GPU (more than half its free memory): batches are then gathered from
        the cache and prefetched, as the input modes yield the same numbers."""
        if self.run.input != "resident" or ctx.device.type != "cuda" or data.source.get("format") != "folder":
            return self
        need = sum(getattr(data, f"x_{split}").nbytes for split in ("train", "val", "test"))
        free = torch.cuda.mem_get_info(ctx.device)[0]
        if need <= free // 2:
            return self
        if ctx.is_main:
            stderr_line(f"towerlab: {need / 2**30:.1f} GiB of images is more than half the GPU's free "
                        f"{free / 2**30:.1f} GiB: --input queue (batches read from the cache) instead of resident")
        return dataclasses.replace(self, run=replace(self.run, input="queue"))

    def _train(self, ctx: Context, data: Dataset, stop: StopFlag) -> None:
        out, run = self.out, self.run
        digest = content_digest(data) if ctx.is_main else ""  # of the arrays: start, resume check, summary
        resume_state = self._start_state(ctx, digest)
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            if resume_state is None:
                (out / "metrics.jsonl").unlink(missing_ok=True)  # left by a restarted attempt, if any
                self._write_config(ctx, digest, data.class_names)
            else:
                truncate_metrics(out / "metrics.jsonl", resume_state["step"])
        barrier(ctx)
        reporter = Reporter(out if ctx.is_main else None, enabled=ctx.is_main, progress=run.progress,
                            tensorboard=run.tensorboard, on_closed=lambda: stop.request(signal.SIGPIPE))
        try:
            if ctx.is_main:
                reporter.line(self._first_line(ctx, data, resume_state))
            options = LoopOptions.of(run, reporter=reporter, checkpoint_path=out / CHECKPOINT, stop=stop)
            result = train(self.cfg, ctx, data, options, source=self.network_source(data), resume_state=resume_state)
            if ctx.is_main:
                self._record(ctx, data, digest, result, reporter)
        finally:
            reporter.close()

    def _first_line(self, ctx: Context, data: Dataset, resume_state: dict | None) -> str:
        cfg, run = self.cfg, self.run
        resuming = "" if resume_state is None else f"{resumes_from(resume_state['step'], cfg, data, ctx)}: "
        model = network_name(self.module, self.function) if cfg.model == CUSTOM_MODEL else cfg.model
        return (f"towerlab: {resuming}{model} on {cfg.dataset} ({data.n_train} train / {data.n_val} val / "
                f"{data.n_test} test), {ctx.world_size} x {ctx.device.type} replica(s), strategy {run.strategy}, "
                f"input {run.input}, global batch {cfg.batch_size * ctx.world_size} -> {self.out}")

    def _record(self, ctx: Context, data: Dataset, digest: str, result: TrainResult, reporter: Reporter) -> None:
        """model.pt and summary.json (rank 0), and the run's last lines."""
        out = self.out
        summary = self._summary(ctx, data, digest, result)
        assert result.model is not None  # train() returns the model it trained
        save_model(out / "model.pt", result.model, self.cfg, data, function=self.function)
        atomic.write_json(out / "summary.json", summary)
        reporter.record("test", step=result.steps, test_loss=result.test_loss, test_accuracy=result.test_accuracy)
        reporter.line(format_final(summary))
        reporter.line(f"Wrote {out / 'summary.json'} and {out / 'model.pt'}")

    def _start_state(self, ctx: Context, digest: str) -> dict | None:
        """The checkpoint this run continues from, or None for a new run. Rank 0 decides (only it may
        see the folder); every rank gets the same answer, or the same UserError."""
        decision: dict = {}
        if ctx.is_main:
            try:
                decision["state"] = decide_start(self.cfg, self.run, ctx, self.out, self.checkpoint_bytes)
                if decision["state"] is not None:
                    check_same_data(self.out, digest, self.run.allow_changed_data)
            except UserError as exc:
                decision["error"] = str(exc)
        decision = broadcast_object(ctx, decision)
        if "error" in decision:
            raise UserError(decision["error"])
        return decision["state"]

    def _write_config(self, ctx: Context, data_digest: str, class_names: tuple[str, ...]) -> None:
        cfg = self.cfg
        write_config(self.out, {"train": to_dict(cfg), "run": to_dict(self.run), "world_size": ctx.world_size,
                                "device_type": ctx.device.type, "global_batch_size": cfg.batch_size * ctx.world_size,
                                "data_digest": data_digest, **({"class_names": list(class_names)} if class_names else {})})

    def _summary(self, ctx: Context, data: Dataset, data_digest: str, result: TrainResult) -> dict:
        cfg, run, out = self.cfg, self.run, self.out
        wall_seconds = time.time() - self.started
        started_on = (read_config(out) or {}).get("data_digest", data_digest)
        changed = {"data_digest_at_start": started_on} if started_on != data_digest else {}
        return {**changed, "data_digest": data_digest,
            "dataset": cfg.dataset, "data_source": data.source, "data_fallback": bool(data.source.get("fallback")),
            "n_train": data.n_train, "n_val": data.n_val, "n_test": data.n_test,
            "model": cfg.model, "model_options": cfg.model_options, "strategy": run.strategy, "input": run.input,
            "world_size": ctx.world_size, "device_type": ctx.device.type, "step": result.step_mode,
            "batch_size_per_replica": cfg.batch_size, "global_batch_size": cfg.batch_size * ctx.world_size,
            "epochs": result.epochs, "steps": result.steps, "steps_per_epoch": result.steps_per_epoch,
            "train_seconds": result.train_seconds, "setup_seconds": result.setup_seconds,
            "test_seconds": result.test_seconds, "wall_seconds": wall_seconds,
            "examples_per_sec": result.examples_per_sec,
            "val_loss": result.val_loss, "val_accuracy": result.val_accuracy,
            "test_loss": result.test_loss, "test_accuracy": result.test_accuracy,
            "best_epoch": result.best_epoch, "stopped": result.stopped,
            "optimizer": cfg.optimizer, "lr": cfg.lr, "schedule": cfg.schedule, "precision": cfg.precision,
            "seed": cfg.seed, "threads_per_process": torch.get_num_threads(),
            "torch_version": torch.__version__, "towerlab_version": towerlab.__version__, "out": str(out),
        }


def fitted_batch_size(share: int) -> int:
    """A batch size for a replica's `share` of the training examples: the largest power of two that
    gives it FITTED_STEPS steps an epoch (1 for a share smaller than that)."""
    return 1 << max(0, (share // FITTED_STEPS).bit_length() - 1)


def stdout_line(text: str) -> None:
    """A line where the run's own lines go, before its Reporter exists."""
    print(text, flush=True)


def require_module(cfg: TrainConfig, module: Optional[NetworkSource], function: Optional[ModelFunction]) -> None:
    if (cfg.model == CUSTOM_MODEL) != (module is not None or function is not None):
        raise UserError(f"model {CUSTOM_MODEL!r} is a module you give from Python: "
                        "towerlab.api.train(model=YourModule()) or model=a function returning one; on the command "
                        "line, --model FILE.py:FUNCTION (give it again on --resume)"
                        if module is None and function is None else "a module of your own goes with model 'custom'")
    if module is not None and cfg.model_options:
        # Only a model function takes options (as keyword arguments); a module is built already.
        raise UserError("--model-opt sets options of the built-in models and the keyword arguments of a model "
                        "function (--model FILE.py:FUNCTION), not of a module of your own")
    unknown = [] if function is None else sorted(not_taken(function, cfg.model_options))
    if function is not None and unknown:
        name = getattr(function, "__name__", "your function")
        keywords = keyword_options(function)
        if keywords is None:  # **kwargs: the option is named like a positional parameter
            raise UserError(f"--model-opt {unknown[0]}: {name} gets {unknown[0]} as a positional parameter (the "
                            "data's), so an option of that name would give it twice: rename the option")
        raise UserError(f"--model-opt {unknown[0]}: {name}(input_shape, num_classes, ...) takes no keyword argument "
                        f"{unknown[0]!r} (it takes: {', '.join(keywords) or 'none'})")


def network_source(module: Optional[NetworkSource], function: Optional[ModelFunction], data: Dataset,
                   options: dict) -> Optional[NetworkSource]:
    """What builds a network of your own for `data`: `module` as given, or a factory calling the model
    function `function(input_shape, num_classes, **options)` with the data's (None: a built-in model)."""
    if function is None:
        return module
    return functools.partial(function, data.input_shape, data.num_classes, **options)


@contextlib.contextmanager
def _exit_is_failure() -> Iterator[None]:
    """A SystemExit inside a training comes from code of yours (no towerlab code below here calls
    sys.exit: a model function and a module's forward are checked before): a failure of that code
    (exit status 2, one line, like any error of a model of yours), never a clean end with status 0."""
    try:
        yield
    except SystemExit as exc:
        raise UserError(f"the training stopped: code of yours that it ran (the network's forward, or what it "
                        f"calls) called sys.exit({'' if exc.code is None else repr(exc.code)})") from None
