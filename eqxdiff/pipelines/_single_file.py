"""Whole pipelines in one ``.safetensors`` file, in and out of eqxdiff: the one assembly that reads and writes every
layout the families declare (:data:`eqxdiff.core.SINGLE_FILE_LAYOUTS`: A1111 / ComfyUI / SGM Stable Diffusion 1.x,
2.x and SDXL files with their inpainting and refiner variants, Black Forest Labs' and ComfyUI's Flux files).

``eqxdiff.load_pipeline("file.safetensors", config=...)`` reaches :func:`read_single_file`; :func:`save_single_file`
writes a pipeline in a layout. A layout (:class:`eqxdiff.loading.single_file.Layout`) says which models the file
holds and how to read each (conversion rules, a config from the tensors or from ``config=``); each model is read
from the file's memory map through its rules straight into its dtype and, with a mesh, onto its sharding. What the
file lacks comes from ``config=`` (a diffusers folder or Hub id: only the files the file lacks are fetched) or from
the layout's published values.
"""

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import jax
from huggingface_hub import snapshot_download

from ..core import ConfigError, ModelConfig, resolve_class, single_file_layouts
from ..loading import (
    PICKLE_SUFFIXES,
    CheckpointError,
    ConversionError,
    SafetensorsFile,
    check_dtype,
    is_hub_id,
    load,
    model_class,
    pickle_error,
    read_json,
    write_safetensors,
)
from ..loading.single_file import Layout, Part, Shapes, check_tensors, detect_in, layout_shapes, layout_tensors
from ..nn import build_abstract
from ._components import build_scheduler, load_processor, load_tokenizer, pipeline_class_for
from ._single_file_slots import assign_parts, file_component_problem, file_targets, warn_same_class

__all__ = ["SingleFile", "file_component_problem", "read_single_file", "save_single_file", "single_file_class",
           "single_file_components"]

_CONFIG_FILES = ["*.json", "*.txt", "*.model"]  # a pipeline's configs and tokenizers (T5's sentencepiece), no weights


@dataclasses.dataclass(frozen=True)
class SingleFile:
    """What :func:`read_single_file` reads: the pipeline class and its constructor's arguments."""

    cls: type
    components: dict
    options: dict
    scheduler_extras: dict


@dataclasses.dataclass(frozen=True)
class _Config:
    """``config=`` of a single file: ``folder`` once local (``None`` without ``config=``), ``hub_id`` while a Hub
    repository is not fetched yet, and its ``model_index.json``."""

    given: object
    folder: Path | None
    hub_id: str | None
    index: Mapping

    def read(self, name: str) -> dict | None:
        return read_json(self.folder / name) if self.folder is not None and (self.folder / name).is_file() else None


