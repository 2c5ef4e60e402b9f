"""Checkpoint conversions as data: a few rule dataclasses and the one converter that applies them.

A checkpoint written by another library (OpenCLIP, an A1111/ComfyUI single file, Black Forest Labs' Flux files, a
LoRA) holds the numbers eqxdiff reads under other names and layouts. A conversion is a sequence of rules applied in
turn to a *view* of the checkpoint, the ``names() / shape(name) / dtype(name) / get(name)`` mapping that
:func:`~eqxdiff.loading.fill_module` reads:

======================================  =============================================================================
``Rename(source, target)``              a tensor's name (exact, a prefix, or with captured parts such as layer indices)
``Split(source, targets, axis, sizes)`` a fused tensor (qkv, BFL's ``linear1``) into pieces; ``sizes`` ints, ``-1``
                                        for the rest, :class:`Dim` for a size read from a tensor; none: equal parts
``Concat(sources, target, axis)``       the inverse: pieces into one fused tensor (fused projections at load time)
``Reshape(source, shape)``              a new shape (``-1`` and :class:`Dim` entries allowed)
``Transpose(source, perm)``             a permuted layout (a projection stored transposed)
``SwapHalves(source, axis)``            the two halves of an axis swapped (Flux's final shift/scale order)
``Tie(source, targets)``                one stored tensor feeding several names (tied embeddings)
``Drop(patterns)`` / ``Keep(...)``      tensors the model does not use / only the tensors it does
``Substitute(pattern, replacement)``    a raw ``re.sub`` over every name (a model's ``CHECKPOINT_KEY_MAP``)
======================================  =============================================================================

Names are matched with *templates*: literal text with ``{placeholders}``. A template matches a whole name; a
placeholder matches any non-empty text (the shortest that fits) and the same placeholder in a target template
writes that text back, so ``Rename("cond_stage_model.transformer.{rest}", "{rest}")`` strips a prefix and
``Split("resblocks.{i}.attn.in_proj_weight", ("layers.{i}.q.weight", "layers.{i}.k.weight", "layers.{i}.v.weight"))``
splits every layer's fused projection. A rule whose sources match no tensor is an error unless ``optional=True``;
a rule that does not fit a tensor (a missing partner, a wrong shape) raises :class:`ConversionError` naming both.

Conversion is lazy and keeps the memory map: a view computes names and shapes only, and a tensor is read when
``get`` is indexed. Renames, transposes and split pieces of a file's tensor are NumPy views of its memmap; a
concatenation is a :class:`LazyTensor` that reads, for each slice it is asked for (one device's shard), only the
parts of its pieces inside that slice.

Each rule knows its inverse where it has one (:meth:`Rule.inverse`, :func:`inverse`), so ``convert_tensors(
state_dict(model), inverse(rules))`` writes a model back in the other format.
"""

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ._errors import ConversionError
from ._lazy import LazyTensor, TensorDict, concat, reshape, take, transpose

# -- views ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Entry:
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], Any]


class _Converted:
    """``base`` after one rule: the names it consumed removed, the ones it produced added."""

    def __init__(self, base, produced: Mapping[str, _Entry], consumed: set[str], rule: "Rule", where: str,
                 origin: Mapping[str, str] | None = None):
        kept = [n for n in base.names() if n not in consumed]
        clash = sorted(set(kept) & set(produced))
        if clash:
            made = f" from {origin[clash[0]]!r}" if origin and clash[0] in origin else ""
            raise ConversionError(f"{rule}: makes {clash[0]!r}{made}, but the {where} already holds a tensor of "
                                  "that name; keep only one of them (drop the other first)")
        self._base, self._produced, self._kept = base, dict(produced), set(kept)
        self._names = kept + list(produced)

    def names(self) -> list[str]:
        return list(self._names)

    def _entry(self, name: str) -> _Entry | None:
        if name in self._produced:
            return self._produced[name]
        if name not in self._kept:
            raise KeyError(name)
        return None

    def shape(self, name: str) -> tuple[int, ...]:
        e = self._entry(name)
        return e.shape if e else tuple(self._base.shape(name))

    def dtype(self, name: str) -> np.dtype:
        e = self._entry(name)
        return e.dtype if e else self._base.dtype(name)

    def get(self, name: str):
        e = self._entry(name)
        return e.read() if e else self._base.get(name)


