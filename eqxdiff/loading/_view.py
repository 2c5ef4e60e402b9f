"""The views conversion rules produce and the name templates they match: a converted view (names and shapes worked
out, tensors read when asked), ``{placeholder}`` templates, and :class:`Dim`, a size read from the checkpoint."""

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ._errors import ConversionError

# -- views ------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], Any]


class Converted:
    """``base`` after one rule: the names it consumed removed, the ones it produced added."""

    def __init__(self, base, produced: Mapping[str, Entry], consumed: set[str], rule, where: str,
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

    def _entry(self, name: str) -> Entry | None:
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

PLACEHOLDER = re.compile(r"\{(\w+)\}")


def placeholders(template: str) -> list[str]:
    return PLACEHOLDER.findall(template)


@functools.cache
def template_pattern(template: str) -> re.Pattern:
    parts, pos, seen = [], 0, set()
    for m in PLACEHOLDER.finditer(template):
        parts.append(re.escape(template[pos:m.start()]))
        name = m.group(1)
        parts.append(f"(?P={name})" if name in seen else f"(?P<{name}>.+?)")
        seen.add(name)
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("".join(parts))


def fill(template: str, groups: Mapping[str, str]) -> str:
    return PLACEHOLDER.sub(lambda m: groups[m.group(1)], template)


def short(names: Iterable[str], limit: int = 6) -> str:
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


def resolve(rule, entries: Sequence, name: str, view, groups, where) -> list[int]:
    """``entries`` (ints, ``-1``, :class:`Dim`) as ints; ``-1`` is left for the caller to fill."""
    out = []
    for e in entries:
        if isinstance(e, Dim):
            other = name if e.tensor is None else fill(e.tensor, groups)
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