def read_single_file(path, *, config=None, revision: str | None = None, dtype=None, sharding=None,
                     offload_encoders: bool = False, scan_layers: bool = False, scheduler: str | None = None,
                     scheduler_options: Mapping | None = None, pipeline_class: type | None = None,
                     config_overrides: Mapping[str, Mapping] | None = None) -> SingleFile:
    """The pipeline class and components of a single-file checkpoint (what ``load_pipeline`` builds the pipeline
    from; call ``eqxdiff.load_pipeline(path, config=...)`` rather than this).

    The layout is read from the file's tensor names (the first of :data:`eqxdiff.core.SINGLE_FILE_LAYOUTS` whose
    signature it holds: SD 1.x, SD 2.x, SDXL base or refiner, inpainting by its UNet's 9 input channels, Flux).
    ``config``: a diffusers folder or Hub id for what the file lacks: the tokenizers, the scheduler,
    ``model_index.json``'s class and options, the models the file does not hold (a Hub id fetches their weights, and
    only the JSON and tokenizer files of the rest), and the ``config.json`` of any model it holds (the others are
    read from the tensors, with the layout's published values for what they do not show). Without ``config`` (not
    for every layout: a Flux file needs one), every config is read from the tensors, the scheduler is the layout's
    (SD 1.x PNDM; SD 2.x DDIM with v-prediction, as SD 2.1-768; SDXL Euler; for an SD 2.x epsilon model pass
    ``scheduler_options={"prediction_type": "epsilon"}`` or its ``config``) and the tokenizers come from the
    family's Hub repository. ``scheduler`` swaps the scheduler by name and ``scheduler_options`` sets its config keys
    (SDXL-Lightning: ``scheduler="euler", scheduler_options={"timestep_spacing": "trailing"}``). ``pipeline_class``
    loads the file as another class with the same components. ``config_overrides`` sets config keys of the models,
    per component, as for a folder (:func:`eqxdiff.load_pipeline`).

    ``path`` may be a mapping ``{component: file}`` (files of one family, each holding one model, each checked as a
    lone file is): each model is read as the component named (Wan 2.2 A14B's experts, two files of one architecture:
    ``{"transformer": high_noise_file, "transformer_2": low_noise_file}``), refused if the pipeline has no such
    model component, the model is of another class, or ``config=`` lists no such component. A lone file fills the
    components its layout names; where ``config=`` lists another component of the class it fills, an
    :class:`~eqxdiff.pipelines.InputWarning` names the one filled, the one read from ``config=`` and the mapping.
    """
    opened = _open_all(path)
    layout, where = opened[0].layout, _where(path, opened)
    source = _config_source(config, revision, layout, [part for o in opened for part in o.parts], where)
    found = _layout_class(layout, source.index)
    cls = pipeline_class_for(found, pipeline_class, where=where, holds=found.__name__)
    opened = [o if o.target is None else o._replace(parts=[assign_parts(cls, o.target, o.parts, o.layout,
                                                                        source.index, config, o.where)])
              for o in opened]
    held = [part for o in opened for part in o.parts]
    if not isinstance(path, Mapping):
        warn_same_class(cls, held, source.index, config, opened[0].path)
    source = _fetched(source, revision, cls, held)
    overrides = cls.check_config_overrides(config_overrides)
    _check_overrides_held(overrides, held, source, where)
    weights_dtype = check_dtype(dtype) or check_dtype("float32")
    flags = {c.name: c for c in cls.COMPONENTS}

    def load_kwargs(name: str) -> dict:
        offload = offload_encoders and flags[name].encoder
        return dict(dtype=weights_dtype, sharding=None if offload else sharding,
                    scan_layers=scan_layers and flags[name].scan, config_overrides=overrides.get(name))

    components = {}
    for o in opened:
        components.update(_read_held(o.path, o.file, o.layout, o.parts, source, o.where, load_kwargs))
    components.update(_read_lacking(cls, layout, components, source, where, load_kwargs))
    components.update(_read_tokenizers(cls, layout, components, source, where))
    components.update(_read_processors(cls, source))
    raw = source.read("scheduler/scheduler_config.json") or layout.scheduler
    if raw is None:
        raise CheckpointError(f"config={os.fspath(source.given)!r} has no scheduler/scheduler_config.json; pass a "
                              f"diffusers {layout.family} pipeline folder")
    extras: dict = {}
    for c in cls.COMPONENTS:
        if c.kind == "scheduler":
            components[c.name], extras = build_scheduler(raw, scheduler, scheduler_options,
                                                         fixes=cls.SCHEDULER_FIXES)
    options = {k: source.index.get(k, layout.options.get(k, default)) for k, default in cls.OPTIONS.items()}
    return SingleFile(cls, components, options, extras)


def single_file_class(path, *, config=None, revision: str | None = None) -> type:
    """The pipeline class ``load_pipeline(path, config=config)`` builds, read from the file's tensor names (and, for
    a layout that loads as several classes, ``config``'s ``model_index.json``: a Flux Kontext folder) without
    loading it: what ``eqxdiff-generate`` takes a single file's options from. A mapping ``{component: file}``: its
    first file's."""
    layout, where = (one := _open_one(None, file_targets(path)[0][1])).layout, one.where
    if len(layout.pipelines) == 1 or config is None:
        return resolve_class(layout.pipelines[0])
    return _layout_class(layout, _config_source(config, revision, layout, (), where).index)


