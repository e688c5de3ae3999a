"""Parsers against files the tests write themselves: good ones, and every way they can be broken."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile
import tracemalloc
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from towerlab.data import readers
from towerlab.errors import UserError


def idx_bytes(arr: np.ndarray, magic: bytes | None = None, dims: tuple[int, ...] | None = None) -> bytes:
    dims = arr.shape if dims is None else dims
    magic = magic if magic is not None else bytes([0, 0, 8, len(dims)])
    return magic + struct.pack(f">{len(dims)}I", *dims) + arr.astype(np.uint8).tobytes()


def write(path, data: bytes, gz: bool = False):
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


@pytest.fixture
def digits():
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, (5, 28, 28), dtype=np.uint8), rng.integers(0, 10, 5).astype(np.uint8)


SMALL = 4 * 2**20  # a few read chunks: nothing near what the forged headers claim


def peak_bytes(fn) -> int:
    """Peak Python+numpy allocation while fn runs (numpy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


# ------------------------------------------------------------------------------------------------ IDX

@pytest.mark.parametrize("gz", [False, True])
def test_idx_images_and_labels_round_trip(tmp_path, digits, gz):
    images, labels = digits
    suffix = ".gz" if gz else ""
    x = readers.read_idx(write(tmp_path / f"img{suffix}", idx_bytes(images), gz))
    y = readers.read_idx(write(tmp_path / f"lab{suffix}", idx_bytes(labels), gz))
    assert x.shape == (5, 1, 28, 28) and x.dtype == np.uint8
    np.testing.assert_array_equal(x[:, 0], images)
    assert y.dtype == np.int64 and y.tolist() == labels.tolist()
    assert readers.idx_header(tmp_path / f"img{suffix}") == (5, 28, 28)


def test_idx_bad_magic_and_type(tmp_path, digits):
    images, _ = digits
    with pytest.raises(UserError, match="not an IDX") as err:
        readers.read_idx(write(tmp_path / "a", idx_bytes(images, magic=b"\x12\x34\x08\x03")))
    assert str(tmp_path / "a") in str(err.value)
    with pytest.raises(UserError, match="element type 0x0d"):
        readers.read_idx(write(tmp_path / "b", idx_bytes(images, magic=b"\x00\x00\x0d\x03")))
    with pytest.raises(UserError, match="not an IDX"):
        readers.read_idx(write(tmp_path / "c", b""))


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("extra", [-1, 1])
def test_idx_dimension_byte_count_mismatch(tmp_path, digits, gz, extra):
    images, _ = digits
    data = idx_bytes(images)
    data = data[:-1] if extra < 0 else data + b"\0"
    with pytest.raises(UserError, match=r"header \(5, 28, 28\) says 3920"):
        readers.read_idx(write(tmp_path / ("f.gz" if gz else "f"), data, gz))


def test_idx_truncated_gzip_names_the_file(tmp_path, digits):
    images, _ = digits
    blob = gzip.compress(idx_bytes(images))
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError, match="corrupt or truncated gzip") as err:
        readers.read_idx(path)
    assert str(path) in str(err.value)
    path.write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match="corrupt or truncated gzip"):
        readers.read_idx(path)


def test_idx_labels_out_of_range(tmp_path):
    with pytest.raises(UserError, match=r"labels range 0\.\.12"):
        readers.read_idx(write(tmp_path / "l", idx_bytes(np.array([0, 12, 3], np.uint8))))


def test_idx_huge_header_in_small_file_is_refused_without_allocating(tmp_path):
    # 2**31 items of one byte claimed by a 100-byte file
    raw = (bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**21, 32, 32)).ljust(100, b"\0")
    path = write(tmp_path / "huge", raw)
    assert peak_bytes(lambda: pytest.raises(UserError, readers.read_idx, path)) < SMALL
    # Within the hard cap but far beyond the (decompressed) stream: refused after reading only the stream.
    near_cap = (bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**20, 32, 64)).ljust(100, b"\0")
    gz_path = write(tmp_path / "huge.gz", near_cap, gz=True)
    with pytest.raises(UserError, match="holds 84 data bytes"):
        readers.read_idx(gz_path)
    assert peak_bytes(lambda: pytest.raises(UserError, readers.read_idx, gz_path)) < SMALL
    over_cap = bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**22, 32, 32)
    with pytest.raises(UserError, match="more than any dataset"):
        readers.read_idx(write(tmp_path / "over.gz", over_cap, gz=True))


