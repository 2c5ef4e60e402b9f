"""The conversion rules that cut one tensor into several or join several into one: :class:`Split` (a fused
qkv), its inverse :class:`Concat` (fused projections built at load time) and :class:`Tie` (one stored tensor feeding
several names)."""

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from ._errors import ConversionError
from ._lazy import LazyTensor, concat, take
from ._rules import Drop, Rename, Rule, as_tuple, check_targets, check_template, set_fields
from ._view import Converted, Dim, Entry, fill, placeholders, resolve, short, template_pattern


def _piece(view, name: str, axis: int, start: int, stop: int):
    return take(view.get(name), axis, start, stop)


@dataclasses.dataclass(frozen=True, repr=False)
class Split(Rule):
    """A fused tensor matching ``source`` cut along ``axis`` into ``targets``. ``sizes``: one entry per target, an
    int, ``-1`` (the rest, at most once) or a :class:`Dim`; ``None`` cuts equal parts. Each piece is a view of the
    stored tensor: nothing is copied until a piece is read."""

    source: str
    targets: tuple[str, ...]
    axis: int = 0
    sizes: tuple[int | Dim, ...] | None = None

    def __post_init__(self):
        check_template(self, self.source, "source")
        set_fields(self, targets=as_tuple(self.targets), sizes=None if self.sizes is None else tuple(self.sizes))
        check_targets(self, set(placeholders(self.source)), self.targets)
        if len(self.targets) < 2:
            raise ValueError(f"{self}: give at least two targets (a Rename moves one tensor)")
        if self.sizes is not None and len(self.sizes) != len(self.targets):
            raise ValueError(f"{self}: {len(self.sizes)} sizes for {len(self.targets)} targets")
        if self.sizes is not None and list(self.sizes).count(-1) > 1:
            raise ValueError(f"{self}: at most one size may be -1 (the rest)")

    def _cuts(self, view, name, groups, where) -> list[int]:
        shape = tuple(view.shape(name))
        if not -len(shape) <= self.axis < len(shape):
            raise ConversionError(f"{self}: tensor {name!r} of shape {shape} has no axis {self.axis}")
        length = shape[self.axis]
        if self.sizes is None:
            if length % len(self.targets):
                raise ConversionError(f"{self}: tensor {name!r} has {length} along axis {self.axis}, which does not "
                                      f"cut into {len(self.targets)} equal parts; give sizes")
            return [length // len(self.targets)] * len(self.targets)
        sizes = resolve(self, self.sizes, name, view, groups, where)
        if -1 in sizes:
            sizes[sizes.index(-1)] = length - (sum(sizes) + 1)
        if sum(sizes) != length or any(s < 0 for s in sizes):
            raise ConversionError(f"{self}: tensor {name!r} of shape {shape} has {length} along axis {self.axis} "
                                  f"but the sizes are {sizes}")
        return sizes

    def apply(self, view, where="checkpoint"):
        produced, consumed = {}, set()
        for name, groups in self._sources(view, self.source, where):
            shape, axis = tuple(view.shape(name)), self.axis % len(view.shape(name))
            start = 0
            for target, size in zip(self.targets, self._cuts(view, name, groups, where)):
                piece = shape[:axis] + (size,) + shape[axis + 1:]
                read = functools.partial(_piece, view, name, axis, start, start + size)
                produced[fill(target, groups)] = Entry(piece, view.dtype(name), read)
                start += size
            consumed.add(name)
        return Converted(view, produced, consumed, self, where)

    def inverse(self):
        return (Concat(self.targets, self.source, self.axis, self.sizes, optional=self.optional),)


def _grouped(rule: Rule, view, sources: Sequence[str], where: str) -> list[tuple[dict, list[str]]]:
    """For each set of placeholder values, the tensor each source template names; a partial set is an error."""
    names = view.names()
    groups: dict[tuple, dict[int, str]] = {}
    values: dict[tuple, dict] = {}
    for i, template in enumerate(sources):
        for name in names:
            if m := template_pattern(template).fullmatch(name):
                key = tuple(sorted(m.groupdict().items()))
                groups.setdefault(key, {})[i] = name
                values[key] = m.groupdict()
    if not groups:
        rule._sources(view, sources[0], where)  # raises unless the rule is optional
    out = []
    for key, found in groups.items():
        missing = [fill(sources[i], values[key]) for i in range(len(sources)) if i not in found]
        if missing:
            raise ConversionError(f"{rule}: the {where} holds {found[min(found)]!r} but not {short(missing)}, "
                                  "which go with it")
        out.append((values[key], [found[i] for i in range(len(sources))]))
    return out


def _joined(view, names: Sequence[str], axis: int) -> LazyTensor:
    return concat([view.get(n) for n in names], axis)


@dataclasses.dataclass(frozen=True, repr=False)
class Concat(Rule):
    """Tensors matching ``sources`` (with the same placeholder values) joined along ``axis`` into ``target``:
    fused projections built at load time. ``sizes`` (optional) are checked and let the inverse cut unequal parts.
    The result is read lazily: a slice of it reads only the pieces' parts inside that slice."""

    sources: tuple[str, ...]
    target: str
    axis: int = 0
    sizes: tuple[int | Dim, ...] | None = None

    def __post_init__(self):
        set_fields(self, sources=as_tuple(self.sources), sizes=None if self.sizes is None else tuple(self.sizes))
        for s in self.sources:
            check_template(self, s, "source")
        if len(self.sources) < 2:
            raise ValueError(f"{self}: give at least two sources")
        names = [set(placeholders(s)) for s in self.sources]
        if any(n != names[0] for n in names):
            raise ValueError(f"{self}: every source must capture the same placeholders")
        check_targets(self, names[0], [self.target])
        if self.sizes is not None and len(self.sizes) != len(self.sources):
            raise ValueError(f"{self}: {len(self.sizes)} sizes for {len(self.sources)} sources")

    def apply(self, view, where="checkpoint"):
        produced, consumed = {}, set()
        for groups, names in _grouped(self, view, self.sources, where):
            shapes = [tuple(view.shape(n)) for n in names]
            ndim = len(shapes[0])
            if not -ndim <= self.axis < ndim:
                raise ConversionError(f"{self}: tensor {names[0]!r} of shape {shapes[0]} has no axis {self.axis}")
            axis = self.axis % ndim
            rest = {s[:axis] + s[axis + 1:] for s in shapes}
            if len(rest) > 1 or len({len(s) for s in shapes}) > 1:
                raise ConversionError(f"{self}: tensors {short(names)} have shapes {shapes}, which differ off "
                                      f"axis {self.axis}")
            if self.sizes is not None:
                want = [(resolve(self, [s], n, view, groups, where)[0]) for s, n in zip(self.sizes, names)]
                got = [s[axis] for s in shapes]
                if any(w not in (-1, g) for w, g in zip(want, got)):
                    raise ConversionError(f"{self}: tensors {short(names)} have sizes {got} along axis "
                                          f"{self.axis}, not {want}")
            shape = shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1:]
            dtype = np.result_type(*(view.dtype(n) for n in names))
            produced[fill(self.target, groups)] = Entry(shape, dtype, functools.partial(_joined, view, names, axis))
            consumed.update(names)
        return Converted(view, produced, consumed, self, where)

    def inverse(self):
        return (Split(self.target, self.sources, self.axis, self.sizes, optional=self.optional),)


@dataclasses.dataclass(frozen=True, repr=False)
class Tie(Rule):
    """One stored tensor matching ``source`` feeding every name in ``targets`` (tied weights: T5's ``shared``
    embedding is also ``encoder.embed_tokens``). ``source`` may be among the targets. The inverse keeps the first."""

    source: str
    targets: tuple[str, ...]

    def __post_init__(self):
        check_template(self, self.source, "source")
        set_fields(self, targets=as_tuple(self.targets))
        check_targets(self, set(placeholders(self.source)), self.targets)
        if not self.targets:
            raise ValueError(f"{self}: give at least one target")

    def apply(self, view, where="checkpoint"):
        produced, consumed = {}, set()
        for name, groups in self._sources(view, self.source, where):
            entry = Entry(tuple(view.shape(name)), view.dtype(name), functools.partial(view.get, name))
            for t in self.targets:
                produced[fill(t, groups)] = entry
            consumed.add(name)
        return Converted(view, produced, consumed, self, where)

    def inverse(self):
        first, *others = self.targets
        undo: list[Rule] = [Drop(tuple(others), optional=self.optional)] if others else []
        if first != self.source:
            undo.append(Rename(first, self.source, optional=self.optional))
        return tuple(undo)
