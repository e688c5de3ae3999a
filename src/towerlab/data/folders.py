"""An image folder as a dataset: decoded once, on every core, into a cache of uint8 arrays in the
data folder (`<data folder>/image-cache/`), keyed by the folder's content; memory-mapped from there
on, so a folder larger than memory trains with batches read from the cache (`release_pages` lets
the reader give back what a batch mapped in).

The content key (`Scan.content`) is a SHA-256 over every image's path, size and SHA-256: an edited,
added or removed image makes another key, hence another cache entry. Pass 1 reads every byte of the
folder each time it is loaded (nothing is recognised by paths, sizes and times); pass 2 decodes every
image into the cache from the very bytes pass 1 hashed (folder_decode.py has the rules); what cannot
be decoded is skipped and counted. An entry is checked each time it is opened (`folder_entry.
open_entry`); what identifies the dataset for a search or a resume is the digest of the arrays it
trains on (`towerlab.data.digest`), as for every dataset.

The cache holds train/'s images, then val/'s, then test/'s. Where a split must be cut from train/
(no test/: --test-size; no val/: --val-size), train/'s images are kept in a stratified order
(`stratified_order`), so every cut is a contiguous block holding each class in proportion; where
train/ has both beside it, its images keep their file-name order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import numpy as np

from towerlab import atomic
from towerlab.catalog.datasets import parse_image_size
from towerlab.data import folder_cache, folder_decode, folder_entry, locate
from towerlab.data.folder_files import Listing, list_folder
from towerlab.data.pages import release_pages
from towerlab.errors import UserError
from towerlab.report import printable

CACHE = "image-cache"
DEFAULT_SIZE = (64, 64)  # the size where the folder's most common one is larger than LARGEST_COMMON
LARGEST_COMMON = 128
DEFAULT_TEST_SIZE = 0.2
VAL_SHARE = 5  # validation held out of train/ is at most a fifth of what is left for training

Log = Callable[[str], object]
Stats = Callable[..., tuple[tuple[float, ...], tuple[float, ...]]]


@dataclass(frozen=True)
class FolderOptions:
    """How a folder is read: `image_size` (height, width; None: its most common size where both
    sides are at most LARGEST_COMMON, else DEFAULT_SIZE), `test_size` (the share of train/ held out
    for testing where there is no test/; None: DEFAULT_TEST_SIZE), `channels` (None: 1 where every
    image is grey, else 3), `classes` (label by these names, a trained model's; None: the folder's)."""

    image_size: Optional[tuple[int, int]] = None
    test_size: Optional[float] = None
    channels: Optional[int] = None
    classes: Optional[tuple[str, ...]] = None

    @classmethod
    def of(cls, cfg: Any) -> FolderOptions:
        """The options a TrainConfig or SearchConfig gives (--image-size, --test-size)."""
        return cls(image_size=parse_image_size(cfg.image_size) if cfg.image_size else None, test_size=cfg.test_size)


@dataclass(frozen=True)
class Scan:
    """Pass 1 of a folder: its content key, the channel count and most common size of its images, and the
    SHA-256 of each file (the listing's order; "" for one that could not be read)."""

    content: str
    channels: int
    common_size: tuple[int, int]
    file_digests: tuple[str, ...]

    def size(self, given: Optional[tuple[int, int]]) -> tuple[int, int]:
        if given is not None:
            return given
        return self.common_size if max(self.common_size) <= LARGEST_COMMON else DEFAULT_SIZE


def cache_root(data_dir: str | os.PathLike | None) -> Path:
    root = locate.resolve_data_dir(data_dir) / CACHE
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot write the image cache in {root} ({err.strerror or err}): pass --data-dir DIR, "
                        "a folder you can write") from None
    return root


