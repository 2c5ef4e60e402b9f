"""``eqxdiff-generate`` (and ``python scripts/generate.py``): images or videos from any pipeline eqxdiff serves.

    eqxdiff-generate                                          # the shipped digits model: a handwritten seven
    eqxdiff-generate --prompt "a handwritten digit two" --num-images 4
    eqxdiff-generate --model path/to/pipeline --prompt "a fox" --scheduler euler --steps 30
    eqxdiff-generate --model path/to/pipeline --help          # that pipeline's own options
    eqxdiff-generate --model path/to/sdxl-base --prompt "a fox" --refiner path/to/sdxl-refiner --denoising-end 0.8
    eqxdiff-generate --model path/to/sd15 --image photo.png --mask mask.png --prompt "a cat on a bench"
    eqxdiff-generate --model path/to/sdxl-inpaint --image photo.png --mask mask.png --refiner path/to/sdxl-refiner \
        --denoising-end 0.8 --prompt "a cat on a bench"
    eqxdiff-generate --model path/to/sd15 --controlnet path/to/canny --control-image edges.png --prompt "a bird"
    eqxdiff-generate --model path/to/sdxl-base --unet sdxl_lightning_4step_unet.safetensors --scheduler euler \
        --scheduler-option timestep_spacing=trailing --steps 4 --guidance-scale 0 --prompt "a fox"
    eqxdiff-generate --model model.safetensors --config path/to/diffusers-folder --prompt "a fox"
    eqxdiff-generate --model path/to/sdxl-base --lora pixel-art-xl.safetensors:0.8 --lora owner/name/toy.safetensors \
        --prompt "a toy fox, pixel art"
    eqxdiff-generate --lora-info pixel-art-xl.safetensors --model path/to/sdxl-base   # what the file is, what fits

The ``--model`` folder's ``model_index.json`` names its pipeline class; the family table
(:data:`eqxdiff.core.FAMILY_TABLE`) gives eqxdiff's, and that class's ``__call__`` gives the family's options
(:mod:`eqxdiff.cli._options`), so a new family needs nothing here; its command line is parsed by
:mod:`eqxdiff.cli._generate_flags`. An option left out takes the folder's recommended call (``model_index.json``'s
``"_eqxdiff": {"call_defaults": ...}``: the digits model's 20 steps, guidance 4, seed 0), else the signature's
default: the command passes the pipeline only the options given. ``--controlnet`` (repeatable) runs the base's
ControlNet pipeline with its ``--control-image`` and ``--controlnet-scale`` per net, ``--refiner`` finishes the
base's latents with a second pipeline, ``--unet`` replaces the base's UNet (:mod:`eqxdiff.cli._compose`),
``--lora FILE_OR_HUB_ID[:SCALE]`` (repeatable) adds LoRA / LyCORIS adapters to it (:mod:`eqxdiff.cli._lora`). Images
are saved as ``image_{i}.png`` and videos as ``video_{i}.mp4``, numbered on after the files already in
``--output-dir``, with the generation parameters in each file (:func:`eqxdiff.pipelines.read_parameters` reads them
back). Load, compile and generation times go to stderr, the files' paths to stdout. Compiled programs are kept in
``~/.cache/eqxdiff/jax`` (``--compilation-cache-dir``, ``--no-compilation-cache``): a second run loads them.

Every flag is checked before anything is loaded (:func:`validate`: the family's arguments against the folder's
configs, the scheduler options, the input and output paths, the --lora files against the models the configs
describe); a bad one stops the command with one line
``error: <what> (<how to fix>)`` and status 2 (``--debug`` shows the traceback).

On a device mesh (``--parallel``, or any ``--mesh.*`` flag) every weight is loaded straight onto its sharding and
the batch is split over the mesh; several hosts run the same command with ``--coordinator-address``,
``--num-processes`` and ``--process-id`` (or ``EQXDIFF_COORDINATOR``, ``EQXDIFF_NUM_PROCESSES``,
``EQXDIFF_PROCESS_ID``), and process 0 writes the files.
"""

