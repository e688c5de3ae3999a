"""A function of yours as the objective (`--objective FILE.py:FUNCTION`, or the function itself from
Python): it gets a trial's genes as keyword arguments and, where it takes them by name, `seed`, `epochs`,
`device` (a string: "cpu", "cuda:0"), `folder` (a pathlib.Path of its own, made before it is called),
`start` (the epochs its training continues from: `towerlab.objective.trial.EXTRAS`) and `report`, a
function to report a learning curve with: `report(epoch, **metrics)`, each metric a number.

Checked before any trial runs, each a UserError of one line: the function exists, it takes every gene of
the space by name (or **kwargs), no gene is named as what the search gives, every parameter it
requires is a gene or one of those, and a conditional gene's parameter has a default: a trial where the
gene is inactive leaves it out (as Optuna's trial has no such parameter), so the function gets its default. It returns a number or a dict of numbers (`towerlab.objective.result`).
An exception it raises fails the trial, with the exception's type, message and line in your file as the
reason, and so do `sys.exit()`, any other BaseException (asyncio's CancelledError, one of yours) and
`os._exit()` (which would end the worker's process: while a trial runs, it raises in its place), and so
does a result that cannot be read: a trial cannot end the search. KeyboardInterrupt, towerlab's
Interrupted and a UserError (a mistake of towerlab's own functions, which every trial would make) stop it.
With a `timeout`, a trial that runs past it is interrupted (`towerlab.objective.deadline`) and fails.

As a kind of objective (`Function`, "function", `towerlab.objective.yours.Yours`): a search's --objective names
it (or the function itself, given from Python); a worker compares the file's bytes with the search's before it
imports it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence, Union

from towerlab.distributed.signals import Interrupted
from towerlab.errors import UserError, did_you_mean
from towerlab.models.custom import (FROM_PYTHON, check_function_file, file_proof, function_file, load_function,
                                   user_code_failed)
from towerlab.objective.deadline import Deadline, TrialTimedOut, check_timeout, lapses, timed_out
from towerlab.objective.result import Goal, Result, extend_curve, failed, read_result
from towerlab.objective.trial import EXTRAS, Trial
from towerlab.objective.yours import Yours
from towerlab.proof import Proof, changes, code_proof, file_digest, install, loads, ran
from towerlab.search import Search

# What a function may take by name besides its genes.
GIVEN = (*EXTRAS, "report")


class FunctionObjective:
    """`function(**genes, [seed=, epochs=, device=, folder=, start=, report=])` (see the module's docstring);
    `function` is FILE.py:FUNCTION, loaded here, or the function itself. Each trial starts with the global
    random generators seeded from its seed (`seed_globals`): a function that draws from them without taking
    `seed` gives the same values whoever runs the trial, and after whichever trials."""

    kind = "function"

    def __init__(self, function: Union[str, Callable[..., Any]], genes: Sequence[str], goal: Goal = Goal(),
                 conditional: Sequence[str] = (), timeout: Optional[float] = None):
        check_timeout(timeout)
        self.timeout = timeout
        self._loaded = isinstance(function, str)  # from its file, here: file_proof knows what it imported
        if isinstance(function, str):
            self.spec, where = function, f"--objective {function}"
            self.function = load_function(function, "--objective")
        else:
            self.spec = function_file(function) or str(getattr(function, "__qualname__", type(function).__name__))
            self.function, where = function, f"your objective {getattr(function, '__qualname__', self.spec)}"
        self.goal = goal
        self.given = _check(self.function, list(genes), where, conditional)
        self.continues = "start" in self.given

    _proved: Optional[Proof] = None  # its proof, taken once (`proof`)
    _mark = 0  # how many modules towerlab.proof's loader had compiled when it was taken
    _seen = -1  # `towerlab.proof.changes()` when its trials were last found to run what it proves

    def proof(self) -> Proof:
        """The function's file and the modules of yours it imports, as they run, or will once its import
        statements run (`towerlab.proof`): taken once, when first asked (a worker joining a search). From
        then on the modules of yours it imports are loaded through towerlab.proof, which sees them run."""
        if self._proved is None:
            install()
            self._mark = loads()
            self._proved = file_proof(self.spec) if self._loaded else code_proof(self._module)
        return self._proved

    def unproven(self, trial: Trial) -> Optional[str]:
        """None where what its trials have run is what `proof()` holds; else what differs, in words: a module
        of yours imported since with other bytes (edited after the proof was taken), or one the proof lacks
        (imported by a name computed as it ran)."""
        proved, seen = self.proof(), changes()
        if seen == self._seen:
            return None  # nothing was compiled or imported since the last look
        problem = proved.covers(ran(self._module, self._mark).parts)
        if problem is None:
            self._seen = seen
        elif "not in it" in problem:
            problem += " (a module imported by a name computed as it runs: import it by an import statement)"
        return problem

    @property
    def _module(self) -> str:
        return Path(self.spec.rpartition(":")[0]).stem if self._loaded else \
            str(getattr(self.function, "__module__", "__main__"))

    def run(self, trial: Trial) -> Result:
        seed_globals(trial.seed)
        if "folder" in self.given:  # made for a function that takes it (a search of 100,000 trials makes no more)
            try:
                trial.folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                return failed(f"cannot make its folder {trial.folder}: {exc.strerror or exc}")
        curve: list[dict[str, Any]] = []

        def report(epoch: int, **metrics: Any) -> None:
            """Records a point of the learning curve: the epoch (a whole number) and metrics (numbers)."""
            try:
                extend_curve(curve, epoch, metrics)
            except ValueError as exc:
                raise TypeError(f"report(epoch, **metrics): {exc}") from None

        given = {**trial.extras(), "report": report}
        started = time.perf_counter()
        ended: list[int] = []
        try:
            with _process_kept(ended), Deadline(self.timeout):
                returned = self.function(**trial.genes, **{name: given[name] for name in self.given})
        except (UserError, Interrupted, KeyboardInterrupt):
            raise
        except TrialTimedOut:
            return failed(timed_out(self.timeout or 0), tuple(curve),
                                    time.perf_counter() - started)
        except BaseException as exc:  # noqa: BLE001 - whatever your function raises fails its trial
            return failed(self._failure(exc), tuple(curve), time.perf_counter() - started)
        seconds = time.perf_counter() - started
        if ended:  # os._exit from a thread of the trial's (or caught by the trial): it meant to end the process
            return failed(f"your {self._name} ended its worker's process: it called os._exit({ended[0]}) "
                                    "(from a thread of its own)", tuple(curve), seconds)
        try:
            return read_result(self.goal, returned, tuple(curve), seconds)
        except Exception as exc:  # noqa: BLE001 - a result of yours whose methods raise as it is read
            return failed(f"its result could not be read: {type(exc).__name__}: {_text(exc)}",
                                    tuple(curve), seconds)

    @property
    def _name(self) -> str:
        return str(getattr(self.function, "__qualname__", None) or type(self.function).__name__)

    def _failure(self, exc: BaseException) -> str:
        """The reason of a trial that raised `exc` (its line in your file), whatever `exc`'s methods do."""
        if isinstance(exc, _ProcessEnded):  # located as any exception, said as what it is
            where = str(user_code_failed(exc, self.function, "")).partition(" failed ")[2].partition(": ")[0]
            return f"your {self._name} ended its worker's process{where}: it called os._exit({exc.status})"
        try:
            return str(user_code_failed(exc, self.function, "with these genes"))
        except Exception:  # noqa: BLE001 - an exception of yours whose __str__ raises
            return f"your {self._name} failed with these genes: {type(exc).__name__}"


class _ProcessEnded(BaseException):
    """Raised in place of `os._exit(status)` while a trial runs: the trial fails, its worker goes on."""

    def __init__(self, status: int) -> None:
        super().__init__(f"os._exit({status})")
        self.status = status


@contextlib.contextmanager
def _process_kept(ended: list[int]) -> Iterator[None]:
    """While a trial runs, `os._exit` raises `_ProcessEnded` (its status also appended to `ended`, for a
    call from a thread of the trial's) instead of ending the worker's process mid-task; a process the
    trial forked still exits as asked."""
    real, pid = os._exit, os.getpid()

    def _exit(status: int) -> None:
        if os.getpid() != pid:
            real(status)
        ended.append(status)
        raise _ProcessEnded(status)

    def unheard(args: Any) -> None:  # a thread of the trial's ended by its os._exit: said by the trial's reason
        if not isinstance(args.exc_value, _ProcessEnded):
            hook(args)

    hook, threading.excepthook = threading.excepthook, unheard
    os._exit = _exit  # type: ignore[assignment]  # a stand-in with the same signature
    try:
        yield
    finally:
        os._exit, threading.excepthook = real, hook


def _text(exc: BaseException) -> str:
    try:
        return " ".join(str(exc).split())[:300]
    except Exception:  # noqa: BLE001 - an exception of yours whose __str__ raises
        return "(its message cannot be read)"


def seed_globals(seed: int) -> None:
    """Seed the global random generators a function may draw from without being given its seed: Python's
    `random`, numpy's (its legacy global one: np.random.rand) and torch's (every device's), from `seed`."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, seed >> 32])  # all 63 bits: numpy takes 32 at a time
    torch.manual_seed(seed)


def _check(function: Callable[..., Any], genes: list[str], where: str, conditional: Sequence[str] = ()) \
        -> tuple[str, ...]:
    """The names of GIVEN that `function` takes, once it is sure to take every gene, to need nothing
    else, and to have a default for each `conditional` gene it names; else a UserError that says what is wrong."""
    clash = [gene for gene in genes if gene in GIVEN]
    if clash:
        raise UserError(f"{where}: the space's gene {clash[0]!r} has the name of what the search gives every trial "
                        f"({', '.join(GIVEN)}): rename the gene")
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        raise UserError(f"{where}: its parameters cannot be read (a builtin?): give a function defined in Python") \
            from None
    for p in parameters:
        if p.default is p.empty and p.kind is p.POSITIONAL_ONLY:
            raise UserError(f"{where}: its parameter {p.name!r} is positional-only, and a trial gives everything by "
                            "name: make it a keyword parameter (drop the /)")
    named = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        missing = [gene for gene in genes if gene not in named]
        if missing:
            raise UserError(f"{where} takes no gene {missing[0]!r}{did_you_mean(missing[0], named)} (its parameters: "
                            f"{', '.join(named) or 'none'}): add it as a parameter, or take **genes")
    for p in parameters:
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) \
                and p.name not in genes and p.name not in GIVEN:
            raise UserError(f"{where}: its parameter {p.name!r} is neither a gene of the space "
                            f"({', '.join(genes) or 'none'}) nor what the search gives ({', '.join(GIVEN)}): "
                            "give it a default, or add the gene to the space")
    required = [p.name for p in parameters if p.default is p.empty and p.name in conditional
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if required:
        raise UserError(f"{where}: its parameter {required[0]!r} has no default, and the gene is conditional (a trial "
                        f"where it is inactive leaves it out): give it one, e.g. {required[0]}=None")
    return tuple(name for name in GIVEN if name in named)


class Function(Yours):
    """A function of yours as a kind of objective (KINDS' "function"): `--objective FILE.py:FUNCTION`, or the
    function given from Python."""

    name: ClassVar[str] = "function"
    setting: ClassVar[Optional[str]] = "objective"
    flag: ClassVar[str] = "--objective FILE.py:FUNCTION"
    runs: ClassVar[str] = "a function"
    torch_here: ClassVar[bool] = True  # most build a torch optimizer; which ones cannot be known

    @classmethod
    def runner(cls, search: Search, spec: str, function: Optional[Callable[..., Any]]) -> FunctionObjective:
        if function is None and spec == FROM_PYTHON:
            raise UserError("its objective is a function given from Python, which only its own process has: give the "
                            "function again (objective=), or its file (--objective FILE.py:FUNCTION)")
        return FunctionObjective(function if function is not None else spec, list(search.space.genes), search.goal,
                                 list(search.space.when), timeout=search.cfg.trial_timeout)

    @classmethod
    def epochs_ignored(cls, runner: Any, how: str) -> Optional[str]:
        if "epochs" in runner.given:
            return None
        return (f"towerlab: warning: your {runner.spec} takes no epochs, and {how}: each of its trials trains "
                "as long as any other; take epochs (a parameter), and train that many")

    @classmethod
    def check_worker(cls, named: Any, trials: str) -> None:
        check_function_file(named.spec, "--objective")
        super().check_worker(named, trials)

    def _measured(self, recorded: dict) -> Optional[dict]:
        """Its file's bytes against the search's proof, before it is imported (nothing to compare where the
        function was given from Python): a file that is not the search's is never imported."""
        if self.here.function is not None:
            return None
        path = self.here.named.spec.rpartition(":")[0]
        try:
            digest = file_digest(path)
        except OSError as exc:
            raise UserError(f"cannot read the objective's file {path}: {exc.strerror or exc}") from None
        module = Path(path).stem
        return None if recorded.get("proof", {}).get(module) == digest else {module: digest}

    @property
    def lapses(self) -> Optional[float]:
        return lapses(self.search.cfg.trial_timeout)
