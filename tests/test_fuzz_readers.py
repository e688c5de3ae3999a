"""Hostile input, property-based: byte-level mutations (flip, truncate, insert, delete, overwrite)
of valid files, for every reader of untrusted files. The contract of each reader: it returns valid
arrays (or a valid record), or raises `UserError` with a one-line message; nothing else (no other
exception type, no hang, no allocation the file's size does not justify), and nothing from a file
is ever executed.

Each test writes one small valid file, checks that it parses, then lets hypothesis mutate it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import resource
import struct
import tarfile
import tracemalloc
import zipfile
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from towerlab.training import checkpoint
from towerlab.data import readers
from towerlab.cli import main
from towerlab.errors import UserError
from towerlab.models import build_model
from towerlab.models.files import load_model, model_record
from towerlab.search import load_space

# Bounded: a few hundred milliseconds per reader and the suite stays quick. A single example that
# takes 10 s is a hang as far as we are concerned.
FUZZ = settings(max_examples=150, deadline=timedelta(seconds=10), derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# Peak traced allocation allowed for one parse: a fixed allowance plus a multiple of the file size.
ALLOWANCE = 8 * 2**20


# ------------------------------------------------------------------------------------- mutations

@st.composite
def mutations(draw, original: bytes, header: int = 64) -> bytes:
    """1-4 edits of `original`; half of the positions fall in its first `header` bytes, where the
    sizes and magic numbers live."""
    data = bytearray(original)

    def position(extra: int = 0) -> int:
        limit = len(data) + extra
        if limit <= 0:
            return 0
        return draw(st.integers(0, min(header, limit) - 1 if draw(st.booleans()) else limit - 1))

    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite", "big"]))
        if op == "flip" and data:
            data[position()] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[position(1):]
        elif op == "insert":
            at = position(1)
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and data:
            at = position()
            del data[at:at + draw(st.integers(1, 16))]
        elif op == "overwrite" and data:
            at = position()
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[at:at + len(chunk)] = chunk
        elif op == "big" and len(data) >= 4:
            # a size field claiming something huge (billions of items)
            at = min(position(), len(data) - 4)
            data[at:at + 4] = struct.pack(">I", draw(st.sampled_from([2**31 - 1, 2**32 - 1, 2**30, 10**9, 2**24])))
    return bytes(data)


def traced_peak(fn):
    """(fn's result or the exception it raised, peak traced bytes); numpy reports its buffers to tracemalloc."""
    tracemalloc.start()
    try:
        try:
            return fn(), tracemalloc.get_traced_memory()[1]
        except Exception as exc:  # noqa: BLE001 - the caller checks the type
            return exc, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def only_user_error(outcome) -> bool:
    """True when the parse failed the way it must: a UserError with a one-line message."""
    if isinstance(outcome, UserError):
        assert "\n" not in str(outcome) and str(outcome), repr(outcome)
        return True
    if isinstance(outcome, BaseException):
        raise AssertionError(f"{type(outcome).__name__} escaped instead of UserError: {outcome}") from outcome
    return False


def check_images(x: np.ndarray, channels: int | None = None) -> None:
    assert isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 4 and len(x) > 0
    if channels is not None:
        assert x.shape[1] == channels


def check_labels(y: np.ndarray, n: int | None = None) -> None:
    assert isinstance(y, np.ndarray) and y.dtype == np.int64 and y.ndim == 1
    assert y.size == 0 or (y.min() >= 0 and y.max() < readers.NUM_CLASSES)
    if n is not None:
        assert len(y) == n


def scratch(tmp_path_factory, name: str) -> Path:
    return tmp_path_factory.mktemp("fuzz") / name


COUNTED: dict[str, int] = {}  # reader -> examples run (printed by the last test, for the record)


def count(reader: str) -> None:
    COUNTED[reader] = COUNTED.get(reader, 0) + 1


# ------------------------------------------------------------------------------------------- IDX

RNG = np.random.default_rng(5)
IMAGES = RNG.integers(0, 256, (6, 28, 28), dtype=np.uint8)
LABELS = RNG.integers(0, 10, 6).astype(np.uint8)


def idx_bytes(arr: np.ndarray) -> bytes:
    return bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()


IDX_IMAGES, IDX_LABELS = idx_bytes(IMAGES), idx_bytes(LABELS)


def parse_idx(path: Path):
    out = readers.read_idx(path)
    if out.ndim == 1:
        check_labels(out)
    else:
        check_images(out, channels=1)
    return out


@pytest.mark.parametrize("original", [IDX_IMAGES, IDX_LABELS], ids=["images", "labels"])
@FUZZ
@given(data=st.data())
def test_fuzz_idx_raw(tmp_path_factory, original, data):
    blob = data.draw(mutations(original, header=20))
    path = scratch(tmp_path_factory, "f-ubyte")
    path.write_bytes(blob)
    outcome, peak = traced_peak(lambda: parse_idx(path))
    count("read_idx (raw)")
    only_user_error(outcome)
    assert peak < ALLOWANCE + 16 * len(blob)


@pytest.mark.parametrize("layer", ["inside", "outside"])
@FUZZ
@given(data=st.data())
def test_fuzz_idx_gzip(tmp_path_factory, layer, data):
    # inside: the IDX content is mutated, then compressed; outside: the gzip stream itself is mutated
    # (truncated, flipped CRC, garbage after the end...).
    if layer == "inside":
        blob = gzip.compress(data.draw(mutations(IDX_IMAGES, header=20)), mtime=0)
    else:
        blob = data.draw(mutations(gzip.compress(IDX_LABELS, mtime=0), header=24))
    path = scratch(tmp_path_factory, "f-ubyte.gz")
    path.write_bytes(blob)
    outcome, peak = traced_peak(lambda: parse_idx(path))
    count("read_idx (gzip)")
    only_user_error(outcome)
    header, _ = traced_peak(lambda: readers.idx_header(path))
    count("idx_header")
    assert only_user_error(header) or isinstance(header, tuple)
    # A gzip stream may legitimately expand ~1000x; the cap is what the decompressed data holds.
    assert peak < ALLOWANCE + 16 * 1100 * len(blob)


def test_idx_header_claiming_billions_of_items_allocates_nothing(tmp_path):
    """4 billion images in a 1 KB file, raw and gzipped, 2**31 labels, and 2**27 within the cap:
    refused, holding one read chunk at most."""
    for name, header in [("img", bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**32 - 1, 28, 28)),
                         ("lab", bytes([0, 0, 8, 1]) + struct.pack(">I", 2**31 - 1)),
                         ("near", bytes([0, 0, 8, 1]) + struct.pack(">I", 2**27))]:  # within the cap
        for gz in (False, True):
            body = header + bytes(1024)
            path = tmp_path / (name + (".gz" if gz else ""))
            path.write_bytes(gzip.compress(body) if gz else body)
            outcome, peak = traced_peak(lambda: readers.read_idx(path))
            assert isinstance(outcome, UserError), outcome
            assert peak < 4 * 2**20, (name, gz, peak)  # one 1 MiB read chunk, against 1 GB to 3 TB claimed


