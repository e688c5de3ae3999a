"""Networks of your own: a model file's function or class (`--model FILE.py:FUNCTION`,
`--module FILE.py:NAME`) and a module or factory given from Python (model "custom")."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import inspect
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence, Union

from torch import nn

from towerlab.errors import UserError
from towerlab.proof import Proof, code_proof, install, proven

_LOADED: dict[str, str] = {}  # module name -> the file load_function imported it from
_FOLDERS: list[str] = []  # the folders load_function put on sys.path, the latest first


# A network of your own as the training takes it: a module (copied, its weights the initial ones) or a
# factory returning a new one (called after the run's seed is set).
NetworkSource = Union[nn.Module, Callable[[], nn.Module]]
# A model function: `function(input_shape, num_classes, **options) -> nn.Module` (a network class is one).
ModelFunction = Callable[..., nn.Module]

def load_function(spec: str, flag: str = "--model", what: str = "FUNCTION") -> Any:
    """What `FILE.py:NAME` names (a function, a network class, a network), imported from its file as a
    module of its folder, so that it finds its neighbours (`import blocks` beside it) and spawned
    workers, which get this process's sys.path, import it by name as well. Its folder goes at the
    end of sys.path, never first: a file beside it named like a module towerlab imports (an
    optuna.py) must not replace that module. `flag` and `what` word the errors: `--model
    FILE.py:FUNCTION` for a search's model function, `--module FILE.py:NAME` for a run's. The file, and
    the modules of yours it imports, run from the bytes that `file_proof` proves (`towerlab.proof`)."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path_text or not name.isidentifier() or (path.suffix != ".py" and not path.is_file()):
        raise UserError(f"{flag} {spec}: give FILE.py:{what}, the file that defines it and the name it has there "
                        f"(e.g. {flag} mynet.py:{'make' if what == 'FUNCTION' else 'Net'})")
    if not path.is_file():
        raise UserError(f"{flag} {spec}: no file {path_text}")
    if path.suffix != ".py":
        raise UserError(f"{flag} {spec}: {path_text} is not a Python file (FILE.py)")
    _on_path(str(path.resolve().parent))
    if _LOADED.get(path.stem, os.path.realpath(path)) != os.path.realpath(path):
        sys.modules.pop(path.stem, None)  # a file of the same name that this function loaded before
        importlib.invalidate_caches()
    install()
    try:
        module = importlib.import_module(path.stem)
    except SystemExit as exc:  # a script's top level that parses its own argv, or calls sys.exit()
        raise UserError(f"{flag} {spec}: importing {path_text} called sys.exit({'' if exc.code is None else exc.code!r})"
                        ": keep a script's own code under if __name__ == \"__main__\":") from None
    except Exception as exc:  # noqa: BLE001 - whatever the user's file raises, say so in one line
        raise UserError(f"{flag} {spec}: importing {path_text} failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if os.path.realpath(getattr(module, "__file__", "") or "") != os.path.realpath(path):
        raise UserError(f"{flag} {spec}: the name {path.stem!r} is taken by another module "
                        f"({getattr(module, '__file__', 'built in')}): rename {path_text}")
    _LOADED[path.stem] = os.path.realpath(path)
    found = getattr(module, name, None)
    if found is None:
        raise UserError(f"{flag} {spec}: {path_text} defines no {name}")
    if not callable(found):
        raise UserError(f"{flag} {spec}: {name} in {path_text} is a {type(found).__name__}, not a function: name "
                        "the function to call")
    return found


def file_proof(spec: str) -> Proof:
    """The proof of what `load_function(spec)` loaded: the file's bytes as they ran, and those of every
    module of yours it imports (a neighbour `blocks.py`), by module name (`towerlab.proof`)."""
    return code_proof(Path(spec.rpartition(":")[0]).stem)


def function_proof(function: Any) -> Proof | None:
    """The proof of the file that defines `function` and of the modules of yours it imports, where that file
    was loaded through towerlab.proof (`load_function`, or a spawned worker's import of it by name); None
    otherwise (a module imported otherwise is proven by its file alone, its imports unseen)."""
    module = getattr(function, "__module__", None)
    return code_proof(module) if isinstance(module, str) and proven(module) else None


def function_file(function: Any) -> str | None:
    """FILE.py:FUNCTION (FILE an absolute path) for a function a module file defines at its top level
    (not __main__'s: a script or a notebook cell cannot be imported by name); None otherwise."""
    name = getattr(function, "__name__", "")
    if getattr(function, "__module__", "__main__") == "__main__" or getattr(function, "__qualname__", "") != name \
            or not name.isidentifier():
        return None
    try:
        path = inspect.getsourcefile(function)
    except TypeError:
        return None
    return f"{path}:{name}" if path and path.endswith(".py") and Path(path).is_file() else None


# What a search records of a function of yours given from Python that no file defines (its model, or its
# objective), which no other process can load.
FROM_PYTHON = "a function given from Python"


def function_spec(function: Any) -> str:
    """What a search records of a function of yours: its FILE.py:FUNCTION (`function_file`), or FROM_PYTHON."""
    return function_file(function) or FROM_PYTHON


def check_function_file(spec: str, flag: str) -> None:
    """A file of yours a worker's command names (`search worker --objective`, `--model`): FILE.py:FUNCTION, a
    file that is there (read, never imported here)."""
    path, _, name = spec.rpartition(":")
    if not path or not name.isidentifier() or not path.endswith(".py"):
        what = "model file a search of the store trains with" if flag == "--model" else "file of the objective"
        raise UserError(f"{flag} {spec}: give FILE.py:FUNCTION, the {what} and its function's name")
    if not Path(path).is_file():
        raise UserError(f"{flag} {spec}: no file {path}")


def network_name(module: NetworkSource | None = None, function: ModelFunction | None = None) -> str:
    """How a run names a network of your own: `mynet.py:make` for a model function of a file,
    `mynet.Net` for a module class (or an instance of one), the function's name otherwise."""
    if function is not None:
        spec = function_file(function)
        return f"{Path(spec).name}" if spec else getattr(function, "__name__", "custom")
    cls = module if isinstance(module, type) else type(module) if isinstance(module, nn.Module) else None
    if cls is not None:
        return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "__main__" else cls.__qualname__
    return getattr(module, "__name__", "custom")


def _on_path(folder: str) -> None:
    """`folder` on sys.path after everything that was there before load_function (the standard
    library, the installed packages), ahead of the folders of files it loaded earlier (so that a
    file of the same name in another folder is found for this call)."""
    if folder in _FOLDERS:
        _FOLDERS.remove(folder)
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    elif folder in sys.path:
        return  # on the path already, where whoever put it there wants it
    ours = [i for i, entry in enumerate(sys.path) if entry in _FOLDERS]
    sys.path.insert(ours[0] if ours else len(sys.path), folder)
    _FOLDERS.insert(0, folder)


def user_code_failed(exc: BaseException, source: Any, what: str) -> UserError:
    """One line for an exception raised by code of yours (`source`: the function, class or factory
    that ran; `what`: what it was doing), naming where in your file it was raised. A SystemExit from
    it is its failure too, never a clean end of towerlab: `sys.exit()` in a model function ended
    `train` and `search run` with exit status 0 and no word."""
    function = getattr(source, "func", source)  # a functools.partial: the function it calls
    name = getattr(function, "__qualname__", None) or type(function).__name__
    where = ""
    with contextlib.suppress(TypeError, OSError):
        file = inspect.getsourcefile(function)
        lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == file]
        if file and lines:
            where = f" at {Path(file).name}:{lines[-1]}"
    if isinstance(exc, SystemExit):
        why = f"it called sys.exit({'' if exc.code is None else repr(exc.code)})"
    else:
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}".rstrip(": ")
    return UserError(f"your {name} failed {what}{where}: {why}")


