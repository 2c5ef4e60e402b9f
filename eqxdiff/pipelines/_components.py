"""How a pipeline's components are read, whatever holds them (a pipeline folder or a single file with its
``config=``): the tokenizers, the scheduler with its options, and which class a checkpoint loads as when a caller
asks for another."""

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from ..core import ConfigError
from ..loading import CheckpointError
from ..schedulers import scheduler_from_config


def load_tokenizer(folder):
    """The checkpoint's own tokenizer through transformers (no download)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(folder):
        raise CheckpointError(f"tokenizer folder {os.fspath(folder)!r} not found")
    return AutoTokenizer.from_pretrained(os.fspath(folder))


def build_scheduler(raw: Mapping[str, Any], name: str | None = None, options: Mapping[str, Any] | None = None):
    """``(scheduler, extras)``: the scheduler ``raw`` (a ``scheduler_config.json`` dict) describes, or the one
    ``name`` swaps in (:func:`eqxdiff.schedulers.scheduler_from_config`), with config keys ``options`` set last; and
    the keys of ``raw`` that its class does not read (kept for a later swap and for saving). An option the class
    does not have raises :class:`~eqxdiff.core.ConfigError` naming the ones it has."""
    options = dict(options or {})
    scheduler = scheduler_from_config(raw, name=name, **options)
    fields = {f.name for f in dataclasses.fields(scheduler.config)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ConfigError(f"{type(scheduler).__name__} has no config option(s) {unknown}; it takes "
                          f"{', '.join(sorted(fields))}")
    extras = {k: v for k, v in raw.items() if k not in fields and not k.startswith("_")}
    return scheduler, extras


def pipeline_class_for(cls: type, pipeline_class: type | None, *, where: str, holds: str) -> type:
    """The class a checkpoint (``where``, holding a ``holds``: its pipeline ``cls``) loads as when the caller asks
    for ``pipeline_class`` (``Cls.from_pretrained``, ``load_pipeline(pipeline_class=...)``): ``cls`` if it is one,
    else ``pipeline_class`` if its components are the same (another task of the family: an SDXL base loaded for
    image-to-image); else a :class:`~eqxdiff.loading.CheckpointError`."""
    if pipeline_class is None or issubclass(cls, pipeline_class):
        return cls
    names = {c.name for c in cls.COMPONENTS}
    if names != {c.name for c in pipeline_class.COMPONENTS}:
        raise CheckpointError(f"{where} holds a {holds}, whose components {sorted(names)} a "
                              f"{pipeline_class.__name__} cannot use")
    return pipeline_class