# ----------------------------------------------------------------------------------------- CIFAR

def cifar_pickle(n: int = 3, protocol: int = 2) -> bytes:
    rng = np.random.default_rng(n)
    batch = {b"batch_label": b"training batch 1 of 5", b"labels": [int(v) for v in rng.integers(0, 10, n)],
             b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
             b"filenames": [b"img%d.png" % i for i in range(n)]}
    return pickle.dumps(batch, protocol=protocol)


def parse_cifar_batch(blob: bytes) -> np.ndarray:
    x, y = readers.read_cifar_batch(blob, "fuzz")
    check_images(x, channels=3)
    check_labels(y, len(x))
    return x


@pytest.mark.parametrize("protocol", [2, 4])
@FUZZ
@given(data=st.data())
def test_fuzz_cifar_batch(protocol, data):
    original = cifar_pickle(protocol=protocol)
    blob = data.draw(mutations(original, header=len(original) // 2))

    outcome, peak = traced_peak(lambda: parse_cifar_batch(blob))
    count("read_cifar_batch")
    only_user_error(outcome)
    assert peak < ALLOWANCE + 16 * len(blob)


@st.composite
def hostile_batches(draw):
    """Pickles of the right outer shape with the wrong inside: other keys, shapes, dtypes, objects."""
    n = draw(st.integers(0, 4))
    data_choices = [
        np.zeros((n, 3072), np.uint8), np.zeros((n, 3, 32, 32), np.uint8), np.zeros((n, 3072), np.float32),
        np.zeros((n, 3071), np.uint8), np.zeros(3072, np.uint8), [[0] * 3072] * n, b"\0" * 3072 * n, None,
        np.zeros((n, 3072), np.int64), np.array(["x"] * n),
    ]
    label_choices = [[0] * n, [0] * (n + 1), [10] * n, [-1] * n, [0.5] * n, ["a"] * n, np.zeros(n, np.uint8),
                     np.zeros((n, 1), np.int64), np.zeros(n, np.float64), None, [True] * n, [2**70] * n]
    batch = {draw(st.sampled_from([b"data", "data", b"Data"])): draw(st.sampled_from(data_choices))}
    if draw(st.booleans()):
        batch[draw(st.sampled_from([b"labels", "labels", b"fine_labels"]))] = draw(st.sampled_from(label_choices))
    outer = draw(st.sampled_from(["dict", "list", "tuple"]))
    obj = batch if outer == "dict" else (list(batch.items()) if outer == "list" else tuple(batch.values()))
    return pickle.dumps(obj, protocol=draw(st.sampled_from([2, 3, 4, 5])))


@FUZZ
@given(hostile_batches())
def test_fuzz_cifar_batch_wrong_keys_shapes_and_types(blob):
    outcome, _ = traced_peak(lambda: parse_cifar_batch(blob))
    count("read_cifar_batch (structure)")
    only_user_error(outcome)


@pytest.mark.parametrize("blob", [
    b"\x80\x02K\x01r\x00\x00\x00\x08.",            # LONG_BINPUT 2**27: the memo grows (and is zeroed) to 1 GiB
    b"\x80\x03B\xff\xff\xff\x7f",                  # BINBYTES claiming 2 GiB in a 7-byte file
    b"\x80\x05\x96\x00\x00\x00\x00\x01\x00\x00\x00",  # BYTEARRAY8 claiming 4 GiB
], ids=["memo index", "bytes length", "bytearray length"])
def test_pickle_size_fields_cannot_make_the_unpickler_allocate(blob):
    """The C unpickler allocates what these fields claim before reading: the opcodes are checked first."""
    outcome, peak = traced_peak(lambda: readers.read_cifar_batch(blob, "bomb"))
    assert isinstance(outcome, UserError) and "malformed pickle" in str(outcome), outcome
    assert peak < 2**20, peak


def cifar_tar() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for i, name in enumerate([*readers.CIFAR_TRAIN_BATCHES, readers.CIFAR_TEST_BATCH]):
            blob = cifar_pickle(n=1 + i % 2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return buffer.getvalue()


CIFAR_TAR = cifar_tar()


@FUZZ
@given(data=st.data())
def test_fuzz_cifar_archive(tmp_path_factory, data):
    inner = data.draw(st.booleans())
    if inner:  # mutate the tar stream, then gzip it (headers, sizes, names)
        blob = gzip.compress(data.draw(mutations(gzip.decompress(CIFAR_TAR), header=512)), mtime=0)
    else:
        blob = data.draw(mutations(CIFAR_TAR, header=32))
    path = scratch(tmp_path_factory, "cifar-10-python.tar.gz")
    path.write_bytes(blob)

    def parse():
        arrays = readers.read_cifar(path)
        check_images(arrays["x_train"], 3)
        check_labels(arrays["y_train"], len(arrays["x_train"]))
        return arrays

    outcome, _ = traced_peak(parse)
    count("read_cifar (tar.gz)")
    only_user_error(outcome)


# ------------------------------------------------------------------------------------------- NPZ

def npz_bytes(compressed: bool, **arrays) -> bytes:
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **arrays)
    return buffer.getvalue()


NPZ_ARRAYS = {"x_train": RNG.integers(0, 256, (4, 28, 28), dtype=np.uint8), "y_train": np.arange(4) % 10,
              "x_test": RNG.integers(0, 256, (2, 28, 28), dtype=np.uint8), "y_test": np.arange(2) % 10}


def parse_npz(path: Path):
    npz_outcome = readers.npz_summary(path)
    arrays = readers.read_npz(path, (1, 28, 28))
    for split in ("train", "test"):
        check_images(arrays[f"x_{split}"], 1)
        check_labels(arrays[f"y_{split}"], len(arrays[f"x_{split}"]))
    return npz_outcome


@pytest.mark.parametrize("compressed", [False, True], ids=["stored", "deflated"])
@FUZZ
@given(data=st.data())
def test_fuzz_npz_bytes(tmp_path_factory, compressed, data):
    original = npz_bytes(compressed, **NPZ_ARRAYS)
    # the zip's local headers are at the start, its directory at the end: mutate both
    blob = data.draw(mutations(original, header=len(original)))
    path = scratch(tmp_path_factory, "mnist.npz")
    path.write_bytes(blob)
    outcome, peak = traced_peak(lambda: parse_npz(path))
    count("read_npz / npz_summary")
    only_user_error(outcome)
    assert peak < ALLOWANCE + 16 * 1100 * len(blob)


@st.composite
def hostile_npz(draw):
    """Well-formed zips holding the wrong arrays: missing keys, other dtypes, objects, shapes."""
    arrays = dict(NPZ_ARRAYS)
    for key in draw(st.lists(st.sampled_from(sorted(arrays)), max_size=2, unique=True)):
        del arrays[key]
    for key in draw(st.lists(st.sampled_from(sorted(NPZ_ARRAYS)), max_size=2, unique=True)):
        arrays[key] = draw(st.sampled_from([
            np.zeros((4, 28, 28), np.float32), np.zeros((4, 28, 28), np.int16), np.zeros((4, 27, 28), np.uint8),
            np.zeros((0, 28, 28), np.uint8), np.zeros((4, 1, 28, 28), np.uint8), np.zeros((4, 784), np.uint8),
            np.array([b"x"] * 4), np.array(["x"] * 4), np.zeros(4, np.float64), np.full(4, 11), np.full(4, -1),
            np.zeros((4, 2), np.int64), np.zeros(3, np.int64), np.zeros((), np.uint8),
            np.zeros((4, 28, 28, 3), np.uint8),
            np.array([1, None, "x"], dtype=object), np.zeros(4, dtype=[("a", "u1"), ("b", "u1")]),
        ]))
    return arrays


@FUZZ
@given(hostile_npz(), st.booleans())
def test_fuzz_npz_wrong_arrays(tmp_path_factory, arrays, compressed):
    path = scratch(tmp_path_factory, "mnist.npz")
    buffer = io.BytesIO()
    # object arrays need allow_pickle when saving: exactly what a hostile file would hold
    (np.savez_compressed if compressed else np.savez)(buffer, allow_pickle=True, **arrays)
    path.write_bytes(buffer.getvalue())
    outcome, _ = traced_peak(lambda: parse_npz(path))
    count("read_npz (structure)")
    only_user_error(outcome)


def test_npz_header_claiming_billions_of_items_allocates_nothing(tmp_path):
    header = {"descr": "|u1", "fortran_order": False, "shape": (4_000_000_000, 28, 28)}
    npy = io.BytesIO()
    np.lib.format.write_array_header_1_0(npy, header)
    npy.write(bytes(100))
    path = tmp_path / "mnist.npz"
    with zipfile.ZipFile(path, "w") as archive:
        for key in readers.NPZ_KEYS:
            archive.writestr(key + ".npy", npy.getvalue())
    outcome, peak = traced_peak(lambda: readers.read_npz(path, (1, 28, 28)))
    assert isinstance(outcome, UserError) and peak < 2**20, (outcome, peak)


# ---------------------------------------------------------------------------------- search space

SPACE = b"""# a search space
model = "cnn"
[genes]
blocks = [1, 2]
filters = [16, 32]
kernel_size = [3, 5]
dense = [64, 128]
dropout = [0.0, 0.25]
optimizer = ["adam", "sgd"]
lr = [0.001, 0.01]
"""


@FUZZ
@given(data=st.data())
def test_fuzz_search_space_toml(tmp_path_factory, data):
    blob = data.draw(mutations(SPACE, header=len(SPACE)))
    path = scratch(tmp_path_factory, "space.toml")
    path.write_bytes(blob)

    def parse():
        space = load_space(path)
        assert space.size >= 1 and space.model in ("cnn", "mlp")
        assert space.contains(space.genome_at(0))
        return space

    outcome, _ = traced_peak(parse)
    count("load_space (TOML)")
    only_user_error(outcome)


@FUZZ
@given(st.dictionaries(st.sampled_from(["model", "genes", "extra"]),
                       st.one_of(st.text(max_size=8), st.integers(), st.floats(allow_nan=True), st.booleans(),
                                 st.lists(st.integers(-2, 10**12), max_size=3),
                                 st.dictionaries(st.sampled_from(["neurons", "layers", "activation", "lr", "x"]),
                                                 st.one_of(st.lists(st.one_of(st.integers(-5, 10**15), st.floats(),
                                                                              st.text(max_size=4), st.booleans()),
                                                                    max_size=3),
                                                           st.integers(), st.text(max_size=4)),
                                                 max_size=4)),
                       max_size=3))
def test_fuzz_search_space_structure(tmp_path_factory, document):
    """Valid TOML, hostile content: wrong types, unknown genes and keys, huge or negative values."""
    import json

    def value(v):  # TOML of a JSON-like value (TOML has no null; floats as repr)
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == float("-inf") else repr(v))
        if isinstance(v, str):
            return json.dumps(v)
        return str(v)

    path = scratch(tmp_path_factory, "space.toml")
    path.write_text("\n".join(f"{k} = {value(v)}" for k, v in document.items()) + "\n", encoding="utf-8")
    outcome, _ = traced_peak(lambda: load_space(path))
    count("load_space (structure)")
    only_user_error(outcome)


# -------------------------------------------------------------------------------- checkpoints

def checkpoint_file(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save({"format": checkpoint.FORMAT, "version": checkpoint.VERSION, **state}, buffer)
    payload = buffer.getvalue()
    return payload + checkpoint.MARKER + hashlib.sha256(payload).digest()


def small_state(model: str = "mlp") -> dict:
    torch.manual_seed(0)
    module = build_model(model, (1, 8, 8), 10, **({"layers": 1, "neurons": 4} if model == "mlp" else {}))
    return {"model": model, "dataset": "synthetic", "world_size": 1, "config": {"model": model},
            "step": 3, "strategy": {"model": module.state_dict(), "optimizer": None, "scheduler": None}}


CHECKPOINT = checkpoint_file(small_state())
EXPECTED = {"model": "mlp", "dataset": "synthetic", "world_size": 1, "config": {"model": "mlp"}}


def load_and_check(path: Path) -> dict:
    state = checkpoint.load(path, log=lambda _line: None)
    assert isinstance(state, dict) and state["format"] == checkpoint.FORMAT
    checkpoint.check_compatible(state, EXPECTED, path.parent)
    return state


@FUZZ
@given(data=st.data())
def test_fuzz_checkpoint_bytes(tmp_path_factory, data):
    """Any damage to the file is caught by the checksum: refused, never loaded."""
    blob = data.draw(mutations(CHECKPOINT, header=len(CHECKPOINT)))
    path = scratch(tmp_path_factory, "checkpoint.pt")
    path.write_bytes(blob)
    outcome, _ = traced_peak(lambda: load_and_check(path))
    count("checkpoint.load (file)")
    if not only_user_error(outcome):
        assert blob == CHECKPOINT  # a damaged file never loads


@FUZZ
@given(data=st.data())
def test_fuzz_checkpoint_archive_behind_a_valid_checksum(tmp_path_factory, data):
    """A damaged archive whose checksum was recomputed (a forged file): still only our error."""
    payload = data.draw(mutations(CHECKPOINT[:-40], header=len(CHECKPOINT)))
    path = scratch(tmp_path_factory, "checkpoint.pt")
    path.write_bytes(payload + checkpoint.MARKER + hashlib.sha256(payload).digest())
    outcome, _ = traced_peak(lambda: load_and_check(path))
    count("checkpoint.load (archive)")
    only_user_error(outcome)


@pytest.mark.parametrize("change, message", [
    ({"model": "lenet5"}, "model='lenet5'"),
    ({"world_size": 2}, "world_size=2"),
    ({"config": {"model": "mlp", "lr": 0.5}}, "config="),
    ({"version": 2}, "format version 2"),
    ({"format": "something-else"}, "not a towerlab checkpoint"),
])
def test_checkpoint_of_another_model_or_version_is_refused(tmp_path, change, message):
    state = {**small_state(), **change}
    payload = io.BytesIO()
    torch.save({"format": checkpoint.FORMAT, "version": checkpoint.VERSION, **state}, payload)
    payload = payload.getvalue()
    (tmp_path / "checkpoint.pt").write_bytes(payload + checkpoint.MARKER + hashlib.sha256(payload).digest())
    with pytest.raises(UserError, match=message):
        load_and_check(tmp_path / "checkpoint.pt")


# ---------------------------------------------------------------------------------- model files

def model_file() -> bytes:
    torch.manual_seed(0)
    module = build_model("mlp", (1, 8, 8), 10, layers=1, neurons=4)
    buffer = io.BytesIO()
    torch.save(model_record(module, "mlp", (1, 8, 8), 10, {"layers": 1, "neurons": 4}), buffer)
    return buffer.getvalue()


MODEL = model_file()


@FUZZ
@given(data=st.data())
def test_fuzz_model_file(tmp_path_factory, data):
    blob = data.draw(mutations(MODEL, header=len(MODEL)))
    path = scratch(tmp_path_factory, "model.pt")
    path.write_bytes(blob)

    def parse():
        model, record = load_model(path)
        assert isinstance(model, torch.nn.Module) and record["format"] == "towerlab-model"
        return model

    outcome, _ = traced_peak(parse)
    count("load_model")
    only_user_error(outcome)


def hostile_record(**change) -> dict:
    torch.manual_seed(0)
    module = build_model("mlp", (1, 8, 8), 10, layers=1, neurons=4)
    record = model_record(module, "mlp", (1, 8, 8), 10, {"layers": 1, "neurons": 4})
    record.update(change)
    for key in [k for k, v in change.items() if v is KeyError]:
        del record[key]
    return record


@pytest.mark.parametrize("record", [
    pytest.param(hostile_record(options={"layers": 1, "neurons": 2**27}), id="options claiming 34 GB"),
    pytest.param(hostile_record(input_shape=[1, 2**16, 2**16]), id="input shape claiming 4 G pixels"),
    pytest.param(hostile_record(input_shape="abc"), id="input shape not a list"),
    pytest.param(hostile_record(input_shape=[1, -8, 8]), id="negative input shape"),
    pytest.param(hostile_record(num_classes="ten"), id="num_classes not a number"),
    pytest.param(hostile_record(options=[1, 2]), id="options not a table"),
    pytest.param(hostile_record(state_dict=[1]), id="state_dict not a dict"),
    pytest.param(hostile_record(input_shape=KeyError), id="input_shape missing"),
    pytest.param(hostile_record(state_dict=KeyError), id="state_dict missing"),
])
def test_hostile_model_records_are_user_errors_without_allocating(tmp_path, record):
    path = tmp_path / "model.pt"
    torch.save(record, path)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(UserError):
        load_model(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 256 * 1024  # < 256 MiB more


@pytest.mark.parametrize("record, message", [
    (hostile_record(options={"bogus": 1}), "has no option bogus"),
    (hostile_record(name="resnet"), "unknown model 'resnet'"),
    (hostile_record(state_dict={}), "does not match model mlp"),
    (hostile_record(format="something"), "not a towerlab model file"),
])
def test_model_records_of_another_model_are_refused(tmp_path, record, message):
    torch.save(record, tmp_path / "model.pt")
    with pytest.raises(UserError, match=message):
        load_model(tmp_path / "model.pt")


# ------------------------------------------------------------------------- nothing is executed

class Payload:
    """Unpickling this creates the marker file: proof that code from the file ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_no_file_we_load_can_run_code(tmp_path):
    marker = tmp_path / "pwned"
    evil = io.BytesIO()
    torch.save({"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "x": Payload(marker)}, evil)
    payload = evil.getvalue()
    signed = payload + checkpoint.MARKER + hashlib.sha256(payload).digest()  # a valid checksum
    (tmp_path / "checkpoint.pt").write_bytes(signed)
    with pytest.raises(UserError, match="unreadable archive"):
        checkpoint.load(tmp_path / "checkpoint.pt")
    (tmp_path / "model.pt").write_bytes(payload)
    with pytest.raises(UserError, match="not a readable towerlab model"):
        load_model(tmp_path / "model.pt")
    with pytest.raises(UserError, match="refusing to unpickle"):
        readers.read_cifar_batch(pickle.dumps({b"data": Payload(marker)}, protocol=2), "evil")
    npz = tmp_path / "mnist.npz"
    np.savez(npz, allow_pickle=True, **{**NPZ_ARRAYS, "x_train": np.array([Payload(marker)], dtype=object)})
    with pytest.raises(UserError, match="object array"):
        readers.read_npz(npz)
    # Through the command line: a run folder whose checkpoint carries the payload.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"train": {"dataset": "synthetic"}, "run": {"download": false}}')
    (run / "checkpoint.pt").write_bytes(signed)
    assert main(["train", "--resume", str(run)]) == 2
    assert not marker.exists()


# ------------------------------------------------------------------------------ via the CLI

def test_hostile_files_through_the_command_line_exit_2_with_one_line(tmp_path, capsys):
    """The same refusals, end to end: exit status 2, one line on stderr, no traceback."""
    cases = {
        "npz": ("mnist.npz", npz_bytes(False, **NPZ_ARRAYS)[:-30]),
        "idx": ("train-images-idx3-ubyte", bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**31, 28, 28)),
        "cifar": ("cifar-10-python.tar.gz", CIFAR_TAR[: len(CIFAR_TAR) // 2]),
    }
    for name, (file, blob) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / file).write_bytes(blob)
        if name == "idx":
            for other in ("train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
                (folder / other).write_bytes(IDX_LABELS if "labels" in other else IDX_IMAGES)
        dataset = "cifar10" if name == "cifar" else "mnist"
        status = main(["train", "--dataset", dataset, "--data-dir", str(folder), "--no-download", "--steps", "1",
                       "--out", str(tmp_path / f"out-{name}")])
        err = capsys.readouterr().err
        assert status == 2 and err.startswith("towerlab: error: ") and err.count("\n") == 1, (name, err)
        assert not (tmp_path / f"out-{name}").exists()
    space = tmp_path / "space.toml"
    space.write_bytes(SPACE.replace(b"[genes]", b"[genes"))
    assert main(["evolve", "--space", str(space), "--dataset", "synthetic", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "not valid TOML" in err and err.count("\n") == 1


def test_the_files_the_fuzzers_start_from_are_valid(tmp_path):
    """Mutations of a valid file reach past the first check; these are the valid files."""
    for name, blob in [("i-ubyte", IDX_IMAGES), ("l-ubyte", IDX_LABELS), ("l.gz", gzip.compress(IDX_LABELS))]:
        (tmp_path / name).write_bytes(blob)
        parse_idx(tmp_path / name)
    for protocol in (2, 4):
        x, y = readers.read_cifar_batch(cifar_pickle(protocol=protocol), "b")
        check_images(x, 3)
        check_labels(y, len(x))
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(CIFAR_TAR)
    assert len(readers.read_cifar(tmp_path / "cifar-10-python.tar.gz")["x_train"]) == 1 + 2 + 1 + 2 + 1
    for compressed in (False, True):
        (tmp_path / "mnist.npz").write_bytes(npz_bytes(compressed, **NPZ_ARRAYS))
        parse_npz(tmp_path / "mnist.npz")
    (tmp_path / "space.toml").write_bytes(SPACE)
    assert load_space(tmp_path / "space.toml").size == 2**7
    (tmp_path / "checkpoint.pt").write_bytes(CHECKPOINT)
    assert load_and_check(tmp_path / "checkpoint.pt")["step"] == 3
    (tmp_path / "model.pt").write_bytes(MODEL)
    assert isinstance(load_model(tmp_path / "model.pt")[0], torch.nn.Module)


def test_zz_fuzz_counts(capsys):
    """Not a check: prints how many examples each reader got (for the record; run with -s)."""
    with capsys.disabled():
        print("\nfuzzed examples:", dict(sorted(COUNTED.items())), "total", sum(COUNTED.values()))
