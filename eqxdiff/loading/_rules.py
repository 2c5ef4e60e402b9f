"""The conversion rules that turn each matching tensor into one (:class:`Rename`, :class:`Transpose`,
:class:`Reshape`, :class:`SwapHalves`), the ones that leave tensors out (:class:`Drop`, :class:`Keep`) and the regex
form (:class:`Substitute`), on the :class:`Rule` base every rule shares. Rules that cut or join tensors are in
:mod:`eqxdiff.loading._fused`."""

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Iterable

import numpy as np

from ._errors import ConversionError
from ._lazy import concat, reshape, take, transpose
from ._view import PLACEHOLDER, Converted, Dim, Entry, fill, placeholders, resolve, short, template_pattern

# -- rules ------------------------------------------------------------------------------------------------------------


def check_template(rule, template, what: str) -> None:
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
        regex = template_pattern(template)
        found = [(n, m.groupdict()) for n in view.names() if (m := regex.fullmatch(n))]
        if not found and not self.optional:
            names = view.names()
            close = difflib.get_close_matches(PLACEHOLDER.sub("0", template), names, n=3, cutoff=0.4)
            hint = f"; the closest names are {short(close)}" if close else f"; it holds {short(sorted(names))}"
            raise ConversionError(f"{self}: no tensor in the {where} matches {template!r}{hint}. Check the rules "
                                  "against the file (or pass optional=True for a tensor some files lack)")
        return found


def as_tuple(value) -> tuple:
    return (value,) if isinstance(value, str) else tuple(value)


def set_fields(obj, **fields) -> None:
    for k, v in fields.items():
        object.__setattr__(obj, k, v)


def check_targets(rule, source_placeholders: set[str], targets: Iterable[str]) -> None:
    for t in targets:
        check_template(rule, t, "target")
        unknown = set(placeholders(t)) - source_placeholders
        if unknown:
            raise ValueError(f"{rule}: target {t!r} uses placeholder(s) {sorted(unknown)} that the source does not "
                             "capture")


@dataclasses.dataclass(frozen=True, repr=False)
class _OneToOne(Rule):
    """A rule that turns each matching tensor into one tensor (in place when ``target`` is ``None``)."""

    def __post_init__(self):
        check_template(self, self.source, "source")
        check_targets(self, set(placeholders(self.source)), [self.target] if self.target else [])

    def _target(self, groups) -> str:
        return fill(self.target or self.source, groups)

    def _other_way(self, **fields):
        """This rule's class reading ``target`` back into ``source``."""
        if self.target is None:
            return type(self)(self.source, optional=self.optional, **fields)
        return type(self)(self.target, target=self.source, optional=self.optional, **fields)

    def _convert(self, view, name: str, groups, where) -> Entry:
        raise NotImplementedError

    def apply(self, view, where="checkpoint"):
        produced, origin = {}, {}
        for name, groups in self._sources(view, self.source, where):
            new = self._target(groups)
            if new in produced:
                raise ConversionError(f"{self}: {origin[new]!r} and {name!r} both become {new!r}")
            produced[new], origin[new] = self._convert(view, name, groups, where), name
        return Converted(view, produced, set(origin.values()), self, where, origin)


@dataclasses.dataclass(frozen=True, repr=False)
class Rename(_OneToOne):
    """Tensors matching ``source`` are called ``target``: ``Rename("transformer.{rest}", "text_model.{rest}")``."""

    source: str
    target: str

    def _convert(self, view, name, groups, where):
        return Entry(tuple(view.shape(name)), view.dtype(name), functools.partial(view.get, name))

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
        set_fields(self, perm=tuple(self.perm))

    def _convert(self, view, name, groups, where):
        shape = tuple(view.shape(name))
        if sorted(self.perm) != list(range(len(shape))):
            raise ConversionError(f"{self}: tensor {name!r} has shape {shape}; perm {self.perm} is not a "
                                  f"permutation of its {len(shape)} axes")
        return Entry(tuple(shape[p] for p in self.perm), view.dtype(name),
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
        set_fields(self, shape=tuple(self.shape),
             inverse_shape=None if self.inverse_shape is None else tuple(self.inverse_shape))

    def _convert(self, view, name, groups, where):
        stored = tuple(view.shape(name))
        shape = resolve(self, self.shape, name, view, groups, where)
        if shape.count(-1) == 1:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = math.prod(stored) // known if known else 0
        if math.prod(shape) != math.prod(stored) or any(s < 0 for s in shape):
            raise ConversionError(f"{self}: tensor {name!r} of shape {stored} cannot be reshaped to "
                                  f"{tuple(shape)}")
        shape = tuple(shape)
        return Entry(shape, view.dtype(name), lambda: reshape(view.get(name), shape))

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
        return Entry(shape, view.dtype(name), read)

    def inverse(self):
        return (self._other_way(axis=self.axis),)


@dataclasses.dataclass(frozen=True, repr=False)
class _Select(Rule):
    """A rule over the tensors matching any of ``patterns``, which has no inverse: what it leaves out is not
    restored when writing back."""

    patterns: tuple[str, ...]

    def __post_init__(self):
        set_fields(self, patterns=as_tuple(self.patterns))
        for p in self.patterns:
            check_template(self, p, "pattern")

    def _matched(self, view, where) -> set[str]:
        return {n for p in self.patterns for n, _ in self._sources(view, p, where)}

    def inverse(self):
        return ()


@dataclasses.dataclass(frozen=True, repr=False)
class Drop(_Select):
    """Tensors matching any of ``patterns`` are not used (buffers, other components' weights). Writing back, they
    are not restored: the inverse is nothing."""

    def apply(self, view, where="checkpoint"):
        return Converted(view, {}, self._matched(view, where), self, where)


@dataclasses.dataclass(frozen=True, repr=False)
class Keep(_Select):
    """Only tensors matching one of ``patterns`` are kept: one component out of an all-in-one file. The inverse is
    nothing (the other components are not restored)."""

    def apply(self, view, where="checkpoint"):
        return Converted(view, {}, set(view.names()) - self._matched(view, where), self, where)


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
            produced[new] = Entry(tuple(view.shape(name)), view.dtype(name), functools.partial(view.get, name))
            origin[new] = name
        if not produced and not self.optional:
            raise ConversionError(f"{self}: no tensor in the {where} matches {self.pattern!r}")
        return Converted(view, produced, set(origin.values()), self, where, origin)


def select(prefix: str) -> tuple[Rule, ...]:
    """Only the tensors under ``prefix`` (one component of an all-in-one file), with the prefix removed. Written
    back, the prefix returns."""
    return (Keep(prefix + "{name}"), Rename(prefix + "{name}", "{name}"))
