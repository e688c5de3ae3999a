"""A CIFAR-10 python batch is a pickle: read here without ever running its code. Only dicts, lists,
bytes, numbers and plain numeric arrays are rebuilt (`_ArrayOnlyUnpickler`: every other global is
refused, numpy's own callables are never handed out), and the opcodes are walked first so that no size
a pickle claims is trusted (`_scan_pickle`). numpy only; the reader is `towerlab.data.readers`'.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
from typing import Any

import numpy as np

from towerlab.errors import UserError

try:  # numpy >= 2 moved the pickling helpers; files written by numpy 1 name the old module
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct  # type: ignore[no-redef]  # numpy 1's place




def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


_RECONSTRUCT_NAMES = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Rebuilds dicts, lists, bytes, numbers and plain numeric ndarrays; refuses every other global.

    What it hands out are fresh guards, not numpy's own callables: `numpy.ndarray` is an inert marker
    that only `_reconstruct` accepts, so a pickle cannot call `ndarray(huge_shape)` to allocate, and a
    BUILD opcode aimed at a guard changes only that guard.
    """

    def __init__(self, data: bytes, name: str):
        super().__init__(io.BytesIO(data), encoding="bytes")
        self._name = name
        self._ndarray_marker = object()

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECONSTRUCT_NAMES:
            return self._reconstruct
        if (module, name) == ("numpy", "ndarray"):
            return self._ndarray_marker
        if (module, name) == ("numpy", "dtype"):
            return self._dtype
        if (module, name) == ("_codecs", "encode"):
            return self._encode
        raise UserError(f"{self._name}: refusing to unpickle {module}.{name}; a CIFAR batch holds only "
                        "arrays and lists, so this file is not one (or was tampered with)")

    def _reconstruct(self, subtype: object, shape: object, dtype: np.dtype) -> object:
        # numpy pickles always start from an empty array and fill it with __setstate__, whose data
        # length numpy checks against the shape, so memory stays bounded by the pickle's size.
        if subtype is not self._ndarray_marker or not isinstance(shape, tuple) or math.prod(shape) > 1:
            raise UserError(f"{self._name}: unexpected array construction in pickle; "
                            "the file is not a CIFAR batch")
        return _np_reconstruct(np.ndarray, shape, dtype)

    def _dtype(self, spec: object, align: object = False, copy: object = False) -> np.dtype:
        if isinstance(spec, bytes):
            spec = spec.decode("ascii", "replace")
        if not isinstance(spec, str):
            raise UserError(f"{self._name}: unexpected dtype in pickle; the file is not a CIFAR batch")
        # Always a fresh copy, never numpy's shared builtin instance, so a BUILD opcode that follows
        # (numpy pickles set a dtype's state that way) can only touch this copy.
        dtype = np.dtype(spec, bool(align), True)
        if dtype.kind not in "biuf" or dtype.fields is not None or dtype.subdtype is not None:
            raise UserError(f"{self._name}: array of type {dtype} in pickle; a CIFAR batch holds numbers only")
        return dtype

    def _encode(self, text: object, encoding: str = "utf-8") -> bytes:
        # Python 3 writes bytes in protocol 2 as encode(text, 'latin1'); nothing else is needed.
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise UserError(f"{self._name}: unexpected _codecs.encode call in pickle; "
                            "the file is not a CIFAR batch")
        return text.encode("latin1")


_MEMO_OPCODES = {"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"}


def load_batch(data: bytes, name: str) -> Any:
    """What a CIFAR-10 batch's pickle holds, read without running any of its code, every size it claims
    checked first: a UserError naming `name` for anything a CIFAR batch does not hold."""
    _scan_pickle(data, name)
    try:
        return _ArrayOnlyUnpickler(data, name).load()
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of a hostile or corrupt pickle is the file's fault
        raise UserError(f"{name} is not a readable CIFAR-10 batch ({type(err).__name__}: {_one_line(err)}): "
                        "replace it with the official file") from None


def _scan_pickle(data: bytes, name: str) -> None:
    """Walk the opcodes before unpickling, so that no size field is trusted: the C unpickler allocates
    what a BINBYTES / BYTEARRAY8 length claims before reading it, and grows (and zeroes) its memo to
    any index a PUT names, so a 10-byte pickle could make it hold gigabytes. pickletools reads each
    argument from the data itself (a claimed length longer than the data is an error) and memo
    indices must stay within the puts made so far, as every pickler writes them."""
    puts = 0
    try:
        for opcode, arg, _pos in pickletools.genops(data):
            if opcode.name in _MEMO_OPCODES:
                if not isinstance(arg, int) or arg < 0 or arg > puts:
                    raise ValueError(f"memo index {arg!r} out of sequence")
                puts += opcode.name.endswith("PUT")
            elif opcode.name == "MEMOIZE":
                puts += 1
    except ValueError as err:
        raise UserError(f"{name} is not a readable CIFAR-10 batch (malformed pickle: {_one_line(err)}): "
                        "replace it with the official file") from None
