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
kept, and the same command trains it again.
"""

import dataclasses
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path

import tyro

from ..data import character_tokenizer
from ..loading import PACKAGED_MODELS, read_config, resolve_folder
from ..parallel import MeshConfig, Remat
from ..pipelines import InputError
from ..train import DigitsArchitecture, Objective, OptimizerConfig, TrainConfig, run
from ._command import DEBUG_HELP, FlagError, as_flags, check_output_folder, config_errors_raise, run_command

DESCRIPTION = ("Train or fine-tune a Stable Diffusion, SDXL or Flux model: every field of eqxdiff.train.TrainConfig "
               f"is a flag, a preset sets the defaults. {DEBUG_HELP}")
MEMORY_HINT = ("a smaller --batch-size (with --optimizer.accumulation-steps to keep the effective batch), a smaller "
               "--resolution, --remat FULL, --no-cache with a large dataset, or shard over more devices "
               "(--mesh.ici-fsdp-parallelism -1)")
PRESETS = {
    "digits": (
        ("The digits model shipped with eqxdiff: SD classes at a small size, trained from scratch on "
         "scikit-learn's digits."),
        TrainConfig(
            data=None, resolution=16, batch_size=64, steps=1500, architecture=DigitsArchitecture(), mesh=MeshConfig(),
            optimizer=OptimizerConfig(learning_rate=1e-3, warmup_steps=100, total_steps=1500, schedule="cosine",
                                      final_learning_rate_fraction=0.05, weight_decay=1e-2, max_grad_norm=1.0),
            objective=Objective(prediction_type="epsilon", snr_gamma=5.0, caption_dropout=0.1),
            ema_decay=0.995, autoencoder_steps=600, autoencoder_batch_size=32, autoencoder_learning_rate=2e-3,
            kl_weight=1e-4, output_dir=Path("runs/digits"),
            export_dtype="float32", export_scheduler="dpm++2m", log_every=25,
            sample_prompts=tuple(f"a handwritten digit {d}" for d in
                                 ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")))),
    "sd15": (
        "Fine-tune Stable Diffusion 1.5 (epsilon prediction) at 512 px (--data, --hf-dataset or --tfrecord).",
        TrainConfig(
            model="stable-diffusion-v1-5/stable-diffusion-v1-5", resolution=512, batch_size=1, steps=15000,
            mesh=MeshConfig(),
            optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=500, total_steps=15000, schedule="constant",
                                      accumulation_steps=4),
            objective=Objective(snr_gamma=5.0, caption_dropout=0.05), ema_decay=0.9999,
            output_dir=Path("runs/sd15"), checkpoint_every=500, sample_every=500,
            sample_prompts=("a photo of a cat",), sample_steps=25, sample_guidance_scale=7.5)),
    "sd21": (
        "Fine-tune Stable Diffusion 2.1 (v-prediction) at 768 px (--data, --hf-dataset or --tfrecord).",
        TrainConfig(
            model="stabilityai/stable-diffusion-2-1", resolution=768, batch_size=1, steps=15000, mesh=MeshConfig(),
            optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=500, total_steps=15000, schedule="constant",
                                      accumulation_steps=4),
            objective=Objective(snr_gamma=5.0, caption_dropout=0.05), ema_decay=0.9999,
            output_dir=Path("runs/sd21"), checkpoint_every=500, sample_every=500,
            sample_prompts=("a photo of a cat",), sample_steps=25, sample_guidance_scale=7.5)),
    "sdxl": (
        ("Fine-tune the SDXL base UNet at 1024 px as diffusers' train_text_to_image_sdxl.py: both text encoders "
         "frozen and cached, each image's original size and crop as micro-conditioning, FSDP over every device with "
         "remat (--data, --hf-dataset or --tfrecord)."),
        TrainConfig(
            model="stabilityai/stable-diffusion-xl-base-1.0", resolution=1024, batch_size=8, steps=10000,
            mesh=MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1), remat=Remat.FULL, cache_stream=True,
            optimizer=OptimizerConfig(learning_rate=1e-6, total_steps=10000, schedule="constant"),
            objective=Objective(caption_dropout=0.2), export_scheduler=None, output_dir=Path("runs/sdxl"),
            checkpoint_every=500, sample_every=500, sample_prompts=("a photo of a cat",), sample_steps=30,
            sample_guidance_scale=5.0)),
    "flux-dev": (
        ("Flow-matching fine-tuning of FLUX.1-dev's transformer at 512 px (diffusers' Flux recipe: guidance 3.5 "
         "embedded; --objective.weighting-scheme logit_normal / mode / cosmap ...), latents and text embeddings "
         "cached, FSDP over every device with remat (--data, --hf-dataset or --tfrecord)."),
        TrainConfig(
            model="black-forest-labs/FLUX.1-dev", resolution=512, batch_size=8, steps=5000,
            mesh=MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1), remat=Remat.FULL, cache_stream=True,
            optimizer=OptimizerConfig(learning_rate=1e-5, total_steps=5000, schedule="constant"),
            objective=Objective(weighting_scheme="none"), guidance_scale=3.5, max_sequence_length=512,
            export_scheduler=None, output_dir=Path("runs/flux-dev"), checkpoint_every=500, sample_every=500,
            sample_prompts=("a photo of a cat",), sample_steps=28, sample_guidance_scale=3.5)),
    "flux-schnell": (
        ("Flow-matching fine-tuning of FLUX.1-schnell's transformer at 512 px (no guidance embedding, T5 at 256 "
         "tokens), latents and text embeddings cached, FSDP over every device with remat (--data, --hf-dataset or "
         "--tfrecord)."),
        TrainConfig(
            model="black-forest-labs/FLUX.1-schnell", resolution=512, batch_size=8, steps=5000,
            mesh=MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1), remat=Remat.FULL, cache_stream=True,
            optimizer=OptimizerConfig(learning_rate=1e-5, total_steps=5000, schedule="constant"),
            objective=Objective(weighting_scheme="none"), max_sequence_length=256, export_scheduler=None,
            output_dir=Path("runs/flux-schnell"), checkpoint_every=500, sample_every=500,
            sample_prompts=("a photo of a cat",), sample_steps=4, sample_guidance_scale=0.0)),
}


def _nested_config(tp) -> type | None:
    """The dataclass a field annotation holds (``MeshConfig | None``: ``MeshConfig``), or ``None``."""
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return next((m for m in members if dataclasses.is_dataclass(m)), None)


def _leaf_fields(cls: type, prefix: str = "") -> list[str]:
    """The dotted names of ``cls``'s fields, those of nested configs spelled out (``optimizer.learning_rate``)."""
    names = []
    for field in dataclasses.fields(cls):
        nested = _nested_config(typing.get_type_hints(cls)[field.name])
        names += [prefix + field.name] if nested is None else _leaf_fields(nested, f"{prefix}{field.name}.")
    return names