def scan_folder(listing: Listing, log: Log) -> Scan:
    """Pass 1: every file read and hashed, every header parsed, each time a folder is loaded (nothing
    recognises a folder by its files' paths, sizes and times: a file edited with its time put back, or
    two of one size swapped, would not be seen)."""
    base = os.path.join(str(listing.root), "")
    items = [(base + f.path, f.size) for f in listing.files]
    results: list[tuple[str, str, int, int, str]] = []
    with folder_cache.progress(log, len(items), f"Reading the {len(items):,} images of {listing.root}") as advance:
        for _, part in folder_decode.parallel(folder_decode.scan, items, advance=advance):
            results += part
    digest = _sha256_lines(f"{f.path}\0{f.size}\0{r[0] or r[4]}" for f, r in zip(listing.files, results))
    readable = [r for r in results if not r[4]]
    sizes = Counter((h, w) for _, _, h, w, _ in readable)
    common = min(sizes, key=lambda s: (-sizes[s], s[0] * s[1], s)) if sizes else DEFAULT_SIZE
    channels = 1 if readable and all(folder_decode.is_grey(r[1]) for r in readable) else 3
    return Scan("sha256:" + digest, channels, common, tuple(r[0] for r in results))


def _sha256_lines(lines: Iterator[str]) -> str:
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return digest.hexdigest()


# -------------------------------------------------------------------------------------------- loading

@dataclass(frozen=True)
class Loaded:
    """An image folder read: its splits, memory-mapped (x_train, y_train, x_val, y_val, x_test,
    y_test), its source (as `Dataset.source`), class names and the training part's channel statistics."""

    arrays: dict[str, np.ndarray]
    source: dict
    classes: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]


def load_folder(path: str | os.PathLike, data_dir: str | os.PathLike | None, val_size: int, options: FolderOptions,
                log: Log, stats: Stats) -> Loaded:
    """The image folder `path`, decoded first where the cache lacks it (or holds it damaged).
    `stats(x_train, release=...)` gives the training part's channel statistics, computed once per cut
    and kept beside the arrays."""
    listing = list_folder(path)
    if "test" in listing.splits and options.test_size is not None:
        raise UserError(f"--test-size cuts a test set out of train/, and {listing.root} has test/ of its own: leave "
                        "--test-size out")
    root = cache_root(data_dir)
    scan = scan_folder(listing, log)
    size, channels = scan.size(options.image_size), options.channels or scan.channels
    entry = _entry(listing, scan, root, size, channels, log)
    meta = entry.meta
    ranges, note = _cuts(listing, meta, val_size, options.test_size)
    classes, y = _labelled(listing, entry.y, options.classes)
    arrays = {}
    for split, (lo, hi) in ranges.items():
        arrays[f"x_{split}"], arrays[f"y_{split}"] = entry.x[lo:hi], y[lo:hi]
    mean, std = _stats(root / folder_entry.entry_name(scan.content, size, channels), meta["digest"], ranges["train"],
                       arrays["x_train"], stats)
    skipped = listing.skipped + [tuple(pair) for pair in meta["failed"]]
    if skipped:
        log(f"{printable(listing.root)}: skipped {skip_summary(skipped)}")
    source = {"format": "folder", "files": [str(listing.root)], "fallback": False, "note": note,
              "content": scan.content, "cache": str(root / folder_entry.entry_name(scan.content, size, channels)),
              "classes": list(classes), "skipped": len(skipped), "skipped_files": [list(pair) for pair in skipped[:100]]}
    return Loaded(arrays, source, classes, tuple(mean), tuple(std))


def _entry(listing: Listing, scan: Scan, root: Path, size: tuple[int, int], channels: int, log: Log) -> folder_entry.Entry:
    """The folder's cache entry at `size` and `channels`, checked (`folder_entry.open_entry`): decoded
    first where there is none, or decoded again where the one there fails a check (one line says which)."""
    where = root / folder_entry.entry_name(scan.content, size, channels)
    expected = folder_entry.expected_meta(listing, scan.content, size, channels)
    with contextlib.suppress(folder_entry.Damaged):
        entry = folder_entry.open_entry(where, expected)
        if entry is not None:
            return entry
    with folder_cache.locked(root / f"{where.name}.lock"):
        try:
            entry = folder_entry.open_entry(where, expected)
        except folder_entry.Damaged as why:
            log(f"towerlab: the image cache entry {where} is damaged ({why}): decoding {printable(listing.root)} again")
            folder_entry.remove_entry(where)
            entry = None
        if entry is None:
            folder_cache.decode_folder(listing, scan.content, scan.file_digests, where, size, channels, log)
            try:
                entry = folder_entry.open_entry(where, expected)
            except folder_entry.Damaged as why:
                raise UserError(f"the image cache entry {where} just written fails its check ({why}): is another "
                                "process writing into the data folder?") from None
    assert entry is not None, "an entry decoded and checked"
    return entry


