"""Generated data: a learnable 10-class image set of any shape, made from a seed (the `synthetic` dataset).

numpy only: the tests and benchmarks make their tiny datasets with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from towerlab.checks import parse_shape
from towerlab.config import TrainConfig
from towerlab.data import readers
from towerlab.errors import UserError

NUM_CLASSES = 10


@dataclass(frozen=True)
class SyntheticOptions:
    """The synthetic set `load_dataset` generates: images of `shape` (C, H, W), `train` of them to train
    on (before the validation split, as for the real sets) and `test` to test on, drawn from `seed`."""

    shape: tuple[int, int, int] = (1, 28, 28)
    train: int = 6000
    test: int = 1000
    seed: int = 0

    @classmethod
    def of(cls, cfg: TrainConfig) -> SyntheticOptions:
        """The synthetic set a training config describes: --synthetic-shape and --synthetic-train, a sixth of
        that to test on. It is one fixed dataset (seed 0): the run's seed varies the training, not the data."""
        return cls(parse_shape(cfg.synthetic_shape), cfg.synthetic_train, max(1, cfg.synthetic_train // 6), 0)


def _upsample_matrix(n_out: int, n_in: int) -> np.ndarray:
    pos = np.linspace(0, n_in - 1, n_out)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, n_in - 1)
    weights = np.zeros((n_out, n_in))
    np.add.at(weights, (np.arange(n_out), lo), 1 - (pos - lo))
    np.add.at(weights, (np.arange(n_out), hi), pos - lo)
    return weights


def make_synthetic(shape: tuple[int, int, int] = (1, 28, 28), n_train: int = 6000, n_test: int = 1000,
                   seed: int = 0) -> dict[str, np.ndarray]:
    """A learnable 10-class image set, identical for identical arguments.

    Each image is its class's smooth random prototype, blended with up to 50% of another class's,
    shifted by up to 10% of the side, plus Gaussian noise (sigma 60 of 255). A nearest-class-mean
    classifier gets about 90%, so models learn it fast without it being trivially separable.
    """
    if len(shape) != 3 or not all(isinstance(d, int) and d > 0 for d in shape) or min(shape[1:]) < 4:
        raise UserError(f"synthetic shape must be (C, H, W) with H and W >= 4, got {shape}")
    if n_train < 1 or n_test < 1:
        raise UserError(f"synthetic sizes must be >= 1, got train {n_train}, test {n_test}")
    c, h, w = shape
    n = n_train + n_test
    if n * c * h * w > readers.MAX_ARRAY_BYTES:
        raise UserError(f"synthetic set of {n} x {shape} images is too large: ask for fewer or smaller images")
    rng = np.random.default_rng(seed)
    low = rng.uniform(size=(NUM_CLASSES, c, max(2, -(-h // 6)), max(2, -(-w // 6))))
    rows, cols = _upsample_matrix(h, low.shape[2]), _upsample_matrix(w, low.shape[3])
    protos = np.einsum("hi,kcij,wj->kchw", rows, low, cols)
    lo, hi = protos.min(axis=(1, 2, 3), keepdims=True), protos.max(axis=(1, 2, 3), keepdims=True)
    protos = (30 + 195 * (protos - lo) / np.maximum(hi - lo, 1e-9)).astype(np.float32)
    shift = max(1, round(min(h, w) * 0.1))
    padded = np.pad(protos, ((0, 0), (0, 0), (shift, shift), (shift, shift)), mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, (h, w), axis=(2, 3))  # (K, C, dy, dx, H, W)
    labels = rng.integers(0, NUM_CLASSES, n)
    other = (labels + rng.integers(1, NUM_CLASSES, n)) % NUM_CLASSES
    blend = rng.uniform(0.0, 0.5, n).astype(np.float32)[:, None, None, None]
    dy, dx, dy2, dx2 = rng.integers(0, 2 * shift + 1, (4, n))
    images = (1 - blend) * windows[labels, :, dy, dx] + blend * windows[other, :, dy2, dx2]
    images += rng.normal(0.0, 60.0, images.shape).astype(np.float32)
    x = np.clip(images, 0, 255).astype(np.uint8)
    return {"x_train": x[:n_train], "y_train": labels[:n_train], "x_test": x[n_train:], "y_test": labels[n_train:]}