import dataclasses
import math
import os
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from ..core import ConfigError
from ..parallel import MeshConfig, MeshError, initialize_distributed, make_mesh
from ..pipelines import (
    InputError,
    SchedulerConfigWarning,
    build_scheduler,
    file_component_problem,
    load_pipeline,
    save_outputs,
    video_fps,
)
from ..schedulers import SCHEDULERS
from ._command import as_flags, check_output_folder, run_command, split_cache_flags
from ._compose import (
    HANDED_LATENTS,
    SCALE,
    check_controlnets,
    check_refiner,
    check_unet,
    check_window,
    control_argument,
    control_kwargs,
    effective_scales,
    folder_nets,
    is_controlnet,
    load_controlnets,
    load_unet,
    refiner_class,
    refiner_kwargs,
)
from ._extras import adapter_images, before_loading, check_extras, extras_metadata, load_extras
from ._generate_flags import (
    Parsed,
    config_reader,
    model_files,
    parse_command,
    pipeline_class,
    scheduler_options,
)
from ._lora import abstract_models, apply_loras, check_loras, lora_info, parse_specs
from ._options import FamilyOptions, family_options


def parse(argv: Sequence[str] | None = None, *, prog: str | None = None):
    """``(family, args)``: the options of the pipeline the command runs (the ``--model`` folder's, or its
    ControlNet pipeline: :func:`eqxdiff.cli._compose.run_class`) and the parsed command line."""
    parsed = parse_command(sys.argv[1:] if argv is None else argv, prog=prog)
    return parsed.family, parsed.args


def scheduler_name(scheduler) -> str | None:
    """The ``--scheduler`` name describing ``scheduler`` (its class and the config keys that name forces), or its
    class name when no name does."""
    if scheduler is None:
        return None
    for name, choice in SCHEDULERS.items():
        if type(scheduler) is choice.cls and all(getattr(scheduler.config, k, None) == v
                                                 for k, v in choice.overrides.items()):
            return name
    return type(scheduler).__name__


@dataclasses.dataclass(frozen=True)
class Invocation:
    """A checked command line: the family's options, the parsed flags, the pipeline call's keyword arguments as the
    call will see them (input files read; an option left out has the folder's recommended value, else the
    signature's default) and the scheduler options."""

    family: FamilyOptions
    args: Any
    kwargs: dict[str, Any]
    scheduler_options: Mapping[str, Any]
    # The class to load --model as when it is not the folder's own (a ControlNet folder run image-to-image).
    load_class: type | None = None
    nets: int = 0  # ControlNets in the run
    refiner: FamilyOptions | None = None  # the --refiner's options
    # The arguments the pipeline call is given (the options on the command line, the command's own digits prompt,
    # the ControlNet arguments); the pipeline's recommended call and its signature give it the others.
    passed: frozenset[str] = frozenset()
    loras: tuple = ()  # the --lora files, checked, located and named (cli._lora.LoraSpec)
    input_fps: float | None = None  # the frame rate of the first input video file (--video), if it says one


