"""An image folder's cache entry: written once by pass 2 (every image decoded, on every core, into
uint8 arrays written aside and renamed into place whole), found again by its name; and the
stratified order that lets a test or validation split be cut from train/ as a contiguous block.

An entry is a folder holding x.npy (N, C, H, W uint8), y.npy (N, int64) and meta.json (classes,
size, the blocks of train/, val/ and test/, what could not be decoded and why, and the digest of its
arrays); stats.json beside them keeps the channel statistics of each training cut (`folders._stats`).
Its name is the folder's content key, the size and channels, and the decoder's key. An entry is trusted
only once checked (`open_entry`: what meta.json says, the arrays' shapes, labels and digest, read in
full), each time it is opened: one edited or damaged on disk is decoded again, with one line saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import shutil
import stat
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from towerlab import atomic
from towerlab.data import folder_decode
from towerlab.data.digest import entry_digest
from towerlab.data.folder_files import SPLITS, Listing
from towerlab.errors import UserError
from towerlab.report import SILENCE_SECONDS, discard_line, format_progress

VERSION = 2  # of the cache's layout: another version decodes again (the decoder is in the entry's name)
MAX_JSON = 64 * 2**20  # the largest meta.json or stats.json read (a folder's failed files are listed there)
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
        return np.load(path, mmap_mode="c", allow_pickle=False)
    except (OSError, ValueError) as err:  # truncated (shorter than its header says), or no .npy at all
        raise Damaged(f"its {path.name} cannot be read as the array it claims ({err})") from None


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


def _meta_of(entry: Path) -> dict:
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
        digest = entry_digest(np.load(tmp / "x.npy", mmap_mode="r"), np.load(tmp / "y.npy"))
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
        earlier = _meta_of(entry)
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
