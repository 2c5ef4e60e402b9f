"""A pipeline's components and how they are read, whatever holds them (a pipeline folder or a single file with its
``config=``): what a :class:`Component` (one ``model_index.json`` entry) is, the tokenizers, the scheduler with its
options, and which class a checkpoint loads as when a caller asks for another."""

import dataclasses
import os
import warnings
from collections.abc import Mapping
from typing import Any

from ..core import ConfigError
from ..loading import CheckpointError, file_tokenizer, tokenizer_class
from ..schedulers import scheduler_from_config

__all__ = ["COMPONENT_KINDS", "LIBRARIES", "Component", "SchedulerConfigWarning", "build_scheduler",
           "fixed_scheduler_config", "load_processor", "load_tokenizer", "pipeline_class_for"]

COMPONENT_KINDS = ("model", "tokenizer", "processor", "scheduler")
LIBRARIES = ("diffusers", "transformers")


@dataclasses.dataclass(frozen=True)
class Component:
    """One entry of a pipeline's ``model_index.json``: a subfolder of the pipeline folder.

    ``kind``: ``"model"`` (read with :func:`eqxdiff.load`), ``"tokenizer"`` (:func:`load_tokenizer`), ``"processor"``
    (a transformers image processor: CLIP's resize, crop and normalisation, :func:`load_processor`) or
    ``"scheduler"``.
    ``library``: what ``model_index.json`` says reads it (``diffusers`` or ``transformers``). ``classes``: the
    checkpoint classes (``model_index.json``'s ``[library, class]``, family-table names) the pipeline runs there;
    :func:`~eqxdiff.pipelines.load_pipeline` refuses any other before loading it (empty: any model eqxdiff serves).
    ``optional``: a folder may lack it (``[null, null]`` in the index). ``encoder``: a text/image encoder, kept in
    host memory with ``offload_encoders``. ``scan``: stacked under ``scan_layers`` (models with repeated layers)."""

    name: str
    library: str
    kind: str = "model"
    classes: tuple[str, ...] = ()
    optional: bool = False
    encoder: bool = False
    scan: bool = True

    def __post_init__(self):
        if self.kind not in COMPONENT_KINDS or self.library not in LIBRARIES:
            raise ValueError(f"Component {self.name!r}: kind={self.kind!r} (one of {COMPONENT_KINDS}), "
                             f"library={self.library!r} (one of {LIBRARIES})")
        if isinstance(self.classes, str) or not all(isinstance(c, str) for c in self.classes):
            raise ValueError(f"Component {self.name!r}: classes={self.classes!r} must be a tuple of class names")
        if self.classes and self.kind != "model":
            raise ValueError(f"Component {self.name!r}: classes are checked for models, not a {self.kind}")


def load_tokenizer(folder):
    """The checkpoint's own tokenizer (no download): read with ``tokenizers`` alone where transformers would run the
    folder's ``tokenizer.json`` as it is (:func:`~eqxdiff.loading.file_tokenizer`: the same ids, without importing
    transformers), else through transformers."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"tokenizer folder {os.fspath(folder)!r} not found")
    if (tokenizer := file_tokenizer(folder)) is not None:
        return tokenizer
    return tokenizer_class(folder).from_pretrained(os.fspath(folder))  # AutoTokenizer's choice, without torch


def load_processor(folder, entry):
    """The checkpoint's own image processor through transformers (no download): the class its ``model_index.json``
    ``entry`` (``["transformers", "CLIPImageProcessor"]``) names, read from ``folder``'s
    ``preprocessor_config.json``."""
    import transformers

    name = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 else entry
    cls = getattr(transformers, str(name), None)
    if not os.path.isdir(folder):
        raise CheckpointError(f"image processor folder {os.fspath(folder)!r} not found")
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise CheckpointError(f"model_index.json names the image processor class {name!r}, which transformers does "
                              f"not have; the folder {os.fspath(folder)!r} needs a transformers image processor "
                              "(CLIPImageProcessor)")
    return cls.from_pretrained(os.fspath(folder))


class SchedulerConfigWarning(UserWarning):
    """A folder's scheduler config value that its pipeline class reads as another, as diffusers' does."""


def fixed_scheduler_config(raw: Mapping[str, Any], fixes: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with the values of ``fixes`` (key -> value) where the folder's own scheduler class has the key at
    another value (its config's default counting where ``raw`` leaves the key out): what diffusers' SD pipelines'
    constructors do to an outdated scheduler config (``steps_offset`` 1, ``clip_sample`` False, the inpainting
    pipeline's PNDM ``skip_prk_steps`` True), each with a :class:`SchedulerConfigWarning` as diffusers'
    deprecation warning. Keys the class does not have are left alone, as diffusers' ``getattr`` default does."""
    out = dict(raw)
    if not fixes:
        return out
    config = scheduler_from_config(raw).config
    for key, value in fixes.items():
        current = getattr(config, key, value)
        if current != value:
            warnings.warn(f"the scheduler config's {key}={current!r} is read as {key}={value!r}, as diffusers' "
                          f"pipeline does with an outdated config; set {key}={value!r} in scheduler_config.json to "
                          "silence this", SchedulerConfigWarning, stacklevel=3)
            out[key] = value
    return out


def build_scheduler(raw: Mapping[str, Any], name: str | None = None, options: Mapping[str, Any] | None = None, *,
                    fixes: Mapping[str, Any] | None = None):
    """``(scheduler, extras)``: the scheduler ``raw`` (a ``scheduler_config.json`` dict) describes, or the one
    ``name`` swaps in (:func:`eqxdiff.schedulers.scheduler_from_config`), with config keys ``options`` set last; and
    the keys of ``raw`` that its class does not read (kept for a later swap and for saving). ``fixes``: the
    pipeline class's :attr:`~eqxdiff.pipelines.DiffusionPipeline.SCHEDULER_FIXES`, applied to the folder's config
    first (:func:`fixed_scheduler_config`). An option the class does not have raises
    :class:`~eqxdiff.core.ConfigError` naming the ones it has."""
    raw = fixed_scheduler_config(raw, fixes or {})
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
    else ``pipeline_class`` if its components are the same, give or take optional ones it has (another task of the
    family: an SDXL base loaded for image-to-image, a Wan TI2V-5B text-to-video folder for image-to-video); else a
    :class:`~eqxdiff.loading.CheckpointError`."""
    if pipeline_class is None or issubclass(cls, pipeline_class):
        return cls
    names = {c.name for c in cls.COMPONENTS}
    if names != {c.name for c in pipeline_class.COMPONENTS if not c.optional or c.name in names}:
        raise CheckpointError(f"{where} holds a {holds}, whose components {sorted(names)} a "
                              f"{pipeline_class.__name__} cannot use")
    return pipeline_class