def validate(argv: Sequence[str] | None = None, *, prog: str | None = None, parsed: Parsed | None = None
             ) -> Invocation:
    """Parse ``argv`` and check every flag without loading the pipeline: --output-dir (an unusable compilation cache
    is a warning when the run starts), the --unet (:func:`eqxdiff.cli._compose.check_unet`), the scheduler and its
    options against the folder's scheduler config, the input files (read here), and the family's arguments against
    the folder's model configs (:meth:`~eqxdiff.pipelines.DiffusionPipeline.check_arguments` with its
    ``folder_limits``: the VAE's factor, the text encoders' layers), an option left out taking the folder's
    recommended value (:meth:`~eqxdiff.pipelines.DiffusionPipeline.folder_call_defaults`) as the call will, and the
    --lora files against the pipeline's models built from their configs (:func:`eqxdiff.cli._lora.check_loras`).
    Raises a ``ValueError`` (``InputError``, ``ConfigError``, ``CheckpointError``) or ``OSError`` naming the flag.
    ``parsed``: ``argv`` parsed already (:func:`main` reads ``--lora-info`` first)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split_cache_flags(argv)  # their errors first: main reads them before the other checks
    parsed = parsed or parse_command(argv, prog=prog)
    family, args, folder_class = parsed.family, parsed.args, parsed.folder_class
    run, control = args.run, args.control
    check_output_folder("--output-dir", run.output_dir)  # before minutes of loading and compiling
    if run.fps is not None and not (math.isfinite(run.fps) and run.fps > 0):
        raise InputError(f"--fps {run.fps:g} must be a positive number of frames per second; leave it out for the "
                         "model's own rate")
    if run.config is not None and not Path(run.model).expanduser().is_file():
        raise InputError(f"--config is for a single .safetensors --model (it gives what the file lacks); --model "
                         f"{run.model!r} holds its own configs: leave out --config")
    files = model_files(run)  # --component's files, before loading
    read = config_reader(run.model, run.revision, run.config)
    _check_components(family.pipeline_class, files, run, read)
    loras = parse_specs(args.lora)  # the scales first: the files are checked once the other flags are
    if run.unet is not None:
        check_unet(family.pipeline_class, run.unet, config_reader, read)
    options = scheduler_options(run.scheduler_option)
    scheduler = _scheduler(read, run.scheduler, options, run.scheduler_option, family.pipeline_class.SCHEDULER_FIXES)
    kwargs = family.call_kwargs(args.pipeline)  # input files are read (or found missing) before loading too
    cls = family.pipeline_class
    nets = len(control.controlnet) or (folder_nets(read) if is_controlnet(cls) else 0)
    if control.controlnet:
        check_controlnets(control.controlnet, config_reader, read, getattr(cls, "NET_CLASS", None))
    control_arguments = control_kwargs(cls, control, nets)
    kwargs.update(control_arguments)
    if not Path(run.model).expanduser().is_file():  # a single file carries no recommended call
        kwargs.update({k: v for k, v in folder_class.folder_call_defaults(read).items()
                       if k in kwargs and k not in parsed.given})
    check_window(kwargs)
    refiner = None
    if run.refiner is not None:
        masked = kwargs.get("mask_image") is not None  # the refiner folder inpaints too, under the same mask
        refiner = family_options(refiner_class(pipeline_class(run.refiner), mask=masked))
        check_refiner(cls, refiner.pipeline_class, _flags(family), _flags(refiner), kwargs)
    if run.vae_tiling and not hasattr(cls, "enable_vae_tiling"):
        raise InputError(f"--vae-tiling: {cls.__name__} has no VAE tiling; leave the flag out")
    check_extras(cls, run, kwargs)
    kwargs = adapter_images(run, kwargs)
    try:
        cls.check_arguments({**kwargs}, cls.folder_limits(read))
        check_schedule(cls, scheduler, before_loading(run, kwargs), read)
    except InputError as e:
        raise in_flags(e, family, kwargs, nets) from None
    if refiner is not None:
        rcls, rread = refiner.pipeline_class, config_reader(run.refiner)
        arguments = refiner_kwargs(_flags(refiner), kwargs, HANDED_LATENTS)
        try:
            rcls.check_arguments(arguments, rcls.folder_limits(rread))
            check_schedule(rcls, _scheduler(rread, run.scheduler, options, run.scheduler_option, rcls.SCHEDULER_FIXES),
                           arguments, rread)
        except InputError as e:
            raise type(e)(f"--refiner: {as_flags(str(e), arguments, {'denoising_start': '--denoising-end'})}"
                          ) from None
    if loras:
        loras = check_loras(cls, loras, args.lora, _lora_models(cls, run, read))
    load_class = None if control.controlnet or cls is folder_class else cls
    return Invocation(family, args, kwargs, options, load_class, nets, refiner, parsed.given | set(control_arguments),
                      tuple(loras), _input_fps(family, args.pipeline))


def _check_components(cls: type, files, run, read) -> None:
    """Each ``--component NAME=FILE`` names a model component of ``cls`` that ``--config``'s ``model_index.json``
    lists, as loading checks it (:func:`eqxdiff.pipelines.file_component_problem`), before anything is loaded."""
    if not isinstance(files, Mapping):
        return
    index = read("model_index.json") or {}
    for name in list(files)[1:]:  # the first is --model's own component, named by its layout
        problem = file_component_problem(cls, name, index, run.config, flags=True)
        if problem is not None:
            raise InputError(problem)


def _input_fps(family: FamilyOptions, parsed) -> float | None:
    """The frame rate of the first video file the command line gives (``--video``), ``None`` without one."""
    for name, kind in family.media.items():
        path = family.values(parsed).get(name)
        path = path[0] if isinstance(path, list) else path
        if kind == "video" and path is not None:
            return video_fps(path)
    return None


def save_fps(checked: Invocation, pipe) -> float | None:
    """The frame rate videos are saved at: ``--fps``, else the call's ``frame_rate`` (the rate the model was
    conditioned on), else the input video's (an upsampled or edited clip plays as it did), else the pipeline's
    ``default_fps``."""
    return (checked.args.run.fps or checked.kwargs.get("frame_rate") or checked.input_fps
            or getattr(pipe, "default_fps", None))


def in_flags(error: InputError, family: FamilyOptions, kwargs: Mapping[str, Any], nets: int = 0) -> InputError:
    """``error`` (about the call's arguments: ``frame_index=9 lies outside ...``) in the command's words
    (:func:`~eqxdiff.cli._command.as_flags`: ``--frame-index 9 lies outside ...``), the call's Python-only arguments'
    alternatives dropped; the same type. Both the checks before loading and the call's own errors go through it."""
    cls = family.pipeline_class
    flags = {SCALE: "--controlnet-scale", control_argument(cls): "--control-image"} if nets else {}
    return type(error)(as_flags(str(error), kwargs, flags, family.python_only))


# MeshConfig's fields as --mesh.* flags (a MeshError names the fields)
MESH_FLAGS = {f.name: "--mesh." + f.name.replace("_", "-") for f in dataclasses.fields(MeshConfig)}


def _lora_models(cls: type, run, read) -> dict[str, Any]:
    """The models the --lora files adapt, built abstractly from the folder's configs (a --unet folder's own)."""
    if run.unet is not None and not Path(run.unet).expanduser().is_file():
        unet_read, base_read = config_reader(run.unet), read
        read = lambda path: unet_read("config.json") if path == "unet/config.json" else base_read(path)  # noqa: E731
    return abstract_models(cls, read, dtype=run.weights_dtype, scan=run.scan_layers)


def _flags(family: FamilyOptions) -> list[str]:
    return [f.name for f in dataclasses.fields(family.options)]


def _scheduler(read, name: str | None, options: Mapping[str, Any], items: Sequence[str] = (),
               fixes: Mapping[str, Any] | None = None):
    """The scheduler the pipeline will sample with (the folder's ``scheduler_config.json``, read with the pipeline
    class's ``fixes`` (its :attr:`~eqxdiff.pipelines.DiffusionPipeline.SCHEDULER_FIXES`; their warnings are left to
    the load), swapped to ``name`` and with ``options`` set, as :func:`~eqxdiff.pipelines.load_pipeline` builds it),
    or ``None`` without one. An option its class does not have is refused naming the class, the options it has and
    the ``--scheduler`` names that have it (``items``: the ``--scheduler-option`` flags as typed)."""
    raw = read("scheduler/scheduler_config.json")
    if raw is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SchedulerConfigWarning)
        try:
            chosen = build_scheduler(raw, name, fixes=fixes)[0]
        except ConfigError as e:
            raise ConfigError(f"--scheduler {name}: {e}" if name else str(e)) from None
        if not options:
            return chosen
        _check_options(chosen, name, options, items)
        try:
            return build_scheduler(raw, name, options, fixes=fixes)[0]
        except ConfigError as e:
            raise ConfigError(f"--scheduler-option: {e}") from None


