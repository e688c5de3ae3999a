"""Atomic file writes: a reader sees the old version or the new one, never a torn file.

Write to a temporary file in the same folder, flush and fsync it, `os.replace` it over the target,
then fsync the folder so the rename itself survives a power cut. If anything fails (a full disk,
a kill), the temporary file is removed and the previous version stays as it was.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Iterable

from towerlab.errors import UserError
from towerlab.job_files import is_job_folder


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def require_regular_file(path: str | os.PathLike, option: str | None = None) -> None:
    """Refuse a path that exists and is a named pipe, socket or device (through a link, too), for
    every file a command reads or writes: read, one blocks until a writer comes, or never ends;
    written, the rename of a new file would replace the device itself (as root: /dev/full became a
    PNG). `option`: the flag that named an output (None: an input, or a file a job writes into its
    folder). A missing path or a folder is left to the reader's or writer's own message."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, a dangling link, a name the file system refuses
        return
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    if option is None:
        raise UserError(f"{path} is not a regular file (a named pipe, socket or device): give a file")
    raise UserError(f"{option} {path} is not a regular file (a named pipe, socket or device), and towerlab "
                    "writes only in place of a regular file: write to another path")


def write_bytes(path: str | Path, data: bytes, *, replaces: str | Path | None = None) -> None:
    """`data` to `path`, atomically. `replaces`: the file this one is on its way to replacing, when
    that is not `path` itself (a checkpoint is written aside, then rotated in): a failure says
    whether a previous version of it is intact. A path that is a pipe, socket or device is refused
    (`require_regular_file`), never replaced."""
    path = Path(path)
    for target in {path, Path(replaces or path)}:
        require_regular_file(target, "the output")
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        kept = "the previous version is intact" if Path(replaces or path).exists() else "nothing was written"
        raise UserError(f"could not write {path}: {exc.strerror or exc}; {kept}") from None
    _fsync_dir(path.parent)


def refuse_overwriting(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], folders: Iterable[str | os.PathLike] = (),
                       option: str = "--out") -> None:
    """Refuse, before anything is read or written, an output path that is a pipe, socket or device
    (`require_regular_file`) or that would replace one of the command's inputs (the same file, by
    any name) or an existing file of a run or search folder among `folders`: a command that only
    reads must not destroy what it read."""
    out = Path(out)
    require_regular_file(out, option)
    if not out.exists():
        return
    for path in inputs:
        with contextlib.suppress(OSError):  # an input that is not there is its reader's error
            if os.path.samefile(out, path):
                raise UserError(f"{option} {out} is {path}, which this command reads: it would be replaced; "
                                "write to another path")
    for folder in folders:
        if is_job_folder(Path(folder)) and out.resolve().parent == Path(folder).resolve():
            raise UserError(f"{option} {out} would replace a file of {folder}, which this command reads: "
                            "write to another path")


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: _finite(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(value) for value in obj]
    return obj


def json_text(obj: Any, **options: Any) -> str:
    """`obj` as strict JSON: a NaN or infinite float (a diverged loss) becomes null, never the bare
    `NaN` / `Infinity` that Python writes by default and JSON parsers refuse."""
    return json.dumps(_finite(obj), allow_nan=False, default=str, **options)


def write_json(path: str | Path, obj: Any) -> None:
    write_text(path, json_text(obj, indent=2, sort_keys=True) + "\n")
