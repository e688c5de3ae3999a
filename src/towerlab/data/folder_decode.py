"""Images as towerlab takes them: one file decoded to uint8 (C, H, W) by the resize rule (`decode`),
and a folder's files read in parallel on every core (`parallel`): numpy and Pillow only.

The rules, the same for training, evaluate and predict:

- Formats: JPEG, PNG, BMP, WebP and GIF (its first frame), whatever the file's extension says;
  anything else is not an image.
- Channels: 1 where every image of the folder is greyscale (Pillow modes 1, L, LA, I, I;16, F), else
  3: a grey image's value is copied into R, G and B, an alpha channel is dropped (the colour under it
  is kept, as Pillow's convert does), a palette image counts as colour.
- Size: an image is scaled (bilinear, keeping its aspect ratio) until it covers the target size,
  then cropped to it about its centre; an image of the target size is taken as it is, pixel for
  pixel. A JPEG is decoded at a reduced scale first where that still covers the target (Pillow's
  draft mode), which is much faster for photos and changes the result by less than a pixel's rounding.
- Orientation: an image is turned as the EXIF orientation tag in its header says (phones store photos
  sideways and tag them; Pillow's `ImageOps.exif_transpose`), before it is scaled, and its size is the
  turned one.
- A decompression bomb (more pixels than Pillow's limit, MAX_PIXELS) is not decoded.

What decodes an image (this module's source, Pillow's version and its codecs') is part of a cache entry's
name (`decoder_key`): another decoder's pixels land in another entry.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import io
import json
import multiprocessing
import os
import signal
import warnings
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import PIL
from PIL import Image, ImageOps, features

from towerlab.proof.package import module_digest

FORMATS = ("JPEG", "PNG", "BMP", "WEBP", "GIF")
MAX_PIXELS = 89_478_485  # Pillow's MAX_IMAGE_PIXELS: its limit against decompression bombs
GREY_MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"})
WHOLE_READ = 64 * 2**20  # files up to this size are read in one go; larger ones streamed
SERIAL_BELOW = 512  # fewer files than this are read in this process: starting workers would cost more
CHUNK = 256  # files a worker reads per task (the progress bar moves by tasks)


TURNED = frozenset({5, 6, 7, 8})  # EXIF orientations that swap an image's width and height
ORIENTATION = 0x0112  # the EXIF tag


class BadImage(Exception):
    """A file that cannot be decoded; its message says why, in a few words."""


def _open(source: Any) -> Image.Image:
    """`source` (a path or a file object) opened by Pillow, its pixels not yet decoded."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(source, formats=FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise BadImage(f"more pixels than Pillow's limit of {MAX_PIXELS:,} (a decompression bomb?)") from None
        except Exception as exc:  # noqa: BLE001 - whatever Pillow raises on a broken file is that file's fault
            raise BadImage(_reason(exc)) from None
    width, height = image.size
    if width * height > MAX_PIXELS:
        raise BadImage(f"{width}x{height} pixels, more than Pillow's limit of {MAX_PIXELS:,} (a decompression bomb?)")
    return image


def _reason(exc: Exception) -> str:
    if isinstance(exc, Image.UnidentifiedImageError):
        return "not a JPEG, PNG, BMP, WebP or GIF image"
    text = " ".join(str(exc).split())[:120]
    return f"corrupt or truncated ({text or type(exc).__name__})"


def is_grey(mode: str) -> bool:
    return mode in GREY_MODES


