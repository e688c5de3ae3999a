"""Image folders written for the tests: class folders of small images, and files that are bad in
each of the ways towerlab must survive."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

COLOURS = {"blue": (40, 40, 200), "green": (40, 200, 40), "red": (200, 40, 40)}


def coloured(rng: np.random.Generator, colour: tuple[int, int, int], size: tuple[int, int]) -> np.ndarray:
    """An (H, W, 3) uint8 image: noise about `colour`."""
    return np.clip(rng.normal(colour, 30, (*size, 3)), 0, 255).astype(np.uint8)


def colour_folder(root: Path, per_class: int = 20, size: tuple[int, int] = (12, 10), suffix: str = ".png",
                  seed: int = 0, classes: dict | None = None, grey: bool = False) -> Path:
    """`root`/<class>/NNN`suffix`: `per_class` noisy images of each class's colour (learnable at once);
    `grey`: greyscale files (of the colour's red)."""
    rng = np.random.default_rng(seed)
    for name, colour in (classes or COLOURS).items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = coloured(rng, colour, size)
            Image.fromarray(image[:, :, 0] if grey else image).save(root / name / f"{i:03d}{suffix}")
    return root


def split_folder(root: Path, splits: dict[str, int], **options) -> Path:
    """`root`/<split>/<class>/...: a colour folder per split (its count per class), seeded apart."""
    for k, (split, per_class) in enumerate(splits.items()):
        colour_folder(root / split, per_class, seed=k, **options)
    return root


def npz_as_folder(x: np.ndarray, y: np.ndarray, folder: Path, names: tuple[str, ...], start: int = 0) -> None:
    """Each image of `x` (N, H, W, C) as folder/<its class name>/<its index, 5 digits>.png."""
    for i, (image, label) in enumerate(zip(x, y)):
        (folder / names[int(label)]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image.squeeze()).save(folder / names[int(label)] / f"{start + i:05d}.png")


def png_bytes(width: int, height: int, rows: bytes, colour_type: int = 0) -> bytes:
    """A PNG file from its parts: what a decompression bomb (a huge size over few bytes) is made of."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def bomb(path: Path) -> Path:
    """A PNG that claims 20,000 x 20,000 pixels (400 M, over Pillow's limit) in a few hundred bytes."""
    path.write_bytes(png_bytes(20000, 20000, b"\x00" * 20001 * 4))
    return path
