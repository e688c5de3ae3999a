"""The proof of towerlab's own code, whole (`package_proof`): every source file of the installed package, by
its path in it, the digest of the bytes its module ran from (or, not imported, of the file as it is).

towerlab's own modules are loaded by `PackageLoader` from its `__init__` on (`install_package`), which runs
the very bytes it hashed: from a .pyc only where that .pyc holds those bytes' source hash (a hash-based
.pyc, Python's own format; the ones it writes are checked ones, which Python's own import checks too),
never from a .pyc stamped with its source's size and modification time. A stale one of those, its source
edited back with both put back (`cp -p`, `rsync -a`, `touch -r`), runs other code than its source says, and
a digest of the source would vouch for code that never ran. The modules imported before the loader is in
place (towerlab's `__init__`, `towerlab.proof` and this module) are checked once the proof is taken: where
Python ran a .pyc of theirs whose code is not their source's, the part is that .pyc's digest, which no
other process has. A module imported after the proof is taken must be what the proof holds (an edit on disk since is
refused: one process runs one towerlab). Names are paths inside the package, so another install of the
same files (another machine's venv) has the same proof.

What it costs (bench/proof/worker_start.py, results/proof/worker-start-2026-11-28.json, a busy 2-core machine): what
a worker imports took 1.718 s through PackageLoader against 1.708 s by Python's own loader, the digest
of the package's 1 MB of source 13 ms; where the package's folder is read-only and holds only pip's
time-stamped .pyc files, each module imported is compiled at every start (1.771 s: `python -m compileall
--invalidation-mode checked-hash` on the folder once, or one import by a user who may write it, gives it
the .pyc files it uses). A worker's start to its first claim on MNIST: 2.59 s, 2.52 s before issue 65.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import marshal
import os
import sys
from pathlib import Path
from types import CodeType, ModuleType
from typing import Any, Optional, Sequence

from towerlab.proof import Proof, module_file, short

_PYC_HEADER = 16  # a .pyc's magic number, flags and source hash (or time and size), then the marshalled code
_HASH_BASED = 0b01  # a .pyc flag: its header holds its source's hash, not its time and size
_CHECKED = 0b10  # a .pyc flag: Python's own import checks that hash against the source


class _Package:
    """A package whose code is proven whole (`package_proof`): its folder, the digest of the bytes each of
    its modules ran from (by path in the folder), and its proof once taken (then a module loaded later
    must be the bytes the proof holds)."""

    def __init__(self, name: str, folder: str) -> None:
        self.name, self.folder = name, os.path.join(os.path.realpath(folder), "")
        self.ran: dict[str, str] = {}
        self.proof: Optional[Proof] = None

    def relative(self, path: str) -> Optional[str]:
        real = os.path.realpath(path)
        return real[len(self.folder):].replace(os.sep, "/") if real.startswith(self.folder) else None

    def running(self, path: str, data: bytes) -> None:
        """Note that the module at `path` runs from `data`; one loaded after the proof was taken must be
        what the proof holds (an edit on disk since would run code that no proof vouches for)."""
        relative = self.relative(path)
        if relative is None:
            return
        digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
        self.ran[relative] = digest
        if self.proof is not None and self.proof.parts.get(relative) != digest:
            raise ImportError(f"{self.name}'s {relative} changed on disk after this process proved its code "
                              f"({short(self.proof.parts.get(relative, ''))} proven, {short(digest)} now): a "
                              f"process runs one {self.name}; restart it")


_PACKAGES: dict[str, _Package] = {}


class PackageLoader(importlib.machinery.SourceFileLoader):
    """A module of a proven package: runs the very bytes it hashed, from a .pyc only where that .pyc holds
    their source hash (a hash-based .pyc, Python's own format), never from a .pyc stamped with its source's
    size and modification time (a stale one, its source edited back with both put back, runs other code
    than the source says); a .pyc it writes is a checked hash-based one, which Python's own import checks
    against the source too."""

    def __init__(self, fullname: str, path: str, package: _Package) -> None:
        super().__init__(fullname, path)
        self.package = package

    def get_code(self, fullname: str) -> Any:
        path = self.get_filename(fullname)
        data = self.get_data(path)
        self.package.running(path, data)
        source_hash = importlib.util.source_hash(data)
        cached = importlib.util.cache_from_source(path)
        try:
            pyc = self.get_data(cached)
        except OSError:
            pyc = b""
        if _compiled_from(pyc, source_hash):
            return _located(marshal.loads(memoryview(pyc)[_PYC_HEADER:]), path)
        code = self.source_to_code(data, path)
        if not sys.dont_write_bytecode:
            header = importlib.util.MAGIC_NUMBER + (_HASH_BASED | _CHECKED).to_bytes(4, "little") + source_hash
            self.set_data(cached, header + marshal.dumps(code))  # quietly nothing where the folder is read-only
        return code


def _compiled_from(pyc: bytes, source_hash: bytes) -> bool:
    """Whether `pyc` is this Python's, compiled from the source whose hash is `source_hash`."""
    return (len(pyc) > _PYC_HEADER and pyc[:4] == importlib.util.MAGIC_NUMBER
            and int.from_bytes(pyc[4:8], "little") & _HASH_BASED != 0 and pyc[8:16] == source_hash)


def _located(code: CodeType, path: str) -> CodeType:
    """`code` (from a .pyc made elsewhere: a folder copied whole) naming `path` as its file, in tracebacks."""
    if code.co_filename == path:
        return code
    consts = tuple(_located(c, path) if isinstance(c, CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=path, co_consts=consts)


class _PackageFinder:
    """Finds a proven package's modules as sys.path's own finder does, and hands their source to PackageLoader."""

    @classmethod
    def find_spec(cls, name: str, path: Optional[Sequence[str]] = None, target: Optional[ModuleType] = None) -> Any:
        package = _PACKAGES.get(name.partition(".")[0])
        if package is None or "." not in name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader and spec.origin \
                and package.relative(spec.origin) is not None:
            spec.loader = PackageLoader(name, spec.origin, package)
        return spec

    @classmethod
    def invalidate_caches(cls) -> None:
        importlib.machinery.PathFinder.invalidate_caches()


def install_package(name: str, folder: str) -> None:
    """Prove package `name` (a top-level package, its folder `folder`) whole from now on: its modules are
    loaded by PackageLoader (call it first thing in the package's `__init__`)."""
    if name not in _PACKAGES:
        _PACKAGES[name] = _Package(name, folder)
    if _PackageFinder not in sys.meta_path:
        sys.meta_path.insert(0, _PackageFinder)


def package_proof(name: str) -> Proof:
    """The proof of package `name` (`install_package`) whole: each of its source files by its path in the
    package (so a copy of it elsewhere, another machine's install, gives the same), the digest of the bytes
    it ran from where it was imported, else of the file as it is (what an import would run). Taken once a
    process: a module imported after it must be what it holds."""
    package = _PACKAGES[name]
    if package.proof is None:
        parts = {}
        for folder, folders, files in os.walk(package.folder):
            folders[:] = [f for f in folders if f != "__pycache__" and not f.startswith(".")]
            for file in files:
                path = os.path.join(folder, file)
                if file.endswith(".py") and not file.startswith(".") and os.path.isfile(path):
                    relative = package.relative(path)
                    assert relative is not None, "a file of the package's folder"
                    parts[relative] = package.ran.get(relative) or _ran_otherwise(name, relative, path)
        package.proof = Proof(dict(sorted(parts.items())))
    return package.proof


def module_digest(name: str) -> str:
    """The digest of the bytes that module `name` of a proven package (imported) runs from: its part of
    `package_proof`, by itself."""
    package = _PACKAGES[name.partition(".")[0]]
    path = module_file(sys.modules[name])
    relative = package.relative(path or "")
    assert path is not None and relative is not None, f"{name}: a module of a proven package, from its file"
    return package.ran.get(relative) or _ran_otherwise(package.name, relative, path)


def _ran_otherwise(name: str, relative: str, path: str) -> str:
    """The digest of what a module of the package that PackageLoader did not load runs (the package's
    `__init__` and this module, imported before its finder was in place; one not imported yet: its file).
    Python's own import ran its .pyc where that .pyc's header matches the source: where the .pyc's code is
    not the source's (a stale one), the digest is of the .pyc, which no other process has."""
    data = Path(path).read_bytes()
    module = ".".join([name, *relative.removesuffix(".py").split("/")]).removesuffix(".__init__")
    loaded = sys.modules.get(module)
    if loaded is not None and os.path.realpath(module_file(loaded) or "") == os.path.realpath(path):
        pyc = _used_pyc(path, data)
        if pyc is not None and marshal.loads(memoryview(pyc)[_PYC_HEADER:]) != compile(data, path, "exec",
                                                                                      dont_inherit=True):
            return f"pyc:{hashlib.sha256(pyc).hexdigest()}"
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


def _used_pyc(path: str, data: bytes) -> Optional[bytes]:
    """The .pyc Python's own import ran instead of `path` (whose bytes are `data`), if any: one of this
    Python's whose header holds the source's modification time and size, or its hash (or that says not to
    check it)."""
    try:
        pyc = Path(importlib.util.cache_from_source(path)).read_bytes()
        stat = os.stat(path)
    except OSError:
        return None
    if len(pyc) <= _PYC_HEADER or pyc[:4] != importlib.util.MAGIC_NUMBER:
        return None
    flags = int.from_bytes(pyc[4:8], "little")
    if flags & _HASH_BASED:  # an unchecked one runs whatever its source (Python checks only a checked one's)
        return pyc if not flags & _CHECKED or pyc[8:16] == importlib.util.source_hash(data) else None
    stamped = int.from_bytes(pyc[8:12], "little"), int.from_bytes(pyc[12:16], "little")
    return pyc if stamped == (int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF) else None
