"""A fourth kind of objective, for tests (`test_objective_new_kind.py`): one module and one registry line,
`KINDS["echo"] = "echo_kind:Echo"`. A trial of it "trains" nothing: its value is the product of the genes
times the number its spec names (`--objective x3`: three times), its seed's remainder by 7 as a second metric.
Everything else (its settings, its admission, its folder, its record) is what every objective of your code
shares (`towerlab.objective.yours.Yours`)."""

from __future__ import annotations

import hashlib
import math
from typing import Any, ClassVar, Optional

from towerlab.objective.result import Result, read_result
from towerlab.objective.trial import Trial
from towerlab.proof import Proof
from towerlab.objective.yours import Yours
from towerlab.search import Search
from towerlab.search.goal import Goal


class EchoRunner:
    """Runs a trial of the echo kind: the product of its genes, times its spec's number."""

    kind = "echo"

    def __init__(self, spec: str, goal: Goal) -> None:
        self.spec, self.goal, self.times = spec, goal, float(spec.lstrip("x"))

    def run(self, trial: Trial) -> Result:
        return read_result(self.goal, {"value": self.times * math.prod(trial.genes.values()),
                                       "seed": float(trial.seed % 7)})

    def proof(self) -> Proof:
        return Proof({"echo": "sha256:" + hashlib.sha256(self.spec.encode()).hexdigest()})

    def unproven(self, trial: Trial) -> Optional[str]:
        return None


class Echo(Yours):
    """The echo kind: named by --objective (in the tests, where the function kind stands aside)."""

    name: ClassVar[str] = "echo"
    setting: ClassVar[Optional[str]] = "objective"
    flag: ClassVar[str] = "--objective xN"
    runs: ClassVar[str] = "an echo"
    torch_here: ClassVar[bool] = False

    @classmethod
    def runner(cls, search: Search, spec: str, function: Any) -> EchoRunner:
        return EchoRunner(spec, search.goal)

    @classmethod
    def epochs_ignored(cls, runner: Any, how: str) -> Optional[str]:
        return None

    @property
    def lapses(self) -> Optional[float]:
        return None
