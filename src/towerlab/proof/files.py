"""Files as a proof names them (stdlib only): the digest of a file's bytes (`file_digest`, and
`current_digest`, read again only where the file may have changed), and whether a file is code of yours
(`is_local`: outside the standard library, the installed packages and towerlab)."""

from __future__ import annotations

import functools
import hashlib
import os
import site
import sysconfig
import time
from pathlib import Path
from types import ModuleType
from typing import Optional


def file_digest(path: str | os.PathLike) -> str:
    """`sha256:` and the SHA-256 of a file's bytes."""
    return f"sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()}"


def short(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


_STATUS: dict[str, tuple[tuple[int, ...], str]] = {}  # a path -> its status when read, and the digest read
SETTLED_NS = 2_000_000_000  # a file changed more recently than this is read again at every ask


def current_digest(path: str) -> str:
    """`file_digest(path)` as the file is now, read again only where its status differs from when it was
    last read (its device, inode, size, and modification and change times): every write sets the change
    time, which no call sets back (`touch -r`, `cp -p` and `rsync -a` put back the modification time, and
    the kernel sets the change time to now). A file changed in the last SETTLED_NS is read every time, so
    that two writes within one tick of its file system's clock cannot hide the second (git's racy-clean
    rule)."""
    status = os.stat(path)
    key = (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)
    seen = _STATUS.get(path)
    if seen is not None and seen[0] == key:
        return seen[1]
    digest = file_digest(path)
    if status.st_ctime_ns < time.time_ns() - SETTLED_NS:
        _STATUS[path] = (key, digest)
    else:
        _STATUS.pop(path, None)
    return digest


@functools.lru_cache(maxsize=1)
def _system_folders() -> tuple[str, ...]:
    """Where code that is not yours lives: the standard library, the installed packages, towerlab (whose
    own code has its own digest)."""
    paths = sysconfig.get_paths()
    folders = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    folders.update(getattr(site, "getsitepackages", list)())
    folders.add(site.getusersitepackages())
    folders.add(str(Path(__file__).parents[1]))  # towerlab's package folder (this is towerlab/proof/files.py)
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
