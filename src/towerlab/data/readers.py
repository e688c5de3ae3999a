"""Parsers of dataset files: MNIST/Fashion-MNIST IDX, CIFAR-10 python batches, Keras-style .npz.

numpy only (no torch), so the parsers can be tested and reused on their own. Images come back as
uint8 (N, C, H, W), labels as int64 (N,) with values 0..9 (or below the class count asked for).

Every input is treated as untrusted: a size claimed by a header is checked against what the file can
hold before anything is allocated, CIFAR pickles may only rebuild plain numeric arrays
(`towerlab.data.cifar_pickle`), and every malformed file becomes a one-line `UserError` naming the file.
The three formats share those bounds (MAX_ARRAY_BYTES, the label and image-layout checks) and are fuzzed
as one surface (tests/test_fuzz_readers.py).
"""

from __future__ import annotations

import gzip
import io
import math
import os
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath
from typing import IO

import numpy as np

from towerlab.atomic import require_regular_file
from towerlab.data.cifar_pickle import load_batch
from towerlab.errors import UserError

NUM_CLASSES = 10
# No array we read is near this (CIFAR-10 train is 150 MiB); it bounds what a forged header can make us hold.
MAX_ARRAY_BYTES = 2**31
# A real CIFAR-10 batch pickle is ~31 MB.
MAX_CIFAR_MEMBER_BYTES = 64 * 2**20
# The four files of an IDX dataset (the MNIST family), each raw or with .gz appended.
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CIFAR_TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST_BATCH = "test_batch"
_CHUNK = 1 << 20
_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)

def _one_line(err: BaseException) -> str:
    """An error's text on one line (tarfile and zipfile list their attempts on several)."""
    return " ".join(str(err).split())


# ----------------------------------------------------------------------------------------------- IDX

def read_idx(path: str | os.PathLike, num_classes: int = NUM_CLASSES) -> np.ndarray:
    """Read an IDX file (raw, or gzipped when the name ends in .gz).

    Image files (magic 0x00000803) give uint8 (N, 1, H, W); label files (0x00000801) give int64 (N,),
    checked to lie in 0..num_classes-1.
    """
    path = Path(path)
    require_regular_file(path)
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as stream:
                return _parse_idx(stream, path, None, num_classes)
        with open(path, "rb") as stream:
            return _parse_idx(stream, path, os.fstat(stream.fileno()).st_size, num_classes)
    except _GZIP_ERRORS as err:
        raise _corrupt_gzip(path, err) from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None


