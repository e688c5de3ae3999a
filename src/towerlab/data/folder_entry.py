"""An image folder's cache entry as it is found again: its name (the folder's content, the size and
channels, the decoder's key), and its check each time it is opened (`open_entry`): what its meta.json
says, its arrays' shapes, types and labels, and the digest of its arrays read in full against the one it
recorded when it was written (folder_cache.py writes it). An entry that fails a check is `Damaged`: the
caller decodes the folder again, with one line saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from towerlab.data import folder_decode
from towerlab.data.digest import entry_digest
from towerlab.data.folder_files import SPLITS, Listing
from towerlab.data.pages import register

VERSION = 2  # of the cache's layout: another version decodes again (the decoder is in the entry's name)
MAX_JSON = 64 * 2**20  # the largest meta.json or stats.json read (a folder's failed files are listed there)


class Damaged(Exception):
    """A cache entry that fails a check (`open_entry`); its message says which, in a few words."""


@dataclass(frozen=True)
class Entry:
    """A cache entry that passed every check: its meta.json, and x.npy and y.npy memory-mapped."""

    meta: dict
    x: np.ndarray
    y: np.ndarray


def entry_name(content: str, size: tuple[int, int], channels: int) -> str:
    """The folder of the entry holding the images of `content` decoded at `size` with `channels` by this
    decoder (`folder_decode.decoder_key`): another decoder's lands elsewhere."""
    return f"{content.removeprefix('sha256:')}-{size[0]}x{size[1]}x{channels}-{folder_decode.decoder_key()}"


def expected_meta(listing: Listing, content: str, size: tuple[int, int], channels: int) -> dict:
    """What an entry's meta.json must say for the folder read now (`open_entry` checks it)."""
    return {"version": VERSION, "content": content, "classes": list(listing.classes), "size": list(size),
            "channels": channels, "decoder": folder_decode.decoder_key()}


def open_entry(where: Path, expected: dict) -> Optional[Entry]:
    """The entry `where` (None where there is none), trusted only once it holds what `expected` (its
    meta.json's values) says, arrays of the shapes its counts give, labels of its classes, and arrays
    whose digest is the one it recorded when it was written (`digest.entry_digest`, read here in full);
    Damaged (why) otherwise."""
    if not os.path.lexists(where):
        return None
    meta = read_json(where / "meta.json")
    if not isinstance(meta, dict):
        raise Damaged("its meta.json is not a JSON object")
    for key, value in expected.items():
        if meta.get(key) != value:
            raise Damaged(f"its meta.json says {key} {_shown(meta.get(key))}, where it must be {_shown(value)}")
    blocks = meta.get("blocks")
    if not isinstance(blocks, dict) or set(blocks) != set(SPLITS) or \
            not all(type(n) is int and n >= 0 for n in blocks.values()):
        raise Damaged("its meta.json's blocks are not counts of train/, val/ and test/")
    failed = meta.get("failed")
    if not isinstance(failed, list) or not all(isinstance(f, list) and [type(v) for v in f] == [str, str] for f in failed):
        raise Damaged("its meta.json's failed files are not a list of (path, why)")
    rows = sum(blocks.values())
    x, y = (_mapped(where / name) for name in ("x.npy", "y.npy"))
    if x.shape != (rows, meta["channels"], *meta["size"]) or x.dtype != np.uint8:
        raise Damaged(f"its x.npy holds {x.dtype} {x.shape}, where its meta.json counts {rows:,} images "
                      f"{meta['channels']}x{meta['size'][0]}x{meta['size'][1]} of uint8")
    if y.shape != (rows,) or y.dtype != np.int64:
        raise Damaged(f"its y.npy holds {y.dtype} {y.shape}, where its meta.json counts {rows:,} int64 labels")
    if rows and (int(y.min()) < 0 or int(y.max()) >= len(meta["classes"])):
        raise Damaged(f"its labels run from {int(y.min())} to {int(y.max())}, outside its {len(meta['classes'])} "
                      "classes")
    found = entry_digest(x, y)
    if found != meta.get("digest"):
        raise Damaged(f"its arrays have digest {found.removeprefix('sha256:')[:12]}, not the "
                      f"{_shown(meta.get('digest'))} it recorded when it was written (edited or damaged)")
    return Entry(meta, x, y)


def _shown(value: object) -> str:
    return json.dumps(value)[:40]


def _mapped(path: Path) -> np.ndarray:
    if not stat.S_ISREG(_stat(path).st_mode):
        raise Damaged(f"its {path.name} is not a regular file")
    try:
        array = np.load(path, mmap_mode="c", allow_pickle=False)
    except (OSError, ValueError) as err:  # truncated (shorter than its header says), or no .npy at all
        raise Damaged(f"its {path.name} cannot be read as the array it claims ({err})") from None
    register(array)  # its check reads it in full: the pages are given back as it goes
    return array


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as err:
        raise Damaged(f"its {path.name} cannot be read ({err.strerror or err})") from None


def read_json(path: Path) -> object:
    """A small JSON file of the cache, read only where it is a regular file of at most MAX_JSON bytes
    (a named pipe would block, a link to /dev/zero never end); Damaged otherwise."""
    if not stat.S_ISREG(_stat(path).st_mode) or _stat(path).st_size > MAX_JSON:
        raise Damaged(f"its {path.name} is not a regular file of at most {MAX_JSON // 2**20} MiB")
    try:
        with open(path, "rb") as stream:
            return json.loads(stream.read(MAX_JSON + 1))
    except (OSError, ValueError) as err:
        raise Damaged(f"its {path.name} cannot be read as JSON ({err})") from None


def meta_of(entry: Path) -> dict:
    """An entry's meta.json as it says, whatever its version ({} where it cannot be read)."""
    with contextlib.suppress(Damaged):
        meta = read_json(entry / "meta.json")
        return meta if isinstance(meta, dict) else {}
    return {}


def remove_entry(where: Path) -> None:
    """Remove the entry `where` (a damaged one, before it is decoded again); a process that maps it keeps
    its arrays until it lets them go."""
    shutil.rmtree(where, ignore_errors=True)
    with contextlib.suppress(OSError):
        where.unlink()  # a file or a link in its place
