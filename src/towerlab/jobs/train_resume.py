"""Where a `towerlab train` run starts: anew, from its folder's checkpoint (--resume), or, under
torchrun with --max-restarts, from the checkpoint of the very job that a restarted worker group
continues (config.json records its TORCHELASTIC_RUN_ID); and the data it continues on must be the data
it started on.
"""

from __future__ import annotations

from pathlib import Path

from towerlab.config import RunConfig, TrainConfig
from towerlab.data.load import Dataset
from towerlab.distributed.env import torchrun_restart, under_torchrun
from towerlab.distributed.group import Context
from towerlab.errors import UserError
from towerlab.fields import from_dict, to_dict
from towerlab.jobs.folder import OutputFolder
from towerlab.proof import short
from towerlab.jobs.job import restarted_by_torchrun
from towerlab.jobs.provenance import read_config
from towerlab.report import stderr_line
from towerlab.training import checkpoint
from towerlab.training.batches import steps_per_epoch
from towerlab.training.progress import RESUME_KEYS

CHECKPOINT = "checkpoint.pt"


def resumes_from(step: int, cfg: TrainConfig, data: Dataset, ctx: Context) -> str:
    """Where a resumed run picks up, in the steps and epochs its progress lines count."""
    per_epoch = steps_per_epoch(data.n_train, ctx.world_size, cfg.batch_size)
    epoch, into = divmod(step, per_epoch)
    where = f"the end of epoch {epoch}" if into == 0 else f"{into} of {per_epoch} steps into epoch {epoch + 1}"
    return f"resuming from step {step} of {cfg.steps or cfg.epochs * per_epoch} ({where})"


def decide_start(cfg: TrainConfig, run: RunConfig, ctx: Context, out: Path,
                 max_bytes: int | None = None) -> dict | None:
    """The checkpoint a run in `out` continues from (rank 0 decides: --resume, or a torchrun restart of
    this very job), or None for a new run; `max_bytes`: the largest checkpoint its model can have."""
    if run.resume:
        if not checkpoint.exists(out / CHECKPOINT) and not any((out / f).exists() for f in ("model.pt", "summary.json")):
            # Stopped (killed, out of disk) before its first checkpoint: config.json holds all it needs to
            # begin again, and no other command would take the folder.
            stderr_line(f"towerlab: {out} holds no checkpoint yet (the run stopped before its first): starting it "
                        "over from step 0 with its recorded settings")
            return None
        return resume_state(cfg, ctx, out, max_bytes)
    restarts = torchrun_restart()[1]
    if restarts_here(out, cfg):
        if not checkpoint.exists(out / CHECKPOINT):
            stderr_line(f"towerlab: torchrun restart {restarts}: no checkpoint in {out} yet, starting over")
            return None
        state = resume_state(cfg, ctx, out, max_bytes)
        stderr_line(f"towerlab: torchrun restart {restarts}: continuing from the checkpoint of step "
                    f"{state['step']} in {out}")
        return state
    if under_torchrun():
        OutputFolder(out).require_new()
    return None


def restarts_here(out: Path, cfg: TrainConfig) -> bool:
    """Whether this torchrun attempt restarts the very job that made `out`, with this training config."""
    return restarted_by_torchrun(out, lambda stored: from_dict(TrainConfig, stored["train"]) == cfg)


def resume_state(cfg: TrainConfig, ctx: Context, out: Path, max_bytes: int | None = None) -> dict:
    state = checkpoint.load(out / CHECKPOINT, log=stderr_line, max_bytes=max_bytes)
    checkpoint.check_compatible(state, {"model": cfg.model, "dataset": cfg.dataset,
                                        "world_size": ctx.world_size, "config": to_dict(cfg)}, out)
    missing = [k for k in RESUME_KEYS if k not in state]
    if missing:
        raise UserError(f"checkpoint in {out} lacks {', '.join(missing)}: it was not written by this towerlab "
                        "train; start a new run")
    return state


def check_same_data(out: Path, now: str, allowed: bool) -> None:
    """Refuse to continue a run on data other than it started on (`now`: the digest of the arrays it
    trains on, `towerlab.data.digest`; by content, so a moved data folder is fine), unless
    --allow-changed-data; then warn (summary.json records both)."""
    recorded = read_config(out) or {}
    started_on = recorded.get("data_digest")
    if started_on is None or started_on == now:
        return  # the same data (or a run recorded before towerlab took this digest of its data)
    dataset = (recorded.get("train") or {}).get("dataset", "the dataset")
    what = f"{dataset} now holds arrays of digest {short(now)}, not {short(started_on)}"
    if not allowed:
        raise UserError(f"the data changed since this run started ({what}): resume with the data it started on, "
                        "or pass --allow-changed-data to continue on these (the result will not equal an "
                        "uninterrupted run)")
    stderr_line(f"towerlab: warning: the data changed since this run started ({what}); continuing on it as "
                "--allow-changed-data asks: summary.json records both digests")
