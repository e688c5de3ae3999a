"""Where a run stands (`Progress`), what a checkpoint holds of it (`checkpoint_state`) and restoring
it (`restore`); `RESUME_KEYS` are what a resumed run needs of a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from towerlab.config import TrainConfig
from towerlab.distributed.group import Context
from towerlab.errors import UserError
from towerlab.fields import to_dict
from towerlab.training.step import Steps

# What train() restores from a checkpoint (checkpoint_state writes them).
RESUME_KEYS = ("step", "train_seconds", "history", "best_val_loss", "best_epoch", "best_state", "since_best",
               "stopped", "strategy")


@dataclass
class Progress:
    """Where a run stands: what a checkpoint keeps of the loop besides the steps' own state."""

    step: int = 0
    train_seconds: float = 0.0
    setup_seconds: float = 0.0
    history: list = field(default_factory=list)
    best_val_loss: float = float("inf")
    best_epoch: int | None = None
    best_state: dict | None = None
    since_best: int = 0
    stopped: str | None = None


def final_val_scores(progress: Progress) -> tuple[float | None, float | None]:
    if not progress.history:
        return None, None
    if progress.best_epoch is not None and progress.best_state is not None:
        best = [r for r in progress.history if r["epoch"] == progress.best_epoch and r["val_loss"] is not None]
        record = min(best, key=lambda r: r["val_loss"])
    else:
        record = progress.history[-1]
    return record["val_loss"], record["val_accuracy"]


def checkpoint_state(cfg: TrainConfig, ctx: Context, progress: Progress, steps: Steps, step: int) -> dict:
    """What a checkpoint of step `step` holds: the run's progress, and the steps' state (its "strategy")."""
    return {"config": to_dict(cfg), "model": cfg.model, "dataset": cfg.dataset, "world_size": ctx.world_size,
            "step": step, "train_seconds": progress.train_seconds, "setup_seconds": progress.setup_seconds,
            "history": progress.history, "best_val_loss": progress.best_val_loss, "best_epoch": progress.best_epoch,
            "best_state": progress.best_state, "since_best": progress.since_best, "stopped": progress.stopped,
            "step_mode": steps.mode, "strategy": steps.state_dict()}


def step_name(mode: str) -> str:
    return "eager step" if mode == "eager" else "step program"


def restore(state: dict, steps: Steps) -> Progress:
    """The progress a checkpoint holds, its steps' state loaded into `steps` (of the same kind)."""
    saved = state.get("step_mode", "eager")  # a checkpoint from before the step program: eager
    if (saved == "eager") != (steps.mode == "eager"):
        how = "--step eager" if saved == "eager" else "--input resident, --strategy ddp and its --step"
        raise UserError(f"the checkpoint was written by the {step_name(saved)}, and this run would take the "
                        f"{step_name(steps.mode)}, whose optimizer state has another form: resume with {how}")
    steps.load_state_dict(state["strategy"])
    # A checkpoint written before setup was timed apart has no setup_seconds.
    return Progress(step=state["step"], train_seconds=state["train_seconds"],
                    setup_seconds=state.get("setup_seconds", 0.0), history=list(state["history"]),
                    best_val_loss=state["best_val_loss"], best_epoch=state["best_epoch"],
                    best_state=state["best_state"], since_best=state["since_best"], stopped=state["stopped"])