def for_shape(source: nn.Module | ModelFunction, input_shape: Sequence[int], num_classes: int,
              options: dict) -> NetworkSource:
    """`source` as a factory: a model function (`--model FILE.py:FUNCTION`, two positional
    parameters without defaults: `source(input_shape, num_classes, **options)`) gets the recorded
    shape, classes and options; a module or a factory of none is `source` itself."""
    if source is None or isinstance(source, nn.Module):
        return source
    try:
        parameters = inspect.signature(source).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: called without arguments
        return source
    takes_shape = sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                      for p in parameters) == 2
    return functools.partial(source, tuple(input_shape), num_classes, **options) if takes_shape else source


def instantiate(source: NetworkSource) -> nn.Module:
    """A fresh network from a module of your own: a copy of an nn.Module (its current weights are the
    initial ones), or what a factory returns (called after the run's seed is set)."""
    if isinstance(source, nn.Module):
        try:
            return copy.deepcopy(source)
        except Exception as exc:  # noqa: BLE001 - whatever an attribute's copy raises, there is no copy
            raise UserError(f"your module cannot be copied ({type(exc).__name__}: {' '.join(str(exc).split())[:200]}),"
                            " and every replica starts from a copy: give a function that returns a new one "
                            "(model=YourModule, or model=lambda: YourModule(...))") from None
    if not callable(source):
        raise UserError(f"model must be a name, an nn.Module or a function returning one, got {type(source).__name__}")
    try:
        module = source()
    except UserError:
        raise  # a check of towerlab's that your code called (catalog.model_options): its line says it all
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - whatever your code raises, one line
        raise user_code_failed(exc, source, "building the network") from None
    if not isinstance(module, nn.Module):
        raise UserError(f"your model factory returned {type(module).__name__}, not an nn.Module")
    return module
