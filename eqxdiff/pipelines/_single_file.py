"""Whole pipelines in one ``.safetensors`` file (A1111 / ComfyUI / SGM layouts: SD 1.x, SD 2.x, SDXL base, refiner
and inpainting, ComfyUI's all-in-one SDXL files such as SDXL-Lightning's) in and out of eqxdiff.

``eqxdiff.load_pipeline("file.safetensors", config=...)`` reaches :func:`read_single_file`; :func:`save_single_file`
writes a pipeline in the layout. The layouts are conversion rules (:mod:`eqxdiff.loading.single_file`): each model
is read from the file's memory map through them straight into its dtype and, with a mesh, onto its sharding.
"""

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import equinox as eqx
import jax
from huggingface_hub import snapshot_download

from ..core import SINGLE_FILE_PIPELINES, ConfigError, ModelConfig, resolve_class
from ..loading import (
    CheckpointError,
    SafetensorsFile,
    check_dtype,
    load,
    model_class,
    pickle_error,
    read_json,
    write_safetensors,
)
from ..loading import single_file as layouts
from ..schedulers import scheduler_from_config

__all__ = ["read_single_file", "save_single_file", "single_file_class"]

_CONFIG_FILES = ["*.json", "*.txt"]  # a pipeline's configs and tokenizers, no weights
_TOKENIZERS = {"tokenizer": "text_encoder", "tokenizer_2": "text_encoder_2"}  # and the encoder each serves


def read_single_file(path, *, config=None, revision: str | None = None, dtype=None, sharding=None,
                     offload_encoders: bool = False, scan_layers: bool = False, scheduler: str | None = None,
                     scheduler_options: Mapping | None = None, pipeline_class: type | None = None,
                     config_overrides: Mapping[str, Mapping] | None = None) -> tuple[type, dict, dict]:
    """The pipeline class, components and options of a single-file checkpoint (what ``load_pipeline`` builds the
    pipeline from; call ``eqxdiff.load_pipeline(path, config=...)`` rather than this).

    The family (SD 1.x, SD 2.x, SDXL base or refiner) is read from the file's prefixes, inpainting from its UNet's
    9 input channels. ``config``: a diffusers folder or Hub id (only its JSON and tokenizer files are fetched) for
    what the file lacks: the tokenizers, the scheduler, ``model_index.json``'s options, and any component whose
    ``config.json`` it holds (the rest are inferred from the tensors). Without ``config`` every model's config is
    inferred (:mod:`eqxdiff.loading.single_file` says which values come from the family's published configs: the
    attention heads, norm groups, sizes), the scheduler is the family's (SD 1.x PNDM; SD 2.x DDIM with
    v-prediction, as SD 2.1-768; SDXL Euler; for an SD 2.x epsilon model pass
    ``scheduler_options={"prediction_type": "epsilon"}`` or its ``config``) and the tokenizers come from the
    family's Hub repository. ``scheduler`` swaps the scheduler by name and ``scheduler_options`` sets its config keys
    (SDXL-Lightning: ``scheduler="euler", scheduler_options={"timestep_spacing": "trailing"}``).
    ``pipeline_class`` loads the file as another class with the same components. ``config_overrides`` sets config
    keys of the models, per component, as for a folder (:func:`eqxdiff.load_pipeline`).
    """
    path = Path(os.fspath(path)).expanduser()
    where = f"file {os.fspath(path)!r}"
    _check_suffix(path)
    file = SafetensorsFile(path)
    family = _family_layout(file)
    if family is not None:  # a family reading a layout of its own (the family table's SINGLE_FILE_PIPELINES)
        return family[0].read_single_file(path, file, family[1], config=config, revision=revision, dtype=dtype,
                                          sharding=sharding, offload_encoders=offload_encoders,
                                          scan_layers=scan_layers, scheduler=scheduler,
                                          scheduler_options=scheduler_options, pipeline_class=pipeline_class,
                                          config_overrides=config_overrides)
    layout = layouts.detect(file, where)
    folder = _config_folder(config, revision, layout)
    cls = resolve_class(layout.pipeline)
    if pipeline_class is not None and not issubclass(cls, pipeline_class):
        if {c.name for c in cls.COMPONENTS} != {c.name for c in pipeline_class.COMPONENTS}:
            raise CheckpointError(f"{where} holds a {layout.pipeline}, whose components a {pipeline_class.__name__} "
                                  "cannot use")
        cls = pipeline_class
    overrides = cls.check_config_overrides(config_overrides)
    absent = sorted(set(overrides) - {part.name for part in layout.parts})
    if absent:
        raise ConfigError(f"config_overrides sets {absent}, which {where} does not hold")
    weights_dtype = check_dtype(dtype) or check_dtype("float32")
    flags = {c.name: c for c in cls.COMPONENTS}
    components: dict = {}
    pooled = None
    for part in sorted(layout.parts, key=lambda p: p.name == "unet"):  # the UNet's time ids need the pooled width
        model_cls = model_class(part.model_class)
        given = _component_config(folder, part.name)
        if given is not None:
            cfg, hint = model_cls.config_class.from_dict(given), (
                f"The config passed (config={os.fspath(config)!r}) does not describe this file's {part.name}: pass "
                "a diffusers folder or Hub id of this very model, or no config= to infer it from the tensors")
        else:
            try:
                cfg = model_cls.config_class.from_dict(layout.infer(part, file, where=where, pooled_dim=pooled))
            except ConfigError as e:
                raise CheckpointError(
                    f"cannot infer the config of the {part.name} in {where}: the values its tensors do not show, taken "
                    f"from {layout.family.name}'s published configs, do not fit them ({e}). Pass config= a diffusers "
                    "folder or Hub id of this model (its component config.json files)") from None
            hint = ("The file is incomplete or its models are not of one pipeline; download it again, or pass "
                    "config= a diffusers folder of this model")
        if part.name == "text_encoder_2":
            pooled = cfg.projection_dim
        rules = layout.rules(part, cfg, file)
        abstract = eqx.filter_eval_shape(lambda c=cfg, m=model_cls: m(c, dtype=weights_dtype, key=jax.random.key(0)))
        layouts.check_tensors(file, abstract, rules, where=where, what=f"the {part.name} ({part.prefix}*)",
                              hint=hint)
        offload = offload_encoders and flags[part.name].encoder
        components[part.name] = load(path, model_class=model_cls, config=cfg, conversion=rules,
                                     dtype=weights_dtype, sharding=None if offload else sharding,
                                     scan_layers=scan_layers and flags[part.name].scan,
                                     config_overrides=overrides.get(part.name))
    tokenizers = [c.name for c in cls.COMPONENTS if c.kind == "tokenizer" and _TOKENIZERS[c.name] in components]
    if folder is None and tokenizers:  # the family's own, from the Hub
        folder_of_tokenizers = _fetch(layout.hub_id, None, [f"{t}/*" for t in tokenizers],
                                      f"{where} holds no tokenizer and no config= was given, so eqxdiff fetches "
                                      f"{layout.family.name}'s")
    else:
        folder_of_tokenizers = folder
    for c in cls.COMPONENTS:
        if c.kind == "tokenizer":
            components[c.name] = _tokenizer(folder_of_tokenizers, c.name, where) if c.name in tokenizers else None
    raw = _read(folder, "scheduler/scheduler_config.json") or layout.scheduler
    components["scheduler"] = _scheduler(raw, scheduler, scheduler_options or {})
    index = _read(folder, "model_index.json") or {}
    options = {k: index.get(k, layout.family.options.get(k, default)) for k, default in cls.OPTIONS.items()}
    return cls, components, options


