"""What a dataset holds, as one digest: the SHA-256 of its decoded arrays (the training images and labels,
the validation split included, then the test images and labels; uint8 (N, C, H, W) images, int64 labels),
so that whatever form its files take (an .npz, the four IDX files, raw or gzipped) the same data has the
same digest, and one changed label changes it. A search records it, and a worker on another machine
trains that search only where its own data has the same (`towerlab.jobs.identity`).

Hashing reads every byte of the arrays (MNIST's 55 MB, CIFAR-10's 184 MB): a dataset read from files
keeps its digest in a small cache in the user's cache folder, by each file's path, size and modification
time, so that a worker's start reads it back instead. A file replaced or edited in place has another size
or time, and is hashed again. Arrays given from Python and generated data are hashed each time (no
file to key them by).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from towerlab import atomic
from towerlab.errors import UserError

if TYPE_CHECKING:
    from towerlab.data.load import Dataset

# Bumped when what the digest covers changes: a cached digest of another version is never used.
DIGEST_VERSION = 1
CACHE_NAME = "content-digests.json"
CACHE_ENTRIES = 64  # the most files' digests kept: the newest


def content_digest(data: Dataset) -> str:
    """`sha256:` and the digest of what `data` holds (see the module's docstring), from the cache where
    its files have not changed."""
    key = _cache_key(data)
    cache = _read_cache() if key is not None else {}
    found = cache.get(key) if key is not None else None
    if isinstance(found, str):
        return found
    digest = arrays_digest(data)
    if key is not None:
        cache.pop(key, None)
        cache[key] = digest
        _write_cache(dict(list(cache.items())[-CACHE_ENTRIES:]))
    return digest


def arrays_digest(data: Dataset) -> str:
    """The digest of the decoded arrays themselves, read in full: their shapes and types, then their
    bytes. The validation split is the end of the training arrays, so `val_size` does not change it."""
    images = (data.x_train, data.x_val)
    labels = (data.y_train, data.y_val)
    header = {"train": [len(data.x_train) + len(data.x_val), *data.x_train.shape[1:]], "test": list(data.x_test.shape),
              "images": str(data.x_train.dtype), "labels": str(data.y_train.dtype)}
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for tensor in (*images, *labels, data.x_test, data.y_test):
        digest.update(tensor.detach().cpu().contiguous().numpy().data)
    return f"sha256:{digest.hexdigest()}"


def _cache_key(data: Dataset) -> str | None:
    """What a dataset's digest is cached under: its format and each file's path, size and modification
    time; for an image folder, its content key (every image's path, size and bytes: a folder's own time
    misses an image edited in a class folder), its decoded cache and its splits' sizes; None for data
    that no file holds."""
    source = data.source
    if source.get("format") == "folder":
        return json.dumps([DIGEST_VERSION, "folder", source.get("content"), source.get("cache"),
                           len(data.x_train) + len(data.x_val), len(data.x_test)])
    files = source.get("files") or []
    if not files or source.get("format") in ("arrays", "synthetic"):
        return None
    stats = []
    for name in files:
        try:
            stat = os.stat(name)
        except OSError:
            return None
        stats.append([os.path.abspath(name), stat.st_size, stat.st_mtime_ns])
    return json.dumps([DIGEST_VERSION, source.get("format"), stats])


def cache_path() -> Path:
    """The cache of digests: $XDG_CACHE_HOME/towerlab (or ~/.cache/towerlab)/content-digests.json."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "towerlab" / CACHE_NAME


def _read_cache() -> dict:
    try:
        found = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or unreadable: digests are computed again
        return {}
    return found if isinstance(found, dict) else {}


def _write_cache(cache: dict) -> None:
    """The cache, written atomically; a folder that cannot be written leaves it unwritten (a cache)."""
    path = cache_path()
    with contextlib.suppress(OSError, UserError):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, json.dumps(cache))
