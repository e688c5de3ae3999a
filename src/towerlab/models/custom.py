"""Networks of your own: a model file's function or class (`--model FILE.py:FUNCTION`,
`--module FILE.py:NAME`) and a module or factory given from Python (model "custom")."""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Any, Callable

from torch import nn

from towerlab.errors import UserError

_LOADED: dict[str, str] = {}  # module name -> the file load_function imported it from


def load_function(spec: str, flag: str = "--model", what: str = "FUNCTION") -> Any:
    """What `FILE.py:NAME` names (a function, a network class, a network), imported from its file as a
    module of its folder, as `python FILE.py` would find its neighbours (and so that spawned workers,
    which get this process's sys.path, import it by name as well). `flag` and `what` word the errors:
    `--model FILE.py:FUNCTION` for a search's model function, `--module FILE.py:NAME` for a run's."""
    path_text, _, name = spec.rpartition(":")
    path = Path(path_text)
    if not path_text or not name.isidentifier() or (path.suffix != ".py" and not path.is_file()):
        raise UserError(f"{flag} {spec}: give FILE.py:{what}, the file that defines it and the name it has there "
                        f"(e.g. {flag} mynet.py:{'make' if what == 'FUNCTION' else 'Net'})")
    if not path.is_file():
        raise UserError(f"{flag} {spec}: no file {path_text}")
    if path.suffix != ".py":
        raise UserError(f"{flag} {spec}: {path_text} is not a Python file (FILE.py)")
    folder = str(path.resolve().parent)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)  # first, over a folder an earlier call put there
    if _LOADED.get(path.stem, os.path.realpath(path)) != os.path.realpath(path):
        sys.modules.pop(path.stem, None)  # a file of the same name that this function loaded before
        importlib.invalidate_caches()
    try:
        module = importlib.import_module(path.stem)
    except Exception as exc:  # noqa: BLE001 - whatever the user's file raises, say so in one line
        raise UserError(f"{flag} {spec}: importing {path_text} failed: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if os.path.realpath(getattr(module, "__file__", "") or "") != os.path.realpath(path):
        raise UserError(f"{flag} {spec}: the name {path.stem!r} is taken by another module "
                        f"({getattr(module, '__file__', 'built in')}): rename {path_text}")
    _LOADED[path.stem] = os.path.realpath(path)
    found = getattr(module, name, None)
    if not callable(found):
        raise UserError(f"{flag} {spec}: {path_text} defines no {name}")
    return found


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


def network_name(module: Any = None, function: Any = None) -> str:
    """How a run names a network of your own: `mynet.py:make` for a model function of a file,
    `mynet.Net` for a module class (or an instance of one), the function's name otherwise."""
    if function is not None:
        spec = function_file(function)
        return f"{Path(spec).name}" if spec else getattr(function, "__name__", "custom")
    cls = module if isinstance(module, type) else type(module) if isinstance(module, nn.Module) else None
    if cls is not None:
        return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ != "__main__" else cls.__qualname__
    return getattr(module, "__name__", "custom")


def for_shape(source: Any, input_shape: tuple, num_classes: int, options: dict) -> Any:
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


def instantiate(source: nn.Module | Callable[[], nn.Module]) -> nn.Module:
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
    module = source()
    if not isinstance(module, nn.Module):
        raise UserError(f"your model factory returned {type(module).__name__}, not an nn.Module")
    return module