def test_idx_gzip_bomb_stops_one_byte_past_the_header_size(tmp_path):
    bomb = bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + bytes(20 * 2**20)  # 20 MB of zeros, ~20 KB gzipped
    path = write(tmp_path / "bomb.gz", bomb, gz=True)
    assert path.stat().st_size < 100_000
    with pytest.raises(UserError, match="more than 10"):
        readers.read_idx(path)
    assert peak_bytes(lambda: pytest.raises(UserError, readers.read_idx, path)) < SMALL


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64))
def test_idx_random_bytes_only_ever_raise_user_error(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("fuzz") / "f"
    path.write_bytes(bytes([0, 0, 8, 1]) + blob)
    try:
        out = readers.read_idx(path)
    except UserError:
        return
    assert out.dtype == np.int64 and out.max() < 10


# ---------------------------------------------------------------------------------------------- CIFAR

def cifar_batch(n: int, seed: int) -> tuple[dict, np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = [int(v) for v in rng.integers(0, 10, n)]
    return ({b"batch_label": b"training batch", b"labels": labels, b"data": data,
             b"filenames": [b"img%d.png" % i for i in range(n)]}, data, labels)


def py2_cifar_pickle(data: np.ndarray, labels: list[int]) -> bytes:
    """Opcode for opcode what Python 2's cPickle wrote for the official batches (protocol 2,
    `str` for bytes, numpy.core module names), so the reader is checked against the real format."""
    def s(b: bytes) -> bytes:
        return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<I", len(b)) + b
    dtype = (b"cnumpy\ndtype\n" + s(b"u1") + b"K\x00K\x01\x87R"
             + b"(K\x03" + s(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb")
    array = (b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + s(b"b") + b"\x87R"
             + b"(K\x01M" + struct.pack("<H", data.shape[0]) + b"M" + struct.pack("<H", 3072) + b"\x86"
             + dtype + b"\x89" + s(data.tobytes()) + b"tb")
    label_list = b"](" + b"".join(b"K" + bytes([v]) for v in labels) + b"e"
    return b"\x80\x02}(" + s(b"data") + array + s(b"labels") + label_list + b"u."


def test_cifar_batch_layout_is_rgb_planes():
    batch, data, labels = cifar_batch(4, seed=0)
    x, y = readers.read_cifar_batch(pickle.dumps(batch, protocol=2), "b")
    assert x.shape == (4, 3, 32, 32) and x.dtype == np.uint8 and x.flags.writeable
    np.testing.assert_array_equal(x[2, 0], data[2, :1024].reshape(32, 32))  # R plane
    np.testing.assert_array_equal(x[2, 2], data[2, 2048:].reshape(32, 32))  # B plane
    assert y.dtype == np.int64 and y.tolist() == labels


def test_cifar_batch_in_python2_format():
    _, data, labels = cifar_batch(3, seed=5)
    x, y = readers.read_cifar_batch(py2_cifar_pickle(data, labels), "py2")
    np.testing.assert_array_equal(x.reshape(3, 3072), data)
    assert y.tolist() == labels


class _RunsShell:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_cifar_pickle_calling_os_system_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps({b"data": _RunsShell(f"touch {marker}"), b"labels": []}, protocol=2)
    with pytest.raises(UserError, match=r"refusing to unpickle (posix|os)\.system"):
        readers.read_cifar_batch(evil, "evil")
    assert not marker.exists()
    assert pickle.loads(evil) == {b"data": 0, b"labels": []} and marker.exists()  # the payload was real


def test_cifar_pickle_cannot_allocate_through_ndarray():
    # numpy.ndarray((10**9,)) called directly would allocate a gigabyte
    forged = b"\x80\x02cnumpy\nndarray\nJ" + struct.pack("<i", 10**9) + b"\x85\x85R."
    with pytest.raises(UserError, match="not a readable CIFAR-10 batch"):
        readers.read_cifar_batch(forged, "forged")
    forged = b"\x80\x02cnumpy._core.multiarray\n_reconstruct\ncnumpy\nndarray\nJ" + struct.pack("<i", 10**9) \
        + b"\x85U\x01b\x87R."
    with pytest.raises(UserError, match="unexpected array construction"):
        readers.read_cifar_batch(forged, "forged")


@pytest.mark.parametrize("change, message", [
    (lambda b: b.pop(b"labels"), "expected a dict"),
    (lambda b: b.update({b"data": b[b"data"][:, :100]}), r"expected uint8 \(N, 3072\)"),
    (lambda b: b.update({b"data": b[b"data"].astype(np.int16)}), "int16"),
    (lambda b: b[b"labels"].pop(), "labels of type"),
    (lambda b: b[b"labels"].__setitem__(0, 10), r"labels range 0\.\.10|range"),
    (lambda b: b[b"labels"].__setitem__(0, "cat"), "non-integers"),
])
def test_cifar_batch_validation(change, message):
    batch, _, _ = cifar_batch(4, seed=2)
    change(batch)
    with pytest.raises(UserError, match=message):
        readers.read_cifar_batch(pickle.dumps(batch, protocol=2), "b")


def test_cifar_batch_garbage_and_non_dict():
    with pytest.raises(UserError, match="not a readable CIFAR-10 batch"):
        readers.read_cifar_batch(b"\x80\x02garbage", "g")
    with pytest.raises(UserError, match="not a CIFAR-10 batch"):
        readers.read_cifar_batch(pickle.dumps([1, 2], protocol=2), "g")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_cifar_random_pickle_bytes_only_ever_raise_user_error(blob):
    with pytest.raises(UserError):
        readers.read_cifar_batch(b"\x80\x02" + blob, "fuzz")


def write_cifar(root, as_tar: bool, sizes=(3, 2, 2, 2, 1, 4)) -> tuple[object, list]:
    names = list(readers.CIFAR_TRAIN_BATCHES) + [readers.CIFAR_TEST_BATCH]
    batches = [cifar_batch(n, seed=i) for i, n in enumerate(sizes)]
    blobs = [pickle.dumps(b, protocol=2) for b, _, _ in batches]
    if not as_tar:
        folder = root / "cifar-10-batches-py"
        folder.mkdir()
        for name, blob in zip(names, blobs):
            (folder / name).write_bytes(blob)
        return folder, batches
    archive = root / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, blob in zip(names, blobs):
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return archive, batches


@pytest.mark.parametrize("as_tar", [False, True])
def test_read_cifar_folder_and_tar_keep_batch_order(tmp_path, as_tar):
    path, batches = write_cifar(tmp_path, as_tar)
    out = readers.read_cifar(path)
    assert out["x_train"].shape == (10, 3, 32, 32) and out["x_test"].shape == (4, 3, 32, 32)
    np.testing.assert_array_equal(out["x_train"].reshape(10, 3072), np.concatenate([d for _, d, _ in batches[:5]]))
    assert out["y_train"].tolist() == sum((lab for _, _, lab in batches[:5]), [])
    assert out["y_test"].tolist() == batches[5][2]
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing extracted


def test_read_cifar_refuses_missing_and_oversized_members(tmp_path, monkeypatch):
    folder, _ = write_cifar(tmp_path, as_tar=False)
    (folder / "data_batch_3").unlink()
    with pytest.raises(UserError, match="lacks data_batch_3"):
        readers.read_cifar(folder)
    (tmp_path / "t").mkdir()
    archive, _ = write_cifar(tmp_path / "t", as_tar=True)
    monkeypatch.setattr(readers, "MAX_CIFAR_MEMBER_BYTES", 1000)
    with pytest.raises(UserError, match="far larger than a CIFAR-10 batch"):
        readers.read_cifar(archive)


def test_read_cifar_corrupt_tar(tmp_path):
    archive, _ = write_cifar(tmp_path, as_tar=True)
    archive.write_bytes(archive.read_bytes()[:3000])
    with pytest.raises(UserError, match="cifar-10-python.tar.gz"):
        readers.read_cifar(archive)


# ------------------------------------------------------------------------------------------------ NPZ

def write_npz(path, **arrays):
    np.savez_compressed(path, **arrays)
    return path


def good_arrays(shape=(28, 28), n_train=6, n_test=4):
    rng = np.random.default_rng(3)
    return dict(x_train=rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
                y_train=rng.integers(0, 10, n_train).astype(np.uint8),
                x_test=rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
                y_test=rng.integers(0, 10, n_test).astype(np.int32))


def test_npz_grayscale(tmp_path):
    arrays = good_arrays()
    out = readers.read_npz(write_npz(tmp_path / "m.npz", **arrays))
    assert out["x_train"].shape == (6, 1, 28, 28) and out["x_test"].shape == (4, 1, 28, 28)
    np.testing.assert_array_equal(out["x_train"][:, 0], arrays["x_train"])
    assert out["y_test"].dtype == np.int64 and out["y_test"].tolist() == arrays["y_test"].tolist()


def test_npz_nhwc_colour_becomes_nchw_and_column_labels_flatten(tmp_path):
    arrays = good_arrays(shape=(32, 32, 3))
    arrays["y_train"] = arrays["y_train"].reshape(-1, 1).astype(np.int64)
    out = readers.read_npz(write_npz(tmp_path / "c.npz", **arrays), (3, 32, 32))
    assert out["x_train"].shape == (6, 3, 32, 32) and out["x_train"].flags.c_contiguous
    assert out["x_train"][4, 2, 7, 9] == arrays["x_train"][4, 7, 9, 2]
    assert out["y_train"].shape == (6,) and out["y_train"].tolist() == arrays["y_train"][:, 0].tolist()


def test_npz_hint_accepts_nchw_and_flat_and_refuses_other_shapes(tmp_path):
    arrays = good_arrays(shape=(3, 8, 8))
    out = readers.read_npz(write_npz(tmp_path / "a.npz", **arrays), (3, 8, 8))
    np.testing.assert_array_equal(out["x_test"], arrays["x_test"])
    flat = {**arrays, "x_train": arrays["x_train"].reshape(6, -1), "x_test": arrays["x_test"].reshape(4, -1)}
    np.testing.assert_array_equal(readers.read_npz(write_npz(tmp_path / "b.npz", **flat), (3, 8, 8))["x_train"],
                                  arrays["x_train"])
    with pytest.raises(UserError, match="expected images of 28x28 with 1 channel"):
        readers.read_npz(tmp_path / "a.npz", (1, 28, 28))


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop("y_test"), "has no array 'y_test'"),
    (lambda a: a.update(x_train=a["x_train"].astype(np.float32)), "x_train is float32, expected uint8"),
    (lambda a: a.update(y_train=a["y_train"].astype(np.float64)), "y_train is float64, expected integer"),
    (lambda a: a.update(y_train=a["y_train"][:5]), "x_train has 6 images but y_train has 5 labels"),
    (lambda a: a.update(y_test=np.array([0, 1, 2, 10])), r"labels range 0\.\.10"),
    (lambda a: a.update(x_test=a["x_test"][:, :20]), "train images are"),
    (lambda a: a.update(y_test=np.array([{"a": 1}] * 4, dtype=object)), "object array"),
])
def test_npz_validation(tmp_path, change, message):
    arrays = good_arrays()
    change(arrays)
    with pytest.raises(UserError, match=message):
        readers.read_npz(write_npz(tmp_path / "bad.npz", **arrays))


def test_npz_corrupt_and_not_a_zip(tmp_path):
    path = write_npz(tmp_path / "m.npz", **good_arrays())
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(UserError, match="not a readable .npz"):
        readers.read_npz(path)
    path.write_bytes(b"just text")
    with pytest.raises(UserError, match="not a readable .npz"):
        readers.read_npz(path)


def test_npz_corrupt_member_data(tmp_path):
    path = tmp_path / "m.npz"
    np.savez(path, **good_arrays())  # stored uncompressed, so flipping a byte hits the pixels
    blob = bytearray(path.read_bytes())
    blob[400] ^= 0xFF
    path.write_bytes(bytes(blob))
    with pytest.raises(UserError, match="corrupt"):
        readers.read_npz(path)


def test_npz_header_claiming_more_than_the_member_is_refused_without_allocating(tmp_path):
    path = tmp_path / "forged.npz"
    arrays = good_arrays()
    with zipfile.ZipFile(path, "w") as archive:
        for key, value in arrays.items():
            buf = io.BytesIO()
            if key == "x_train":  # claims 4 GB, holds 10 bytes
                np.lib.format.write_array_header_1_0(buf, {"descr": "|u1", "fortran_order": False,
                                                           "shape": (2**32,)})
                buf.write(bytes(10))
            else:
                np.lib.format.write_array(buf, value)
            archive.writestr(f"{key}.npy", buf.getvalue())
    assert peak_bytes(lambda: pytest.raises(UserError, readers.read_npz, path)) < SMALL
    with pytest.raises(UserError, match=r"header claims \(4294967296,\)"):
        readers.read_npz(path)