def _check_options(scheduler, name: str | None, options: Mapping[str, Any], items: Sequence[str]) -> None:
    def fields(config) -> set[str]:
        return {f.name for f in dataclasses.fields(config)}

    taken = fields(scheduler.config)
    for key in options:
        if key in taken:
            continue
        item = next((i for i in items if i.partition("=")[0].strip() == key), key)
        whose = f"--scheduler {name}'s" if name else "the --model folder's"
        having = [n for n, choice in SCHEDULERS.items() if key in fields(choice.cls.CONFIG)]
        fix = (f"--scheduler {', '.join(having)} {'has' if len(having) == 1 else 'have'} it: pass one of those or "
               "leave the option out" if having else "no --scheduler has it: leave it out")
        raise ConfigError(f"--scheduler-option {item}: {whose} {type(scheduler).__name__} has no option {key!r} "
                          f"(its options: {', '.join(sorted(taken))}); {fix}")


class _BeforeLoading:
    """A pipeline class as its :meth:`~eqxdiff.pipelines.DiffusionPipeline.check_call` sees it before loading:
    the scheduler built from the folder's config, the VAE's latent channels (its ``config.json`` read through
    its config class) and the folder's ``model_index.json`` (``folder_index``); every other attribute is the class's."""

    def __init__(self, cls: type, scheduler, latent_channels: int, folder_index: dict):
        self._cls, self.scheduler, self.latent_channels = cls, scheduler, latent_channels
        self.folder_index = folder_index  # the folder's model_index.json: its components and settings

    def __getattr__(self, name: str):
        return getattr(self._cls, name)


