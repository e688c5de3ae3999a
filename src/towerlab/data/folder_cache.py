"""An image folder's cache entry: written once by pass 2 (every image decoded, on every core, into
uint8 arrays written aside and renamed into place whole), found again by its name; and the
stratified order that lets a test or validation split be cut from train/ as a contiguous block.

An entry is a folder holding x.npy (N, C, H, W uint8), y.npy (N, int64) and meta.json (classes,
size, the blocks of train/, val/ and test/, what could not be decoded and why, and the digest of its
arrays); stats.json beside them keeps the channel statistics of each training cut (`folders._stats`).
Its name and its check each time it is opened are folder_entry.py's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from towerlab import atomic
from towerlab.data import folder_decode
from towerlab.data.digest import entry_digest
from towerlab.data.folder_entry import VERSION, expected_meta, meta_of, remove_entry
from towerlab.data.folder_files import SPLITS, Listing
from towerlab.data.pages import register
from towerlab.errors import UserError
from towerlab.report import SILENCE_SECONDS, discard_line, format_progress

SPACE_MARGIN = 64 * 2**20  # free space left on a disk after a decode's files
SPLIT_SEED = 0  # the stratified order's: one split for every run, seed and search worker

Log = Callable[[str], object]


@contextlib.contextmanager
def progress(log: Log, total: int, what: str) -> Iterator[Callable[[int], None]]:
    """Say `what` through `log`, then show a progress bar over `total` images on an interactive stderr
    (elsewhere, a progress line through `log` every SILENCE_SECONDS); nothing where `log` says nothing
    (the other processes of a job)."""
    if log is discard_line:
        yield lambda n: None
        return
    log(what)
    if sys.stderr.isatty():
        from tqdm import tqdm

        with tqdm(total=total, unit="image", file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
            yield bar.update
        return
    started = said = time.monotonic()
    done = 0

    def advance(n: int) -> None:
        nonlocal done, said
        done += n
        if time.monotonic() - said >= SILENCE_SECONDS:
            said = time.monotonic()
            log(format_progress(done, total, done / max(said - started, 1e-9), "image"))
    yield advance


def stratified_order(labels: np.ndarray, seed: int = SPLIT_SEED) -> np.ndarray:
    """A permutation of 0..len(labels)-1 each of whose suffixes holds every class in proportion, within
    one image: each class's images, shuffled, are spread evenly over the order (the k-th of n at
    (k + u) / n, u drawn once per class)."""
    rng = np.random.default_rng(seed)
    keys = np.zeros(len(labels))
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        keys[members] = (np.arange(len(members)) + rng.random()) / len(members)
    return np.argsort(keys, kind="stable")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One process at a time decodes a folder into a cache entry; the others wait, then read it."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def decode_folder(listing: Listing, content: str, file_digests: Sequence[str], where: Path, size: tuple[int, int],
                  channels: int, log: Log) -> dict:
    """Pass 2: every image decoded into `where` (x.npy, y.npy, meta.json with the arrays' digest), from the
    bytes whose SHA-256 pass 1 found (`file_digests`, in the listing's order) and only from those, written
    aside and renamed into place whole, so that no reader ever sees half a cache. The caller holds the
    entry's lock. The space it needs is checked first and reserved (a full disk is one line, never a
    bus error halfway), and what it leaves where it fails is removed, with the leftovers of a process
    killed while decoding this entry before."""
    started = time.perf_counter()
    files = listing.files
    labels = np.fromiter((f.label for f in files), np.int64, len(files))
    blocks = {split: listing.count(split) for split in SPLITS}
    stratified = not {"val", "test"} <= set(listing.splits)
    order = np.arange(len(files))
    if stratified:
        order[:blocks["train"]] = stratified_order(labels[:blocks["train"]])
    for leftover in where.parent.glob(f".{where.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    need = len(files) * channels * size[0] * size[1]
    check_space(where.parent, need + 8 * len(files))
    tmp = where.with_name(f".{where.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir()
        target = tmp / "x-all.npy"
        np.lib.format.open_memmap(target, "w+", np.uint8, (len(files), channels, *size)).flush()
        _reserve(target)
        base = os.path.join(str(listing.root), "")
        items = [(position, base + files[index].path, file_digests[index])
                 for position, index in enumerate(order.tolist())]
        failed: dict[int, str] = {}
        with progress(log, len(items), f"Decoding them into {size[0]}x{size[1]}x{channels} on "
                                        f"{min(folder_decode.cores(), len(items))} core(s)") as advance:
            for _, (part, changed) in folder_decode.parallel(folder_decode.decode_into, items,
                                                              (str(target), size, channels), advance=advance):
                if changed:
                    raise UserError(f"{listing.root / files[order[changed[0]]].path} changed while {listing.root} was "
                                    "being decoded: run again once nothing writes into the folder")
                failed.update(part)
        kept = np.array([p not in failed for p in range(len(files))], bool)
        _check_every_class(listing, order, kept, failed)
        _write_kept(target, tmp / "x.npy", kept)
        np.save(tmp / "y.npy", labels[order][kept])
        counts = {split: int(kept[lo:hi].sum()) for split, (lo, hi) in ranges(blocks).items()}
        written = np.load(tmp / "x.npy", mmap_mode="r")
        register(written)
        digest = entry_digest(written, np.load(tmp / "y.npy"))
        del written
        seconds = time.perf_counter() - started
        meta = {**expected_meta(listing, content, size, channels), "folder": str(listing.root),
                "blocks": counts, "stratified": stratified, "digest": digest,
                "failed": sorted([files[order[p]].path, why] for p, why in failed.items()),
                "decode_seconds": seconds, "cores": folder_decode.cores()}
        atomic.write_json(tmp / "meta.json", meta)
        try:
            tmp.rename(where)
        except OSError:  # another machine's process wrote it first (a cache on a shared file system)
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write the image cache entry {where} ({err.strerror or err}): free space in "
                        f"{where.parent}, or pass --data-dir DIR on a larger disk") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"Decoded {len(files) - len(failed):,} images in {seconds:.1f} s into {where}")
    forget_earlier(where, meta, log)
    return meta


def check_space(folder: Path, need: int) -> None:
    """Refuse, in one line, to write `need` bytes into `folder` where its disk has less free (with
    SPACE_MARGIN to spare) or the file-size limit (`ulimit -f`) is lower."""
    free = shutil.disk_usage(folder).free
    if free < need + SPACE_MARGIN:
        raise UserError(f"decoding the images needs {need / 2**20:,.1f} MiB in {folder}, whose disk has "
                        f"{free / 2**20:,.1f} MiB free: free space there, pass --data-dir DIR on a larger disk, "
                        "or a smaller --image-size")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and limit < need:
        raise UserError(f"decoding the images writes a file of {need / 2**20:,.1f} MiB, over this shell's file-size "
                        f"limit of {limit / 2**20:,.1f} MiB (ulimit -f): raise it, or pass a smaller --image-size")


def _reserve(path: Path) -> None:
    """The blocks of the .npy `path` (just made) reserved on the disk: writing its memory map then never
    meets a full disk (a bus error); a disk without room says so here, as an OSError."""
    with open(path, "r+b") as stream:
        os.posix_fallocate(stream.fileno(), 0, os.fstat(stream.fileno()).st_size)


def forget_earlier(where: Path, meta: dict, log: Log) -> None:
    """Remove the entries beside `where` (whose `meta` was just written) that hold an earlier content
    of its folder, or were written by another version of the cache (the same path, other images, or
    an older layout: an edited folder would otherwise leave a full copy of itself behind at each edit),
    whatever their size. An entry decoded from another path is kept, even of the same images, and so is
    one of another decoder (another towerlab may share the data folder)."""
    for entry in where.parent.iterdir():
        if entry == where or entry.name.startswith(".") or not entry.is_dir():
            continue
        earlier = meta_of(entry)
        if earlier.get("folder") != meta["folder"] or \
                (earlier.get("content") == meta["content"] and earlier.get("version") == VERSION):
            continue
        size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
        remove_entry(entry)
        with contextlib.suppress(OSError):
            entry.with_name(f"{entry.name}.lock").unlink()
        log(f"Removed {entry} ({size / 2**20:,.1f} MiB), the cache of an earlier content of {meta['folder']}")


def ranges(counts: dict[str, int]) -> dict[str, tuple[int, int]]:
    out, start = {}, 0
    for split in SPLITS:
        out[split] = (start, start + counts.get(split, 0))
        start += counts.get(split, 0)
    return out


def _check_every_class(listing: Listing, order: np.ndarray, kept: np.ndarray, failed: dict[int, str]) -> None:
    """A class folder none of whose images decodes is an error, as an empty one is: skipping it would
    change the classes."""
    files = listing.files
    alive = Counter((files[i].split, files[i].label) for i in order[kept])
    for position, why in failed.items():
        f = files[order[position]]
        if not alive[(f.split, f.label)]:
            where = f"{listing.prefixes[f.split]}{listing.classes[f.label]}"
            raise UserError(f"no image of class folder {where} can be decoded (e.g. {f.path}: {why}): fix or remove them")


def _write_kept(source: Path, target: Path, kept: np.ndarray) -> None:
    """`source`'s rows where `kept`, as the .npy `target` (a rename where every row is kept)."""
    if kept.all():
        source.rename(target)
        return
    rows = np.load(source, mmap_mode="r")
    check_space(target.parent, int(kept.sum()) * rows[0].nbytes)
    np.lib.format.open_memmap(target, "w+", np.uint8, (int(kept.sum()), *rows.shape[1:])).flush()
    _reserve(target)
    out = np.load(target, mmap_mode="r+")
    positions = np.flatnonzero(kept)
    step = max(1, 2**26 // max(1, rows[0].nbytes))  # 64 MB at a time
    for start in range(0, len(positions), step):
        chunk = positions[start:start + step]
        out[start:start + len(chunk)] = rows[chunk]
    out.flush()
    del out, rows
    source.unlink()
