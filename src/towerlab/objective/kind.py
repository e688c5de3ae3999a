"""The one protocol of what trains a search's tasks: a `Kind` of objective (towerlab's own training, a function
of yours, a command of yours: `towerlab.objective.KINDS`). A kind's class says how a search's settings name it
(`setting`), what it ranks by (`goal`), what it refuses of those settings (`settings`, `check`), and whether
it trains on the search's data (`data`); one of it is made for one search in one process (`Kind(search,
here)`: the job that makes or resumes the search, or a worker that joins it), and says what decides its
results besides the common items (`objective`, its own admission `items`, `training_hash`; compared by
`towerlab.objective.admission.admit` before anything trains), what a new search records of it (`setup`), how
long a trial may take (`lapses`, from --trial-timeout), and, once admitted (`join`), trains a task (`__call__`:
an Assignment in, its Outcome out, the worker's `towerlab.search.work.objective.Objective`) and ranks the
tasks of a generation (`priority`). The search, the job and the worker know only this protocol.

What a process brings to it is `Here` (its device and threads, and what its command line names: `Named`; a
worker's name and stop flag; what a search's job hands its workers), and `Named`, what a command line names
of an objective (its kind and spec, and the --metric and --direction it gives). What decides a search's
results is measured item by item (`Item`): the common items and the comparison are `admission`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Literal, Optional, Protocol

from towerlab.config import RunConfig, SearchConfig
from towerlab.search import Candidate, Outcome, Search, Store
from towerlab.search.goal import TRAINING, Goal
from towerlab.search.work.objective import Assignment

if TYPE_CHECKING:
    import torch

    from towerlab.data.load import Dataset
    from towerlab.distributed.signals import StopFlag


@dataclass(frozen=True)
class Named:
    """The objective a process's command line (or its settings) names: its `kind` (a name in KINDS), its `spec`
    (FILE.py:FUNCTION, the command's text; "" for towerlab's own training) and the --metric and --direction it
    gives (None: the search's)."""

    kind: str = TRAINING
    spec: str = ""
    metric: Optional[str] = None
    direction: Optional[str] = None

    @property
    def own(self) -> bool:
        """Whether it is an objective of yours, not towerlab's own training."""
        return self.kind != TRAINING


class Times(Protocol):
    """Where a worker's time goes, for the benchmarks (`towerlab.jobs.search.worker_times.WorkerTimes`)."""

    def data(self, seconds: float) -> None: ...

    def candidate(self, seconds: float, result: Any) -> None: ...


@dataclass(frozen=True)
class Here:
    """This process, as a kind's objective for one search gets it: its `device` and CPU `threads` per trial
    (None: none set), what its command line names (`named`), whether it is the search's own job resuming it;
    a worker's `name`, `stop` flag, `run` settings (data folder, downloads), the model files its command names
    (`model_files`: the only ones it imports), where the trials of an objective of yours keep their folders
    (`trials`), its `store` and `times`; and what a search's job hands its workers: its `data` (or whether it
    fell back offline: `fallback`) and `function` (its model function, or its objective given from Python)."""

    device: torch.device
    threads: Optional[int] = None
    named: Named = Named()
    resuming: bool = False
    name: str = ""
    stop: Optional[StopFlag] = None
    run: RunConfig = RunConfig()
    model_files: tuple[str, ...] = ()
    trials: Optional[Path] = None
    store: Optional[Store] = None
    times: Optional[Times] = None
    data: Optional[Dataset] = None
    fallback: Optional[bool] = None
    function: Optional[Callable[..., Any]] = None


TRAINING_HASH = "train_config_hash"  # the search's own column, not a key of its setup


@dataclass(frozen=True)
class Item:
    """One thing that decides a search's results (see the module's docstring), stored under `key`;
    `measure(objective, search, stored)` is this process's, through the objective it would run (None: it has
    none to compare); `differs(stored, ours, objective, search)` says in one line which differs and what to
    do; `on_resume`: what the search's own job does where it differs as it resumes ("refuse"; "adopt": record
    this process's as the search's from then on; "search": left to `Search.resume`)."""

    key: str
    measure: Callable[[Kind, Search, Any], Any]
    differs: Callable[[Any, Any, Kind, Search], str]
    on_resume: Literal["refuse", "adopt", "search"] = "refuse"

    def stored(self, search: Search) -> Any:
        """What `search` holds of this item (None: recorded before it existed; a search that recorded no
        objective trained towerlab's networks, its `aim`)."""
        if self.key == TRAINING_HASH:
            return search.train_config_hash
        return search.recorded(self.key) or (search.aim.recorded() if self.key == "objective" else None)


class Kind(Protocol):
    """A kind of objective (see the module's docstring). Its class: `name` (its line in KINDS), `setting` (the
    SearchConfig field whose value names one, its spec: None for the kind of a search that names none),
    `flag` (how a command line names it, for a message), `data` (whether it trains on the search's
    --dataset, which its job loads once and hands its workers), `torch_here` (whether its trials train with
    torch in the worker's own process, so that its job imports torch's compiler front end once before
    forking its workers: `towerlab.jobs.search.workers.warm_up`), `goal(cfg)`, `settings(cfg, model_function)`
    (the settings as it takes them, each it refuses a UserError), `check(search, function)` (a new search
    checked before anything is written: its warnings), `check_worker(named, trials)` (a worker's command,
    before any worker starts); for a refusal's line, `runs` (what a worker of it runs) and `searches(search)`
    (what a search of it searches). One for a search here: `Kind(search, here)`."""

    name: ClassVar[str]
    setting: ClassVar[Optional[str]]
    flag: ClassVar[str]
    runs: ClassVar[str]
    data: ClassVar[bool]
    torch_here: ClassVar[bool]
    here: Here
    search: Search
    threads: Optional[int]  # the CPU threads of its trials here (None: it sets none)

    @classmethod
    def goal(cls, cfg: SearchConfig) -> Goal: ...

    @classmethod
    def settings(cls, cfg: SearchConfig, model_function: object) -> SearchConfig: ...

    @classmethod
    def check(cls, search: Search, function: Optional[Callable[..., Any]]) -> tuple[str, ...]: ...

    @classmethod
    def check_worker(cls, named: Named, trials: str) -> None: ...

    @classmethod
    def searches(cls, search: Search) -> str: ...

    def __init__(self, search: Search, here: Here) -> None: ...

    # -- what decides its results: its admission (`towerlab.objective.admission`) --------------------------

    def objective(self, recorded: Optional[dict]) -> dict:
        """The item "objective": its kind and goal (`Aim.recorded`), and the proof of what it runs where it is
        code of yours; measured against the search's `recorded` one where there is one."""

    @property
    def items(self) -> tuple[Item, ...]:
        """Its own admission items, compared after the common ones (in order: what is cheap first)."""

    def training_hash(self, stored: Optional[Search]) -> str:
        """The search's training-config hash, made here (`stored`: the search as its store holds it; None: new)."""

    def setup(self) -> dict:
        """What a new search records of it besides its items (its model, its data's form, whether it tests
        its top, what names it)."""

    def resume(self, store: Store, stored: Search) -> Search:
        """`stored` as its job resumes it (an objective of yours may rank it by another goal from now on)."""

    # -- once admitted: its trials ------------------------------------------------------------------------

    @property
    def lapses(self) -> Optional[float]:
        """Seconds after which a task of it is over whatever it does (its --trial-timeout and the grace to stop
        it: its worker renews the task's lease no longer); None: no timeout."""

    def join(self) -> None:
        """Made ready to train the search's tasks here (its data on the device, its model or objective loaded),
        once admitted."""

    def __call__(self, assignment: Assignment, /) -> Outcome:
        """Train one task here: its Outcome (a failed one for a trial that failed; an exception stops the worker)."""

    def priority(self, candidate: Candidate) -> float:
        """A task's rank among its generation's, largest first (its cost: a generation then ends on small ones)."""
