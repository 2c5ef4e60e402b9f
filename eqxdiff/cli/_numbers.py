"""A numeric flag's bad value in the flag's words: ``--steps expects an integer, got 'abc'`` where tyro would say
``invalid literal for int() with base 10: 'abc'`` (its message names neither the flag nor what it takes).

A command asks :func:`number_error` once tyro has refused its command line, with ``{flag: annotation}`` of its
flags (:func:`field_types` reads them off a dataclass); the first numeric flag whose value does not convert as
tyro converts it (``int(text)``, ``float(text)``; ``None`` where the annotation is optional) gives the message.
"""

import dataclasses
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

_KINDS = {int: ("an integer", "integers"), float: ("a number", "numbers")}


def field_types(config, *, dotted: bool = True) -> dict[str, Any]:
    """``{name: annotation}`` of the fields of ``config`` (a dataclass, or an instance: then its nested configs'
    own classes, as a preset's options), those of nested dataclasses spelled out: ``optimizer.learning_rate`` (or
    ``learning_rate`` with ``dotted=False``, for a command whose nested options have no prefix)."""
    cls = config if isinstance(config, type) else type(config)
    hints = typing.get_type_hints(cls, include_extras=False)
    out = {}
    for field in dataclasses.fields(cls):
        value = None if isinstance(config, type) else getattr(config, field.name)
        nested = value if dataclasses.is_dataclass(value) else _dataclass_in(hints[field.name])
        if nested is None:
            out[field.name] = hints[field.name]
        else:
            prefix = f"{field.name}." if dotted else ""
            out.update({prefix + k: v for k, v in field_types(nested, dotted=dotted).items()})
    return out


def _dataclass_in(annotation) -> type | None:
    """The dataclass an annotation holds (``MeshConfig | None``: ``MeshConfig``), or ``None``."""
    return next((m for m in _members(annotation) if dataclasses.is_dataclass(m)), None)


def _members(annotation) -> tuple:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _number(annotation) -> tuple[type, bool, bool] | None:
    """``(int or float, optional, several values)`` of a numeric annotation (``int``, ``float | None``,
    ``tuple[int, ...]``, ``int | tuple[int, int]``), or ``None`` for any other."""
    members = _members(annotation)
    optional = type(None) in members
    kinds, several = set(), False
    for kind in (m for m in members if m is not type(None)):
        if typing.get_origin(kind) in (tuple, list) and typing.get_args(kind):
            kind, several = typing.get_args(kind)[0], True
        kinds.add(kind)
    if len(kinds) != 1 or (kind := kinds.pop()) not in _KINDS:  # (bool is not int: an annotation is the class)
        return None
    return kind, optional, several


def _counts(annotation) -> tuple[int, ...] | None:
    """How many values a numeric flag takes: ``(1, 2)`` for ``int | tuple[int, int]``; ``None``: any number."""
    counts = set()
    for member in (m for m in _members(annotation) if m is not type(None)):
        args = typing.get_args(member) if typing.get_origin(member) in (tuple, list) else ()
        if typing.get_origin(member) is list or Ellipsis in args:
            return None
        counts.add(len(args) or 1)
    return tuple(sorted(counts))


def _converts(text: str, kind: type, optional: bool) -> bool:
    if optional and text == "None":
        return True
    try:
        kind(text)
    except ValueError:
        return False
    return True


def is_flag(token: str) -> bool:
    """Whether argparse reads ``token`` as a flag rather than a value (``-1`` and ``-.5`` are values)."""
    return token.startswith("-") and len(token) > 1 and not (token[1].isdigit() or token[1] == ".")


def number_error(argv: Sequence[str], types_by_flag: Mapping[str, Any]) -> str | None:
    """``--flag expects an integer, got 'abc'`` for the first value in ``argv`` that a numeric flag of
    ``types_by_flag`` (``{"--steps": int, "--ema-decay": float | None, ...}``; ``_`` and ``-`` alike) cannot take,
    else ``None``. Reads ``--flag value``, ``--flag=value`` and a sequence flag's values up to the next flag."""
    flags = {k.replace("_", "-"): v for k, v in types_by_flag.items()}
    for i, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        name, eq, given = token.partition("=")
        number = _number(flags.get(name.replace("_", "-")))
        if number is None:
            continue
        kind, optional, several = number
        values = [given] if eq else []
        if not eq:
            for value in argv[i + 1:]:
                if is_flag(value):
                    break
                values.append(value)
                if not several:
                    break
        for value in values:
            if not _converts(value, kind, optional):
                expects = _KINDS[kind][several] + (" or None" if optional else "")
                return f"{name} expects {expects}, got {value!r}"
        counts = _counts(flags[name.replace("_", "-")])
        if several and not eq and counts and len(values) not in counts:
            return f"{name} takes {' or '.join(map(str, counts))} values, got {len(values)}: {' '.join(values)}"
    return None
