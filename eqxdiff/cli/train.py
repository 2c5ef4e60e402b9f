"""``eqxdiff-train`` (and ``python scripts/train.py``): train or fine-tune a Stable Diffusion, SDXL, Flux or Wan
model.

    eqxdiff-train digits                                  # the shipped digits model, from scratch
    eqxdiff-train sd15 --data path/to/folder --steps 2000 # fine-tune SD 1.5 on captioned images
    eqxdiff-train sd15 --hf-dataset user/name --caption-column caption  # ... on a Hugging Face dataset
    eqxdiff-train sd15 --tfrecord shards/ --caption-key caption         # ... on TFRecord files
    eqxdiff-train sd15 --data x --mesh.ici-data-parallelism 1 --mesh.ici-fsdp-parallelism -1 --remat FULL
    eqxdiff-train digits --optimizer.learning-rate 5e-4 --objective.snr-gamma 5 --help
    eqxdiff-train sdxl --data path/to/folder              # SDXL base, encoders cached, FSDP + remat
    eqxdiff-train flux-dev --data path/to/folder --objective.weighting-scheme logit_normal
    eqxdiff-train lora-sdxl --data path/to/folder --lora.rank 16 --lora.targets attention mlp --lora.dora
    eqxdiff-train lora-digits --data thick-digits/   # a style LoRA on the shipped digits model, minutes on a CPU
    eqxdiff-train dreambooth-sd15 --data dog/ --instance-prompt "a photo of sks dog" --class-prompt "a photo of dog"

Every field of :class:`eqxdiff.train.TrainConfig` is a flag; a preset only changes the defaults
(:mod:`eqxdiff.cli._train_presets`). The SD presets run data parallel over every device, ``sdxl``, ``flux-*`` and
their LoRA and DreamBooth presets FSDP with remat (``--mesh.*`` changes the mesh). The trained pipeline is exported
to ``OUTPUT_DIR/pipeline``, a LoRA (``--lora.rank`` > 0) to ``OUTPUT_DIR/lora`` (a PEFT file, or kohya's with
``--lora.format kohya``), unless ``--export-dir`` says otherwise; nothing is written into the package.

Every flag is checked before anything is loaded (:func:`validate`); a bad one stops the command with one line
``error: <what> (<how to fix>)`` naming the flags, and status 2 (``--debug`` shows the traceback). Ctrl-C or SIGTERM
stop at the next step with a checkpoint saved: ``interrupted at step N; checkpoint saved in DIR (run the same command
to resume)`` and status 130; during the autoencoder stage of a from-scratch run (minutes) nothing of that stage is
kept, and the same command trains it again. The same command resumes from the latest checkpoint once the settings
saved with it agree (only those the ``--resume`` help lists may change, each with a note; any other change is
refused before loading, naming each ``--flag old -> new``); a finished run has nothing to do. Compiled programs are
kept in the persistent compilation cache (``~/.cache/eqxdiff/jax``; ``--compilation-cache-dir``,
``--no-compilation-cache``), so a resumed or repeated run starts without compiling its step again.
"""

import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import tyro

from ..data import character_tokenizer, holds_videos
from ..loading import PACKAGED_MODELS, read_config, resolve_folder
from ..parallel import MeshError
from ..pipelines import InputError
from ..train import (
    CheckpointMismatchError,
    DataError,
    LoraConfig,
    TrainConfig,
    TrainingInterrupted,
    autoencoder_reuse,
    check_data_kind,
    check_frame_count,
    check_model,
    check_size,
    family_options,
    local_index,
    resume_point,
    run,
    train_family,
)
from ._command import (
    CACHE_HELP,
    DEBUG_HELP,
    FlagError,
    as_flags,
    check_output_folder,
    config_errors_raise,
    run_command,
    split_cache_flags,
)
from ._generate_flags import config_reader, pipeline_class
from ._numbers import field_types, number_error
from ._train_presets import PRESET_NEEDS, PRESETS

DESCRIPTION = ("Train or fine-tune a Stable Diffusion, SDXL, Flux or Wan model: every field of "
               "eqxdiff.train.TrainConfig is a flag, a preset sets the defaults. A run resumes from the checkpoints in "
               f"its --output-dir (--resume says which settings may change). {CACHE_HELP} {DEBUG_HELP}")
MEMORY_HINT = ("a smaller --batch-size (with --optimizer.accumulation-steps to keep the effective batch), a smaller "
               "--resolution, --remat FULL, --no-cache with a large dataset, or shard over more devices "
               "(--mesh.ici-fsdp-parallelism -1)")
