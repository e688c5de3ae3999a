"""Checksummed, atomically replaced checkpoints, and the loading that refuses torn or foreign ones.

A checkpoint file is a `torch.save` archive followed by a 40-byte trailer: the marker `TLCK0001`
and the SHA-256 of the archive. The previous checkpoint is kept as `<name>.prev`, so a corrupt
latest one falls back to the one before. Loading never executes code from the file
(`weights_only=True`).
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
FORMAT = "towerlab-checkpoint"
VERSION = 1


def previous(path: Path) -> Path:
    return path.with_name(path.name + ".prev")


def save(path: str | Path, state: dict) -> None:
    """Write `state` to `path`; the checkpoint it replaces becomes `<path>.prev`."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "version": VERSION, **state}, buffer)
    payload = buffer.getvalue()
    data = payload + MARKER + hashlib.sha256(payload).digest()
    tmp = path.with_name(f".{path.name}.new")
    atomic.write_bytes(tmp, data)
    if path.exists():
        os.replace(path, previous(path))
    os.replace(tmp, path)


def _read(path: Path) -> dict:
    data = path.read_bytes()
    if len(data) < 40 or data[-40:-32] != MARKER:
        raise ValueError("no checksum trailer (truncated, or not a towerlab checkpoint)")
    payload, digest = data[:-40], data[-32:]
    if hashlib.sha256(payload).digest() != digest:
        raise ValueError("checksum mismatch (the file is corrupt)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler says, the file is unusable
        raise ValueError(f"unreadable archive ({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError("not a towerlab checkpoint")
    if state.get("version") != VERSION:
        raise ValueError(f"checkpoint format version {state.get('version')}, this towerlab reads {VERSION}")
    return state


def load(path: str | Path, log: Callable[[str], None] = print) -> dict:
    """The newest good checkpoint at `path` (falling back to `<path>.prev`), or a UserError."""
    path = Path(path)
    problems = []
    for candidate in (path, previous(path)):
        if not candidate.exists():
            continue
        try:
            state = _read(candidate)
        except (ValueError, OSError) as exc:
            problems.append(f"{candidate.name}: {exc}")
            continue
        if problems:
            log(f"towerlab: warning: {problems[0]}; resuming from {candidate.name} instead")
        return state
    if problems:
        raise UserError(f"no usable checkpoint in {path.parent}: {'; '.join(problems)}")
    raise UserError(f"no checkpoint in {path.parent}: nothing to resume (was the run started with towerlab train?)")


def check_compatible(state: dict, expected: dict[str, Any], where: Path) -> None:
    """Refuse a checkpoint made for another model or setting, naming the first difference."""
    for key, value in expected.items():
        if state.get(key) != value:
            raise UserError(f"checkpoint in {where} was made with {key}={state.get(key)!r}, "
                            f"this run has {key}={value!r}: start a new run or resume with the same settings")
