"""Checksummed, atomically replaced checkpoints, and the loading that refuses torn or foreign ones.

A checkpoint file is a `torch.save` archive followed by a 40-byte trailer: the marker `TLCK0001`
and the SHA-256 of the archive. The previous checkpoint is kept as `<name>.prev`, so a corrupt
latest one falls back to the one before. Loading never executes code from the file
(`weights_only=True`).

Saving writes `.<name>.new` completely (fsynced), renames `<name>` to `<name>.prev`, then
`.<name>.new` to `<name>`. A crash at any point leaves at least one complete, checksummed file:
between the two renames only `<name>.prev` and `.<name>.new` exist, and loading tries `<name>`,
then `<name>.prev`, then `.<name>.new`. A torn file never loads: its checksum does not match.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any, Callable

import torch

from towerlab import atomic
from towerlab.errors import UserError

MARKER = b"TLCK0001"
_CHUNK = 1 << 20  # read and hashed in pieces: a file is checked before it is held in memory
FORMAT = "towerlab-checkpoint"
VERSION = 1


def previous(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def pending(path: Path) -> Path:
    """Where `save` writes the new checkpoint before renaming it into place."""
    return path.with_name(f".{path.name}.new")


def candidates(path: str | Path) -> tuple[Path, ...]:
    """The files `load` tries, in order."""
    path = Path(path)
    return path, previous(path), pending(path)


def exists(path: str | Path) -> bool:
    """Whether `load` has anything to try (not whether it is good)."""
    return any(p.is_file() for p in candidates(path))


def save(path: str | Path, state: dict) -> None:
    """Write `state` to `path`; the checkpoint it replaces becomes `<path>.prev`."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, **state}, buffer)
    payload = buffer.getvalue()
    data = payload + MARKER + hashlib.sha256(payload).digest()
    tmp = pending(path)
    atomic.write_bytes(tmp, data, replaces=path)  # a full disk fails here, with both older files untouched
    try:
        if path.exists():
            os.replace(path, previous(path))
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"could not put the new checkpoint in place as {path}: {exc.strerror or exc}; "
                        f"the last good one is still loadable") from None


def size_limit(network: torch.nn.Module) -> int:
    """The most bytes a checkpoint of `network` can take: its tensors as the best epoch's weights,
    the step's own copy, and up to six more per tensor of optimizer, averaging and Lookahead state,
    plus 64 MiB for the history and settings. A larger file is not this run's checkpoint."""
    return 8 * sum(t.numel() * t.element_size() for t in network.state_dict().values()) + 64 * 2**20


def _read(path: Path, max_bytes: int | None = None) -> dict:
    """The checkpoint at `path`; a ValueError saying why it is unusable. Its size, trailer and
    checksum are checked before the archive is held in memory (at most `max_bytes`)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if max_bytes is not None and size > max_bytes:
                raise ValueError(f"{size:,} bytes, more than a checkpoint of this run's model can be "
                                 f"({max_bytes:,}): not this run's checkpoint")
            f.seek(max(size - 40, 0))
            trailer = f.read(40)
            if len(trailer) < 40 or trailer[:8] != MARKER:
                raise ValueError("no checksum trailer (truncated, or not a towerlab checkpoint)")
            digest = hashlib.sha256()
            f.seek(0)
            for left in range(size - 40, 0, -_CHUNK):
                digest.update(f.read(min(left, _CHUNK)))
            if digest.digest() != trailer[8:]:
                raise ValueError("checksum mismatch (the file is corrupt)")
            f.seek(0)
            payload = f.read(size - 40)
    except MemoryError:
        raise ValueError("too large to read in this machine's memory (MemoryError)") from None
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler says, the file is unusable
        raise ValueError(f"unreadable archive ({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("not a towerlab checkpoint")
    if state.get("version") != VERSION:
        raise ValueError(f"checkpoint format version {state.get('version')}, this towerlab reads {VERSION}")
    return state


def load(path: str | Path, log: Callable[[str], None] = print, max_bytes: int | None = None) -> dict:
    """The newest good checkpoint at `path` (falling back to `<path>.prev`), or a UserError;
    `max_bytes` (`size_limit` of the run's model): a larger file is refused unread."""
    path = Path(path)
    if not exists(path):
        raise UserError(f"no checkpoint in {path.parent}: nothing to resume (was the run started with towerlab train?)")
    problems = []
    for candidate in candidates(path):
        if not candidate.is_file():
            if candidate == path:
                problems.append(f"{path.name} is missing (a save was interrupted)")
            continue
        try:
            state = _read(candidate, max_bytes)
        except (ValueError, OSError) as exc:
            problems.append(f"{candidate.name}: {exc}")
            continue
        if problems:
            log(f"towerlab: warning: {problems[0]}; resuming from {candidate.name} instead")
        return state
    raise UserError(f"no usable checkpoint in {path.parent}: {'; '.join(problems)}: "
                    "start the run again (a new --out), the files here cannot be resumed")


def check_compatible(state: dict, expected: dict[str, Any], where: Path) -> None:
    """Refuse a checkpoint made for another model or setting, naming the first difference."""
    for key, value in expected.items():
        if state.get(key) != value:
            raise UserError(f"checkpoint in {where} was made with {key}={state.get(key)!r}, "
                            f"this run has {key}={value!r}: start a new run or resume with the same settings")