def field_flags(cls: type = TrainConfig) -> dict[str, str]:
    """``{name: flag}`` of every field of ``cls`` and of the configs nested in it, under the names the configs'
    errors use: the dotted path (``optimizer.learning_rate``, ``architecture.image_size``) and, where no other
    field has it, the bare name (``learning_rate``) -> ``--optimizer.learning-rate``."""
    dotted = {name: "--" + name.replace("_", "-") for name in _leaf_fields(cls)}
    bare: dict[str, list[str]] = {}
    for name, flag in dotted.items():
        bare.setdefault(name.rsplit(".", 1)[-1], []).append(flag)
    return {**{k: v[0] for k, v in bare.items() if len(v) == 1}, **dotted}


FIELD_FLAGS = field_flags()


def in_flags(error: ValueError) -> ValueError:
    """``error`` (a :class:`~eqxdiff.train.TrainConfig` field's check: ``learning_rate=nan must be ...``) with the
    fields named as the flags that set them (``--optimizer.learning-rate nan must be ...``), of the same type."""
    message = as_flags(str(error), (), FIELD_FLAGS)
    return error if message == str(error) else type(error)(message)


def _check_preset(argv: Sequence[str], prog: str | None) -> None:
    if not argv or argv[0] in PRESETS or any(a in ("-h", "--help") for a in argv):
        return  # no arguments: tyro's own message names the presets
    first = "" if argv[0].startswith("-") else f"unknown preset {argv[0]!r}; "
    raise FlagError(f"{first}a command line starts with a preset, one of {', '.join(PRESETS)} "
                    f"({prog or 'eqxdiff-train'} PRESET [flags]; --help describes each)")


def parse(argv: Sequence[str] | None = None, *, prog: str | None = None) -> TrainConfig:
    """The :class:`~eqxdiff.train.TrainConfig` a command line (default ``sys.argv[1:]``) selects: a preset's, with
    the flags given. A value a config refuses raises its ``ValueError`` with the flags named (:func:`in_flags`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    _check_preset(argv, prog)
    try:
        with config_errors_raise():
            return tyro.extras.overridable_config_cli(PRESETS, args=argv, prog=prog, description=DESCRIPTION)
    except FlagError:
        raise
    except ValueError as e:
        raise in_flags(e) from None


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


def _vae_factor(model: str) -> int | None:
    """The VAE's downsampling factor of a local pipeline folder (``None`` for a Hub id: read when it loads)."""
    local = Path(model).expanduser()
    if not local.is_dir() and model not in PACKAGED_MODELS:
        return None
    vae = read_config(resolve_folder(model, "vae"))
    return 2 ** (len(vae.get("block_out_channels", (0,) * 4)) - 1)


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> None:
    """Check ``argv`` (:func:`validate`) and train (:func:`eqxdiff.train.run`)."""
    config = validate(argv, prog=prog)
    if config.optimizer.total_steps != config.steps:  # the schedule spans the run unless set on purpose
        print(f"note: optimizer.total_steps={config.optimizer.total_steps} differs from steps={config.steps}",
              file=sys.stderr)
    run(config)


def cli() -> None:
    """The ``eqxdiff-train`` console command (see :func:`eqxdiff.cli._command.run_command`)."""
    run_command(main, memory_hint=MEMORY_HINT)


if __name__ == "__main__":
    cli()