def idx_header(path: str | os.PathLike) -> tuple[int, ...]:
    """The dimensions an IDX file declares, after the cheap checks (magic, type; size for raw files)."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as stream:
            size = None if path.suffix == ".gz" else os.fstat(stream.fileno()).st_size
            return _idx_dims(stream, path, size)
    except _GZIP_ERRORS as err:
        raise _corrupt_gzip(path, err) from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None


def _corrupt_gzip(path: Path, err: Exception) -> UserError:
    return UserError(f"{path} is a corrupt or truncated gzip file ({_one_line(err)}): "
                     "delete it and download it again")


def _idx_dims(stream: io.BufferedIOBase, path: Path, file_size: int | None) -> tuple[int, ...]:
    magic = stream.read(4)
    if len(magic) < 4 or magic[:2] != b"\0\0" or magic[3] not in (1, 3):
        raise UserError(f"{path} is not an IDX label or image file (magic {magic.hex() or 'missing'}, "
                        "expected 00000801 or 00000803): replace it with the official file")
    if magic[2] != 0x08:
        raise UserError(f"{path}: IDX element type 0x{magic[2]:02x} is not supported (only 0x08, unsigned bytes)")
    ndim = magic[3]
    raw_dims = stream.read(4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise UserError(f"{path} is truncated inside its header: replace it with the official file")
    dims = struct.unpack(f">{ndim}I", raw_dims)
    if 0 in dims:
        raise UserError(f"{path} declares an empty array {dims}: replace it with the official file")
    n_bytes = math.prod(dims)
    # Labels come back as int64: 8 bytes held per byte read, so they are capped 8 times lower.
    held = n_bytes * (8 if ndim == 1 else 1)
    if held > MAX_ARRAY_BYTES:
        raise UserError(f"{path} declares {dims} = {n_bytes} bytes, more than any dataset here: "
                        "the header is corrupt")
    if file_size is not None and file_size != 4 + 4 * ndim + n_bytes:
        raise UserError(f"{path} holds {file_size - 4 - 4 * ndim} data bytes but its header {dims} says "
                        f"{n_bytes}: the file is truncated or corrupt, replace it")
    return dims


def _parse_idx(stream: io.BufferedIOBase, path: Path, file_size: int | None, num_classes: int) -> np.ndarray:
    dims = _idx_dims(stream, path, file_size)
    n_bytes = math.prod(dims)
    # Grow with what actually arrives instead of trusting the header, and stop one byte past it:
    # a gzip bomb or a short stream is then detected with at most header-size bytes held.
    body = bytearray()
    while len(body) <= n_bytes:
        chunk = stream.read(min(_CHUNK, n_bytes + 1 - len(body)))
        if not chunk:
            break
        body += chunk
    if len(body) != n_bytes:
        held = f"more than {n_bytes}" if len(body) > n_bytes else str(len(body))
        raise UserError(f"{path} holds {held} data bytes but its header {dims} says {n_bytes}: "
                        "the file is truncated or corrupt, replace it")
    flat = np.frombuffer(body, dtype=np.uint8)
    if len(dims) == 1:
        return _check_labels(flat, str(path), num_classes).astype(np.int64)  # checked before the 8x wider copy
    return flat.reshape(dims[0], 1, dims[1], dims[2])


def _check_labels(labels: np.ndarray, where: str, num_classes: int = NUM_CLASSES) -> np.ndarray:
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise UserError(f"{where}: labels range {labels.min()}..{labels.max()}, expected 0..{num_classes - 1}")
    return labels


# --------------------------------------------------------------------------------------------- CIFAR

def read_cifar_batch(data: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse one CIFAR-10 python batch: uint8 (N, 3, 32, 32) images (RGB planes) and int64 (N,) labels."""
    batch = load_batch(data, name)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise UserError(f"{name} is not a CIFAR-10 batch (expected a dict with b'data' and b'labels'): "
                        "use the 'python version' files")
    images, labels = batch[b"data"], batch[b"labels"]
    if not (isinstance(images, np.ndarray) and images.dtype == np.uint8 and images.shape[1:] == (3072,)):
        got = f"{images.dtype} {images.shape}" if isinstance(images, np.ndarray) else type(images).__name__
        raise UserError(f"{name}: b'data' is {got}, expected uint8 (N, 3072)")
    if isinstance(labels, list) and not all(type(v) is int for v in labels):
        raise UserError(f"{name}: b'labels' holds non-integers")
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.dtype.kind not in "iu" or len(labels) != len(images):
        raise UserError(f"{name}: {labels.shape} labels of type {labels.dtype} for {len(images)} images, "
                        "expected one integer per image")
    x = np.array(images.reshape(-1, 3, 32, 32), copy=True)  # own, writable memory, not the pickle's buffer
    return x, _check_labels(labels.astype(np.int64), name)


