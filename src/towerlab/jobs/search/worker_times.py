"""Where a search worker's time goes: the seam through which a benchmark measures it. Nothing of towerlab's
measures it; bench/common/worker_times.py does (the GPU suite's search figure, bench/proof/worker_start.py).

A `WorkerTimes` hears, in a worker's process, of the worker's own store calls on its critical path
(`timed`: claim, complete, put_back), of a search's data reaching its device (`data`), of each candidate it
trained (`candidate`: its seconds in all and its TrainResult, None where it failed or was a trial of your
objective), and of the worker's leaving (`leave`). None is made unless $TOWERLAB_WORKER_CLOCK names one as
MODULE:NAME: an importable module and, in it, a callable that takes no argument and returns the
WorkerTimes (or None). The worker imports it as it starts; unset, nothing is imported, measured or written.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional, Protocol

from towerlab.errors import UserError

ENV = "TOWERLAB_WORKER_CLOCK"


class WorkerTimes(Protocol):
    """What a worker tells the clock that measures it (see the module's docstring)."""

    def timed(self, name: str, seconds: float, started: float) -> None: ...

    def data(self, seconds: float) -> None: ...

    def candidate(self, seconds: float, result: Any) -> None: ...

    def leave(self, name: str, device: str) -> None: ...


def from_env() -> Optional[WorkerTimes]:
    """The clock $TOWERLAB_WORKER_CLOCK names, made; None where it names none."""
    named = os.environ.get(ENV, "").strip()
    if not named:
        return None
    module, _, attribute = named.partition(":")
    try:
        make = getattr(importlib.import_module(module), attribute) if module and attribute else None
    except (ImportError, AttributeError) as exc:
        raise UserError(f"${ENV}={named}: {exc}") from None
    if not callable(make):
        raise UserError(f"${ENV}={named}: name a callable as MODULE:NAME (a worker's clock, none by default)")
    return make()
