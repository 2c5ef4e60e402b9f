"""The pipeline base and its folder form: :class:`DiffusionPipeline` (its table of components, placement on a mesh
with encoder offload, timings, the helpers a ``__call__`` uses), and :func:`load_pipeline` / :func:`save_pipeline`,
which read its components from a diffusers folder straight into dtype and sharding and write them back.

A family's pipeline subclasses :class:`DiffusionPipeline`, lists its :class:`~eqxdiff.pipelines.Component` s and its
``model_index.json`` class name, and writes ``__call__`` (decorated with
:func:`~eqxdiff.pipelines.checked_call`) from its own pre/post steps plus :func:`eqxdiff.pipelines.denoise_loop` with
its :class:`~eqxdiff.pipelines.Denoiser`. ``eqxdiff.load_pipeline`` finds the class through the family table
(:data:`eqxdiff.core.FAMILY_TABLE`).
"""

import contextlib
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from ..core import DEFAULT_RULES, ConfigError, ModelConfig, Plan, family_names, resolve_class
from ..loading import (
    CheckpointError,
    check_dtype,
    class_name_of,
    load,
    model_class,
    read_config,
    replacing_folder,
    resolve_folder,
    save_pretrained,
)
from ..nn import with_attention_implementation
from ..parallel import shard_batch, shard_params, sharding_fn, with_plan
from ._call import COMPILE_SUFFIX, call_argument_names, check_call_class, compile_seconds
from ._checks import CallLimits, check_arguments
from ._components import Component, build_scheduler, load_processor, load_tokenizer, pipeline_class_for
from ._diffusers_api import DiffusersApiMixin
from ._lora import LoraMixin

EQXDIFF_KEY = "_eqxdiff"  # model_index.json's entry for eqxdiff's own settings (the recommended call)