# -- templates --------------------------------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _placeholders(template: str) -> list[str]:
    return _PLACEHOLDER.findall(template)


@functools.cache
def _pattern(template: str) -> re.Pattern:
    parts, pos, seen = [], 0, set()
    for m in _PLACEHOLDER.finditer(template):
        parts.append(re.escape(template[pos:m.start()]))
        name = m.group(1)
        parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>.+?)")
        seen.add(name)
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("".join(parts))


def _fill(template: str, groups: Mapping[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda m: groups[m.group(1)], template)


def _short(names: Iterable[str], limit: int = 6) -> str:
    names = list(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


# -- sizes ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Dim:
    """A size read from the checkpoint: axis ``axis`` of the tensor the rule works on, or of ``tensor`` (a template
    filled with the rule's placeholders). BFL's single-block ``linear1`` splits as
    ``sizes=(Dim(1), Dim(1), Dim(1), -1)``: q, k, v of the model width, the MLP the rest."""

    axis: int
    tensor: str | None = None


def _resolve(rule, entries: Sequence, name: str, view, groups, where) -> list[int]:
    """``entries`` (ints, ``-1``, :class:`Dim`) as ints; ``-1`` is left for the caller to fill."""
    out = []
    for e in entries:
        if isinstance(e, Dim):
            other = name if e.tensor is None else _fill(e.tensor, groups)
            if other not in view.names():
                raise ConversionError(f"{rule}: a size is read from {other!r} (for {name!r}), which the {where} "
                                      "does not hold at this rule (if an earlier rule renames or splits it, put "
                                      "this rule first)")
            shape = view.shape(other)
            if not -len(shape) <= e.axis < len(shape):
                raise ConversionError(f"{rule}: {e} reads axis {e.axis} of {other!r}, which has shape {shape}")
            out.append(shape[e.axis])
        else:
            out.append(e)
    return out


# -- rules ------------------------------------------------------------------------------------------------------------


def _check_template(rule, template, what: str) -> None:
    if not isinstance(template, str) or not template:
        raise ValueError(f"{type(rule).__name__}: {what} must be a non-empty name template (str), got {template!r}")


@dataclasses.dataclass(frozen=True, repr=False)
class Rule:
    """One step of a conversion. ``apply(view, where)`` returns the converted view; ``inverse()`` the rules that
    undo it. ``optional=True``: sources that match no tensor are not an error."""

    optional: bool = dataclasses.field(default=False, kw_only=True)

    def apply(self, view, where: str = "checkpoint"):
        raise NotImplementedError

    def inverse(self) -> tuple["Rule", ...]:
        raise ConversionError(f"{self} has no inverse; write the rules for the other direction explicitly")

    def __str__(self) -> str:
        fields = [f for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]
        return f"{type(self).__name__}({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields)})"

    __repr__ = __str__

    def _sources(self, view, template: str, where: str) -> list[tuple[str, dict[str, str]]]:
        """Every ``(name, placeholders)`` that ``template`` matches; none is an error unless ``optional``."""
        pattern = _pattern(template)
        found = [(n, m.groupdict()) for n in view.names() if (m := pattern.fullmatch(n))]
        if not found and not self.optional:
            names = view.names()
            close = difflib.get_close_matches(_PLACEHOLDER.sub("0", template), names, n=3, cutoff=0.4)
            hint = f"; the closest names are {_short(close)}" if close else f"; it holds {_short(sorted(names))}"
            raise ConversionError(f"{self}: no tensor in the {where} matches {template!r}{hint}. Check the rules "
                                  "against the file (or pass optional=True for a tensor some files lack)")
        return found


def _tuple(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value)


def _set(obj, **fields) -> None:
    for k, v in fields.items():
        object.__setattr__(obj, k, v)


def _check_targets(rule, source_placeholders: set[str], targets: Iterable[str]) -> None:
    for t in targets:
        _check_template(rule, t, "target")
        unknown = set(_placeholders(t)) - source_placeholders
        if unknown:
            raise ValueError(f"{rule}: target {t!r} uses placeholder(s) {sorted(unknown)} that the source does not "
                             "capture")


@dataclasses.dataclass(frozen=True, repr=False)
class _OneToOne(Rule):
    """A rule that turns each matching tensor into one tensor (in place when ``target`` is ``None``)."""

    def __post_init__(self):
        _check_template(self, self.source, "source")
        _check_targets(self, set(_placeholders(self.source)), [self.target] if self.target else [])

    def _target(self, groups) -> str:
        return _fill(self.target or self.source, groups)

    def _other_way(self, **fields):
        """This rule's class reading ``target`` back into ``source``."""
        if self.target is None:
            return type(self)(self.source, optional=self.optional, **fields)
        return type(self)(self.target, target=self.source, optional=self.optional, **fields)

    def _convert(self, view, name: str, groups, where) -> _Entry:
        raise NotImplementedError

    def apply(self, view, where="checkpoint"):
        produced, origin = {}, {}
        for name, groups in self._sources(view, self.source, where):
            new = self._target(groups)
            if new in produced:
                raise ConversionError(f"{self}: {origin[new]!r} and {name!r} both become {new!r}")
            produced[new], origin[new] = self._convert(view, name, groups, where), name
        return _Converted(view, produced, set(origin.values()), self, where, origin)


@dataclasses.dataclass(frozen=True, repr=False)
class Rename(_OneToOne):
    """Tensors matching ``source`` are called ``target``: ``Rename("transformer.{rest}", "text_model.{rest}")``."""

    source: str
    target: str

    def _convert(self, view, name, groups, where):
        return _Entry(tuple(view.shape(name)), view.dtype(name), functools.partial(view.get, name))

    def inverse(self):
        return (Rename(self.target, self.source, optional=self.optional),)


@dataclasses.dataclass(frozen=True, repr=False)
class Transpose(_OneToOne):
    """Tensors matching ``source`` stored in another layout: ours is ``transpose(stored, perm)``."""

    source: str
    perm: tuple[int, ...] = (1, 0)
    target: str | None = None

    def __post_init__(self):
        super().__post_init__()
        _set(self, perm=tuple(self.perm))

    def _convert(self, view, name, groups, where):
        shape = tuple(view.shape(name))
        if sorted(self.perm) != list(range(len(shape))):
            raise ConversionError(f"{self}: tensor {name!r} has shape {shape}; perm {self.perm} is not a "
                                  f"permutation of its {len(shape)} axes")
        return _Entry(tuple(shape[p] for p in self.perm), view.dtype(name),
                      lambda: transpose(view.get(name), self.perm))

    def inverse(self):
        return (self._other_way(perm=tuple(int(i) for i in np.argsort(self.perm))),)


@dataclasses.dataclass(frozen=True, repr=False)
class Reshape(_OneToOne):
    """Tensors matching ``source`` reshaped to ``shape`` (ints, one ``-1``, :class:`Dim` of the stored tensor).
    ``inverse_shape`` (same vocabulary) gives the inverse: a 1x1 conv stored as a linear layer is
    ``Reshape(name, (Dim(0), Dim(1)), inverse_shape=(Dim(0), Dim(1), 1, 1))``."""

    source: str
    shape: tuple[int | Dim, ...]
    target: str | None = None
    inverse_shape: tuple[int | Dim, ...] | None = None

    def __post_init__(self):
        super().__post_init__()
        _set(self, shape=tuple(self.shape),
             inverse_shape=None if self.inverse_shape is None else tuple(self.inverse_shape))

    def _convert(self, view, name, groups, where):
        stored = tuple(view.shape(name))
        shape = _resolve(self, self.shape, name, view, groups, where)
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = math.prod(stored) // known if known else 0
        if math.prod(shape) != math.prod(stored) or any(s < 0 for s in shape):
            raise ConversionError(f"{self}: tensor {name!r} of shape {stored} cannot be reshaped to "
                                  f"{tuple(shape)}")
        shape = tuple(shape)
        return _Entry(shape, view.dtype(name), lambda: reshape(view.get(name), shape))

    def inverse(self):
        if self.inverse_shape is None:
            return super().inverse()
        return (self._other_way(shape=self.inverse_shape, inverse_shape=self.shape),)


@dataclasses.dataclass(frozen=True, repr=False)
class SwapHalves(_OneToOne):
    """Tensors matching ``source`` with the two halves of ``axis`` swapped: ``[a, b] -> [b, a]`` (its own
    inverse). Black Forest Labs' Flux stores the final layer's modulation as (shift, scale), diffusers as
    (scale, shift)."""

    source: str
    axis: int = 0
    target: str | None = None

    def _convert(self, view, name, groups, where):
        shape = tuple(view.shape(name))
        if not -len(shape) <= self.axis < len(shape) or shape[self.axis] % 2:
            raise ConversionError(f"{self}: tensor {name!r} of shape {shape} has no axis {self.axis} of even length "
                                  "to swap the halves of")
        axis, half = self.axis % len(shape), shape[self.axis] // 2

        def read():
            arr = view.get(name)
            return concat([take(arr, axis, half, 2 * half), take(arr, axis, 0, half)], axis)
        return _Entry(shape, view.dtype(name), read)

    def inverse(self):
        return (self._other_way(axis=self.axis),)


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
        _check_template(self, self.source, "source")
        _set(self, targets=_tuple(self.targets), sizes=None if self.sizes is None else tuple(self.sizes))
        _check_targets(self, set(_placeholders(self.source)), self.targets)
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
        sizes = _resolve(self, self.sizes, name, view, groups, where)
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
                produced[_fill(target, groups)] = _Entry(piece, view.dtype(name), read)
                start += size
            consumed.add(name)
        return _Converted(view, produced, consumed, self, where)

    def inverse(self):
        return (Concat(self.targets, self.source, self.axis, self.sizes, optional=self.optional),)


def _grouped(rule: Rule, view, sources: Sequence[str], where: str) -> list[tuple[dict, list[str]]]:
    """For each set of placeholder values, the tensor each source template names; a partial set is an error."""
    names = view.names()
    groups: dict[tuple, dict[int, str]] = {}
    values: dict[tuple, dict] = {}
    for i, template in enumerate(sources):
        for name in names:
            if m := _pattern(template).fullmatch(name):
                key = tuple(sorted(m.groupdict().items()))
                groups.setdefault(key, {})[i] = name
                values[key] = m.groupdict()
    if not groups:
        rule._sources(view, sources[0], where)  # raises unless the rule is optional
    out = []
    for key, found in groups.items():
        missing = [_fill(sources[i], values[key]) for i in range(len(sources)) if i not in found]
        if missing:
            raise ConversionError(f"{rule}: the {where} holds {found[min(found)]!r} but not {_short(missing)}, "
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
        _set(self, sources=_tuple(self.sources), sizes=None if self.sizes is None else tuple(self.sizes))
        for s in self.sources:
            _check_template(self, s, "source")
        if len(self.sources) < 2:
            raise ValueError(f"{self}: give at least two sources")
        names = [set(_placeholders(s)) for s in self.sources]
        if any(n != names[0] for n in names):
            raise ValueError(f"{self}: every source must capture the same placeholders")
        _check_targets(self, names[0], [self.target])
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
                raise ConversionError(f"{self}: tensors {_short(names)} have shapes {shapes}, which differ off "
                                      f"axis {self.axis}")
            if self.sizes is not None:
                want = [(_resolve(self, [s], n, view, groups, where)[0]) for s, n in zip(self.sizes, names)]
                got = [s[axis] for s in shapes]
                if any(w not in (-1, g) for w, g in zip(want, got)):
                    raise ConversionError(f"{self}: tensors {_short(names)} have sizes {got} along axis "
                                          f"{self.axis}, not {want}")
            shape = shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1:]
            dtype = np.result_type(*(view.dtype(n) for n in names))
            produced[_fill(self.target, groups)] = _Entry(shape, dtype, functools.partial(_joined, view, names, axis))
            consumed.update(names)
        return _Converted(view, produced, consumed, self, where)

    def inverse(self):
        return (Split(self.target, self.sources, self.axis, self.sizes, optional=self.optional),)


@dataclasses.dataclass(frozen=True, repr=False)
class Tie(Rule):
    """One stored tensor matching ``source`` feeding every name in ``targets`` (tied weights: T5's ``shared``
    embedding is also ``encoder.embed_tokens``). ``source`` may be among the targets. The inverse keeps the first."""

    source: str
    targets: tuple[str, ...]

    def __post_init__(self):
        _check_template(self, self.source, "source")
        _set(self, targets=_tuple(self.targets))
        _check_targets(self, set(_placeholders(self.source)), self.targets)
        if not self.targets:
            raise ValueError(f"{self}: give at least one target")

    def apply(self, view, where="checkpoint"):
        produced, consumed = {}, set()
        for name, groups in self._sources(view, self.source, where):
            entry = _Entry(tuple(view.shape(name)), view.dtype(name), functools.partial(view.get, name))
            for t in self.targets:
                produced[_fill(t, groups)] = entry
            consumed.add(name)
        return _Converted(view, produced, consumed, self, where)

    def inverse(self):
        first, *others = self.targets
        undo: list[Rule] = [Drop(tuple(others), optional=self.optional)] if others else []
        if first != self.source:
            undo.append(Rename(first, self.source, optional=self.optional))
        return tuple(undo)


@dataclasses.dataclass(frozen=True, repr=False)
class _Select(Rule):
    """A rule over the tensors matching any of ``patterns``, which has no inverse: what it leaves out is not
    restored when writing back."""

    patterns: tuple[str, ...]

    def __post_init__(self):
        _set(self, patterns=_tuple(self.patterns))
        for p in self.patterns:
            _check_template(self, p, "pattern")

    def _matched(self, view, where) -> set[str]:
        return {n for p in self.patterns for n, _ in self._sources(view, p, where)}

    def inverse(self):
        return ()


@dataclasses.dataclass(frozen=True, repr=False)
class Drop(_Select):
    """Tensors matching any of ``patterns`` are not used (buffers, other components' weights). Writing back, they
    are not restored: the inverse is nothing."""

    def apply(self, view, where="checkpoint"):
        return _Converted(view, {}, self._matched(view, where), self, where)


@dataclasses.dataclass(frozen=True, repr=False)
class Keep(_Select):
    """Only tensors matching one of ``patterns`` are kept: one component out of an all-in-one file. The inverse is
    nothing (the other components are not restored)."""

    def apply(self, view, where="checkpoint"):
        return _Converted(view, {}, set(view.names()) - self._matched(view, where), self, where)


@dataclasses.dataclass(frozen=True, repr=False)
class Substitute(Rule):
    """``re.sub(pattern, replacement, name)`` for every name (the regex form, for a model's version key maps). A
    pattern that matches nothing is not an error. It has no inverse: regexes do not run backwards."""

    pattern: str
    replacement: str
    optional: bool = dataclasses.field(default=True, kw_only=True)

    def __post_init__(self):
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"{self}: pattern is not a valid regex ({e})") from None

    def apply(self, view, where="checkpoint"):
        produced, origin = {}, {}
        for name in view.names():
            new = re.sub(self.pattern, self.replacement, name)
            if new == name:
                continue
            if new in produced:
                raise ConversionError(f"{self}: {origin[new]!r} and {name!r} both become {new!r}; keep only one "
                                      "of them")
            produced[new] = _Entry(tuple(view.shape(name)), view.dtype(name), functools.partial(view.get, name))
            origin[new] = name
        if not produced and not self.optional:
            raise ConversionError(f"{self}: no tensor in the {where} matches {self.pattern!r}")
        return _Converted(view, produced, set(origin.values()), self, where, origin)


# -- the converter ----------------------------------------------------------------------------------------------------


def _check_rules(rules) -> tuple[Rule, ...]:
    if isinstance(rules, Rule):
        return (rules,)
    rules = tuple(rules)
    for r in rules:
        if not isinstance(r, Rule):
            raise TypeError(f"a conversion is a sequence of rules (Rename, Split, ...); got {r!r}")
    return rules


def convert(view, rules: Rule | Sequence[Rule], *, where: str = "checkpoint"):
    """``view`` (anything with ``names/shape/dtype/get``: a :class:`~eqxdiff.loading.SafetensorsFile`,
    :class:`~eqxdiff.loading.CheckpointFiles`, :class:`TensorDict`) seen through ``rules`` in turn. Names and shapes
    are worked out now (so a rule that does not fit fails here, naming the rule and the tensor); tensors are read
    when asked for."""
    for rule in _check_rules(rules):
        view = rule.apply(view, where)
    return view


def inverse(rules: Rule | Sequence[Rule]) -> tuple[Rule, ...]:
    """The rules that undo ``rules`` (in reverse order): from eqxdiff's names back to the other format."""
    return tuple(undo for rule in reversed(_check_rules(rules)) for undo in rule.inverse())


def convert_tensors(tensors: Mapping[str, Any], rules: Rule | Sequence[Rule], *,
                    where: str = "state dict") -> dict[str, np.ndarray]:
    """``{name: array}`` through ``rules``, read into NumPy arrays (``write_safetensors`` writes them)."""
    view = convert(TensorDict(tensors), rules, where=where)
    return {n: np.ascontiguousarray(np.asarray(view.get(n))) for n in view.names()}