def field_flags(config: type | TrainConfig = TrainConfig) -> dict[str, str]:
    """``{name: flag}`` of every field of ``config`` (:class:`~eqxdiff.train.TrainConfig`, or a preset's config:
    with its family's options) and of the configs nested in it, under the names the configs' errors use: the dotted
    path (``optimizer.learning_rate``, ``family.guidance_scale``) and, where no other field has it, the bare name
    (``learning_rate``) -> ``--optimizer.learning-rate``."""
    dotted = {name: "--" + name.replace("_", "-") for name in field_types(config)}
    bare: dict[str, list[str]] = {}
    for name, flag in dotted.items():
        bare.setdefault(name.rsplit(".", 1)[-1], []).append(flag)
    return {**{k: v[0] for k, v in bare.items() if len(v) == 1}, **dotted}


FIELD_FLAGS = field_flags()


def in_flags(error: ValueError, flags: dict[str, str] = FIELD_FLAGS) -> ValueError:
    """``error`` (a :class:`~eqxdiff.train.TrainConfig` field's check: ``learning_rate=nan must be ...``) with the
    fields named as the flags that set them (``--optimizer.learning-rate nan must be ...``, ``resume=False``:
    ``--no-resume``; ``flags``: a preset's :func:`field_flags`, for its family's options), of the same type."""
    message = as_flags(str(error).replace("resume=False", "--no-resume"), (), flags)
    return error if message == str(error) else type(error)(message)


def _check_preset(argv: Sequence[str], prog: str | None) -> None:
    if not argv or argv[0] in PRESETS or any(a in ("-h", "--help") for a in argv):
        return  # no arguments: tyro's own message names the presets
    first = "" if argv[0].startswith("-") else f"unknown preset {argv[0]!r}; "
    raise FlagError(f"{first}a command line starts with a preset, one of {', '.join(PRESETS)} "
                    f"({prog or 'eqxdiff-train'} PRESET [flags]; --help describes each)")


