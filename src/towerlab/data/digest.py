"""What identifies a dataset: one digest of the decoded arrays a training reads (`content_digest`), the only
content key there is. A search records it and compares a worker's before the worker trains (`towerlab.jobs.
identity`), a search's cache of fitnesses is keyed by it (`towerlab.objective.candidate.training_settings`), a run records
it so that its `--resume` notices other data, and `evaluate` shows a run's own figure only on data of the same
digest. Whatever form the files take (an .npz, the four IDX files, raw or gzipped) the same arrays have the
same digest, and one changed pixel or label changes it.

It is computed from the arrays in memory each time it is asked, never answered by a cache: a cache keyed by
a file's path, size and modification time answers for bytes it did not read (a same-size file with its time
put back, a home folder shared by machines, a file replaced between a read and a stat), and a digest of the
files would not see a reader or decoder that turns the same bytes into other arrays. An image folder's
decoded cache entry carries its own digest of its arrays (`entry_digest`), checked each time it is opened.

The digest: SHA-256 over a header (what the arrays are: counts, shape, types) and the SHA-256 of each
PIECE-byte piece of the images' bytes (train, validation and test, one after the other), then of the
labels', the pieces hashed on every core (threads: hashlib lets go of the interpreter while it hashes).
SHA-256 because it is the fastest cryptographic hash Python has where the processor has SHA instructions
(1.7 GB/s a core here, against BLAKE2b's 0.65), which the servers of a cluster have; a cryptographic one
because a digest that admits a worker must not be forged by a file made to collide (xxHash's can be). The
figures: bench/proof/data_digest.py. The validation split is the end of the training arrays, so `val_size` does
not change the digest.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from towerlab.data.folder_decode import cores
from towerlab.data.pages import release_pages

VERSION = 2  # of what the digest covers and how: another version is another digest
PIECE = 16 * 2**20  # bytes hashed as one piece, by one thread
WAVE = 4  # pieces per core hashed before a memory-mapped cache's pages are given back

Stream = Sequence[np.ndarray]


class Splits(Protocol):
    """What a digest reads of a dataset (`towerlab.data.load.Dataset`): its splits' images and labels."""

    @property
    def x_train(self) -> Any: ...
    @property
    def y_train(self) -> Any: ...
    @property
    def x_val(self) -> Any: ...
    @property
    def y_val(self) -> Any: ...
    @property
    def x_test(self) -> Any: ...
    @property
    def y_test(self) -> Any: ...


def content_digest(data: Splits) -> str:
    """`sha256:` and the digest of what `data` holds (see the module's docstring), from its arrays."""
    images = [_flat(t) for t in (data.x_train, data.x_val, data.x_test)]
    labels = [_flat(t) for t in (data.y_train, data.y_val, data.y_test)]
    header = {"version": VERSION, "train": len(data.x_train) + len(data.x_val), "test": len(data.x_test),
              "shape": [int(d) for d in data.x_train.shape[1:]], "images": str(data.x_train.dtype).removeprefix("torch."),
              "labels": str(data.y_train.dtype).removeprefix("torch.")}
    return arrays_digest(header, [images, labels], release=_releaser([a.__array_interface__["data"][0]
                                                                     for a in (*images, *labels)]))


def digest_as(data: Splits, recorded: Optional[str]) -> str:
    """`content_digest(data)`; or `recorded` (a digest a search holds) where that is not it but is what
    towerlab's first formula (before VERSION 2: one SHA-256 over a header and the arrays' bytes, which the
    searches of an older towerlab hold) gives of the same arrays: those are the search's data."""
    digest = content_digest(data)
    if recorded is None or recorded == digest or recorded != _first_formula(data):
        return digest
    return recorded


def _first_formula(data: Splits) -> str:
    """The digest of `data` as towerlab's first formula made it (searches of schema 5 before VERSION 2)."""
    header = {"train": [len(data.x_train) + len(data.x_val), *data.x_train.shape[1:]], "test": list(data.x_test.shape),
              "images": str(data.x_train.dtype), "labels": str(data.y_train.dtype)}
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for tensor in (data.x_train, data.x_val, data.y_train, data.y_val, data.x_test, data.y_test):
        digest.update(_flat(tensor).data)
    return f"sha256:{digest.hexdigest()}"


def entry_digest(x: np.ndarray, y: np.ndarray) -> str:
    """The digest an image folder's cache entry records of its arrays (x.npy, y.npy), and is checked by."""
    header = {"version": VERSION, "x": [*x.shape, str(x.dtype)], "y": [*y.shape, str(y.dtype)]}
    return arrays_digest(header, [[x], [y]], release=_releaser([a.__array_interface__["data"][0] for a in (x, y)]))


def arrays_digest(header: dict, streams: Sequence[Stream], release: Optional[Callable[[], object]] = None) -> str:
    """SHA-256 over `header` (as JSON) and, for each stream (arrays whose bytes follow one another), its
    length and the SHA-256 of each PIECE-byte piece of it; `release()` after each wave of pieces."""
    pieces = [(index, piece) for index, stream in enumerate(streams) for piece in _pieces(stream)]
    workers = max(1, min(cores(), len(pieces)))
    digests: list[bytes] = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for start in range(0, len(pieces), workers * WAVE):
            digests += pool.map(_piece_digest, [piece for _, piece in pieces[start:start + workers * WAVE]])
            if release is not None:
                release()
    top = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for index, stream in enumerate(streams):
        top.update(sum(a.nbytes for a in stream).to_bytes(8, "little"))
        top.update(b"".join(d for (i, _), d in zip(pieces, digests) if i == index))
    return f"sha256:{top.hexdigest()}"


def _releaser(addresses: list[int]) -> Callable[[], None]:
    """What gives back the pages of the memory-mapped caches (if any) that hold `addresses`."""
    def release() -> None:
        for address in addresses:
            release_pages(address)
    return release


def _flat(tensor: object) -> np.ndarray:
    """A tensor's (or array's) bytes as a flat uint8 array, without a copy where it lies on the CPU."""
    array = tensor.detach().cpu().contiguous().numpy() if hasattr(tensor, "detach") else np.ascontiguousarray(tensor)
    return array.reshape(-1).view(np.uint8)


def _pieces(stream: Stream) -> list[list[memoryview]]:
    """The PIECE-byte pieces of the stream's bytes (the last one shorter), each as the parts of its arrays."""
    flats = [a.reshape(-1).view(np.uint8).data for a in stream]
    pieces: list[list[memoryview]] = []
    current: list[memoryview] = []
    filled = 0
    for flat in flats:
        at = 0
        while at < len(flat):
            take = min(PIECE - filled, len(flat) - at)
            current.append(flat[at:at + take])
            at, filled = at + take, filled + take
            if filled == PIECE:
                pieces.append(current)
                current, filled = [], 0
    if current:
        pieces.append(current)
    return pieces


def _piece_digest(parts: list[memoryview]) -> bytes:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.digest()
