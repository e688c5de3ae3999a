"""What trains a search's tasks in a worker, as the worker sees it: one narrow interface. A worker claims
a task, makes it an `Assignment` (the candidate, and from which validation accuracy its network is scored
on the test split: `towerlab.search.testing`) and hands it to the search's `Objective`, which returns the
`Outcome`. The worker never knows what is behind it: the kinds of objective (towerlab's own training, a
function of yours, a command of yours: `towerlab.objective.KINDS`) each keep this contract
(`towerlab.objective.kind.Kind`), and so does any function of an Assignment (a test's fake fitness).

The contract: an objective trains the assignment's candidate (its genome, with its seed, for at most its
`max_epochs`) in this process and returns its outcome, with its test accuracy where it was scored. A
candidate's failure (out of memory, diverged, a network that cannot be built, a trial past its timeout) is a
failed outcome (`Outcome.failed`); an exception escaping it stops the worker, and the task goes back on the
queue. An objective with a timeout says when a task of it is over whatever it does (`lapses`, in seconds):
past that, its worker renews the task's lease no longer, and the task goes to another worker once the lease
lapses. The worker gets each search's objective from its job (`objective_for(search)`), which raises a
UserError saying why where this worker may not train that search (`towerlab.objective.admission.admit`): the
search is then left to others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

from towerlab.search.candidates import Candidate, Outcome


@dataclass(frozen=True)
class Assignment:
    """A claimed task as its objective gets it: the `candidate` to train, and `test_from`, the validation
    accuracy from which its network is scored on the test split as it ends (-inf: whatever it reaches, a
    top network retrained for its test accuracy; None: never)."""

    candidate: Candidate
    test_from: Optional[float] = None

    def tests(self, val_accuracy: Optional[float]) -> bool:
        """Whether a network that ended at `val_accuracy` is scored on the test split."""
        return self.test_from is not None and val_accuracy is not None and val_accuracy >= self.test_from


class Objective(Protocol):
    """Trains one assignment of a search in this process: its Outcome (see the module's docstring)."""

    def __call__(self, assignment: Assignment, /) -> Outcome: ...


def lapses(objective: Objective) -> Optional[float]:
    """Seconds after which a task of `objective` is over whatever it does (None: it says none, a function of an
    Assignment has no timeout)."""
    found = getattr(objective, "lapses", None)
    return found if isinstance(found, (int, float)) else None
