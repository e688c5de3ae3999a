"""Setup before the training clock starts. A step's first calls cost more than the rest: torch.compile
compiles the step on them (--compile), and on a GPU cuDNN times its convolution algorithms for each
new shape (`cudnn.benchmark`) and kernels and library handles are loaded. `warm_up` runs the run's
own next steps ahead, timed as setup, then undoes them, so `train_seconds` holds steady-state steps.

Undoing restores everything a step changes from a copy taken before: parameters and BatchNorm
statistics, the optimizer's and the scheduler's state, Lookahead's slow weights. Dropout and
augmentation draw from generators seeded per step, so no random state carries over either: the
trained numbers are those of a run without the warm-up.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Callable

import torch
from torch._dynamo.exc import TorchDynamoException

from towerlab.batches import Batches
from towerlab.strategies import Strategy

# torch.compile compiles the forward on the first call and the backward on the first backward; in
# mode reduce-overhead a CUDA graph is recorded on the second call and replayed from the third.
WARMUP_STEPS = 3

Step = Callable[[int, torch.Tensor, torch.Tensor], object]  # (step, x, y) -> the step's outputs


def warms_up(device: torch.device, compile_model: bool) -> bool:
    """Whether a run warms its step up: with --compile, and on CUDA. A plain CPU step costs the same
    from its first call, so an eager CPU run skips it (no extra cost)."""
    return compile_model or device.type == "cuda"


def warm_up(strat: Strategy, batches: Batches, step: int, count: int, run_step: Step,
            log: Callable[[str], None]) -> int:
    """Run steps `step` .. `step + count - 1` (at most to the end of their epoch) as the training loop
    will, then restore the state before them; returns how many steps ran. A compiled step that fails
    to compile (no C++ compiler, an operation the compiler cannot handle) is left for the plain
    step, with one line."""
    snapshot = copy.deepcopy(strat.state_dict())
    try:
        ran = _run(batches, step, count, run_step)
    except TorchDynamoException as exc:
        if not strat.compile_model:
            raise
        log(f"towerlab: warning: --compile failed ({_reason(exc)}); training with the plain step")
        strat.load_state_dict(snapshot)  # the failed step may have changed part of it
        strat.use_plain_step()
        ran = _run(batches, step, count, run_step) if strat.ctx.device.type == "cuda" else 0
    strat.load_state_dict(snapshot)
    return ran


def _run(batches: Batches, step: int, count: int, run_step: Step) -> int:
    epoch, start = divmod(step, batches.steps_per_epoch)
    ran = 0
    with contextlib.closing(batches.epoch(epoch, start)) as source:  # stops a queue's thread
        for x, y in itertools.islice(source, count):
            run_step(step + ran, x, y)
            ran += 1
    return ran


def _reason(exc: Exception) -> str:
    """The first line of the compiler's message that says what went wrong."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    said = [line for line in lines if not line.endswith("raised:")]
    return said[0] if said else type(exc).__name__
