"""What trains a search's candidate, as a plug-in: an `Objective` runs a `Trial` (its genes, seed, epochs,
device and folder) and returns a `Result` (a number or a dict of numbers, read by one protocol,
`towerlab.objective.result`). Its kinds: a function of yours (`FunctionObjective`, `--objective
FILE.py:FUNCTION`), a command of yours (`CommandObjective`, `--command '...'`), and towerlab's own
training. Each says what runs (`Objective.proof`, `towerlab.proof`) so that a worker can compare it with
a search's before it joins.
"""

from towerlab.objective.command import CommandObjective
from towerlab.objective.function import FunctionObjective
from towerlab.objective.result import DEFAULT_METRIC, DIRECTIONS, Goal, Result
from towerlab.objective.trial import EXTRAS, Objective, Trial, setup

__all__ = ["DEFAULT_METRIC", "DIRECTIONS", "EXTRAS", "CommandObjective", "FunctionObjective", "Goal", "Objective",
           "Result", "Trial", "setup"]