def single_file_class(path, *, config=None, revision: str | None = None) -> type:
    """The pipeline class ``load_pipeline(path, config=config)`` builds, read from the file's tensor names (and, for
    a family of :data:`eqxdiff.core.SINGLE_FILE_PIPELINES`, ``config``'s ``model_index.json``) without loading it:
    what ``eqxdiff-generate`` takes a single file's options from."""
    path = Path(os.fspath(path)).expanduser()
    _check_suffix(path)
    file = SafetensorsFile(path)
    family = _family_layout(file)
    if family is not None:
        return family[0].single_file_class(family[1], config=config, revision=revision)
    return resolve_class(layouts.detect(file, f"file {os.fspath(path)!r}").pipeline)


def save_single_file(pipe, path, *, dtype=None, family: str | None = None) -> Path:
    """Write ``pipe`` (an SD 1.x/2.x or SDXL pipeline) as one ``.safetensors`` file in the A1111 / SGM layout, which
    :func:`eqxdiff.load_pipeline` and diffusers' ``from_single_file`` read. ``family``: ``"sd1"``, ``"sd2"``,
    ``"sdxl"`` or ``"sdxl_refiner"``; by default an SDXL pipeline without its first text encoder is a refiner and
    a Stable Diffusion pipeline whose text encoder runs GELU (OpenCLIP's) is SD 2.x. An SD 2.x file gets one more
    OpenCLIP block than the text encoder has, of zeros (an identity), as SD 2.x files hold a last block their
    pipelines never run. Tokenizers and scheduler are not written: a single file has none. ``dtype`` casts the
    floating-point tensors (e.g. ``"float16"``)."""
    family = family or _family_of(pipe)
    if family not in layouts.FAMILIES:
        raise ValueError(f"family={family!r}; choose one of {list(layouts.FAMILIES)}")
    layout = layouts.Layout(layouts.FAMILIES[family])
    tensors: dict = {}
    for part in layout.parts:
        model = getattr(pipe, part.name, None)
        if model is None:
            raise ValueError(f"{type(pipe).__name__} has no {part.name}, which a {family} single file holds; pass "
                             f"family= the layout of this pipeline (one of {list(layouts.FAMILIES)})")
        tensors.update(layouts.layout_tensors(model, layout.rules(part, model.config)))
        if family == "sd2" and part.kind == "openclip":
            tensors.update(layouts.openclip_padding_block(model.config, part.prefix, model.config.num_hidden_layers))
    if dtype is not None:
        dt = check_dtype(dtype)
        tensors = {k: v.astype(dt) if v.dtype.kind == "f" else v for k, v in tensors.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, path, metadata={"format": "pt"})
    return path