def _cuts(listing: Listing, meta: dict, val_size: int, test_size: Optional[float]) -> tuple[dict, str]:
    """Where train, val and test lie in the cache, and a note that says how they were made."""
    blocks, splits, pool = meta["blocks"], listing.splits, meta["blocks"]["train"]
    ranges = folder_cache.ranges(blocks)
    if "test" in splits:
        test_note = "test/"
    else:
        share = DEFAULT_TEST_SIZE if test_size is None else test_size
        cut = round(share * pool)
        ranges["test"], pool = (pool - cut, pool), pool - cut
        test_note = f"{cut:,} ({share:g}) of train/'s, stratified"
    if "val" in splits:
        val_note = "val/"
    else:
        held = min(val_size, pool // VAL_SHARE)
        ranges["val"], pool = (pool - held, pool), pool - held
        val_note = f"{held:,} of train/'s, stratified" + (f" (--val-size {val_size} is more than a fifth)"
                                                         if held < val_size else "")
    if pool < 1:
        raise UserError(f"{listing.root}: the test and validation images leave no training images ({blocks['train']} in "
                        "train/): use a smaller --test-size or --val-size")
    ranges["train"] = (0, pool)
    size = "x".join(map(str, (meta["channels"], *meta["size"])))
    note = f"image folder: {len(meta['classes'])} classes, images {size}; test: {test_note}; val: {val_note}"
    return ranges, note


def _labelled(listing: Listing, y: np.ndarray, classes: Optional[tuple[str, ...]]) -> tuple[tuple[str, ...], np.ndarray]:
    """The class names and labels: the folder's, or `classes` (a trained model's) by name."""
    if classes is None or tuple(classes) == listing.classes:
        return listing.classes, y
    unknown = [name for name in listing.classes if name not in classes]
    if unknown:
        raise UserError(f"{listing.root} has class {unknown[0]}, which the model was not trained on (its classes: "
                        f"{', '.join(classes)})")
    return tuple(classes), np.array([classes.index(name) for name in listing.classes], np.int64)[y]


def _stats(where: Path, digest: str, train: tuple[int, int], x_train: np.ndarray, stats: Stats) -> tuple[list, list]:
    """The training part's channel mean and std: computed once per cut, then read from stats.json,
    where that holds them for the entry's arrays (`digest`) and its own checksum holds."""
    path, key = where / "stats.json", f"{train[0]}:{train[1]}"
    cuts: dict = {}
    with contextlib.suppress(folder_entry.Damaged):
        known = folder_entry.read_json(path)
        if isinstance(known, dict) and isinstance(known.get("cuts"), dict) and known.get("digest") == digest \
                and known.get("sha256") == _checksum(known["cuts"]):
            cuts = known["cuts"]
    if not isinstance(cuts.get(key), dict):
        mean, std = stats(x_train, release=lambda: release_pages(x_train.__array_interface__["data"][0]))
        cuts[key] = {"mean": list(mean), "std": list(std)}
        with contextlib.suppress(UserError):  # a cache we cannot write to is only slower next time
            atomic.write_json(path, {"digest": digest, "cuts": cuts, "sha256": _checksum(cuts)})
    return cuts[key]["mean"], cuts[key]["std"]


def _checksum(cuts: object) -> str:
    return hashlib.sha256(json.dumps(cuts, sort_keys=True).encode()).hexdigest()


def skip_summary(skipped: list) -> str:
    """'N file(s) (how many for each reason; e.g. the first and its reason)'."""
    reasons = Counter(why.split(" (")[0] for _, why in skipped)
    first = f"{printable(skipped[0][0])}: {printable(skipped[0][1])}"
    return f"{len(skipped):,} file(s) ({'; '.join(f'{n:,} {why}' for why, n in reasons.most_common())}; e.g. {first})"
