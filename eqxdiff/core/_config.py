"""The config base of every model and scheduler: frozen dataclasses read from a checkpoint's JSON.

Subclasses list their fields with the checkpoint's key names and defaults. ``from_dict`` keeps the known
keys (lists become tuples so configs stay hashable) and ignores the bookkeeping keys (``_diffusers_version`` ...);
``to_dict`` writes them back in the same format. Every config, however built, is checked once in
:meth:`ModelConfig.__post_init__`: each value against its field's type, and each key in ``SUPPORTED_VALUES``
against the values eqxdiff implements. Subclasses add their own checks after ``super().__post_init__()``.
"""

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from beartype import BeartypeConf
from beartype.door import is_bearable


class ConfigError(ValueError):
    """A config value eqxdiff does not support, a value of the wrong type, or a config that contradicts itself."""


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


_TOWER = BeartypeConf(is_pep484_tower=True)  # an int is an acceptable float, as in JSON


def _bearable(value, hint) -> bool:
    """``value`` fits ``hint``, every entry of a tuple checked: beartype checks one random entry of a container, so a
    list in config.json with one entry of the wrong type would pass or fail by chance."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_bearable(value, a) for a in args)
    if origin is tuple and args:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_bearable(v, args[0]) for v in value)
        return len(value) == len(args) and all(_bearable(v, a) for v, a in zip(value, args))
    return is_bearable(value, hint, conf=_TOWER)


@functools.cache
def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name in hints}


def _same(a, b) -> bool:
    return a == b and type(a) is type(b)  # 1 is not True here


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Base for model and scheduler configs. ``SUPPORTED_VALUES`` maps a key that some checkpoints set to the
    values that eqxdiff implements; any other value raises :class:`ConfigError` naming the key and the value."""

    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {}

    def __post_init__(self):
        name = type(self).__name__
        for f, hint in _field_types(type(self)).items():
            value = _freeze(getattr(self, f))
            object.__setattr__(self, f, value)
            if not _bearable(value, hint):
                raise ConfigError(f"{name}: config value {f}={value!r} has the wrong type; {f} must be "
                                  f"{_describe(hint)}")
        self._check_supported({k: getattr(self, k) for k in self.SUPPORTED_VALUES if k in _field_types(type(self))})

    @classmethod
    def _check_supported(cls, values: Mapping[str, Any]) -> None:
        for key, value in values.items():
            allowed = cls.SUPPORTED_VALUES[key]
            if not any(_same(a, value) or (isinstance(a, float) and type(value) is int and a == value)
                       for a in allowed):
                raise ConfigError(f"{cls.__name__}: unsupported config value {key}={value!r}; eqxdiff supports "
                                  f"{key} in {list(allowed)}")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        # Keys the class fixes rather than stores (``model_type``) are checked here; fields in __post_init__.
        cls._check_supported({k: _freeze(raw[k]) for k in cls.SUPPORTED_VALUES if k in raw and k not in names})
        return cls(**{k: _freeze(v) for k, v in raw.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def check(self, condition: bool, key: str, message: str) -> None:
        """Raise :class:`ConfigError` naming ``key`` and its value unless ``condition`` holds."""
        if not condition:
            raise ConfigError(f"{type(self).__name__}: {key}={getattr(self, key)!r} {message}")


def _describe(hint) -> str:
    text = repr(hint).replace("typing.", "")
    return text.replace("<class '", "").replace("'>", "")