def _orientation(image: Image.Image) -> int:
    """The EXIF orientation (1 to 8) that the file's header carries (1: none, or one that cannot be read;
    a PNG whose EXIF follows its pixels is not decoded to find it)."""
    if "exif" not in image.info:
        return 1
    try:
        orientation = image.getexif().get(ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - a malformed EXIF block is a photo without an orientation, not a broken file
        return 1
    return orientation if isinstance(orientation, int) and 1 <= orientation <= 8 else 1


def shown_size(image: Image.Image) -> tuple[int, int]:
    """(width, height) of `image` as it is shown: turned by its EXIF orientation."""
    width, height = image.size
    return (height, width) if _orientation(image) in TURNED else (width, height)


def fitted(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`image` scaled to cover `size` (height, width), keeping its aspect ratio, and cropped to it about
    its centre; itself where it has that size already."""
    height, width = size
    w0, h0 = image.size
    if (h0, w0) == (height, width):
        return image
    scale = max(height / h0, width / w0)
    h1, w1 = max(height, round(h0 * scale)), max(width, round(w0 * scale))
    image = image.resize((w1, h1), Image.Resampling.BILINEAR)
    top, left = (h1 - height) // 2, (w1 - width) // 2
    return image.crop((left, top, left + width, top + height))


def _as_mode(image: Image.Image, channels: int) -> Image.Image:
    if image.mode.startswith("I;16"):  # 16-bit grey: its top 8 bits (Pillow's convert would clip at 255)
        image = Image.fromarray((np.asarray(image).astype(np.uint32) >> 8).astype(np.uint8))
    return image.convert("L" if channels == 1 else "RGB")


def decode(source: Any, size: tuple[int, int], channels: int) -> np.ndarray:
    """The image of `source` (a path, bytes or a file object) as uint8 (channels, height, width) by the
    module's rules; BadImage where it cannot be decoded."""
    with _open(io.BytesIO(source) if isinstance(source, bytes) else source) as image:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Pillow's notes on odd files (EXIF, palettes): the file decodes
                orientation = _orientation(image)
                if image.format == "JPEG":
                    w0, h0 = shown_size(image)
                    scale = max(size[0] / h0, size[1] / w0)
                    wanted = (max(1, round(w0 * scale)), max(1, round(h0 * scale)))
                    image.draft("L" if channels == 1 else "RGB", wanted[::-1] if orientation in TURNED else wanted)
                if orientation != 1:
                    image = ImageOps.exif_transpose(image)
                pixels = np.asarray(fitted(_as_mode(image, channels), size))
        except Exception as exc:  # noqa: BLE001 - a broken file is that file's fault
            raise BadImage(_reason(exc)) from None
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def _read(path: str, size: int) -> tuple[str, Any]:
    """(the file's SHA-256, what Pillow opens: its bytes, or its path when it is large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        if size <= WHOLE_READ:
            data = stream.read()
            digest.update(data)
            return digest.hexdigest(), data
        for block in iter(lambda: stream.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest(), path


def scan(items: Sequence[tuple[str, int]]) -> list[tuple[str, str, int, int, str]]:
    """Pass 1, for each (path, size): (its SHA-256 or "", its mode, height, width, why it cannot be
    read or ""): what the folder's content key, channel count and common size are made of."""
    out = []
    for path, size in items:
        try:
            digest, data = _read(path, size)
        except OSError as err:
            out.append(("", "", 0, 0, f"unreadable ({err.strerror or err})"))
            continue
        try:
            with _open(io.BytesIO(data) if isinstance(data, bytes) else data) as image:
                width, height = shown_size(image)
                out.append((digest, image.mode, height, width, ""))
        except BadImage as err:
            out.append((digest, "", 0, 0, str(err)))
    return out


def decode_many(paths: Sequence[str], size: tuple[int, int], channels: int) -> list[np.ndarray | str]:
    """Each file decoded (an array), or why it cannot be (a string)."""
    out: list[np.ndarray | str] = []
    for path in paths:
        try:
            out.append(decode(path, size, channels))
        except BadImage as err:
            out.append(str(err))
        except OSError as err:
            out.append(f"unreadable ({err.strerror or err})")
    return out


def decode_into(items: Sequence[tuple[int, str, str]], target: str, size: tuple[int, int],
                channels: int) -> tuple[list[tuple[int, str]], list[int]]:
    """Pass 2: each (position, path, the SHA-256 pass 1 read) decoded into row `position` of the .npy
    `target` (opened here, memory-mapped), from the bytes it reads now, and only where they are those
    pass 1 hashed: the cache's key names what it holds. Returns ((position, why) of those that cannot be
    decoded, the positions of files whose bytes changed since pass 1)."""
    images = np.load(target, mmap_mode="r+")
    failed, changed = [], []
    for position, path, expected in items:
        try:
            with open(path, "rb") as stream:
                data = stream.read()
        except OSError as err:
            failed.append((position, f"unreadable ({err.strerror or err})"))
            continue
        if hashlib.sha256(data).hexdigest() != expected:
            changed.append(position)
            continue
        try:
            images[position] = decode(data, size, channels)
        except BadImage as err:
            failed.append((position, str(err)))
    images.flush()
    return failed, changed


@functools.lru_cache(maxsize=1)
def decoder_key() -> str:
    """What decides the pixels a file decodes to, in 16 hexadecimal digits: this module's code as it runs
    (`towerlab.proof.package.module_digest`: the bytes it ran from, not its file now), Pillow's version and the
    versions of the codecs it was built with."""
    versions = {"pillow": PIL.__version__, **{name: features.version(name) for name in ("jpg", "zlib", "webp")}}
    digest = hashlib.sha256(module_digest(__name__).encode())
    digest.update(json.dumps(versions, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _quiet_worker() -> None:
    # Ctrl-C reaches the whole process group: the job's process stops the workers and cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def parallel(function: Callable[..., Any], items: Sequence, args: tuple = (), *,
             advance: Callable[[int], None] = lambda n: None) -> Iterable[tuple[Sequence, Any]]:
    """`function(chunk, *args)` over `items` in chunks, on every core (forked worker processes, where
    the system forks; spawned elsewhere), yielding (each chunk, its results) in order; `advance(n)`
    as chunks of n items finish. Few items are read here, in this process."""
    chunks = [items[i:i + CHUNK] for i in range(0, len(items), CHUNK)]
    workers = min(cores(), len(chunks))
    if len(items) < SERIAL_BELOW or workers < 2:
        for chunk in chunks:
            yield chunk, function(chunk, *args)
            advance(len(chunk))
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    # Pillow imports its format plugins on first use: done here, so that a forked worker imports
    # nothing (a module another thread of this process was importing when it forked stays locked there).
    Image.init()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(method),
                                                initializer=_quiet_worker) as pool:
        futures = [pool.submit(function, chunk, *args) for chunk in chunks]
        try:
            for chunk, future in zip(chunks, futures):
                yield chunk, future.result()
                advance(len(chunk))
        finally:
            for future in futures:
                future.cancel()
