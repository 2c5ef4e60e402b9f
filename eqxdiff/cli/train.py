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
``error: <what> (<how to fix>)`` and status 2 (``--debug`` shows the traceback). Ctrl-C or SIGTERM stop at the next
step with a checkpoint saved: ``interrupted at step N; checkpoint saved in DIR (run the same command to resume)``
and status 130.
"""

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import tyro

from ..data import character_tokenizer
from ..loading import PACKAGED_MODELS, read_config, resolve_folder
from ..parallel import MeshConfig, Remat
from ..pipelines import InputError
from ..train import DigitsArchitecture, Objective, OptimizerConfig, TrainConfig, run
from ._command import DEBUG_HELP, config_errors_raise, run_command

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


def parse(argv: Sequence[str] | None = None, *, prog: str | None = None) -> TrainConfig:
    """The :class:`~eqxdiff.train.TrainConfig` a command line (default ``sys.argv[1:]``) selects: a preset's, with
    the flags given."""
    with config_errors_raise():
        return tyro.extras.overridable_config_cli(PRESETS, args=argv, prog=prog, description=DESCRIPTION)


def _inside(path: Path, folder: Path) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def validate(argv: Sequence[str] | None = None, *, prog: str | None = None) -> TrainConfig:
    """Parse ``argv`` into a :class:`~eqxdiff.train.TrainConfig` (whose fields check their own values) and check
    what needs more than one field, without loading anything: one data source, the output and export folders (never
    a file, never the model shipped inside eqxdiff), the from-scratch architecture's model configs, and a resolution
    the VAE can downsample. Raises a ``ValueError`` naming the flag."""
    config = parse(argv, prog=prog)
    config.source  # noqa: B018 - a missing or conflicting data source raises ValueError
    export = config.export_dir or Path(config.output_dir) / "pipeline"
    for flag, path in (("--output-dir", Path(config.output_dir)), ("--export-dir", export)):
        if path.exists() and not path.is_dir():
            raise InputError(f"{flag} {os.fspath(path)!r} is a file; pass a folder (created if missing)")
        shipped = next((name for name, folder in PACKAGED_MODELS.items() if _inside(path, folder)), None)
        if shipped is not None:
            raise InputError(f"{flag} {os.fspath(path)!r} is inside the {shipped!r} model shipped with eqxdiff; pass "
                             f"another folder (copy the exported pipeline over {os.fspath(PACKAGED_MODELS[shipped])} "
                             "yourself to replace the shipped model)")
    if config.model is None:
        tokenizer = character_tokenizer(max_length=32)
        _, _, vae = config.architecture.configs(tokenizer)  # ConfigError for sizes the models cannot take
        factor = 2 ** (len(vae.block_out_channels) - 1)
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