def _listing(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _family_fields(config: TrainConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(config.family)]


def _family_flags(argv: list[str]) -> list[str]:
    """``argv`` with a family option given by its bare name (``--guidance-scale``, ``--max-sequence-length``: the
    top-level flags they were before ``--family.*``) renamed to its ``--family.*`` flag, with a note. A family
    option the preset's family does not take raises :class:`FlagError` naming the presets whose family does."""
    if not argv or argv[0] not in PRESETS:
        return argv
    preset, config = argv[0], PRESETS[argv[0]][1]
    own = _family_fields(config)
    renamed = [preset]
    for token in argv[1:]:
        name, sep, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        field = name.removeprefix("family.").replace("-", "_")
        if name and "--" + name not in FIELD_FLAGS.values():
            others = [p for p, (_, c) in PRESETS.items() if field in _family_fields(c)]
            flag = "--family." + field.replace("_", "-")
            if field in own and not name.startswith("family."):
                print(f"note: --{name} is {flag} now (the old name still works)", file=sys.stderr)
                token = f"{flag}{sep}{value}"
            elif field not in own and others:
                takes = ", ".join("--family." + f.replace("_", "-") for f in own) or "none"
                given = "--" + name if "--" + name == flag else f"--{name} ({flag} now)"
                raise FlagError(f"{given} is a family option of the {_listing(others)} presets; the {preset} "
                                f"preset's family takes {takes}")
        renamed.append(token)
    return renamed


def parse(argv: Sequence[str] | None = None, *, prog: str | None = None) -> TrainConfig:
    """The :class:`~eqxdiff.train.TrainConfig` a command line (default ``sys.argv[1:]``) selects: a preset's, with
    the flags given (a family option also by its bare name, as it was before ``--family.*``: :func:`_family_flags`;
    the cache flags, read by :func:`main`, left out). A value a config refuses raises its ``ValueError`` with the
    flags named (:func:`in_flags`)."""
    _, argv = split_cache_flags(sys.argv[1:] if argv is None else argv)
    _check_preset(argv, prog)
    argv = _family_flags(argv)
    preset = PRESETS[argv[0]][1] if argv and argv[0] in PRESETS else TrainConfig()
    flags = field_flags(preset)
    # the chosen preset's --help names the cache flags, which its config does not hold (the list of presets has
    # them in the command's description)
    presets = {name: (f"{text} {CACHE_HELP}" if argv and name == argv[0] else text, config)
               for name, (text, config) in PRESETS.items()}
    if argv and argv[0] in PRESETS and _full_fine_tune(argv) and PRESETS[argv[0]][1].lora.enabled:
        text, config = presets[argv[0]]  # a LoRA preset trained in full: its adapters' settings go too
        presets[argv[0]] = text, dataclasses.replace(config, lora=LoraConfig())
    try:
        with config_errors_raise():
            return tyro.extras.overridable_config_cli(presets, args=argv, prog=prog, description=DESCRIPTION)
    except FlagError:
        raise
    except ValueError as e:  # a number that does not parse: in the flag's words (tyro's names neither)
        message = number_error(argv[1:], {flags[name]: kind for name, kind in field_types(preset).items()})
        raise (FlagError(message) if message else in_flags(e, flags)) from None


def _full_fine_tune(argv: Sequence[str]) -> bool:
    """Whether ``argv`` sets ``--lora.rank 0`` (the last value given wins)."""
    ranks = [b if a == "--lora.rank" else a.partition("=")[2] for a, b in zip(argv, [*argv[1:], ""])
             if a == "--lora.rank" or a.startswith("--lora.rank=")]
    return bool(ranks) and ranks[-1].strip() == "0"


def _inside(path: Path, folder: Path) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def validate(argv: Sequence[str] | None = None, *, prog: str | None = None) -> TrainConfig:
    """Parse ``argv`` into a :class:`~eqxdiff.train.TrainConfig` (whose fields check their own values) and check
    what needs more than one field, without loading anything: one data source, the output and export folders (never
    a file, never the model shipped inside eqxdiff), the from-scratch architecture's model configs, and a resolution
    the VAE can downsample. Raises a ``ValueError`` naming the flag."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config = parse(argv, prog=prog)
    k = config.optimizer.accumulation_steps
    if config.steps < k:  # optax.MultiSteps applies an update every k micro-steps: none would run
        raise InputError(f"--steps {config.steps} is fewer than --optimizer.accumulation-steps {k}: no optimizer "
                         f"update would run (the export would be the model as loaded); give --steps {k} or more (a "
                         f"multiple of {k}), or fewer accumulation steps")
    try:
        config.source  # noqa: B018 - a missing or conflicting data source raises ValueError
    except ValueError as e:
        raise in_flags(e) from None
    folders = [("--output-dir", Path(config.output_dir)), ("--export-dir", config.export_folder)]
    if config.class_prompt is not None and config.class_data_dir is not None:
        folders.append(("--class-data-dir", config.class_data_dir))
    for flag, path in folders:
        check_output_folder(flag, path)  # a file, or under one: refused before hours of training
        shipped = next((name for name, folder in PACKAGED_MODELS.items() if _inside(path, folder)), None)
        if shipped is not None:
            raise InputError(f"{flag} {os.fspath(path)!r} is inside the {shipped!r} model shipped with eqxdiff; pass "
                             f"another folder (copy the exported pipeline over {os.fspath(PACKAGED_MODELS[shipped])} "
                             "yourself to replace the shipped model)")
    _check_family(config)
    _check_preset_folder(next(iter(split_cache_flags(argv)[1]), ""), config)
    _check_clips(config)  # a --data folder of clips: in flags, with the sizes that fit
    try:  # the folder's configs against the family options, objective and schedulers; clips or images as it trains
        check_data_kind(config, check_model(config))
    except ValueError as e:
        raise InputError(str(in_flags(e, field_flags(config))) + _family_presets(config)) from None
    try:  # an earlier run in --output-dir trained with other settings: refused now, not after minutes of loading
        resume_point(config)
        if config.model is None:
            autoencoder_reuse(config)
    except CheckpointMismatchError as e:
        raise in_flags(e, field_flags(config)) from None
    if config.model is None:
        tokenizer = character_tokenizer(max_length=32)
        try:
            _, _, vae = config.architecture.configs(tokenizer)  # ConfigError for sizes the models cannot take
        except ValueError as e:
            raise in_flags(e) from None
        factor = vae.downsample_factor
    else:
        factor = _vae_factor(config.model)
    _check_size(config, factor, f"the VAE downsamples by {factor}")
    return config


def _flag(field: str, value) -> str:
    """A setting's value as its flag gives it (``--resolution 32 48``), for the library's checks' messages."""
    shown = " ".join(map(str, value)) if isinstance(value, (tuple, list)) else value
    return f"--{field.replace('_', '-')} {shown}"


def _check_size(config: TrainConfig, factor: int | None, why: str) -> None:
    """Both sides of ``--resolution`` (one size, or height and width) are multiples of ``factor`` (``why``), else an
    :class:`InputError` naming the nearest size that is (the lower one on a tie)."""
    check_size(config, factor, why, spell=_flag, error=InputError)


def _local(model: str) -> bool:
    """Whether ``model`` is a folder on this machine (or a model shipped with eqxdiff), read before loading; a Hub
    id is read when it loads."""
    return Path(model).expanduser().is_dir() or model in PACKAGED_MODELS


def _vae_factor(model: str) -> int | None:
    """The VAE's downsampling factor of a local pipeline folder (``None`` for a Hub id: read when it loads)."""
    if not _local(model):
        return None
    vae = read_config(resolve_folder(model, "vae"))
    return 2 ** (len(vae.get("block_out_channels", (0,) * 4)) - 1)


def _check_clips(config: TrainConfig) -> None:
    """For a ``--data`` folder of clips and a local ``--model`` folder: the clips' frame count and size are ones its
    VAE and transformer take (the pipeline's limits, read from the folder's configs), before anything is loaded."""
    if config.model is None or not _local(config.model) or not config.data or not Path(config.data).is_dir() \
            or not holds_videos(config.data):
        return
    limits = pipeline_class(config.model).folder_limits(config_reader(config.model))
    check_frame_count(config.frames.count, limits.frame_factor, spell=_flag, error=InputError)
    _check_size(config, limits.size_factor, limits.why_size())


def _check_family(config: TrainConfig) -> None:
    """A local ``--model`` folder's pipeline is one eqxdiff trains, and the preset's family options (``--family.*``)
    are its family's (:func:`eqxdiff.train.family_options`), before anything is loaded (what the folder can take of
    them: :func:`eqxdiff.train.check_model`)."""
    if config.model is None or not _local(config.model):
        return
    index = resolve_folder(config.model) / "model_index.json"
    name = read_config(index.parent, index.name).get("_class_name") if index.is_file() else None
    if name is None:
        return  # not a pipeline folder: loading says so
    family = train_family(name)
    try:
        family_options(config.family, family, f"--model {config.model!r} (a {name})")
    except ValueError:
        presets = [p for p, (_, c) in PRESETS.items() if type(c.family) is family.OPTIONS]
        raise InputError(f"--model {config.model!r} is a {name}, which trains as {family.__name__}, but the "
                         f"preset's --family.* options are {type(config.family).__name__}, another family's; start "
                         f"from a preset of the model's family ({', '.join(presets)}) with --model") from None


def _family_presets(config: TrainConfig) -> str:
    """``; or start from a preset of the model's family (...)`` where the preset is another family's (``sd15 --model
    WAN_FOLDER``: its objective and options are SD's), else ``""``."""
    index = local_index(config.model) if config.model is not None else None
    if index is None or index.get("_class_name") is None:
        return ""
    family = train_family(index["_class_name"])
    presets = [p for p, (_, c) in PRESETS.items() if type(c.family) is family.OPTIONS is not type(config.family)]
    return f"; or start from a preset of the model's family ({', '.join(presets)}) with --model" if presets else ""


def _check_preset_folder(preset: str, config: TrainConfig) -> None:
    """A local ``--model`` folder holds what the preset trains (:data:`~eqxdiff.cli._train_presets.PRESET_NEEDS`:
    the ``wan2.2-a14b`` preset's second expert), read from its ``model_index.json`` before loading; else an
    :class:`InputError` naming the preset, what the folder lacks and the presets of its family that fit it."""
    needs = PRESET_NEEDS.get(preset)
    if needs is None or config.model is None or not _local(config.model):
        return
    index = resolve_folder(config.model) / "model_index.json"
    model_index = read_config(index.parent, index.name) if index.is_file() else {}
    lacks = needs.lacks(model_index)
    if not lacks:
        return
    fits = [name for name, (_, c) in PRESETS.items() if type(c.family) is type(config.family)
            and not (name in PRESET_NEEDS and PRESET_NEEDS[name].lacks(model_index))]
    other = f", or start from a preset this folder fits ({', '.join(fits)})" if fits else ""
    raise InputError(f"the {preset} preset trains a folder with {_listing(lacks)}, which --model "
                     f"{config.model!r} lacks; pass such a folder ({PRESETS[preset][1].model}){other}")


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> None:
    """Check ``argv`` (:func:`validate`) and train (:func:`eqxdiff.train.run`) with the persistent compilation cache
    of the cache flags (:class:`~eqxdiff.cli._command.CacheOptions`), leaving JAX's cache settings as they were."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with split_cache_flags(argv)[0].scope():
        config = validate(argv, prog=prog)
        total = config.optimizer.total_steps  # None: the schedule spans --steps
        if total is not None and total != config.steps:
            print(f"note: --optimizer.total-steps {total} differs from --steps {config.steps}: the learning-rate "
                  f"schedule spans {total} steps", file=sys.stderr)
        k = config.optimizer.accumulation_steps
        if config.steps % k:
            print(f"note: --steps {config.steps} is not a multiple of --optimizer.accumulation-steps {k}: the last "
                  f"{config.steps % k} micro-step(s) accumulate a gradient that no update applies", file=sys.stderr)
        try:
            run(config)
        except (MeshError, DataError) as e:  # --mesh.* sizes that do not fit the devices or the batch, bad data
            raise in_flags(e, field_flags(config)) from None


def cli() -> None:
    """The ``eqxdiff-train`` console command (see :func:`eqxdiff.cli._command.run_command`)."""
    run_command(main, memory_hint=MEMORY_HINT, interrupted=TrainingInterrupted)


if __name__ == "__main__":
    cli()
