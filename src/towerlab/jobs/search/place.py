"""Where a search job's things are: its folder (--resume, else --out, else a new one under runs/; which
search of its store a resumed folder continues; whether torchrun restarted the very job that made it)
and its store, as the job opens it (what a store's name means is `towerlab.search.store.location`'s):
opened with one line for what fails, and the token by which torchrun's ranks check that they reach the
store rank 0 made.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

from towerlab.checks import dataset_label
from towerlab.config import RunConfig, SearchConfig
from towerlab.errors import UserError
from towerlab.fields import replace, to_dict
from towerlab.jobs.job import restarted_by_torchrun
from towerlab.objective import named
from towerlab.job_files import config_path, job_record
from towerlab.search import Space, load_space
from towerlab.search.store.location import is_url, recorded_store
from towerlab.search.store import Store


def store_token(target: str, search_id: int) -> Optional[str]:
    """The token of search `search_id` in the store at `target` as this process sees it (None: no such
    store or search here)."""
    if not is_url(target) and not Path(target).is_file():
        return None
    try:
        with Store(target, create=False) as store:
            row = store.records.search(search_id)
    except UserError:
        return None
    return None if row is None else row.token


def open_store(target: str) -> Store:
    """The store at `target`, made where there is none; what fails is one line."""
    try:
        return Store(target)
    except UserError:
        raise
    except OSError as exc:
        raise UserError(f"cannot create the search store {recorded_store(target)}: {exc.strerror or exc}") from None


def search_out(kind: str, cfg: SearchConfig, run: RunConfig, space: Space | None = None) -> Path:
    """The job's output folder: --resume, else --out, else a new one under runs/."""
    if run.resume or run.out:
        return Path(run.resume or run.out or "")
    own = named(cfg).own
    return default_out(kind, cfg, space or load_space(cfg.space, objective=own), own)


def restarted(out: Path, kind: str, cfg: SearchConfig) -> bool:
    """Whether this is a torchrun restart of the very job that made `out` (same kind and settings)."""
    recorded = json.loads(json.dumps(to_dict(replace(cfg, store=recorded_store(cfg.store) if cfg.store else None))))
    return restarted_by_torchrun(out, lambda stored: stored.get("kind") == kind and stored.get("search") == recorded)


def default_out(kind: str, cfg: SearchConfig, space: Space, own: bool) -> Path:
    """runs/<time>-<kind>-<space>-<dataset>, or -objective for a search of your own objective (`own`)."""
    trains = "objective" if own else dataset_label(cfg.dataset)
    return Path("runs") / f"{datetime.now():%Y%m%d-%H%M%S}-{kind}-{Path(space.name).stem}-{trains}"


def stored_search_id(out: Path) -> int:
    """Which search of its store a resumed folder continues, as its config.json records it."""
    try:
        search_id = job_record(out)["search_id"]
    except (OSError, ValueError, KeyError, TypeError):
        search_id = None
    if type(search_id) is not int:
        raise UserError(f"{config_path(out)} names no search of its store (search_id was edited or removed): resume cannot "
                        "tell which search to continue; start a new search")
    return search_id