class DiffusionPipeline(LoraMixin, DiffusersApiMixin):
    """Base of eqxdiff's pipelines. Subclasses set :attr:`CLASS_NAME` (their ``model_index.json``
    ``_class_name``), :attr:`COMPONENTS` and write ``__call__``, decorated with
    :func:`~eqxdiff.pipelines.checked_call`; components become attributes of the same name.

    ``attention`` picks the attention kernel of every model but the encoders (the denoisers, ControlNets and the
    VAE; a text or image encoder keeps its own, as T5's relative-position bias needs a kernel that takes a logits
    bias, which the context-parallel, flash and cuDNN kernels do not); ``activations_dtype`` is the dtype of latents and
    activations (default: float32). ``mesh`` (:func:`eqxdiff.parallel.make_mesh`) runs every model on it:
    parameters placed by ``rules`` (default :data:`eqxdiff.parallel.DEFAULT_RULES`), activations constrained at
    block boundaries, the batch split over data+fsdp. ``offload_encoders`` keeps the encoders' weights in host
    memory and puts them on the devices only while they encode (:meth:`encoder`), so they are gone before the loop.

    :attr:`timings` holds the last call's seconds: ``"call"`` (the whole call) and each stage a family times
    (``"encode"``, ``"prepare"``, ``"denoise"``, ``"decode"`` ...), wall time with compiling included, and beside each
    the compile seconds within it (``"call_compile"``, ``"denoise_compile"`` ...); run time is their difference.
    """

    CLASS_NAME: ClassVar[str]
    COMPONENTS: ClassVar[tuple[Component, ...]]
    # model_index.json entries diffusers expects that eqxdiff does not use (written on save, ignored on load).
    INDEX_EXTRAS: ClassVar[Mapping[str, Any]] = {}
    # The pipeline's own settings in model_index.json (diffusers' register_to_config), with their defaults: read on
    # load, written on save, attributes of the pipeline (SDXL's force_zeros_for_empty_prompt ...).
    OPTIONS: ClassVar[Mapping[str, Any]] = {}
    # The call argument holding the picture an image-to-image call starts from (diffusers' names), or None where the
    # class's image argument is no such start (a ControlNet text-to-image pipeline's image is its control image).
    INIT_IMAGE: ClassVar[str | None] = "image"
    # What that picture is where a call cannot run without it ("the first frame of the video"; None: optional):
    # check_arguments refuses a call leaving it out first, asking "pass image= (what it is)", before loading too.
    REQUIRED_IMAGE: ClassVar[str | None] = None
    # Scheduler config values the class's diffusers namesake forces on a folder's outdated config (key -> value).
    SCHEDULER_FIXES: ClassVar[Mapping[str, Any]] = {}
    # What a user sets on a pipeline after building it (enable_vae_tiling's vae_tiling ...), carried by from_pipe and
    # with_scheduler to the pipeline they build.
    SETTINGS: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        check_call_class(cls)  # its __call__ wrapped by checked_call, its LoRA-scale argument in the signature

    def __init__(self, *, attention: str | None = None, activations_dtype=jnp.float32, mesh=None, rules=None,
                 offload_encoders: bool = False, scheduler_extras: Mapping[str, Any] | None = None,
                 call_defaults: Mapping[str, Any] | None = None, **components_and_options):
        name = type(self).__name__
        known = {c.name: c for c in self.COMPONENTS}
        options = {k: components_and_options.pop(k) for k in list(components_and_options) if k in self.OPTIONS}
        components = components_and_options
        unknown = sorted(set(components) - set(known))
        if unknown:
            raise TypeError(f"{name}: unknown component(s) or option(s) {unknown}; its components are "
                            f"{list(known)}, its options {list(self.OPTIONS)}")
        for key, default in self.OPTIONS.items():
            setattr(self, key, _option(name, key, options.get(key, default), default))
        missing = [c.name for c in self.COMPONENTS if not c.optional and components.get(c.name) is None]
        if missing:
            raise TypeError(f"{name}: missing component(s) {missing}")
        self.activations_dtype = jnp.dtype(activations_dtype)
        # scheduler_config.json keys the scheduler's class does not read (a DPM-Solver config's clip_sample):
        # carried to a swapped scheduler and written back on save, as diffusers keeps them.
        self.scheduler_extras = dict(scheduler_extras or {})
        # The folder's recommended call (model_index.json's "_eqxdiff": {"call_defaults": ...}): arguments a call
        # does not give take these values before the signature's defaults (checked_call applies them).
        self.call_defaults = self.check_call_defaults(call_defaults)
        self.timings: dict[str, float] = {}
        self.mesh, self.offload_encoders = mesh, offload_encoders
        self.rules = (rules or DEFAULT_RULES) if mesh is not None else rules
        for c in self.COMPONENTS:
            value = components.get(c.name)
            if c.kind == "model" and value is not None:
                value = self.place(value, encoder=c.encoder, attention=attention)
            setattr(self, c.name, value)

    def place(self, model, *, encoder: bool, attention: str | None = None):
        """``model`` placed as this pipeline's models are: a denoiser with ``attention``; on the mesh with its plan;
        an encoder in host memory under ``offload_encoders`` (also one loaded later: an IP-Adapter's image encoder)."""
        if attention and not encoder:
            model = with_attention_implementation(model, attention)
        offload = self.offload_encoders and encoder
        if self.mesh is not None:
            if not offload:
                model = shard_params(model, self.mesh, self.rules)
            model = with_plan(model, Plan(self.mesh, self.rules))
        return jax.device_get(model) if offload else model

    @classmethod
    def check_call_defaults(cls, defaults: Mapping[str, Any] | None, where: str = "call_defaults") -> dict[str, Any]:
        """``defaults`` as a dict of this class's call arguments; a name its ``__call__`` does not take is a
        :class:`~eqxdiff.core.ConfigError` naming it (``where``: the setting's source) and the arguments there are."""
        defaults = dict(defaults or {})
        taken = call_argument_names(cls)
        unknown = sorted(set(defaults) - taken)
        if unknown:
            raise ConfigError(f"{where} names {unknown}, which {cls.__name__}.__call__ does not take; its arguments "
                              f"are {sorted(taken)}")
        return defaults

    # -- loading and saving ------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_hub_id, **kwargs):
        """This pipeline from a diffusers folder or Hub id (see :func:`load_pipeline`)."""
        return load_pipeline(path_or_hub_id, pipeline_class=cls, **kwargs)

    def save_pretrained(self, folder, *, dtype=None) -> Path:
        return save_pipeline(self, folder, dtype=dtype)

    @classmethod
    def component_classes(cls, component: Component) -> tuple[str, ...]:
        """The checkpoint classes (``model_index.json`` names) this pipeline runs as ``component``: its
        :attr:`Component.classes`. A pipeline whose choice is its own (a ControlNet pipeline's nets) overrides this."""
        return component.classes

    @classmethod
    def check_component_class(cls, component: Component, entry, where: str) -> None:
        """Raise :class:`~eqxdiff.loading.CheckpointError` unless ``entry`` (``component``'s ``[library, class]`` in
        the ``model_index.json`` of ``where``) names a class this pipeline runs there (:meth:`component_classes`)."""
        accepted = cls.component_classes(component)
        found = entry[1] if isinstance(entry, (list, tuple)) and len(entry) == 2 else entry
        if component.kind != "model" or not accepted or found in accepted:
            return
        raise CheckpointError(
            f"model_index.json in {where} gives component {component.name!r} the class {found!r}, but a "
            f"{cls.__name__} runs {' or '.join(accepted)} as its {component.name}; use a folder made for this "
            f"pipeline, or replace its {component.name}/ with a {accepted[0]} (eqxdiff.load it to check)")

    @classmethod
    def check_config_overrides(cls, overrides: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict]:
        """:func:`load_pipeline`'s ``config_overrides`` checked against this pipeline's models: a mapping from
        model components to the config keys set in each (``{"transformer": {"fused_projections": True}}``);
        returned as a dict of dicts (``{}`` for ``None``). Each model's keys are checked by :func:`eqxdiff.load`."""
        if overrides is None:
            return {}
        models = [c.name for c in cls.COMPONENTS if c.kind == "model"]
        if not isinstance(overrides, Mapping) or not all(isinstance(v, Mapping) for v in overrides.values()):
            raise ConfigError(f"config_overrides={overrides!r} must map model components to the config keys to set "
                              f"in each, e.g. {{{models[-1]!r}: {{key: value}}}}; a {cls.__name__}'s models are "
                              f"{models}")
        unknown = sorted(set(overrides) - set(models))
        if unknown:
            raise ConfigError(f"config_overrides names {unknown}, not models of a {cls.__name__}: its models are "
                              f"{models} (the scheduler's keys go in scheduler_options)")
        return {name: dict(keys) for name, keys in overrides.items()}

    @classmethod
    def load_component(cls, folder: Path, component: Component, entry, **load_kwargs):
        """Model ``component`` from pipeline ``folder`` (``entry``: its ``[library, class]`` in model_index.json;
        ``load_kwargs`` go to :func:`eqxdiff.load`). A component stored in several folders overrides this."""
        return load(folder, component.name, **load_kwargs)

    def save_component(self, folder: Path, component: Component, value, *, dtype=None) -> list:
        """Write model ``component`` (``value``) into pipeline ``folder``; returns its model_index.json entry."""
        save_pretrained(value, folder / component.name, dtype=dtype)
        return [component.library, type(value).__name__]

    @classmethod
    def from_pipe(cls, pipe: "DiffusionPipeline", **overrides):
        """This pipeline class sharing ``pipe``'s components (no copy, no reload): e.g. an SDXL refiner built from
        the base's ``text_encoder_2`` and ``vae``. ``overrides`` replace components or options; components
        ``pipe`` lacks are ``None`` (they must be optional here or given). The :attr:`SETTINGS` both classes have
        (VAE tiling ...) are carried over, as diffusers' VAE keeps its tiling when it is shared, and so are the LoRA
        adapters of the models it shares (a copy of their bookkeeping: ``set_adapters`` on one leaves the other)."""
        shared = {c.name: getattr(pipe, c.name, None) for c in cls.COMPONENTS}
        options = {k: getattr(pipe, k) for k in cls.OPTIONS if hasattr(pipe, k)}
        taken = call_argument_names(cls)
        defaults = {k: v for k, v in getattr(pipe, "call_defaults", {}).items() if k in taken}
        new = cls(activations_dtype=pipe.activations_dtype, mesh=pipe.mesh, rules=pipe.rules,
                  offload_encoders=pipe.offload_encoders,
                  **{"scheduler_extras": pipe.scheduler_extras, "call_defaults": defaults, **shared, **options,
                     **overrides})
        for key in cls.SETTINGS:
            if key in pipe.SETTINGS:
                setattr(new, key, getattr(pipe, key))
        new._carry_lora(pipe, overrides)  # the shared models' adapters, set_adapters / fuse_lora on them
        return new

    # -- what a call may ask for -----------------------------------------------------------------------------

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any], limits: CallLimits | None = None) -> None:
        """Check call ``arguments`` (``__call__``'s names -> values) before anything is loaded or compiled:
        every call runs this with :meth:`call_limits`, ``eqxdiff-generate`` with :meth:`folder_limits` before it
        loads the pipeline. Raises :class:`~eqxdiff.pipelines.InputError` naming the argument and the fix. The
        shared diffusers names are checked by :func:`eqxdiff.pipelines.check_arguments`; a family with arguments
        of its own overrides this and calls ``super()``."""
        check_arguments(arguments, limits or CallLimits(), init_image=cls.INIT_IMAGE, required_image=cls.REQUIRED_IMAGE)

    # The components whose configs decide a call's limits, handed in this order to limits_from (which call_limits
    # and folder_limits use: the loaded models' configs, a folder's).
    LIMIT_COMPONENTS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def limits_from(cls, *configs: ModelConfig | None) -> CallLimits:
        """The call limits from the configs of :attr:`LIMIT_COMPONENTS` (``None`` for a missing one)."""
        return CallLimits()

    def call_limits(self) -> CallLimits:
        """What this pipeline's models allow its call arguments (the VAE's factor, the text encoder's layers)."""
        return self.limits_from(*(getattr(getattr(self, name, None), "config", None)
                                  for name in self.LIMIT_COMPONENTS))

    def check_call(self, arguments: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Checks of a call that need its components (the schedule for the steps ...), before anything is encoded or
        compiled; may return keyword arguments it resolved (``{name: value}``), which the call takes as they are."""

    @classmethod
    def folder_limits(cls, read_json: Callable[[str], Mapping | None]) -> CallLimits:
        """:meth:`call_limits` from the configs of a pipeline folder, before loading it: ``read_json(path)`` reads
        ``path`` (``"vae/config.json"``) relative to the folder, ``None`` if it is missing. Read the configs with
        :meth:`folder_config`, which checks them as loading would."""
        return cls.limits_from(*(cls.folder_config(read_json, name) for name in cls.LIMIT_COMPONENTS))

    @classmethod
    def folder_call_defaults(cls, read_json: Callable[[str], Mapping | None]) -> dict[str, Any]:
        """:attr:`call_defaults` of a pipeline folder before loading it (``read_json`` as for :meth:`folder_limits`):
        its ``model_index.json``'s recommended call, checked as :func:`load_pipeline` checks it."""
        where = "model_index.json"
        return cls.check_call_defaults(_eqxdiff_entry(read_json(where) or {}, where).get("call_defaults"),
                                       f"{where} (_eqxdiff.call_defaults)")

    @classmethod
    def folder_config(cls, read_json: Callable[[str], Mapping | None], name: str) -> ModelConfig | None:
        """Component ``name``'s ``config.json`` (``read_json`` as for :meth:`folder_limits`) read into its config
        class, as :func:`eqxdiff.load` reads it: every value type-checked, a bad one raising
        :class:`~eqxdiff.core.ConfigError` that names the file and the key. The class is the one the config names
        (``_class_name`` / ``architectures``), else the component's first of :meth:`component_classes`; ``None``
        without a config or a class eqxdiff serves (loading says why)."""
        path = f"{name}/config.json"
        raw = read_json(path)
        if raw is None:
            return None
        component = next((c for c in cls.COMPONENTS if c.name == name), None)
        accepted = cls.component_classes(component) if component is not None else ()
        named = raw.get("_class_name") or (raw.get("architectures") or [None])[0]
        try:
            model = model_class(class_name_of(raw, path) if named or not accepted else accepted[0])
        except CheckpointError:
            return None
        try:
            return model.config_class.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @property
    def options(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.OPTIONS}

    @property
    def components(self) -> dict[str, Any]:
        return {c.name: getattr(self, c.name) for c in self.COMPONENTS}

    def with_scheduler(self, name: str | None = None, **overrides):
        """The same pipeline with another scheduler (``"euler"``, ``"dpm++2m_karras"`` ...; ``None``: the same
        class), keeping the checkpoint's noise schedule and prediction type (and the config keys it does not read,
        such as ``clip_sample``); ``overrides`` set config keys (:func:`build_scheduler`). The rest is shared
        (:meth:`from_pipe`)."""
        raw = {**self.scheduler_extras, **self.scheduler.config.to_dict(), "_class_name": type(self.scheduler).__name__}
        scheduler, extras = build_scheduler(raw, name, overrides)
        return self.from_pipe(self, scheduler=scheduler, scheduler_extras=extras)

    # -- helpers for __call__ ------------------------------------------------------------------------------------

    def encoder(self, name: str):
        """Component ``name`` on the devices: an offloaded encoder is placed there for this use only (released
        when the returned model goes)."""
        return self.encoder_on_devices(getattr(self, name))

    def encoder_on_devices(self, model):
        """An encoder ``model`` on the devices (:meth:`encoder`'s, for one held elsewhere: an IP-Adapter's)."""
        if not self.offload_encoders:
            return model
        return jax.tree.map(jnp.asarray, model) if self.mesh is None else shard_params(model, self.mesh, self.rules)

    def shard(self, x):
        """``x`` (a pytree of batch-major arrays) placed on the mesh, the batch over data+fsdp."""
        return x if self.mesh is None else shard_batch(x, self.mesh, self.rules)

    def gather(self, x):
        """``x`` whole on every host (multi-host meshes); unchanged otherwise."""
        if self.mesh is not None and not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return multihost_utils.process_allgather(x, tiled=True)
        return x

    @contextlib.contextmanager
    def timed(self, stage: str):
        """Record a stage's (``encode``, ``denoise``, ``decode`` ...) wall time in :attr:`timings` under its name, and
        the seconds spent compiling JAX programs meanwhile under ``stage + "_compile"`` (:func:`compile_seconds`)."""
        compiled, t0 = compile_seconds(), time.perf_counter()
        try:
            yield
        finally:
            self.timings[stage] = time.perf_counter() - t0
            self.timings[stage + COMPILE_SUFFIX] = compile_seconds() - compiled


def _option(pipeline: str, key: str, value, default):
    """``value`` checked against the type of the option's default (an int is accepted for a float); an option whose
    default is ``None`` (unset, as diffusers' ``boundary_ratio``) takes ``None`` or a number."""
    if default is None:
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return value
        raise TypeError(f"{pipeline}: option {key}={value!r} must be a number or None")
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if type(value) is not type(default):
        raise TypeError(f"{pipeline}: option {key}={value!r} must be a {type(default).__name__} (like its default "
                        f"{default!r})")
    return value


def _index_entry(index: Mapping, name: str):
    entry = index.get(name)
    return None if not entry or entry[0] is None else entry


def load_pipeline(path_or_hub_id, *, dtype=None, revision: str | None = None, variant: str | None = None,
                  scheduler: str | None = None, attention: str | None = None, activations_dtype=None,
                  sharding=None, mesh=None, rules=None, offload_encoders: bool = False, scan_layers: bool = False,
                  pipeline_class: type | None = None, config=None, scheduler_options: Mapping[str, Any] | None = None,
                  config_overrides: Mapping[str, Mapping[str, Any]] | None = None):
    """Load every component a ``model_index.json`` lists and return the pipeline its ``_class_name`` names.

    ``dtype`` sets the weights (default float32); ``scheduler`` swaps the checkpoint's scheduler by name
    (see :data:`eqxdiff.schedulers.SCHEDULERS`) and ``scheduler_options`` sets its config keys
    (``{"clip_sample": False}``, :func:`build_scheduler`); ``attention`` picks the attention kernel of every model but
    the encoders; ``activations_dtype`` (default: the weights' dtype) is the dtype of latents and activations. ``mesh``
    (:func:`eqxdiff.parallel.make_mesh`) loads every weight straight onto its rule-given sharding (``rules``,
    default :data:`eqxdiff.parallel.DEFAULT_RULES`; each device reads only its slices) and runs the pipeline on
    the mesh; ``offload_encoders`` keeps the encoders in host memory outside encoding. ``scan_layers`` stacks the
    models' repeated layers (run with ``lax.scan``: faster compiles, same numbers; see
    :func:`eqxdiff.nn.scan_layers`). ``config_overrides`` sets config keys of the models, per component, as
    :func:`eqxdiff.load`'s does for one (``{"transformer": {"fused_projections": True}}``: Flux's fused projections;
    :meth:`DiffusionPipeline.check_config_overrides`). The class's :attr:`~DiffusionPipeline.OPTIONS` are read from
    ``model_index.json``. ``pipeline_class`` (``Cls.from_pretrained``) loads the folder as that class: a subclass
    of it, or another task of the same family (the same components, e.g. an SDXL base folder as image-to-image).
    A single ``.safetensors`` file in a layout a family declares (A1111 / ComfyUI / SGM, Black Forest Labs; see
    :data:`eqxdiff.core.SINGLE_FILE_LAYOUTS`) is read by :func:`eqxdiff.pipelines._single_file.read_single_file`;
    ``config`` (a diffusers folder or Hub id) gives what such a file lacks (tokenizers, scheduler, configs). A file
    fills the components its layout names; a mapping says which each file fills: Wan 2.2 A14B's two experts as
    ``load_pipeline({"transformer": high_noise_file, "transformer_2": low_noise_file}, config=folder)`` (a lone
    expert file fills ``transformer``, with an ``InputWarning`` naming the mapping that puts it elsewhere)."""
    weights_dtype = check_dtype(dtype) or check_dtype("float32")
    act_dtype = check_dtype(activations_dtype) or weights_dtype
    if mesh is not None and sharding is None:
        sharding = sharding_fn(mesh, rules or DEFAULT_RULES)
    if config is not None or isinstance(path_or_hub_id, Mapping) or os.path.isfile(os.path.expanduser(path_or_hub_id)):
        from ._single_file import read_single_file  # here: a folder needs neither it nor huggingface_hub
        read = read_single_file(
            path_or_hub_id, config=config, revision=revision, dtype=weights_dtype, sharding=sharding,
            offload_encoders=offload_encoders, scan_layers=scan_layers, scheduler=scheduler,
            scheduler_options=scheduler_options, pipeline_class=pipeline_class, config_overrides=config_overrides)
        return read.cls(attention=attention, activations_dtype=act_dtype, mesh=mesh, rules=rules,
                        offload_encoders=offload_encoders, scheduler_extras=read.scheduler_extras,
                        **read.components, **read.options)
    folder = resolve_folder(path_or_hub_id, revision=revision)
    index = read_config(folder, "model_index.json")
    cls, overrides = _folder_class(folder, index, pipeline_class, config_overrides)
    components, extras = {}, {}
    for c in cls.COMPONENTS:
        if _index_entry(index, c.name) is None:
            components[c.name] = None
        elif c.kind == "model":
            offload = offload_encoders and c.encoder
            components[c.name] = cls.load_component(folder, c, index[c.name], dtype=weights_dtype, variant=variant,
                                                    sharding=None if offload else sharding,
                                                    scan_layers=scan_layers and c.scan,
                                                    config_overrides=overrides.get(c.name))
        elif c.kind == "tokenizer":
            components[c.name] = load_tokenizer(folder / c.name)
        elif c.kind == "processor":
            components[c.name] = load_processor(folder / c.name, index[c.name])
        else:
            raw = read_config(folder / c.name, "scheduler_config.json")
            components[c.name], extras = build_scheduler(raw, scheduler, scheduler_options, fixes=cls.SCHEDULER_FIXES)
    options = {k: index[k] for k in cls.OPTIONS if k in index}
    where = f"model_index.json in {os.fspath(folder)!r}"
    defaults = cls.check_call_defaults(_eqxdiff_entry(index, where).get("call_defaults"),
                                       f"{where} (_eqxdiff.call_defaults)")
    return cls(attention=attention, activations_dtype=act_dtype, mesh=mesh, rules=rules,
               offload_encoders=offload_encoders, scheduler_extras=extras, call_defaults=defaults, **components,
               **options)


def _eqxdiff_entry(index: Mapping, where: str) -> Mapping:
    """model_index.json's ``"_eqxdiff"`` entry (``where``: the file, for the error): eqxdiff's own settings for the
    folder (diffusers, which keeps no call defaults, ignores keys starting with an underscore)."""
    entry = index.get(EQXDIFF_KEY, {})
    if not isinstance(entry, Mapping) or not isinstance(entry.get("call_defaults", {}), Mapping):
        raise ConfigError(f"{where}: \"{EQXDIFF_KEY}\" must be an object such as "
                          '{"call_defaults": {"num_inference_steps": 20}}')
    return entry


def _folder_class(folder: Path, index: Mapping, pipeline_class: type | None, config_overrides) -> tuple[type, dict]:
    """The class that loads ``folder`` (``index``: its ``model_index.json``): the one the index names, or
    ``pipeline_class`` (a subclass, or another task of the same family); with the index's components checked against
    it and the ``config_overrides`` against both."""
    name = index.get("_class_name")
    cls = resolve_class(name) if isinstance(name, str) else None
    if cls is None or not (isinstance(cls, type) and issubclass(cls, DiffusionPipeline)):
        raise CheckpointError(f"unknown pipeline class {name!r} in model_index.json; eqxdiff serves "
                              f"{family_names('pipeline')}")
    cls = pipeline_class_for(cls, pipeline_class, where=repr(os.fspath(folder)), holds=name)
    missing = [c.name for c in cls.COMPONENTS if not c.optional and _index_entry(index, c.name) is None]
    if missing:
        raise CheckpointError(f"model_index.json in {os.fspath(folder)!r} lacks component(s) {missing} that a "
                              f"{name} needs")
    for c in cls.COMPONENTS:
        if _index_entry(index, c.name) is not None:
            cls.check_component_class(c, index[c.name], repr(os.fspath(folder)))
    overrides = cls.check_config_overrides(config_overrides)
    absent = sorted(k for k in overrides if _index_entry(index, k) is None)
    if absent:
        raise ConfigError(f"config_overrides sets {absent}, which {os.fspath(folder)!r} does not hold")
    return cls, overrides


def save_pipeline(pipe: DiffusionPipeline, folder, *, dtype=None) -> Path:
    """Write ``pipe`` as a diffusers pipeline folder (``model_index.json``, one subfolder per component) that
    :func:`load_pipeline` and diffusers' own pipeline class both load.

    Everything is written into a temporary folder beside ``folder`` and swapped in at the end
    (:func:`eqxdiff.loading.replacing_folder`): a save that fails leaves an existing ``folder`` as it was, and
    entries of it that the pipeline does not write (a ``safety_checker``, a README) are kept. LoRA adapters not
    fused into the weights are left out, with a warning (:meth:`~DiffusionPipeline.models_to_save`)."""
    if not isinstance(pipe, DiffusionPipeline):
        raise CheckpointError(f"save_pipeline needs an eqxdiff pipeline, got {type(pipe).__name__}; save a single "
                              "model with eqxdiff.save_pretrained")
    check_dtype(dtype)
    index: dict[str, Any] = {"_class_name": pipe.CLASS_NAME, "_diffusers_version": "0.30.0", **pipe.INDEX_EXTRAS,
                             **pipe.options}
    models = pipe.models_to_save()  # unfused adapters left out, with one warning
    with replacing_folder(folder) as tmp:
        for c in pipe.COMPONENTS:
            value = models.get(c.name, getattr(pipe, c.name))
            if value is None:
                index[c.name] = [None, None]
            elif c.kind == "model":
                index[c.name] = pipe.save_component(tmp, c, value, dtype=dtype)
            elif c.kind in ("tokenizer", "processor"):
                value.save_pretrained(tmp / c.name)
                index[c.name] = ["transformers", getattr(value, "transformers_class", type(value).__name__)]
            else:
                (tmp / c.name).mkdir(exist_ok=True)
                config = {k: v for k, v in value.config.to_dict().items() if k != "_use_default_values"}
                config = {**pipe.scheduler_extras, **config, "_class_name": type(value).__name__}
                (tmp / c.name / "scheduler_config.json").write_text(json.dumps(config, indent=2))
                index[c.name] = ["diffusers", config["_class_name"]]
        defaults = {k: v for k, v in pipe.call_defaults.items() if k != "progress"}  # set_progress_bar_config's
        if defaults:
            index[EQXDIFF_KEY] = {"call_defaults": defaults}
        (tmp / "model_index.json").write_text(json.dumps(index, indent=2))
    return Path(folder)