def read_cifar(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read CIFAR-10 from the `cifar-10-batches-py/` folder or `cifar-10-python.tar.gz` (read in memory)."""
    path = Path(path)
    wanted = CIFAR_TRAIN_BATCHES + (CIFAR_TEST_BATCH,)
    blobs = _cifar_blobs_from_dir(path, wanted) if path.is_dir() else _cifar_blobs_from_tar(path, wanted)
    missing = [n for n in wanted if n not in blobs]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: use the complete official CIFAR-10 python archive")
    train = [read_cifar_batch(blobs.pop(n), f"{path}:{n}") for n in CIFAR_TRAIN_BATCHES]
    x_test, y_test = read_cifar_batch(blobs.pop(CIFAR_TEST_BATCH), f"{path}:{CIFAR_TEST_BATCH}")
    return {"x_train": np.concatenate([x for x, _ in train]), "y_train": np.concatenate([y for _, y in train]),
            "x_test": x_test, "y_test": y_test}


def _cifar_blobs_from_dir(folder: Path, wanted: tuple[str, ...]) -> dict[str, bytes]:
    blobs = {}
    for name in wanted:
        file = folder / name
        if not file.is_file():
            continue
        if file.stat().st_size > MAX_CIFAR_MEMBER_BYTES:
            raise UserError(f"{file} is {file.stat().st_size} bytes, far larger than a CIFAR-10 batch: replace it")
        try:
            blobs[name] = file.read_bytes()
        except OSError as err:
            raise UserError(f"cannot read {file}: {err.strerror or err}") from None
    return blobs


def _cifar_blobs_from_tar(archive: Path, wanted: tuple[str, ...]) -> dict[str, bytes]:
    blobs = {}
    require_regular_file(archive)
    try:
        with tarfile.open(archive, mode="r:*") as tar:
            for member in tar:  # streamed: never extracted to disk
                base = PurePosixPath(member.name).name
                if base not in wanted or base in blobs or not member.isfile():
                    continue
                if member.size > MAX_CIFAR_MEMBER_BYTES:
                    raise UserError(f"{archive}: member {member.name} is {member.size} bytes, far larger than "
                                    "a CIFAR-10 batch: use the official archive")
                blobs[base] = tar.extractfile(member).read()  # type: ignore[union-attr]  # a file (isfile): never None
    except (tarfile.TarError, *_GZIP_ERRORS) as err:
        raise UserError(f"{archive} is not a readable tar archive ({_one_line(err)}): "
                        "delete it and download it again") from None
    except OSError as err:
        raise UserError(f"cannot read {archive}: {err.strerror or err}") from None
    return blobs


# ----------------------------------------------------------------------------------------------- NPZ

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


def npz_summary(path: str | os.PathLike, keys: tuple[str, ...] = NPZ_KEYS,
                *, required: bool = True) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of each array of `keys` (every one, or with `required=False` those present),
    from the zip directory and .npy headers alone.

    Refuses missing keys, object arrays, and headers claiming more data than their zip member holds.
    """
    path = Path(path)
    require_regular_file(path)
    summary = {}
    try:
        with zipfile.ZipFile(path) as archive:
            for key in keys:
                try:
                    info = archive.getinfo(key + ".npy")
                except KeyError:
                    if not required:
                        continue
                    raise UserError(f"{path} has no array '{key}' (it needs {', '.join(keys)})") from None
                with archive.open(info) as member:
                    summary[key] = _npy_header(member, info.file_size, f"{path}:{key}")
    except (zipfile.BadZipFile, *_GZIP_ERRORS) as err:
        raise UserError(f"{path} is not a readable .npz (zip) file ({_one_line(err)}): replace it") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    return summary


def _npy_header(member: IO[bytes], member_size: int, where: str) -> tuple[tuple[int, ...], np.dtype]:
    try:
        version = np.lib.format.read_magic(member)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(member)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(member)
        else:
            raise UserError(f"{where}: .npy format version {version} is not supported: save with numpy.savez")
    except ValueError as err:
        raise UserError(f"{where} is not a valid .npy array ({_one_line(err)}): replace the file") from None
    if dtype.hasobject:
        raise UserError(f"{where} is an object array (pickled Python objects), which is refused: "
                        "save plain integer arrays")
    n_bytes = math.prod(shape) * dtype.itemsize
    if n_bytes > MAX_ARRAY_BYTES or member.tell() + n_bytes != member_size:
        raise UserError(f"{where}: header claims {shape} {dtype} ({n_bytes} bytes) but the zip member holds "
                        f"{member_size - member.tell()} data bytes: the file is corrupt, replace it")
    return shape, dtype


def read_npz(path: str | os.PathLike, image_shape_hint: tuple[int, int, int] | None = None,
             num_classes: int = NUM_CLASSES) -> dict[str, np.ndarray]:
    """Read a Keras-layout .npz: x_train/x_test uint8 (N,H,W) or (N,H,W,C); y_* integers (N,) or (N,1).

    `image_shape_hint` is the expected (C, H, W). With it, images may also be stored NCHW or flat
    (N, C*H*W), and any other shape is refused; without it, the Keras layouts above are assumed and
    C must be 1 to 4. Labels must lie in 0..num_classes-1.
    """
    path = Path(path)
    raw = npz_arrays(path)
    out = {}
    for split in ("train", "test"):
        x = images_as_nchw(raw[f"x_{split}"], f"{path}:x_{split}", image_shape_hint)
        y = labels_as_int64(raw[f"y_{split}"], f"{path}:y_{split}", num_classes)
        if len(x) != len(y):
            raise UserError(f"{path}: x_{split} has {len(x)} images but y_{split} has {len(y)} labels")
        out[f"x_{split}"], out[f"y_{split}"] = x, y
    if out["x_train"].shape[1:] != out["x_test"].shape[1:]:
        raise UserError(f"{path}: train images are {out['x_train'].shape[1:]} but test images are "
                        f"{out['x_test'].shape[1:]}")
    return out


def npz_arrays(path: str | os.PathLike, keys: tuple[str, ...] = NPZ_KEYS,
               *, required: bool = True) -> dict[str, np.ndarray]:
    """The arrays `keys` of an .npz (every one, or with `required=False` those present), each size
    vouched for by `npz_summary` before np.load allocates from the headers."""
    present = npz_summary(path, keys, required=required)
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in present}
    except (zipfile.BadZipFile, ValueError, *_GZIP_ERRORS) as err:
        raise UserError(f"{path} is corrupt ({type(err).__name__}: {_one_line(err)}): replace it") from None
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None


