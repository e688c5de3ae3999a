"""Minibatches for one replica, in the three input modes of the seeds.

Every rank draws the same permutation of the training set from (seed + epoch) and takes
`perm[rank::world_size]`, cut to `steps_per_epoch * batch_size`. So 2 replicas with batch B see,
step for step, exactly the examples 1 replica with batch 2B sees.

- `resident`: the split is moved to the device once, as uint8; batches are gathered there.
- `feed`: the split stays on the host; each batch is gathered on the host and copied over (the
  seeds' "direct feed").
- `queue`: a background thread gathers the next batches into pinned host memory while the device
  works on the current one (the seeds' "batching" queue).

All three yield the same numbers: uint8 -> float, scaled and normalised on the device.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Sequence, Union

import torch

from towerlab.data.pages import release_pages
from towerlab.distributed.group import Context
from towerlab.models.preprocessing import Normalizer

PREFETCH = 4  # batches the queue mode keeps ready
# An epoch's augmentation salts (`Augmentation.salts`): ints for the eager step, a device tensor in the program.
Salts = Union[Sequence[int], torch.Tensor]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 steps), for per-step and per-rank streams."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
    return state >> 1


def _gather_pixels(images: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """out[k, :, i, j] = images[k, :, rows[k, i], cols[k, j]] as one `gather` (rows (n, h), cols (n, w))."""
    n, c = images.shape[:2]
    h, w = rows.shape[1], cols.shape[1]
    offsets = (rows[:, :, None] * images.shape[3] + cols[:, None, :]).view(n, 1, h * w)
    return images.reshape(n, c, -1).gather(2, offsets.expand(n, c, h * w)).view(n, c, h, w)


_WORD = 0x7FFFFFFF  # 31-bit words: every product below stays inside int64


def epoch_salt(seed: int, epoch: int | None) -> int:
    """The salt of `hashed_words` for (seed, epoch); `epoch=None`: one salt for every epoch."""
    return mix_seed(seed, -1 if epoch is None else epoch) & _WORD


def hashed_words(index: torch.Tensor, salt: int | torch.Tensor) -> torch.Tensor:
    """A pseudo-random 31-bit word per example index under `salt` (an int, or an int64 tensor on the
    device, which a captured step reads without knowing its value). An integer hash (two
    multiply-xorshift rounds): no generator state, so the draw does not depend on which replica holds
    the example, nor on what was drawn before."""
    x = (index.long() ^ salt) & _WORD
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B & _WORD
    return (x >> 16) ^ x


def crop_flip(x: torch.Tensor, index: torch.Tensor, salt: int | torch.Tensor, pad: int = 4) -> torch.Tensor:
    """Random crop after zero padding, and a random horizontal flip, on the device (uint8 in, uint8 out),
    drawn per example from its index: dy, dx in 0..2 pad and the flip from one word.

    One `gather` per batch: each output pixel's offset in its padded plane is computed from the
    example's shift and flip, so crop and flip cost a single pass over the images (no 4-way advanced
    indexing, no flipped copy and `where`)."""
    n, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    span = 2 * pad + 1
    word = hashed_words(index, salt)
    dy, dx, flip = word % span, (word // span) % span, ((word // (span * span)) & 1).bool()
    j = torch.arange(w, device=x.device)
    cols = dx[:, None] + torch.where(flip[:, None], (w - 1) - j, j)              # (n, w)
    rows = dy[:, None] + torch.arange(h, device=x.device)                        # (n, h)
    return _gather_pixels(padded, rows, cols)


def _reflect(position: torch.Tensor, size: int) -> torch.Tensor:
    """Indices outside 0..size-1 mirrored back inside (edge pixel not repeated, like pad 'reflect')."""
    position = position.abs()
    return torch.where(position > size - 1, 2 * (size - 1) - position, position)


def flip_translate(x: torch.Tensor, index: torch.Tensor, salts: Salts, shift: int) -> torch.Tensor:
    """airbench94's augmentation (K. Jordan, arXiv 2404.00498), on the device, uint8 in and out:
    each image is mirrored in alternate epochs (whether it starts mirrored is drawn once per example),
    then shifted by dy, dx in -shift..shift with reflected borders (drawn per example and epoch):
    out[i, j] = mirrored[reflect(i - dy), reflect(j - dx)]. `salts`: `Augmentation.salts(epoch)`.
    Every draw comes from the example's index in the training set, so the batch a replica gets is
    augmented exactly as in a single replica's batch, and a resumed epoch repeats its draws."""
    n, c, h, w = x.shape
    if not 0 <= shift < min(h, w):
        raise ValueError(f"shift {shift} must be below the image size {h}x{w}")
    fixed, salt, parity = salts[0], salts[1], salts[2]
    flip = ((hashed_words(index, fixed) & 1) ^ parity).bool()
    span = 2 * shift + 1
    word = hashed_words(index, salt)
    dy, dx = word % span - shift, (word // span) % span - shift
    i = torch.arange(h, device=x.device)
    j = torch.arange(w, device=x.device)
    rows = _reflect(i[None, :] - dy[:, None], h)
    cols = _reflect(j[None, :] - dx[:, None], w)
    cols = torch.where(flip[:, None], (w - 1) - cols, cols)
    return _gather_pixels(x, rows, cols)


class Augmentation:
    """--augment: crop+flip, or with --translate airbench94's flip+translate, each drawn per example
    from (seed, epoch, the example's index in the training set). `salts(epoch)` are the epoch's
    three numbers (a fixed salt, the epoch's salt, the epoch's parity): a list of ints for the eager
    step, copied into a device tensor at each epoch's start by the step program."""

    def __init__(self, seed: int, translate: int = 0):
        self.seed = seed
        self.translate = translate

    def salts(self, epoch: int) -> list[int]:
        return [epoch_salt(self.seed, None), epoch_salt(self.seed, epoch), epoch & 1]

    def __call__(self, x: torch.Tensor, index: torch.Tensor, salts: Salts) -> torch.Tensor:
        if self.translate:
            return flip_translate(x, index, salts, self.translate)
        return crop_flip(x, index, salts[1])


def steps_per_epoch(n: int, world_size: int, batch_size: int) -> int:
    """Each replica takes n // world_size examples an epoch, in whole batches."""
    return (n // world_size) // batch_size


class Batches:
    """This rank's minibatches of one split."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, ctx: Context, batch_size: int, seed: int,
                 mode: str, normalize: Normalizer, augment_images: bool = False, translate: int = 0):
        self.ctx = ctx
        self.batch_size = batch_size
        self.seed = seed
        self.mode = mode
        self.normalize = normalize
        self.n = x.shape[0]
        self.steps_per_epoch = steps_per_epoch(self.n, ctx.world_size, batch_size)
        on_device = mode == "resident"
        self.x = x.to(ctx.device) if on_device else x
        self.y = y.to(ctx.device) if on_device else y
        self.pin = ctx.device.type == "cuda" and mode == "queue"
        self.augmentation = Augmentation(seed, translate) if augment_images else None

    def indices(self, epoch: int) -> torch.Tensor:
        """This rank's example indices for `epoch`, identical on every run with the same seed."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.n, generator=g)
        mine = perm[self.ctx.rank::self.ctx.world_size][: self.steps_per_epoch * self.batch_size]
        return mine.to(self.x.device)

    def epoch(self, epoch: int, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches `start_step` .. end of `epoch` (a resumed epoch starts mid-way)."""
        idx = self.indices(epoch)
        steps = range(start_step, self.steps_per_epoch)
        chunks = [idx[s * self.batch_size:(s + 1) * self.batch_size] for s in steps]
        if self.mode == "queue":
            source = _prefetch(_gathered(self.x, self.y, chunks), self.pin)
        else:
            source = _gathered(self.x, self.y, chunks)
        salts = self.augmentation.salts(epoch) if self.augmentation is not None else None
        for i, (xb, yb) in zip(chunks, source):
            xb = xb.to(self.ctx.device, non_blocking=self.pin)
            yb = yb.to(self.ctx.device, non_blocking=self.pin)
            if self.augmentation is not None:
                xb = self.augmentation(xb, i.to(self.ctx.device, non_blocking=self.pin), salts)  # type: ignore[arg-type]  # set with it
            yield self.normalize(xb), yb


def _gathered(x: torch.Tensor, y: torch.Tensor, chunks: list[torch.Tensor]
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each chunk's examples gathered; from a memory-mapped cache (an image folder's), the pages a
    gather mapped in are given back at once, so that resident memory stays at a batch's."""
    for i in chunks:
        yield x[i], y[i]
        release_pages(x.data_ptr())
        release_pages(y.data_ptr())


def _prefetch(items: Iterator[tuple[torch.Tensor, torch.Tensor]], pin: bool
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Run `items` in a daemon thread, PREFETCH ahead, optionally into pinned memory."""
    ready: queue.Queue = queue.Queue(maxsize=PREFETCH)
    done = object()
    stop = threading.Event()

    def put(item: object) -> bool:
        # Give up once the consumer has gone, so an abandoned epoch never leaves a thread blocked.
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for xb, yb in items:
                if not put((xb.pin_memory(), yb.pin_memory()) if pin else (xb, yb)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, re-raised there
            put(exc)
            return
        put(done)

    thread = threading.Thread(target=produce, name="towerlab-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def eval_batches(x: torch.Tensor, y: torch.Tensor, ctx: Context, batch_size: int,
                 normalize: Normalizer) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard of an evaluation split (`rank::world_size`), in large batches."""
    xs, ys = x[ctx.rank::ctx.world_size], y[ctx.rank::ctx.world_size]
    for start in range(0, xs.shape[0], batch_size):
        xb = xs[start:start + batch_size].to(ctx.device)
        yield normalize(xb), ys[start:start + batch_size].to(ctx.device)
        release_pages(x.data_ptr())
        release_pages(y.data_ptr())
