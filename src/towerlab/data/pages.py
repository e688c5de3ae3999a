"""The memory-mapped image caches of this process and their resident pages: a training over a cache
larger than memory (and a digest read through one) gives back, after each batch or piece, the pages it
mapped in (`release_pages`), so its resident memory stays at what the batch needs. numpy only."""

from __future__ import annotations

import mmap
import weakref

import numpy as np

_MAPPED: list[tuple[int, int, weakref.ref]] = []


def register(array: np.ndarray) -> None:
    """`array` (an np.memmap) is one whose pages `release_pages` may give back."""
    _MAPPED[:] = [entry for entry in _MAPPED if entry[2]() is not None]
    start = array.__array_interface__["data"][0]
    _MAPPED.append((start, start + array.nbytes, weakref.ref(array)))


def release_pages(address: int) -> None:
    """Unmap from this process the pages of the memory-mapped cache that holds `address` (a tensor's
    data_ptr()): they stay in the system's page cache, and a later read maps them in again. Called
    after each batch is gathered, so a training's resident memory stays at what its batches need
    however large the cache is; nothing for memory that is not a cache's."""
    for start, end, ref in _MAPPED:
        array = ref()
        if array is not None and start <= address < end:
            getattr(array, "_mmap").madvise(mmap.MADV_DONTNEED)  # np.memmap keeps its mmap there
            return
