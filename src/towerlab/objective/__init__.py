"""What trains a search's tasks, as plug-ins of one protocol (`towerlab.objective.kind.Kind`): towerlab's own
training of its networks (`training`), a function of yours (`function`, `--objective FILE.py:FUNCTION`) and a
command of yours (`command`, `--command '...'`), registered in KINDS as samplers are in SAMPLERS. Each kind
says, in its own module, how a search's settings name it, its goal, its admission items, its timeout and its
result; the search, its job and its workers know only the protocol. A search's kind and goal are decided once,
when it is made (`resolve`), and carried on it (`Search.aim`).

Adding a kind: a module with a class that provides `Kind` (`towerlab.objective.yours.Yours` is what an
objective of your code shares: a trial per task, a Result read by one protocol, `towerlab.objective.result`),
and its line in KINDS; its `setting` names the SearchConfig field that names one. `tests/echo_kind.py` is a
worked example (`tests/test_objective_new_kind.py` runs a search of it). Each kind's module is imported when it
is first asked for (`kind_class`), as a sampler's is.

Below them: a trial of your code (`trial.Trial` in, `result.Result` out: `function.FunctionObjective`,
`command.CommandObjective`), its timeout (`deadline`), a command's program (`process`, `keeper`, `files`), what
decides a search's results (`admission`) and towerlab's training of one candidate (`candidate`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from towerlab.config import SearchConfig
from towerlab.errors import UserError
from towerlab.search.goal import Aim

if TYPE_CHECKING:
    from towerlab.objective.kind import Kind, Named

KINDS = {
    "training": "towerlab.objective.training:Training",
    "function": "towerlab.objective.function:Function",
    "command": "towerlab.objective.command:Command",
}


def kind_class(name: str) -> type[Kind]:
    """The class of the kind of objective named `name` (its line in KINDS, imported now)."""
    if name not in KINDS:
        raise UserError(f"no kind of objective {name!r} (this towerlab has {', '.join(KINDS)}): a store written by "
                        "a newer towerlab? upgrade towerlab here")
    module, _, attribute = KINDS[name].partition(":")
    found: type[Kind] = getattr(importlib.import_module(module), attribute)
    return found


def kinds() -> list[type[Kind]]:
    """Every kind's class, in KINDS' order."""
    return [kind_class(name) for name in KINDS]


def named(settings: Any) -> Named:
    """The objective that a search's settings (a SearchConfig), or a worker's command line (its parsed
    arguments), name: the kind whose `setting` they give (at most one: a UserError naming both), or, where
    they give none, the kind that no setting names (towerlab's own training); with the --metric and
    --direction they give."""
    from towerlab.objective.kind import Named

    given = [kind for kind in kinds() if kind.setting is not None and getattr(settings, kind.setting, None) is not None]
    if len(given) > 1:
        raise UserError(f"{' and '.join(kind.flag.split()[0] for kind in given)} both say what a trial runs: give one of "
                        "them")
    kind = given[0] if given else next(kind for kind in kinds() if kind.setting is None)
    spec = getattr(settings, kind.setting) if kind.setting is not None else ""
    return Named(kind.name, spec, getattr(settings, "metric", None), getattr(settings, "direction", None))


def resolve(cfg: SearchConfig, model_function: object = None) -> tuple[SearchConfig, Aim]:
    """A new search's settings as its objective's kind takes them (each it refuses a UserError, before anything
    is written), and its `Aim`: the kind, what names it and its goal, decided here once and carried on the
    search (`Search.resolve`)."""
    found = named(cfg)
    kind = kind_class(found.kind)
    cfg = kind.settings(cfg, model_function)
    return cfg, Aim(kind.name, found.spec, kind.goal(cfg))


def worker_flag(name: str, spec: str) -> str:
    """How to start a worker of the kind `name` (its flag, with the search's `spec`), for a refusal's line."""
    kind = kind_class(name)
    if kind.setting is None:
        others = [other.flag.split()[0] for other in kinds() if other.setting is not None]
        return f"a worker without {' or '.join(others)}"
    return f"it with {kind.flag}" + (f" (the search's: {spec})" if spec else "")


def __getattr__(name: str) -> Any:
    """The trial's protocol and the objectives of your code, by their names here (imported when first asked:
    a kind's module imports what it trains with)."""
    places = {"Trial": "trial", "EXTRAS": "trial", "setup": "trial", "Result": "result", "Goal": "result",
              "DEFAULT_METRIC": "search.goal", "FunctionObjective": "function", "CommandObjective": "command"}
    if name not in places:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = places[name]
    module = importlib.import_module(f"towerlab.{where}" if "." in where else f"towerlab.objective.{where}")
    return getattr(module, name)
