"""``eqxdiff-train`` (and ``python scripts/train.py``): train or fine-tune a Stable Diffusion, SDXL or Flux model.

    eqxdiff-train digits                                  # the shipped digits model, from scratch
    eqxdiff-train sd15 --data path/to/folder --steps 2000 # fine-tune SD 1.5 on captioned images
    eqxdiff-train sd15 --hf-dataset user/name --caption-column caption  # ... on a Hugging Face dataset
    eqxdiff-train sd15 --tfrecord shards/ --caption-key caption         # ... on TFRecord files
    eqxdiff-train sd15 --data x --mesh.ici-data-parallelism 1 --mesh.ici-fsdp-parallelism -1 --remat FULL
    eqxdiff-train digits --optimizer.learning-rate 5e-4 --objective.snr-gamma 5 --help
    eqxdiff-train sdxl --data path/to/folder              # SDXL base, encoders cached, FSDP + remat
    eqxdiff-train flux-dev --data path/to/folder --objective.weighting-scheme logit_normal

Every field of :class:`eqxdiff.train.TrainConfig` is a flag; a preset only changes the defaults. The SD presets run
data parallel over every device, ``sdxl`` and ``flux-*`` FSDP with remat (``--mesh.*`` changes the mesh). The trained
pipeline is exported to ``OUTPUT_DIR/pipeline`` unless ``--export-dir`` says otherwise; nothing is written into the
package.

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

from ..data import character_tokenizer
from ..loading import PACKAGED_MODELS, read_config, resolve_folder
from ..parallel import MeshConfig, Remat
from ..pipelines import InputError
from ..train import (
    CheckpointMismatchError,
    DigitsArchitecture,
    FluxOptions,
    Objective,
    OptimizerConfig,
    TrainConfig,
    TrainingInterrupted,
    autoencoder_reuse,
    family_options,
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
from ._numbers import field_types, number_error

DESCRIPTION = ("Train or fine-tune a Stable Diffusion, SDXL or Flux model: every field of eqxdiff.train.TrainConfig "
               "is a flag, a preset sets the defaults. A run resumes from the checkpoints in its --output-dir "
               f"(--resume says which settings may change). {CACHE_HELP} {DEBUG_HELP}")
MEMORY_HINT = ("a smaller --batch-size (with --optimizer.accumulation-steps to keep the effective batch), a smaller "
               "--resolution, --remat FULL, --no-cache with a large dataset, or shard over more devices "
               "(--mesh.ici-fsdp-parallelism -1)")
_CAT = ("a photo of a cat",)
_FSDP = MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1)


def _stable_diffusion(model: str, name: str, resolution: int) -> TrainConfig:
    """An SD 1.x/2.x fine-tuning preset (diffusers' ``train_text_to_image.py``): data parallel over every device,
    4 micro-steps per update, Min-SNR, EMA, checkpoints and samples every 500 steps."""
    return TrainConfig(
        model=model, resolution=resolution, batch_size=1, steps=15000, mesh=MeshConfig(),
        optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=500, schedule="constant", accumulation_steps=4),
        objective=Objective(snr_gamma=5.0, caption_dropout=0.05), ema_decay=0.9999, output_dir=Path(f"runs/{name}"),
        checkpoint_every=500, sample_every=500, sample_prompts=_CAT, sample_steps=25, sample_guidance_scale=7.5)


def _large(model: str, name: str, *, resolution: int, steps: int, learning_rate: float, **changes) -> TrainConfig:
    """A preset for a model that needs the whole machine (SDXL, Flux): FSDP over every device with full remat, a
    stream's latents and text embeddings cached once, a constant learning rate, the folder's own scheduler
    exported, checkpoints and samples every 500 steps; ``changes``: the family's objective, options, samples."""
    return TrainConfig(
        model=model, resolution=resolution, batch_size=8, steps=steps, mesh=_FSDP, remat=Remat.FULL,
        cache_stream=True, optimizer=OptimizerConfig(learning_rate=learning_rate, schedule="constant"),
        export_scheduler=None, output_dir=Path(f"runs/{name}"), checkpoint_every=500, sample_every=500,
        sample_prompts=_CAT, **changes)


# name: (description, config). A family's own options are its preset's ``family`` (--family.*).
PRESETS = {
    "digits": (
        ("The digits model shipped with eqxdiff: SD classes at a small size, trained from scratch on "
         "scikit-learn's digits. Its autoencoder stage (--autoencoder-steps 600, about 3 minutes on a 2-core CPU, "
         "its own progress bar) trains the VAE before any of --steps, whatever --steps is; a later run in the same "
         "--output-dir reuses it."),
        TrainConfig(
            data=None, resolution=16, batch_size=64, steps=1500, architecture=DigitsArchitecture(), mesh=MeshConfig(),
            optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=100, schedule="cosine",
                                      final_learning_rate_fraction=0.05, weight_decay=1e-2, max_grad_norm=1.0),
            objective=Objective(prediction_type="epsilon", snr_gamma=5.0, caption_dropout=0.1),
            ema_decay=0.995, autoencoder_steps=600, autoencoder_batch_size=32, autoencoder_learning_rate=2e-3,
            kl_weight=1e-4, output_dir=Path("runs/digits"),
            export_dtype="float32", export_scheduler="dpm++2m", log_every=25,
            sample_prompts=tuple(f"a handwritten digit {d}" for d in
                                 ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")))),
    "sd15": (
        "Fine-tune Stable Diffusion 1.5 (epsilon prediction) at 512 px (--data, --hf-dataset or --tfrecord).",
        _stable_diffusion("stable-diffusion-v1-5/stable-diffusion-v1-5", "sd15", 512)),
    "sd21": (
        "Fine-tune Stable Diffusion 2.1 (v-prediction) at 768 px (--data, --hf-dataset or --tfrecord).",
        _stable_diffusion("stabilityai/stable-diffusion-2-1", "sd21", 768)),
    "sdxl": (
        ("Fine-tune the SDXL base UNet at 1024 px as diffusers' train_text_to_image_sdxl.py: both text encoders "
         "frozen and cached, each image's original size and crop as micro-conditioning, FSDP over every device with "
         "remat (--data, --hf-dataset or --tfrecord)."),
        _large("stabilityai/stable-diffusion-xl-base-1.0", "sdxl", resolution=1024, steps=10000, learning_rate=1e-6,
               objective=Objective(caption_dropout=0.2), sample_steps=30, sample_guidance_scale=5.0)),
    "flux-dev": (
        ("Flow-matching fine-tuning of FLUX.1-dev's transformer at 512 px (diffusers' Flux recipe: guidance 3.5 "
         "embedded, --family.guidance-scale; --objective.weighting-scheme logit_normal / mode / cosmap ...), latents "
         "and text embeddings cached, FSDP over every device with remat (--data, --hf-dataset or --tfrecord)."),
        _large("black-forest-labs/FLUX.1-dev", "flux-dev", resolution=512, steps=5000, learning_rate=1e-5,
               objective=Objective(weighting_scheme="none"),
               family=FluxOptions(guidance_scale=3.5, max_sequence_length=512), sample_steps=28,
               sample_guidance_scale=3.5)),
    "flux-schnell": (
        ("Flow-matching fine-tuning of FLUX.1-schnell's transformer at 512 px (no guidance embedding, T5 at 256 "
         "tokens: --family.max-sequence-length), latents and text embeddings cached, FSDP over every device with "
         "remat (--data, --hf-dataset or --tfrecord)."),
        _large("black-forest-labs/FLUX.1-schnell", "flux-schnell", resolution=512, steps=5000, learning_rate=1e-5,
               objective=Objective(weighting_scheme="none"), family=FluxOptions(max_sequence_length=256),
               sample_steps=4, sample_guidance_scale=0.0)),
}


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
                raise FlagError(f"{given} is a family option of the {' and '.join(others)} presets; the {preset} "
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
    try:
        with config_errors_raise():
            return tyro.extras.overridable_config_cli(presets, args=argv, prog=prog, description=DESCRIPTION)
    except FlagError:
        raise
    except ValueError as e:  # a number that does not parse: in the flag's words (tyro's names neither)
        message = number_error(argv[1:], {flags[name]: kind for name, kind in field_types(preset).items()})
        raise (FlagError(message) if message else in_flags(e, flags)) from None


def _inside(path: Path, folder: Path) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def validate(argv: Sequence[str] | None = None, *, prog: str | None = None) -> TrainConfig:
    """Parse ``argv`` into a :class:`~eqxdiff.train.TrainConfig` (whose fields check their own values) and check
    what needs more than one field, without loading anything: one data source, the output and export folders (never
    a file, never the model shipped inside eqxdiff), the from-scratch architecture's model configs, and a resolution
    the VAE can downsample. Raises a ``ValueError`` naming the flag."""
    config = parse(argv, prog=prog)
    try:
        config.source  # noqa: B018 - a missing or conflicting data source raises ValueError
    except ValueError as e:
        raise in_flags(e) from None
    export = config.export_dir or Path(config.output_dir) / "pipeline"
    for flag, path in (("--output-dir", Path(config.output_dir)), ("--export-dir", export)):
        check_output_folder(flag, path)  # a file, or under one: refused before hours of training
        shipped = next((name for name, folder in PACKAGED_MODELS.items() if _inside(path, folder)), None)
        if shipped is not None:
            raise InputError(f"{flag} {os.fspath(path)!r} is inside the {shipped!r} model shipped with eqxdiff; pass "
                             f"another folder (copy the exported pipeline over {os.fspath(PACKAGED_MODELS[shipped])} "
                             "yourself to replace the shipped model)")
    _check_family(config)
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
    if factor and config.resolution % factor:
        raise InputError(f"--resolution {config.resolution} must be a multiple of {factor} (the VAE downsamples by "
                         f"{factor}); try --resolution {max(factor, config.resolution // factor * factor)}")
    return config


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


def _check_family(config: TrainConfig) -> None:
    """A local ``--model`` folder's pipeline is one eqxdiff trains, and the preset's family options (``--family.*``)
    are its family's (:func:`eqxdiff.train.family_options`), before anything is loaded."""
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
        run(config)


def cli() -> None:
    """The ``eqxdiff-train`` console command (see :func:`eqxdiff.cli._command.run_command`)."""
    run_command(main, memory_hint=MEMORY_HINT, interrupted=TrainingInterrupted)


if __name__ == "__main__":
    cli()