def check_schedule(cls: type, scheduler, kwargs: Mapping[str, Any], read) -> None:
    """The schedule a call of ``cls`` with ``kwargs`` asks for exists, before anything is loaded: the class's own
    :meth:`~eqxdiff.pipelines.DiffusionPipeline.check_call` (the steps within the training timesteps, a
    ``strength`` or hand-off that leaves a step, a custom ``timesteps`` / ``sigmas`` the scheduler takes: what
    :func:`~eqxdiff.pipelines.plan_schedule` refuses) on ``scheduler`` (:func:`_scheduler`; ``None``: not
    checked). Raises :class:`~eqxdiff.pipelines.InputError` with the check's message."""
    if scheduler is None:
        return
    vae = cls.folder_config(read, "vae")
    latent_channels = 4 if vae is None else vae.latent_channels
    try:
        cls.check_call(_BeforeLoading(cls, scheduler, latent_channels, read("model_index.json") or {}), {**kwargs})
    except InputError:
        raise
    except ValueError as e:  # the scheduler's and plan_schedule's errors: the call's arguments cannot run
        raise InputError(str(e)) from None


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> list[Path]:
    """Check ``argv`` (default ``sys.argv[1:]``; :func:`validate`), generate, save; returns the saved files' paths.
    All of it runs with the compilation cache the flags ask for (:meth:`~eqxdiff.cli._command.CacheOptions.scope`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with split_cache_flags(argv)[0].scope():
        parsed = parse_command(argv, prog=prog)
        if parsed.args.lora.lora_info is not None:
            print(_lora_info(parsed, argv))
            return []
        checked = validate(argv, prog=prog, parsed=parsed)
        hosts = checked.args.parallel
        initialize_distributed(hosts.coordinator_address, hosts.num_processes, hosts.process_id)
        return _generate(checked)


def _lora_info(parsed: Parsed, argv: Sequence[str]) -> str:
    """``--lora-info FILE``'s report; with ``--model`` given, what of the file adapts that pipeline's models (built
    abstractly from its configs: nothing is loaded)."""
    run, cls = parsed.args.run, parsed.family.pipeline_class
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        return lora_info(parsed.args.lora.lora_info)
    return lora_info(parsed.args.lora.lora_info, cls, _lora_models(cls, run, config_reader(run.model, run.revision,
                                                                                            run.config)))


def _generate(checked: Invocation) -> list[Path]:
    """Load, generate, save and report (:func:`main` after its checks)."""
    args, kwargs = checked.args, dict(checked.kwargs)
    run = args.run
    mesh = None
    if args.parallel.parallel or args.mesh != MeshConfig() or jax.process_count() > 1:
        try:
            mesh = make_mesh(args.mesh)
        except MeshError as e:  # sizes that do not fit this machine's devices: in the --mesh.* flags' words
            raise MeshError(as_flags(str(e), (), MESH_FLAGS)) from None
    main_process = jax.process_index() == 0

    t0 = time.perf_counter()
    common = {"dtype": run.weights_dtype, "scheduler": run.scheduler, "scheduler_options": checked.scheduler_options,
              "attention": run.attention, "activations_dtype": run.activations_dtype, "mesh": mesh,
              "offload_encoders": run.offload_encoders, "scan_layers": run.scan_layers}
    controlnets = args.control.controlnet
    pipe = load_pipeline(model_files(run), revision=run.revision, config=run.config,
                         **({"pipeline_class": checked.load_class} if checked.load_class else {}), **common)
    added = {}
    if controlnets:
        added["controlnet"] = load_controlnets(controlnets, dtype=run.weights_dtype, mesh=mesh, rules=pipe.rules,
                                               attention=run.attention, scan_layers=run.scan_layers)
    if run.unet is not None:
        added["unet"] = load_unet(run.unet, pipe, dtype=run.weights_dtype, attention=run.attention,
                                  scan_layers=run.scan_layers)
    if added:  # the base's other components shared (its ControlNet pipeline with nets), as diffusers' from_pipe
        pipe = checked.family.pipeline_class.from_pipe(pipe, **added)
    loras = apply_loras(pipe, checked.loras, args.lora)
    load_extras(pipe, run)
    refiner = None if run.refiner is None else load_pipeline(run.refiner, pipeline_class=checked.refiner.pipeline_class,
                                                             **common)
    load_s = time.perf_counter() - t0
    for p in (pipe, refiner):
        if run.vae_tiling and p is not None:
            p.enable_vae_tiling()
    if "progress" in kwargs:
        kwargs["progress"] = kwargs["progress"] and main_process
    # The options given (and the command's own): the pipeline's recommended call and signature give the others.
    passed = checked.passed | ({"progress"} if not main_process else set())
    call = {k: v for k, v in kwargs.items() if k in passed}
    t0 = time.perf_counter()
    try:
        if refiner is None:
            outputs = pipe(**call)
        else:  # the base hands its latents over to the refiner, which gets the base's arguments as the base ran them
            latents = pipe(**{**call, "output_type": "latent"})
            outputs = refiner(**refiner_kwargs(_flags(checked.refiner), kwargs, latents))
    except InputError as e:  # what only the call could check, in the flags' words as the checks before loading
        raise in_flags(e, checked.family, kwargs, checked.nets) from None
    total_s = time.perf_counter() - t0
    compile_s = sum(p.timings["call_compile"] for p in (pipe, refiner) if p is not None)

    params = _parameters(checked, pipe, outputs, refiner, loras)
    fps = save_fps(checked, pipe)
    paths = save_outputs(outputs, run.output_dir, params, fps=fps, overwrite=run.overwrite) if main_process else []
    print(f"load: {load_s:.2f} s | compile: {compile_s:.2f} s | generation (excluding compile): "
          f"{max(total_s - compile_s, 0.0):.2f} s | total call: {total_s:.2f} s"
          + ("" if mesh is None else f" | mesh {dict(mesh.shape)}"), file=sys.stderr)
    for p in paths:
        print(p)
    return paths


def _parameters(checked: Invocation, pipe, outputs, refiner=None, loras=()) -> dict:
    """What went into the outputs, under the pipeline arguments' names: enough to make them again (with the
    ControlNets' folders, control image files and scales, the single file's config folder, the --unet, the
    refiner, the --lora files: name, scale, sha256 and where from)."""
    args = checked.args
    values = checked.family.values(args.pipeline)
    # The pipeline's recommended call gave what the command line left out (the digits model's 20 steps ...).
    values.update({k: v for k, v in pipe.call_defaults.items() if k in values and k not in checked.passed})
    values.pop("progress", None)
    values = {k: os.fspath(v) if isinstance(v, Path) else [os.fspath(p) for p in v]
              if isinstance(v, list) and v and isinstance(v[0], Path) else v for k, v in values.items()}
    # The sizes actually used (None in the flags means the model's native size).
    values["height"], values["width"] = int(outputs.shape[-3]), int(outputs.shape[-2])
    if outputs.ndim == 5 and "num_frames" in values:
        values["num_frames"] = int(outputs.shape[1])
    init_image = type(pipe).INIT_IMAGE
    if "strength" in values and (init_image is None or values.get(init_image) is None):
        del values["strength"]  # image-to-image only
    run, control = args.run, args.control
    extra: dict[str, Any] = {"scheduler_options": dict(checked.scheduler_options)} if checked.scheduler_options else {}
    extra.update({k: v for k, v in (("revision", run.revision), ("config", run.config), ("unet", run.unet))
                  if v is not None})
    if checked.nets:
        if control.controlnet:
            extra["controlnet"] = list(control.controlnet)
        extra["control_image"] = [os.fspath(p) for p in control.control_image]
        extra[SCALE] = effective_scales(type(pipe), checked.kwargs, len(control.control_image) or checked.nets)
        if control.control_mode:
            extra["control_mode"] = list(control.control_mode)
    if loras:
        extra.update(lora=list(loras), **({"fuse_lora": True} if args.lora.fuse_lora else {}))
    extra.update(extras_metadata(run))
    if run.component:  # the files read beside --model's (Wan 2.2 A14B's second expert)
        extra["component"] = list(run.component)
    if refiner is not None:
        extra.update(refiner=run.refiner, refiner_pipeline=type(refiner).__name__,
                     refiner_scheduler=scheduler_name(getattr(refiner, "scheduler", None)))
    return {**values, "model": run.model, "pipeline": type(pipe).__name__,
            "scheduler": scheduler_name(getattr(pipe, "scheduler", None)), **extra,
            "weights_dtype": run.weights_dtype, "activations_dtype": run.activations_dtype,
            "attention": run.attention, **({"vae_tiling": True} if run.vae_tiling else {})}


MEMORY_HINT = ("fewer images (--num-images-per-prompt), a smaller --height/--width or input image, --vae-tiling, "
               "--weights-dtype bfloat16 --activations-dtype bfloat16, --attention chunked, --offload-encoders, or "
               "more devices (--mesh.ici-fsdp-parallelism -1)")


def cli() -> None:
    """The ``eqxdiff-generate`` console command (see :func:`eqxdiff.cli._command.run_command`)."""
    run_command(main, memory_hint=MEMORY_HINT)


if __name__ == "__main__":
    cli()