def single_file_components(path) -> list[str]:
    """The components a lone single file fills, as its layout names them (``["transformer"]``; an A1111 file's
    ``["text_encoder", "unet", "vae"]``)."""
    return [part.name for part in _open_one(None, path).parts]


def save_single_file(pipe, path, *, dtype=None, layout: str | None = None) -> Path:
    """Write ``pipe`` as one ``.safetensors`` file in a single-file layout, which :func:`eqxdiff.load_pipeline` reads:
    an SD 1.x/2.x or SDXL pipeline in the A1111 / SGM layout (diffusers' ``from_single_file`` reads it too), a Flux
    pipeline as a ComfyUI all-in-one file. ``layout`` names one (``"sd1"``, ``"sd2"``, ``"sdxl"``, ``"sdxl_refiner"``,
    ``"flux_comfyui"`` ...: :data:`eqxdiff.core.SINGLE_FILE_LAYOUTS`); by default the first whose models are exactly
    the pipeline's, each one it holds (an SD 2.x file's OpenCLIP is a GELU text encoder, SD 1.x's CLIP is not), and
    whose signature the written file has (an inpainting UNet's 9 channels). A layout's extra tensors are written too
    (an SD 2.x file gets one more OpenCLIP block than the text encoder has, of zeros: an identity, as SD 2.x files
    hold a last block their pipelines never run). Tokenizers and scheduler are not written: a single file has none.
    ``dtype`` casts the floating-point tensors (e.g. ``"float16"``)."""
    chosen = _layout_to_write(pipe, layout)
    tensors: dict = {}
    for part in chosen.parts:
        model = getattr(pipe, part.name, None)
        if model is None and part.optional:
            continue
        if model is None:
            raise ValueError(f"{type(pipe).__name__} has no {part.name}, which a {chosen.name} single file holds; "
                             "pass layout= the layout of this pipeline")
        written = layout_tensors(model, part.rules(model.config))
        tensors.update(written)
        tensors.update(part.extra_tensors(model.config, written))
    if dtype is not None:
        dt = check_dtype(dtype)
        tensors = {k: v.astype(dt) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, path, metadata={"format": "pt"})
    return path


# -- reading the models -----------------------------------------------------------------------------------------------


def _read_held(path, file, layout: Layout, held: list[Part], source: _Config, where: str, load_kwargs) -> dict:
    """The models the file holds, in the layout's order (a part's config may read the configs before it)."""
    components, configs = {}, {}
    for part in held:
        kwargs = load_kwargs(part.name)
        model_cls = model_class(part.model_class)
        config, hint = _part_config(part, model_cls, file, layout, source, where, configs)
        configs[part.name] = config
        rules = part.rules(config, file)
        dt = kwargs["dtype"]
        abstract = build_abstract(lambda c=config, m=model_cls: m(c, dtype=dt, key=jax.random.key(0)))
        what = f"the {part.name} ({part.prefix}*)" if part.prefix else f"the {part.name} (no prefix)"
        check_tensors(file, abstract, rules, where=where, what=what, hint=hint)
        components[part.name] = load(path, model_class=model_cls, config=config, conversion=rules, **kwargs)
    return components


