"""A job folder's records, the one module that names them and opens them: config.json (CONFIG, the resolved
settings a job writes first and --resume reads first), summary.json and best.json. `job_record` reads one
as a dict, `config_path` names a folder's config.json, `is_job_folder` says whether a folder holds a job's
output, and `read_json` is how any JSON settings file is read (a key given twice refused, as TOML refuses
it; a byte-order mark skipped). Standard library only: settings.py and the search store's location read
records here, below both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from towerlab.fields import json_loads

CONFIG = "config.json"  # a job's resolved settings with their provenance (jobs.provenance writes it)
SUMMARY = "summary.json"
BEST = "best.json"


def config_path(folder: str | os.PathLike) -> Path:
    """A job folder's config.json."""
    return Path(folder) / CONFIG


def is_job_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a job's output (a run's or a search's): its config.json, which --resume reads
    first."""
    return config_path(folder).is_file()


def read_json(path: Path, where: str) -> Any:
    """The JSON value a file holds (`where` names it in the message of a key given twice: a UserError).
    OSError where it cannot be read, UnicodeDecodeError where it is not UTF-8, ValueError where it is not
    JSON (RecursionError where it nests past what Python reads)."""
    text = path.read_bytes().decode("utf-8-sig")  # a byte-order mark, as some Windows editors write, is no setting
    return json_loads(text, where)


def job_record(folder: str | os.PathLike, name: str = CONFIG) -> dict:
    """A job folder's JSON record as a dict: its config.json, or another of its records (`name`: SUMMARY,
    BEST). FileNotFoundError where it is missing, ValueError where it is not a JSON object (or nests past
    what Python reads), OSError where it cannot be read."""
    path = Path(folder) / name
    try:
        stored = read_json(path, str(path))
    except RecursionError:
        raise ValueError(f"{path} nests its values too deeply") from None
    if not isinstance(stored, dict):
        raise ValueError(f"{path} holds a {type(stored).__name__}, not a JSON object")
    return stored
