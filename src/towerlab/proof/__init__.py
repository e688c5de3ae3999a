"""The proof of what runs from your files: the SHA-256 of the bytes Python executed, by module name.

A file of yours (`--model FILE.py:FUNCTION`, `--objective FILE.py:FUNCTION`) and every module it imports
from outside the standard library, the installed packages and towerlab itself (a neighbour `blocks.py`,
a package of yours on PYTHONPATH or installed in place) are loaded by `SourceLoader`, which compiles
the very bytes it read and hashed, never a `.pyc`: a stale one beside a changed source whose size and
mtime were put back (`cp -p`, `rsync -a`, `touch -r`) runs other code than the source says, and a
digest of the source would vouch for code that never ran. Each module so loaded has its own
`__import__`, which notes the local modules it imports when it imports them (at its top, or later
inside a function), served from sys.modules or not. `code_proof(name)` follows those notes from one
module: the module and every local module it reaches, each by its name and the digest of its bytes.
Names, never paths: the same files in another folder, or on another machine, give the same proof.

Each module's source is read as well (`towerlab.proof.imports`): every import statement in it, at its
top or inside a function, names a module the proof holds before the statement runs (`def train(x):
import helper` proves helper.py when the search starts, not once a trial has imported it). A worker
checks what its trials ran against the proof it joined with (`ran`, `loads`, `changes`): a module
imported later must be the bytes the proof holds.

What it cannot see: a module imported by a name computed at run time (`importlib.import_module(name)`;
`import_module(f"pkg.{name}")` proves every module of pkg), data files your code reads, and a local module loaded otherwise (imported before `install`, or by another
finder, an editable install's): that one is proven by its file as it is on disk when the proof is taken.
Measured (bench/proof/objective_proof.py, results/proof/objective-proof-2026-11-28.json, before the import statements
were read): a file and 5 neighbours of 1,864 lines load in 13 ms where their .pyc files take 0.8 ms: what
compiling costs, the digests 1%; an import statement run again inside a function costs 0.2 microseconds more;
torch, numpy, matplotlib and optuna import as fast with the finder installed (1.01x).

A process spawned by towerlab (a replica, a search's worker) gets this loader before the functions and
classes of your files that it is handed (`LoaderThere`), which it imports by name as it unpickles them.
towerlab's own code has its proof apart: `towerlab.proof.package`.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import importlib.machinery
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Mapping, Optional, Sequence

from towerlab.proof.files import current_digest as current_digest  # re-exported: the files' digests live there
from towerlab.proof.files import file_digest, is_local, module_file, short
from towerlab.proof.imports import Finder, Statement, calls_import, named, source_statements, statements

_BUILTIN_IMPORT = builtins.__import__
_RAN: dict[str, tuple[str, str]] = {}  # module name -> (its file, the digest of the bytes compiled from it)
_IMPORTS: dict[str, set[str]] = {}  # module name -> the local modules it imported
_STATEMENTS: dict[str, tuple[Statement, ...]] = {}  # module name -> the import statements of the bytes compiled
_READ: dict[str, tuple[Statement, ...]] = {}  # a file's digest -> the import statements of those bytes
_LOADS: list[str] = []  # the modules SourceLoader compiled, in order
_CHANGES = [0]  # how many times the loader has seen something new: a module compiled, an import noted


@dataclass(frozen=True)
class Proof:
    """What runs, as digests by name (a module's name, `command`, a file as a command names it):
    `parts`, JSON as it is; `digest`, one SHA-256 over them all."""

    parts: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        text = json.dumps(dict(self.parts), sort_keys=True, separators=(",", ":"))
        return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"

    def difference(self, recorded: Mapping[str, str]) -> Optional[str]:
        """None where `recorded` (another proof's parts) is this one; else what differs, in words:
        each part whose digest differs, and each that only one side has."""
        changed = sorted(name for name in self.parts.keys() & recorded.keys() if self.parts[name] != recorded[name])
        said = []
        if len(changed) == 1:
            name = changed[0]
            said.append(f"{name} differs ({short(self.parts[name])} here, {short(recorded[name])} recorded)")
        elif changed:
            said.append(f"{', '.join(changed)} differ")
        if only_here := sorted(self.parts.keys() - recorded.keys()):
            said.append(f"{', '.join(only_here)} only here")
        if only_recorded := sorted(recorded.keys() - self.parts.keys()):
            said.append(f"{', '.join(only_recorded)} missing here")
        return "; ".join(said) or None

    def covers(self, ran: Mapping[str, str]) -> Optional[str]:
        """None where every part of `ran` (what ran, or runs now) is one of this proof's with its digest;
        else what is not, in words: each part whose digest differs (now, and proven), each it lacks."""
        changed = sorted(name for name in ran.keys() & self.parts.keys() if ran[name] != self.parts[name])
        said = [f"{name} differs ({short(ran[name])} now, {short(self.parts[name])} proven)" for name in changed]
        if unproven := sorted(ran.keys() - self.parts.keys()):
            said.append(f"{', '.join(unproven)} not in it")
        return "; ".join(said) or None


def _note(importer: str, name: str, globals_: Optional[Mapping[str, Any]], fromlist: Optional[Sequence[str]],
          level: int) -> None:
    """Record the local modules that an import statement of `importer` named, now in sys.modules."""
    if level:
        package = (globals_ or {}).get("__package__") or importer.rpartition(".")[0]
        name = importlib.util.resolve_name("." * level + name, package)
    parts = name.split(".")
    names = {".".join(parts[:n]) for n in range(1, len(parts) + 1)}
    names.update(f"{name}.{item}" for item in fromlist or () if item != "*")
    found = _IMPORTS.setdefault(importer, set())
    for imported in names - found:
        path = module_file(sys.modules.get(imported))
        if path is not None and is_local(path):
            found.add(imported)
            _CHANGES[0] += 1


def _recording_builtins(importer: str) -> dict[str, Any]:
    """The builtins a module of yours runs with: Python's, with an `__import__` that notes what it imports."""

    noted: set[tuple] = set()  # the import statements already noted: run again (in a loop), they cost a lookup

    def __import__(name: str, globals: Optional[Mapping[str, Any]] = None, locals: Any = None,
                   fromlist: Optional[Sequence[str]] = (), level: int = 0) -> ModuleType:
        module = _BUILTIN_IMPORT(name, globals, locals, fromlist or (), level)
        statement = (name, tuple(fromlist or ()), level)
        if statement not in noted:
            _note(importer, name, globals, fromlist, level)
            noted.add(statement)
        return module

    return {**builtins.__dict__, "__import__": __import__}


class SourceLoader(importlib.machinery.SourceFileLoader):
    """A local module's loader: compiles the bytes it hashed (never a cached .pyc), and gives the module
    builtins whose `__import__` notes the local modules it imports."""

    def get_code(self, fullname: str) -> Any:
        path = self.get_filename(fullname)
        data = self.get_data(path)
        tree = ast.parse(data, path)  # parsed once: its import statements read, then compiled
        _RAN[fullname] = (path, f"sha256:{hashlib.sha256(data).hexdigest()}")
        _STATEMENTS[fullname] = statements(tree, calls_import(data))
        _LOADS.append(fullname)
        _CHANGES[0] += 1
        return compile(tree, path, "exec", dont_inherit=True)

    def exec_module(self, module: ModuleType) -> None:
        _IMPORTS[module.__name__] = set()
        module.__dict__["__builtins__"] = _recording_builtins(module.__name__)
        super().exec_module(module)


class _LocalFinder:
    """Finds modules as sys.path's own finder does, and hands a local Python source to SourceLoader."""

    @classmethod
    def find_spec(cls, name: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None) -> Any:
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader \
                and spec.origin and is_local(spec.origin):
            spec.loader = SourceLoader(name, spec.origin)
        return spec  # what PathFinder, next in line, would find anyway: found once, not twice

    @classmethod
    def invalidate_caches(cls) -> None:
        importlib.machinery.PathFinder.invalidate_caches()


def install() -> None:
    """Load local modules through SourceLoader from now on, in this process (once; its finder sits just
    before sys.path's own, after the built-in and frozen modules' finders)."""
    if _LocalFinder in sys.meta_path:
        return
    at = sys.meta_path.index(importlib.machinery.PathFinder) if importlib.machinery.PathFinder in sys.meta_path \
        else len(sys.meta_path)
    sys.meta_path.insert(at, _LocalFinder)


class LoaderThere:
    """Sent to a spawned process among its arguments, before any function or class of your files (a model
    function, a module class: pickled by name, imported where they are unpickled): unpickled there, it
    installs this module's loader where it is installed here, so that those are imported through it (the
    bytes proven, never a stale .pyc) and their proof follows their imports. It unpickles as None."""

    def __init__(self) -> None:
        self.installed = _LocalFinder in sys.meta_path

    def __reduce__(self) -> tuple:
        return _install_if, (self.installed,)


def _install_if(installed: bool) -> None:
    if installed:
        install()


def proven(name: str) -> bool:
    """Whether module `name` was loaded by SourceLoader (its proof follows what it imports)."""
    return name in _RAN


def code_proof(name: str) -> Proof:
    """The proof of module `name` (in sys.modules) and of every local module it imports, and they in turn:
    those its import statements name (`towerlab.proof.imports`: imported yet or not, found where import
    would find them) and those it was seen importing. Each is the digest of the bytes SourceLoader compiled,
    or, for one it did not load, of its file as it is now. A module with no file of its own (a namespace
    package, a module made in memory) has no part."""
    return Proof(_walk([name], Finder.here(), here=True, digest=file_digest))


def ran(name: str, since: int = 0) -> Proof:
    """What ran of the proof of module `name`, as far as it can be known: the modules of it that SourceLoader
    compiled (followed from `name` through the imported ones), each the digest of the bytes it compiled, and
    every module it compiled since `loads()` was `since` (one imported by a name computed as it ran too). A
    module loaded otherwise has no part: the bytes it ran from are not known (its proof is of its file as it
    was when the proof was taken)."""
    parts = _walk([name], Finder.here(), here=True, digest=file_digest, imported=True)
    for loaded in dict.fromkeys(_LOADS[since:]):
        if loaded not in parts and loaded in _RAN:
            parts[loaded] = _RAN[loaded][1]
    return Proof(parts)


def loads() -> int:
    """How many modules SourceLoader has compiled so far (a mark for `ran`)."""
    return len(_LOADS)


def changes() -> int:
    """A count that grows whenever the loader sees something new (a module compiled, an import noted):
    where it has not grown, what `ran` would say has not changed."""
    return _CHANGES[0]


def script_modules(path: str, finder: Finder, digest: Callable[[str], str] = file_digest) -> dict[str, str]:
    """The local modules a Python script at `path` imports, and they in turn, by name, each the digest of
    its file (`digest`), found by `finder` (`Finder.fresh`: as the interpreter that runs the script would)."""
    try:
        said = _statements_of(path, digest(path))
    except OSError:
        return {}
    return _walk(sorted({n for statement in said for n in named(statement, "")}), finder, here=False, digest=digest)


def module_modules(name: str, finder: Finder, digest: Callable[[str], str] = file_digest) -> dict[str, str]:
    """The local module `name` (`python -m name`: its packages too) and every local module it imports."""
    return _walk(named((name, (), 0), ""), finder, here=False, digest=digest)


def _statements_of(path: str, digest: str) -> tuple[Statement, ...]:
    """The import statements of the file at `path`, whose digest is `digest` (read once per content)."""
    if digest not in _READ:
        _READ[digest] = source_statements(Path(path).read_bytes(), path) if path.endswith(".py") else ()
    return _READ[digest]


def _walk(todo: list[str], finder: Finder, *, here: bool, digest: Callable[[str], str],
          imported: bool = False) -> dict[str, str]:
    """The parts of the modules `todo` names (`here`: of this process, each root whatever it is; else
    local ones alone) and of the local modules they import, by name (`imported`: those imported alone,
    each a part where SourceLoader compiled it)."""
    parts: dict[str, str] = {}
    seen: set[str] = set()
    roots = set(todo) if here else set()
    todo = list(reversed(todo))
    while todo:
        current = todo.pop()
        if current in seen or (imported and current not in sys.modules):
            continue
        seen.add(current)
        found = finder.find(current)
        path = None if found is None else found.origin
        if path is None or (current not in roots and not is_local(path)):
            continue
        compiled = _RAN.get(current) if here else None
        try:
            if compiled is not None and compiled[0] == path:
                parts[current], said = compiled[1], _STATEMENTS.get(current, ())
            else:
                read = digest(path)
                said = _statements_of(path, read)
                if not imported:
                    parts[current] = read
        except OSError:
            continue  # gone since it was found: nothing of it runs from there
        package = current if found is not None and found.locations is not None else current.rpartition(".")[0]
        children: set[str] = set(_IMPORTS.get(current, ())) if here else set()
        for statement in said:
            children.update(named(statement, package))
            if "*" in statement[1]:  # every module of the package (`from pkg import *`, import_module(f"pkg.{x}"))
                children.update(n for top in named((statement[0], (), statement[2]), package)[-1:]
                                for n in finder.every(top))
        todo.extend(sorted(children - seen, reverse=True))
    return parts