def _part_config(part: Part, model_cls, file, layout: Layout, source: _Config, where: str, configs: Mapping):
    """``(config, hint)``: the part's config from ``config=`` or else the tensors, and what to do if the file's
    tensors do not fit it."""
    given = source.read(f"{part.name}/config.json")
    if given is not None:
        hint = (f"The config passed (config={os.fspath(source.given)!r}) does not describe this file's {part.name}: "
                "pass a diffusers folder or Hub id of this very model")
        if part.infer_config:
            hint += (f", or one without {part.name}/config.json to read it from the tensors" if layout.needs_config
                     else ", or no config= to infer it from the tensors")
        _check_given_class(given, part, model_cls, layout, source)
        return model_cls.config_class.from_dict(given), hint
    raw = part.infer(file, where=where, configs=configs) if part.infer_config else None
    if raw is None:
        lacking = (f"config={os.fspath(source.given)!r} has no {part.name}/config.json" if source.folder is not None
                   else "no config= was given")
        raise CheckpointError(f"{where} holds the {part.name} (under {part.prefix!r}), whose config its tensors do "
                              f"not give, and {lacking}; pass config= a diffusers {layout.family} pipeline folder or "
                              "Hub id")
    try:
        config = model_cls.config_class.from_dict(raw)
    except ConfigError as e:
        raise CheckpointError(
            f"cannot infer the config of the {part.name} in {where}: the values its tensors do not show, taken from "
            f"{layout.family}'s published configs, do not fit them ({e}). Pass config= a diffusers folder or Hub id "
            "of this model (its component config.json files)") from None
    return config, ("The file is incomplete or its models are not of one pipeline; download it again, or pass "
                    "config= a diffusers folder of this model")


def _check_given_class(given: Mapping, part: Part, model_cls, layout: Layout, source: _Config) -> None:
    """Raise a :class:`CheckpointError` if ``config=``'s ``{part}/config.json`` configures a model of another kind
    than the one the file holds (another family's folder): its values would be read as the wrong config's."""
    named = given.get("_class_name") or (given.get("architectures") or [None])[0]
    other = resolve_class(named) if isinstance(named, str) else None
    if other is None or other.config_class is model_cls.config_class:
        return
    raise CheckpointError(
        f"config={os.fspath(source.given)!r} describes a {named} as its {part.name}, but the file is a "
        f"{layout.family} file (the {layout.name!r} layout), whose {part.name} is a {part.model_class}; pass config= a "
        f"diffusers {layout.family} folder or Hub id (e.g. {layout.hub_id!r})")


def _read_lacking(cls, layout: Layout, components: Mapping, source: _Config, where: str, load_kwargs) -> dict:
    """The models of ``cls`` that the file does not hold, from ``config=``'s folder (``None`` where optional)."""
    out = {}
    for c in cls.COMPONENTS:
        if c.kind != "model" or c.name in components:
            continue
        entry = source.index.get(c.name)
        if entry and entry[0] is not None:
            cls.check_component_class(c, entry, repr(os.fspath(source.folder)))
            try:
                out[c.name] = cls.load_component(source.folder, c, entry, **load_kwargs(c.name))
            except CheckpointError as e:
                raise CheckpointError(
                    f"{where} does not hold the {c.name}, so it is read from config={os.fspath(source.given)!r}, "
                    f"which cannot give it ({e}); pass config= a diffusers {layout.family} folder with the "
                    f"{c.name}'s weights (or a Hub id: the weights the file lacks are fetched)") from None
        elif c.optional:
            out[c.name] = None
        else:
            given = "no config= was given" if source.folder is None else \
                f"config={os.fspath(source.given)!r} has no {c.name} (model_index.json)"
            raise CheckpointError(f"{where} does not hold the {c.name} and {given}; pass config= a diffusers "
                                  f"{layout.family} pipeline folder")
    return out


def _read_tokenizers(cls, layout: Layout, components: Mapping, source: _Config, where: str) -> dict:
    """Each tokenizer whose model (``layout.tokenizers``) was loaded, from ``config=`` or, without it, from the
    layout's Hub repository (only the tokenizers fetched); the others ``None``."""
    tokenizers = [c.name for c in cls.COMPONENTS if c.kind == "tokenizer"]
    needed = [t for t in tokenizers if components.get(layout.tokenizers.get(t, "")) is not None]
    folder = source.folder
    if folder is None and needed:
        folder = _fetch(layout.hub_id, None, [f"{t}/*" for t in needed],
                        f"{where} holds no tokenizer and no config= was given, so eqxdiff fetches {layout.family}'s")
    out = {}
    for name in tokenizers:
        if name not in needed:
            out[name] = None
        elif not (folder / name).is_dir():
            raise CheckpointError(f"{where} holds no tokenizer and config={os.fspath(folder)!r} has no {name} "
                                  f"folder; pass config= a diffusers folder or Hub id of this model family that "
                                  f"holds {name}/")
        else:
            out[name] = load_tokenizer(folder / name)
    return out


