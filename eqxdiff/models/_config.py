"""Frozen config dataclasses read from a checkpoint's ``config.json``.

Subclasses list their fields with the checkpoint's key names and defaults. ``from_dict`` keeps the known
keys (lists become tuples so configs stay hashable), rejects values it cannot honour, and ignores the
bookkeeping keys (``_diffusers_version`` ...). ``to_dict`` writes them back in the same format.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Self


class ConfigError(ValueError):
    """A config value eqxdiff does not support, or a config that contradicts itself."""


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value):
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Base for model configs. ``SUPPORTED_VALUES`` maps a key that some checkpoints set to the values that
    eqxdiff implements; any other value raises :class:`ConfigError` naming the key and the value."""

    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Self:
        for key, allowed in cls.SUPPORTED_VALUES.items():
            if key in raw and _freeze(raw[key]) not in allowed:
                raise ConfigError(f"{cls.__name__}: unsupported config value {key}={raw[key]!r}; "
                                  f"eqxdiff supports {key} in {list(allowed)}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: _freeze(v) for k, v in raw.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def check(self, condition: bool, key: str, message: str) -> None:
        """Raise :class:`ConfigError` naming ``key`` and its value unless ``condition`` holds."""
        if not condition:
            raise ConfigError(f"{type(self).__name__}: {key}={getattr(self, key)!r} {message}")
