"""Read and write the safetensors format with memory maps.

The ``safetensors`` package cannot hand bfloat16 tensors to NumPy, and loading onto a sharded mesh needs to
read only a slice of each tensor. The format is a little-endian u64 header length, a JSON header mapping
names to ``{dtype, shape, data_offsets}``, then the raw bytes; a ``numpy.memmap`` over it gives both.

Opening a file checks its header against the file's size (a truncated download, a file cut short by a full disk,
or a header that does not parse), so a broken file fails there with the fix, never later with a NumPy reshape error.
Float8 tensors (``F8_E4M3``, ``F8_E5M2``) come back as ``ml_dtypes`` arrays, which NumPy casts to float32/bfloat16.
"""

import json
import math
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from ._errors import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """One ``.safetensors`` file: ``names()``, ``shape(name)``, ``dtype(name)`` and ``get(name)`` as a read-only
    memmap view. Raises :class:`CheckpointError` on opening a truncated or corrupt file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                self._corrupt(f"it is {size} bytes long, too short to hold a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                self._corrupt(f"its header claims {n} bytes but the file holds only {size - 8} after the length")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                self._corrupt(f"its header is not valid JSON ({e})")
        if not isinstance(header, dict):
            self._corrupt("its header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        self._header = header
        self._start = 8 + n
        self._check_offsets(size - self._start)
        self._mmap = None

    def _corrupt(self, problem: str):
        raise CheckpointError(f"{self.path!r} is truncated or corrupt: {problem}. Download it again (or write it "
                              "again) and retry.")

    def _check_offsets(self, data_size: int) -> None:
        for name, info in self._header.items():
            try:
                begin, end = (int(x) for x in info["data_offsets"])
                shape = [int(d) for d in info["shape"]]
                code = info["dtype"]
            except (KeyError, TypeError, ValueError):
                self._corrupt(f"tensor {name!r} has no valid dtype, shape and data_offsets in the header")
            if not 0 <= begin <= end:
                self._corrupt(f"tensor {name!r} has data_offsets [{begin}, {end}]")
            if end > data_size:
                self._corrupt(f"tensor {name!r} ends at byte {end} of the data but the file holds only {data_size} "
                              "bytes of data")
            if code in _DTYPES and end - begin != math.prod(shape) * _DTYPES[code].itemsize:
                self._corrupt(f"tensor {name!r} ({code}, shape {tuple(shape)}) should take "
                              f"{math.prod(shape) * _DTYPES[code].itemsize} bytes but data_offsets give {end - begin}")

    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._header[name]["dtype"]
        if code not in _DTYPES:
            raise CheckpointError(f"{self.path!r}: tensor {name!r} has dtype {code}, which eqxdiff cannot read "
                                  f"(it reads {', '.join(_DTYPES)})")
        return _DTYPES[code]

    def get(self, name: str) -> np.ndarray:
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        info = self._header[name]
        begin, end = info["data_offsets"]
        raw = self._mmap[self._start + begin:self._start + end]
        return raw.view(self.dtype(name)).reshape(info["shape"])


def write_safetensors(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (NumPy arrays, bfloat16 allowed) to ``path`` in the safetensors format."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.require(np.asarray(tensors[name]), requirements="C")  # C-contiguous; a 0-d array stays 0-d
        if a.dtype not in _NAMES:
            raise ValueError(f"cannot write tensor {name!r} of dtype {a.dtype} to safetensors")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
