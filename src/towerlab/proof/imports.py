"""What Python code imports, read from its source without running it (stdlib only): every import
statement of a module, at its top or inside a function (`statements`), the modules each names
(`named`), and where Python's import would find them (`Finder`), never importing one.

A module a function imports when it runs (`def train(x): import helper`) has not run when a search
takes its proof: its import statement, read here, names it all the same, so the proof holds it
before any trial imports it (`towerlab.proof.code_proof`). A program run by a command (`python
train.py`) is read the same way, as a fresh interpreter would find its modules: beside the script,
then on PYTHONPATH (`Finder.fresh`). `importlib.import_module("name")` and `__import__("name")` with
a name written in the source count as import statements, `import_module(f"pkg.{name}")` as `from pkg
import *` (every module of pkg); a name computed at run time otherwise cannot be read.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import os
import pkgutil
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Mapping, Optional, Sequence

# An import statement as `__import__` is asked it: the name, the names after `import` in `from X
# import a, b`, and the level of a relative import (the dots).
Statement = tuple[str, tuple[str, ...], int]
_CALLS = {"import_module", "__import__"}
_BLOCKS = (ast.stmt, ast.excepthandler, ast.match_case)  # what holds statements (an expression holds none)


def statements(tree: ast.AST, calls: bool = True) -> tuple[Statement, ...]:
    """Every import statement in `tree` (a module's), wherever it is, and, with `calls`, every call of
    importlib.import_module or __import__ with a name written out (where a module's source names neither,
    its expressions are not walked: an import statement is a statement, never inside an expression)."""
    found: list[Statement] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found.extend((alias.name, (), 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", tuple(alias.name for alias in node.names), node.level))
        else:
            todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _BLOCKS))
    if calls:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and _called(node.func) in _CALLS:
                found.extend(_called_name(node.args[0]))
    return tuple(found)


def _called_name(argument: ast.expr) -> list[Statement]:
    """What `import_module(argument)` imports, as a statement: a name written out (`"helper"`, `".sub"`), or,
    for a name that begins with a package written out (`f"models.{name}"`, `"models." + name`), every module
    of that package (`from models import *`, which `named` and the proof read as every module of it)."""
    every: tuple[str, ...] = ()
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        name = argument.value
    else:
        first = argument.values[0] if isinstance(argument, ast.JoinedStr) and argument.values else \
            argument.left if isinstance(argument, ast.BinOp) and isinstance(argument.op, ast.Add) else None
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str) and "." in first.value):
            return []
        name, every = first.value.rpartition(".")[0], ("*",)
    level = len(name) - len(name.lstrip("."))  # import_module(".sub", package)
    return [(name[level:], every, level)] if name[level:] or every else []


def calls_import(data: bytes) -> bool:
    """Whether source bytes may call importlib.import_module or __import__ (`statements`' `calls`)."""
    return b"import_module" in data or b"__import__" in data


def _called(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def source_statements(data: bytes, path: str) -> tuple[Statement, ...]:
    """The import statements of a module's source bytes (none where they are not Python)."""
    try:
        return statements(ast.parse(data, path), calls_import(data))
    except (SyntaxError, ValueError):  # ValueError: a NUL byte
        return ()


def named(statement: Statement, package: str) -> list[str]:
    """The modules that `statement`, in a module of `package`, may import: `import a.b` imports a and a.b,
    `from a import b` a, and a.b where b is a module; a relative import resolved against `package` (`from a
    import *` names a alone here: `Finder.every` lists its modules)."""
    name, fromlist, level = statement
    if level:
        try:
            name = importlib.util.resolve_name("." * level + name, package)
        except (ImportError, ValueError):
            return []  # beyond the top-level package: it fails when it runs
    if not name:
        return []
    parts = name.split(".")
    found = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
    found.extend(f"{name}.{item}" for item in fromlist if item != "*")
    return found


@dataclass(frozen=True)
class Found:
    """Where a module is: its file (None: a namespace package, or none Python reads from a file) and, for a
    package, the folders its modules are found in."""

    origin: Optional[str]
    locations: Optional[tuple[str, ...]]


class Finder:
    """Finds modules as Python's import would, without importing them: a module already imported is the one
    that import returns (`modules`, this process's sys.modules), any other is looked for by sys.path's own
    finder on `path` (None: sys.path) or, inside a package, in its folders. Each name is looked up once."""

    def __init__(self, modules: Mapping[str, ModuleType], path: Optional[Sequence[str]] = None) -> None:
        self.modules, self.path = modules, None if path is None else list(path)
        self._found: dict[str, Optional[Found]] = {}

    @classmethod
    def here(cls) -> Finder:
        """As an import in this process finds modules."""
        return cls(sys.modules)

    @classmethod
    def fresh(cls, path: Sequence[str]) -> Finder:
        """As a new interpreter whose sys.path begins with `path` (a script's folder, PYTHONPATH) finds the
        modules of yours (what it finds elsewhere, the standard library and installed packages, is not)."""
        return cls({}, path)

    def every(self, name: str) -> list[str]:
        """The modules of package `name` (those in its folders, not in its subpackages'), by full name."""
        found = self.find(name)
        if found is None or found.locations is None:
            return []
        return sorted(f"{name}.{module.name}" for module in pkgutil.iter_modules(list(found.locations)))

    def find(self, name: str) -> Optional[Found]:
        if name not in self._found:
            self._found[name] = self._look(name)
        return self._found[name]

    def _look(self, name: str) -> Optional[Found]:
        module = self.modules.get(name)
        if module is not None:
            origin = getattr(module, "__file__", None)
            path = getattr(module, "__path__", None)
            return Found(origin if isinstance(origin, str) else None,
                         None if path is None else tuple(str(p) for p in path))
        if name in sys.builtin_module_names:
            return None
        parent = name.rpartition(".")[0]
        if parent:
            above = self.find(parent)
            if above is None or above.locations is None:
                return None  # no package of that name: the import fails when it runs
            where: Optional[list[str]] = list(above.locations)
        else:
            where = self.path
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, where)
        except (ImportError, ValueError, OSError):
            return None
        if spec is None:
            return None
        origin = spec.origin if spec.has_location and spec.origin and os.path.isfile(spec.origin) else None
        locations = spec.submodule_search_locations
        return Found(origin, None if locations is None else tuple(str(p) for p in locations))