# -- helpers ----------------------------------------------------------------------------------------------------------


def _family_layout(view):
    """``(pipeline class, layout)`` of the first of :data:`eqxdiff.core.SINGLE_FILE_PIPELINES` whose layout the
    file ``view`` is in (its ``single_file_layout(view)``), or ``None``."""
    for name in SINGLE_FILE_PIPELINES:
        cls = resolve_class(name)
        layout = cls.single_file_layout(view)
        if layout is not None:
            return cls, layout
    return None


def _check_suffix(path: Path) -> None:
    if path.suffix.lower() in layouts.PICKLE_SUFFIXES:
        raise pickle_error(path)
    if path.suffix.lower() != ".safetensors":
        raise CheckpointError(f"{os.fspath(path)!r} is a file; pass the model's folder (the one holding "
                              "model_index.json), a Hub id, or a single-file .safetensors checkpoint")


def _config_folder(config, revision: str | None, layout: layouts.Layout) -> Path | None:
    """``config`` as a local folder (a Hub id: its JSON and tokenizer files fetched); ``None`` without one."""
    if config is None:
        return None
    if isinstance(config, (ModelConfig, Mapping)):
        raise CheckpointError("config= for a single file is a diffusers pipeline folder or Hub id (its tokenizers, "
                              "scheduler and component configs), not one model's config")
    p = os.fspath(config)
    local = Path(p).expanduser()
    if local.is_dir():
        return local
    if p.startswith((".", "/", "~")) or p.count("/") != 1 or local.exists():
        raise CheckpointError(f"config={p!r} is not a folder; pass a diffusers pipeline folder or a Hub id such as "
                              f"{layout.hub_id!r}")
    return _fetch(p, revision, _CONFIG_FILES, f"config={p!r}")


def _fetch(repo: str, revision: str | None, patterns: list[str], what: str) -> Path:
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns))
    except Exception as e:  # network, auth and offline errors all end here
        raise CheckpointError(
            f"{what}: could not fetch {repo!r} from the Hugging Face Hub ({type(e).__name__}: {e}). Offline, pass "
            "config= a local diffusers folder of this model (its tokenizers, scheduler and configs: `hf download "
            f"{repo} --exclude '*.safetensors' '*.bin' --local-dir DIR` on a connected machine)") from e


def _read(folder: Path | None, name: str) -> dict | None:
    return read_json(folder / name) if folder is not None and (folder / name).is_file() else None


def _component_config(folder: Path | None, name: str) -> dict | None:
    return _read(folder, f"{name}/config.json")


def _scheduler(raw: Mapping, name: str | None, options: Mapping):
    """The scheduler ``raw`` describes (or the one ``name`` swaps in) with config keys ``options`` set."""
    scheduler = scheduler_from_config(raw, name=name, **options)
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(scheduler.config)})
    if unknown:
        raise ConfigError(f"{type(scheduler).__name__} has no config option(s) {unknown}; it takes "
                          f"{', '.join(f.name for f in dataclasses.fields(scheduler.config))}")
    return scheduler


def _tokenizer(folder: Path | None, name: str, where: str):
    from transformers import AutoTokenizer

    if not (folder / name).is_dir():
        raise CheckpointError(f"{where} holds no tokenizer and config={os.fspath(folder)!r} has no {name} folder; "
                              f"pass config= a diffusers folder or Hub id of this model family that holds {name}/")
    return AutoTokenizer.from_pretrained(os.fspath(folder / name))


def _family_of(pipe) -> str:
    if hasattr(pipe, "text_encoder_2"):
        return "sdxl" if getattr(pipe, "text_encoder", None) is not None else "sdxl_refiner"
    encoder = getattr(pipe, "text_encoder", None)
    return "sd2" if encoder is not None and encoder.config.hidden_act == "gelu" else "sd1"