def _read_processors(cls, source: _Config) -> dict:
    """Each image processor of ``cls`` from ``config=``'s folder if it lists one (Wan 2.1 image-to-video's CLIP
    processor), else ``None``: a single file holds none."""
    out = {}
    for c in cls.COMPONENTS:
        if c.kind == "processor":
            entry = source.index.get(c.name)
            listed = source.folder is not None and entry and entry[0] is not None
            out[c.name] = load_processor(source.folder / c.name, entry) if listed else None
    return out


def _check_overrides_held(overrides: Mapping, held: list[Part], source: _Config, where: str) -> None:
    listed = {k for k, entry in source.index.items() if isinstance(entry, list) and entry and entry[0] is not None}
    absent = sorted(set(overrides) - {part.name for part in held} - listed)
    if absent:
        nor = f" nor config={os.fspath(source.given)!r}" if source.folder is not None else ""
        raise ConfigError(f"config_overrides sets {absent}, which {where} does not hold{nor}")


# -- the layout, the class and config= --------------------------------------------------------------------------------


class _Opened(NamedTuple):
    """One file to read: the component a mapping names for it (``None``: what its layout says), its path, tensors,
    layout, name in messages and the parts it holds."""

    target: str | None
    path: Path
    file: SafetensorsFile
    layout: Layout
    where: str
    parts: list[Part]


def _open_all(path) -> list[_Opened]:
    """The files of ``path``: one file, or a mapping ``{component: file}`` (:func:`file_targets`) whose files are of
    one family, each opened and its layout found."""
    opened = [_open_one(target, given) for target, given in file_targets(path)]
    families = sorted({o.layout.family for o in opened})
    if len(families) > 1:
        raise CheckpointError(f"{_where(path, opened)} holds files of {' and '.join(families)} models, not of one "
                              "pipeline; map files of one model family")
    return opened


def _open_one(target: str | None, given) -> _Opened:
    """The file ``given`` opened, its layout found and the parts it holds, for the component ``target``."""
    path, file = _open(given)
    where = f"file {os.fspath(path)!r}"
    layout = detect_in(file, where, single_file_layouts())
    return _Opened(target, path, file, layout, where, [part for part in layout.parts if part.held(file)])


def _where(path, opened: list[_Opened]) -> str:
    """The file (``file 'x.safetensors'``) or mapping (``the mapping {'transformer': 'x.safetensors', ...}``) in
    messages."""
    if not isinstance(path, Mapping):
        return opened[0].where
    return "the mapping {" + ", ".join(f"{o.target!r}: {os.fspath(o.path)!r}" for o in opened) + "}"


def _open(path) -> tuple[Path, SafetensorsFile]:
    path = Path(os.fspath(path)).expanduser()
    if path.is_dir():
        raise CheckpointError(f"{os.fspath(path)!r} is a folder: config= is for single .safetensors files; a pipeline "
                              "folder holds its own configs (drop config=)")
    if not path.exists():
        raise CheckpointError(f"no file {os.fspath(path)!r}; check its path (config= goes with a single .safetensors "
                              "file: a pipeline folder or Hub id holds its own configs)")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise pickle_error(path)
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{os.fspath(path)!r} is a file; pass the model's folder (the one holding "
                              "model_index.json), a Hub id, or a single-file .safetensors checkpoint")
    return path, SafetensorsFile(path)


def _layout_class(layout: Layout, index: Mapping) -> type:
    """The class a file in ``layout`` loads as: the one ``config=``'s ``model_index.json`` names if the layout
    loads as it (one of its classes, or a subclass of its first with the same components: a family's
    image-to-image or control variant), else the layout's first."""
    first, named = resolve_class(layout.pipelines[0]), index.get("_class_name")
    cls = resolve_class(named) if isinstance(named, str) else None
    if named in layout.pipelines or (cls is not None and issubclass(cls, first) and _names(cls) == _names(first)):
        return cls
    return first


