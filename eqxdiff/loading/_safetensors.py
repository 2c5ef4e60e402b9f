"""Read and write the safetensors format with memory maps.

The ``safetensors`` package cannot hand bfloat16 tensors to NumPy, and loading onto a sharded mesh needs to
read only a slice of each tensor. The format is a little-endian u64 header length, a JSON header mapping
names to ``{dtype, shape, data_offsets}``, then the raw bytes; a ``numpy.memmap`` over it gives both.
"""

import json
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """One ``.safetensors`` file: ``names()``, ``shape(name)``, and ``get(name)`` as a read-only memmap view."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", None) or {}
        self._header = header
        self._start = 8 + n
        self._mmap = None

    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._header[name]["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
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
        a = np.ascontiguousarray(tensors[name])
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
