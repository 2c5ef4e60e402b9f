"""Lazy tensors: what a converted checkpoint hands out instead of reading a whole tensor.

A file's tensors are NumPy memmaps, and slicing, transposing and reshaping them gives views of the same map. What
NumPy cannot express as a view (pieces joined along an axis) is a :class:`LazyTensor`: it reads, for each box it is
sliced with, only the parts of its pieces inside that box, so a device loading its shard of a fused projection
reads its shard and no more.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


class LazyTensor:
    """A tensor read only where it is indexed. ``read(box)`` returns the part inside ``box``, a tuple of
    ``slice(start, stop)`` (one per axis, step 1, bounds resolved). Basic slicing reads only that box; any other
    indexing, ``np.asarray`` and NumPy functions read the whole tensor."""

    def __init__(self, shape: tuple[int, ...], dtype, read: Callable[[tuple[slice, ...]], np.ndarray]):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self._read = read

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self, box: tuple[slice, ...]) -> np.ndarray:
        return self._read(box)

    def __getitem__(self, index):
        box = _as_box(index, self.shape)
        return self._read(box) if box is not None else np.asarray(self)[index]

    def __array__(self, dtype=None, copy=None):
        out = self._read(tuple(slice(0, n) for n in self.shape))
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape}, dtype={self.dtype})"


def _as_box(index, shape) -> tuple[slice, ...] | None:
    """``index`` as one resolved ``slice(start, stop)`` per axis, or ``None`` if it is not plain slicing."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > len(shape) or not all(isinstance(i, slice) and i.step in (None, 1) for i in index):
        return None
    index = index + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*i.indices(n)[:2]) for i, n in zip(index, shape))


def _read_box(arr, box: tuple[slice, ...]) -> np.ndarray:
    return arr.read(box) if isinstance(arr, LazyTensor) else np.asarray(arr[box])


def take(arr, axis: int, start: int, stop: int):
    """``arr[..., start:stop, ...]`` on ``axis``: a view of a NumPy array (a memmap stays a memmap)."""
    if not isinstance(arr, LazyTensor):
        return arr[(slice(None),) * axis + (slice(start, stop),)]
    shape = arr.shape[:axis] + (stop - start,) + arr.shape[axis + 1:]

    def read(box):
        s = box[axis]
        return arr.read(box[:axis] + (slice(start + s.start, start + max(s.start, s.stop)),) + box[axis + 1:])
    return LazyTensor(shape, arr.dtype, read)


def transpose(arr, perm: tuple[int, ...]):
    if not isinstance(arr, LazyTensor):
        return np.transpose(arr, perm)

    def read(box):
        inner = [slice(None)] * len(perm)
        for i, p in enumerate(perm):
            inner[p] = box[i]
        return np.transpose(arr.read(tuple(inner)), perm)
    return LazyTensor(tuple(arr.shape[p] for p in perm), arr.dtype, read)


def concat(parts: Sequence, axis: int) -> LazyTensor:
    """The parts joined on ``axis``, reading from each only what a slice needs."""
    lengths = [p.shape[axis] for p in parts]
    starts = np.cumsum([0, *lengths]).tolist()
    shape = parts[0].shape[:axis] + (starts[-1],) + parts[0].shape[axis + 1:]
    dtype = np.result_type(*(p.dtype for p in parts))

    def read(box):
        s = box[axis]
        pieces = []
        for part, lo, hi in zip(parts, starts[:-1], starts[1:]):
            a, b = max(s.start, lo), min(s.stop, hi)
            if a < b:
                pieces.append(_read_box(part, box[:axis] + (slice(a - lo, b - lo),) + box[axis + 1:]))
        if not pieces:
            return np.zeros([sl.stop - sl.start for sl in box], dtype)
        return pieces[0].astype(dtype, copy=False) if len(pieces) == 1 else np.concatenate(pieces, axis).astype(dtype)
    return LazyTensor(shape, dtype, read)


def reshape(arr, shape: tuple[int, ...]):
    if not isinstance(arr, LazyTensor):
        return np.reshape(arr, shape)  # a view where the layout allows it
    return LazyTensor(shape, arr.dtype, lambda box: np.reshape(np.asarray(arr), shape)[box])


class TensorDict:
    """A view over ``{name: array}`` in memory (a state dict, the tensors a test builds)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self._tensors = dict(tensors)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(self._tensors[name].dtype)

    def get(self, name: str):
        return self._tensors[name]