def images_as_nchw(x: np.ndarray, where: str, hint: tuple[int, int, int] | None) -> np.ndarray:
    """uint8 images as (N, C, H, W), from Keras's (N, H, W) or (N, H, W, C); with `hint` (C, H, W),
    also from (N, C, H, W) or flat (N, C*H*W), and refused in any other shape."""
    if x.dtype != np.uint8:
        raise UserError(f"{where} is {x.dtype}, expected uint8 pixels 0-255")
    if x.ndim == 0 or len(x) == 0:
        raise UserError(f"{where} holds no images")
    if hint is None:
        if x.ndim == 3 and min(x.shape[1:]) >= 1:
            return x[:, None]
        if x.ndim == 4 and 1 <= x.shape[3] <= 4 and min(x.shape[1:3]) >= 1:
            return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        raise UserError(f"{where} has shape {x.shape}, expected (N, H, W) or (N, H, W, C) with C of 1 to 4 "
                        "(channels last, as Keras stores them)")
    c, h, w = hint
    rest = x.shape[1:]
    if rest == (h, w, c):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    if rest == (c, h, w):
        return x
    if (c == 1 and rest == (h, w)) or rest == (c * h * w,):
        return x.reshape(len(x), c, h, w)
    raise UserError(f"{where} has shape {x.shape}, expected images of {h}x{w} with {c} channel(s) "
                    f"such as (N, {h}, {w}{', ' + str(c) if c != 1 else ''}): is this the right dataset?")


def labels_as_int64(y: np.ndarray, where: str, num_classes: int) -> np.ndarray:
    """Integer class labels (N,) or (N, 1), checked to lie in 0..num_classes-1, as int64 (N,)."""
    if y.dtype.kind not in "iu":
        raise UserError(f"{where} is {y.dtype}, expected integer class labels")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise UserError(f"{where} has shape {y.shape}, expected (N,) or (N, 1)")
    return _check_labels(y.astype(np.int64), where, num_classes)
