"""A trial of your code: a `TrialRunner` runs a `Trial` (the genes, and what the search gives it) and returns a
`Result` (`towerlab.objective.result`): a function of yours (`towerlab.objective.function.FunctionObjective`),
a command of yours (`towerlab.objective.command.CommandObjective`). The kinds of objective of your code
(`towerlab.objective.yours.Yours`) run a search's tasks as trials of their runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

from towerlab.objective.result import Goal, Result
from towerlab.proof import Proof

# What a search gives every trial besides its genes, by these names (a function's parameters, a command's
# placeholders): the trial's seed, its epochs (its rung's budget in a pruned search, the full budget
# otherwise), its device ("cpu", "cuda:0", ...), a folder of its own (for checkpoints and output: the
# genome's and seed's, kept from rung to rung) and the epochs it starts from (a promotion in a pruned search
# continues the training its lower rung left in that folder; 0 otherwise). A trial that takes `start`
# continues, and a budget in epochs charges it `epochs - start`; one that does not trains from scratch.
EXTRAS = ("seed", "epochs", "device", "folder", "start")


@dataclass(frozen=True)
class Trial:
    """One training of a candidate: its `genes` (JSON values by name), `seed`, `epochs`, `device`, `folder`
    and `start` (see EXTRAS); `stop`, where given, says at any moment whether the worker was asked to stop
    (the signal's number, else 0), for an objective that waits on something it must end first."""

    genes: Mapping[str, Any]
    seed: int
    epochs: int
    device: str
    folder: Path
    stop: Optional[Callable[[], int]] = None
    start: int = 0

    def extras(self) -> dict[str, Any]:
        """EXTRAS by name."""
        return {"seed": self.seed, "epochs": self.epochs, "device": self.device, "folder": self.folder,
                "start": self.start}


class TrialRunner(Protocol):
    """Runs a trial of your code: `run(trial) -> Result`, a failure of the trial being a failed Result, never
    an exception (an exception is a mistake every trial would make, or a stop: KeyboardInterrupt,
    towerlab's Interrupted). `kind` ("function", "command": its kind of objective's name) and `spec`
    (FILE.py:FUNCTION, the command's text) say what it is, `goal` what its results are ranked by, `proof()`
    what runs (for a worker to compare with a search's before it joins: taken once, when first asked), and
    `unproven(trial)` whether what a trial runs, or ran, is still what that proof holds (None), or what
    differs, in words (its worker records no result of it). A runner whose trials take `start` (EXTRAS) and
    continue from it says so with `continues = True` (none: they start again)."""

    kind: str
    spec: str
    goal: Goal

    def run(self, trial: Trial) -> Result: ...

    def proof(self) -> Proof: ...

    def unproven(self, trial: Trial) -> Optional[str]: ...


def setup(objective: TrialRunner) -> dict[str, Any]:
    """What a search records of its objective, and a worker compares: its kind, its goal and the proof of
    what runs (JSON); not its spec, which names a file where it is on one machine (the same file elsewhere,
    the same proof)."""
    return {"kind": objective.kind, "metric": objective.goal.metric, "direction": objective.goal.direction,
            "proof": dict(objective.proof().parts)}
