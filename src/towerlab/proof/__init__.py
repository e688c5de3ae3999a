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

What it cannot see: a module imported with `importlib.import_module` (no import statement), data files
your code reads, and a local module loaded otherwise (imported before `install`, or by another finder,
an editable install's): that one is proven by its file as it is on disk when the proof is taken, and
followed no further. Measured (bench/objective_proof.py, results/objective-proof-2026-11-28.json): a
file and 5 neighbours of 1,864 lines load in 13 ms where their .pyc files take 0.8 ms: what compiling
costs, the digests 1%; an import statement run again inside a function costs 0.2 microseconds more;
torch, numpy, matplotlib and optuna import as fast with the finder installed (1.01x).

A process spawned by towerlab (a replica, a search's worker) gets this loader before the functions and
classes of your files that it is handed (`LoaderThere`), which it imports by name as it unpickles them.
towerlab's own code has its proof apart: `towerlab.proof.package`.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import site
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

_BUILTIN_IMPORT = builtins.__import__
_RAN: dict[str, tuple[str, str]] = {}  # module name -> (its file, the digest of the bytes compiled from it)
_IMPORTS: dict[str, set[str]] = {}  # module name -> the local modules it imported


def file_digest(path: str | os.PathLike) -> str:
    """`sha256:` and the SHA-256 of a file's bytes."""
    return f"sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"


def short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


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


@functools.lru_cache(maxsize=1)
def _system_folders() -> tuple[str, ...]:
    """Where code that is not yours lives: the standard library, the installed packages, towerlab (whose
    own code has its own digest)."""
    paths = sysconfig.get_paths()
    folders = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    folders.update(getattr(site, "getsitepackages", list)())
    folders.add(site.getusersitepackages())
    folders.add(str(Path(__file__).parent))
    return tuple(os.path.join(os.path.realpath(folder), "") for folder in folders)


@functools.lru_cache(maxsize=1024)
def _real_folder(folder: str) -> str:
    return os.path.join(os.path.realpath(folder), "")


@functools.lru_cache(maxsize=4096)
def is_local(path: str) -> bool:
    """Whether the file at `path` is code of yours: outside the standard library, the installed packages
    and towerlab. Its folder's real path is resolved once per folder (a package of a thousand modules
    asks a thousand times), the file's own only where it is a link."""
    if os.path.islink(path):
        real = os.path.realpath(path)
    else:
        real = _real_folder(os.path.dirname(os.path.abspath(path))) + os.path.basename(path)
    return not real.startswith(_system_folders())


def module_file(module: Optional[ModuleType]) -> Optional[str]:
    path = getattr(module, "__file__", None)
    return path if isinstance(path, str) and os.path.isfile(path) else None


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
        _RAN[fullname] = (path, f"sha256:{hashlib.sha256(data).hexdigest()}")
        return self.source_to_code(data, path)

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
    """The proof of module `name` (in sys.modules) and of every local module it imported, and they in
    turn: each the digest of the bytes SourceLoader compiled, or, for one it did not load, of its file
    as it is now. A module with no file of its own (a namespace package, a module made in memory) has
    no part."""
    parts: dict[str, str] = {}
    todo = [name]
    while todo:
        current = todo.pop()
        if current in parts:
            continue
        path = module_file(sys.modules.get(current))
        if path is None:
            continue
        ran = _RAN.get(current)
        parts[current] = ran[1] if ran is not None and ran[0] == path else file_digest(path)
        todo.extend(_IMPORTS.get(current, ()))
    return Proof(parts)