def _names(cls) -> list[str]:
    return [c.name for c in cls.COMPONENTS]


def _config_source(config, revision: str | None, layout: Layout, held, where: str) -> _Config:
    """``config=`` checked, with its ``model_index.json`` (a Hub id: that file alone fetched so far)."""
    if config is None:
        if layout.needs_config:
            holds = " and ".join(f"the {part.name}" for part in held) or "models"
            raise CheckpointError(
                f"{where} holds {holds} of a {layout.family} pipeline but not the rest of it (tokenizers, scheduler "
                f"and the models it lacks); pass config= a diffusers {layout.family} folder or Hub id, e.g. "
                f"eqxdiff.load_pipeline(file, config={layout.hub_id!r})")
        return _Config(None, None, None, {})
    if isinstance(config, (ModelConfig, Mapping)):
        raise CheckpointError("config= for a single file is a diffusers pipeline folder or Hub id (its tokenizers, "
                              "scheduler and component configs), not one model's config")
    p = os.fspath(config)
    local = Path(p).expanduser()
    if local.is_dir():
        index = read_json(local / "model_index.json") if (local / "model_index.json").is_file() else {}
        return _Config(config, local, None, index)
    if not is_hub_id(p):
        raise CheckpointError(f"config={p!r} is not a folder; pass a diffusers {layout.family} pipeline folder or a "
                              f"Hub id such as {layout.hub_id!r}")
    fetched = _fetch(p, revision, ["model_index.json"], f"config={p!r}")
    index = read_json(fetched / "model_index.json") if (fetched / "model_index.json").is_file() else {}
    return _Config(config, None, p, index)


def _fetched(source: _Config, revision: str | None, cls: type, held: list[Part]) -> _Config:
    """``source`` with a Hub id fetched: its configs and tokenizers, and the weights of ``cls``'s models that the
    file does not hold (``held``)."""
    if source.hub_id is None:
        return source
    lacking = [f"{c.name}/*" for c in cls.COMPONENTS
               if c.kind == "model" and c.name not in {part.name for part in held}]
    folder = _fetch(source.hub_id, revision, [*_CONFIG_FILES, *lacking], f"config={source.hub_id!r}")
    return dataclasses.replace(source, folder=folder, hub_id=None)


def _fetch(repo: str, revision: str | None, patterns: list[str], what: str) -> Path:
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except Exception as e:  # network, auth and offline errors all end here
        raise CheckpointError(
            f"{what}: could not fetch {repo!r} from the Hugging Face Hub ({type(e).__name__}: {e}). Offline, pass "
            "config= a local diffusers folder of this model (its tokenizers, scheduler and configs: `hf download "
            f"{repo} --exclude '*.safetensors' '*.bin' --local-dir DIR` on a connected machine)") from e


def _layout_to_write(pipe, name: str | None) -> Layout:
    """The layout ``name``, or by default the first that writes exactly ``pipe``'s models (see
    :func:`save_single_file`)."""
    layouts = single_file_layouts()
    if name is not None:
        by_name = {layout.name: layout for layout in layouts}
        if name not in by_name:
            raise ValueError(f"layout={name!r}; choose one of {list(by_name)}")
        return by_name[name]
    models = {c.name: getattr(pipe, c.name) for c in pipe.COMPONENTS
              if c.kind == "model" and getattr(pipe, c.name, None) is not None}
    for layout in layouts:
        parts = {part.name: part for part in layout.parts if part.name in models or not part.optional}
        if parts.keys() != models.keys() or not all(p.fits(models[n].config) for n, p in parts.items()):
            continue
        shapes = {}
        try:
            for n, part in parts.items():
                shapes.update(layout_shapes(models[n], part.rules(models[n].config)))
        except ConversionError:  # another family's model under the same component name: not this layout
            continue
        if layout.matches(Shapes(shapes)):
            return layout
    raise ValueError(f"no single-file layout holds exactly a {type(pipe).__name__}'s models {sorted(models)}; pass "
                     f"layout= one of {[layout.name for layout in layouts]} to write the models it holds")

