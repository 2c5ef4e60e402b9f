"""``eqxdiff-train``'s presets: a name, a description (its ``--help``) and the :class:`~eqxdiff.train.TrainConfig`
whose values the flags start from. Full fine-tunes as diffusers' ``train_text_to_image*.py`` run them (``digits``,
``sd15``, ``sd21``, ``sdxl``, ``flux-*``), LoRA as its ``train_text_to_image_lora*.py`` /
``train_dreambooth_lora_flux.py`` (``lora-*``), and DreamBooth with prior preservation as its ``train_dreambooth*.py``
and MaxDiffusion's SD 1.x DreamBooth (``dreambooth-*``)."""

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..data import FrameSampling
from ..data.digits import DIGIT_NAMES
from ..parallel import MeshConfig, Remat
from ..train import (
    DigitsArchitecture,
    FluxOptions,
    LoraConfig,
    Objective,
    OptimizerConfig,
    TrainConfig,
    WanOptions,
)

SD15 = "stable-diffusion-v1-5/stable-diffusion-v1-5"
SDXL = "stabilityai/stable-diffusion-xl-base-1.0"
FLUX_DEV = "black-forest-labs/FLUX.1-dev"
_DIGITS = tuple(f"a handwritten digit {d}" for d in DIGIT_NAMES)
_INSTANCE, _CLASS = "a photo of sks dog", "a photo of dog"  # diffusers' DreamBooth example

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


def _dreambooth(config: TrainConfig, name: str, **changes) -> TrainConfig:
    """``config`` as DreamBooth with prior preservation (diffusers' ``train_dreambooth*.py``): every image captioned
    ``a photo of sks dog`` (``--instance-prompt``), 100 class images ``a photo of dog`` (``--class-prompt``) drawn by
    the model itself, prior loss weight 1, center crops without flips, both encoded once; 4 images a step
    (instance images repeat when there are fewer), checkpoints and samples every 100 steps."""
    return dataclasses.replace(
        config, instance_prompt=_INSTANCE, class_prompt=_CLASS, num_class_images=100, prior_loss_weight=1.0,
        cache_stream=True, center_crop=True, random_flip=False, batch_size=4, output_dir=Path(f"runs/{name}"),
        checkpoint_every=100, sample_every=100, sample_prompts=(_INSTANCE,), ema_decay=None,
        objective=dataclasses.replace(config.objective, snr_gamma=None, caption_dropout=0.0), **changes)


_LORA_FLUX = LoraConfig(rank=4, targets=("attention", "mlp"))  # diffusers' Flux targets: attention and feed-forward


def _wan(model: str, name: str, *, resolution: int, frames: int, batch_size: int, context: int,
         **changes) -> TrainConfig:
    """A Wan video preset: :func:`_large`'s FSDP, remat and caching, clips of ``frames`` frames at ``resolution``
    (square; ``--resolution HEIGHT WIDTH`` for another shape, e.g. the pipelines' 480 832), ``batch_size`` clips a
    step over the devices' data x fsdp axes with ``context`` of them splitting each clip's tokens (context parallel:
    a fraction of a clip per device); one video sample at the end (Wan's 50 steps at guidance 5: minutes for the 14B
    models; --sample-every N takes them during the run too)."""
    mesh = MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1, ici_context_parallelism=context)
    return dataclasses.replace(
        _large(model, name, resolution=resolution, steps=5000, learning_rate=1e-5, sample_steps=50,
               sample_guidance_scale=5.0, **changes),
        frames=FrameSampling(count=frames), batch_size=batch_size, mesh=mesh, sample_every=0)


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
            sample_prompts=_DIGITS)),
    "sd15": (
        "Fine-tune Stable Diffusion 1.5 (epsilon prediction) at 512 px (--data, --hf-dataset or --tfrecord).",
        _stable_diffusion(SD15, "sd15", 512)),
    "sd21": (
        "Fine-tune Stable Diffusion 2.1 (v-prediction) at 768 px (--data, --hf-dataset or --tfrecord).",
        _stable_diffusion("stabilityai/stable-diffusion-2-1", "sd21", 768)),
    "sdxl": (
        ("Fine-tune the SDXL base UNet at 1024 px as diffusers' train_text_to_image_sdxl.py: both text encoders "
         "frozen and cached, each image's original size and crop as micro-conditioning, FSDP over every device with "
         "remat (--data, --hf-dataset or --tfrecord)."),
        _large(SDXL, "sdxl", resolution=1024, steps=10000, learning_rate=1e-6,
               objective=Objective(caption_dropout=0.2), sample_steps=30, sample_guidance_scale=5.0)),
    "flux-dev": (
        ("Flow-matching fine-tuning of FLUX.1-dev's transformer at 512 px (diffusers' Flux recipe: guidance 3.5 "
         "embedded, --family.guidance-scale; --objective.weighting-scheme logit_normal / mode / cosmap ...), latents "
         "and text embeddings cached, FSDP over every device with remat (--data, --hf-dataset or --tfrecord)."),
        _large(FLUX_DEV, "flux-dev", resolution=512, steps=5000, learning_rate=1e-5,
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
    "lora-digits": (
        ("A style LoRA on the digits model shipped with eqxdiff, in a few minutes on a CPU: rank 4 on the attention, "
         "feed-forward and convolution layers, from a folder of captioned 16 px digits (--data; the README makes one "
         "with thicker strokes), saved to OUTPUT_DIR/lora."),
        TrainConfig(
            model="digits", resolution=16, batch_size=32, steps=300, mesh=MeshConfig(),
            lora=LoraConfig(rank=4, targets=("attention", "mlp", "conv")),
            optimizer=OptimizerConfig(learning_rate=1e-3, schedule="constant"),
            objective=Objective(caption_dropout=0.1), cache_stream=True, random_flip=False,
            output_dir=Path("runs/lora-digits"), export_scheduler=None, log_every=25, sample_prompts=_DIGITS)),
    "lora-sd15": (
        ("LoRA on Stable Diffusion 1.5 at 512 px as diffusers' train_text_to_image_lora.py: rank 4 on the UNet's "
         "attention (--lora.*: rank, alpha, targets, dora, text-encoders, format), learning rate 1e-4, saved to "
         "OUTPUT_DIR/lora as a PEFT file (--data, --hf-dataset or --tfrecord)."),
        dataclasses.replace(
            _stable_diffusion(SD15, "lora-sd15", 512), lora=LoraConfig(rank=4), ema_decay=None,
            optimizer=OptimizerConfig(learning_rate=1e-4, schedule="cosine", accumulation_steps=4),
            objective=Objective(caption_dropout=0.05))),
    "lora-sdxl": (
        ("LoRA on the SDXL base UNet at 1024 px as diffusers' train_text_to_image_lora_sdxl.py: rank 4 on the "
         "attention, learning rate 1e-4, both text encoders cached, the frozen weights FSDP-sharded with remat, "
         "saved to OUTPUT_DIR/lora (--data, --hf-dataset or --tfrecord)."),
        _large(SDXL, "lora-sdxl", resolution=1024, steps=5000, learning_rate=1e-4, lora=LoraConfig(rank=4),
               objective=Objective(caption_dropout=0.2), sample_steps=30, sample_guidance_scale=5.0)),
    "lora-flux": (
        ("LoRA on FLUX.1-dev's transformer at 512 px (diffusers' Flux LoRA recipe: rank 4 on the attention and "
         "feed-forward layers, learning rate 1e-4, guidance 3.5 embedded), latents and text embeddings cached, the "
         "frozen weights FSDP-sharded with remat, saved to OUTPUT_DIR/lora (--data, --hf-dataset or --tfrecord)."),
        _large(FLUX_DEV, "lora-flux", resolution=512, steps=2000, learning_rate=1e-4, lora=_LORA_FLUX,
               objective=Objective(weighting_scheme="none"),
               family=FluxOptions(guidance_scale=3.5, max_sequence_length=512), sample_steps=28,
               sample_guidance_scale=3.5)),
    "dreambooth-sd15": (
        ("DreamBooth of the whole Stable Diffusion 1.5 UNet at 512 px (diffusers' train_dreambooth.py, as MaxDiffusion "
         "trains SD 1.x): --data a folder of a few images of the subject, each captioned --instance-prompt; prior "
         "preservation on --num-class-images images of --class-prompt the model draws into --class-data-dir first "
         "(kept; --prior-loss-weight); learning rate 5e-6, 800 steps. --lora.rank 4 trains a LoRA instead."),
        _dreambooth(_stable_diffusion(SD15, "dreambooth-sd15", 512), "dreambooth-sd15", steps=800,
                    optimizer=OptimizerConfig(learning_rate=5e-6, schedule="constant"))),
    "dreambooth-sdxl": (
        ("DreamBooth LoRA of the SDXL base UNet at 1024 px (diffusers' train_dreambooth_lora_sdxl.py): rank 4 on "
         "the attention, learning rate 1e-4, 500 steps, --instance-prompt for every image of --data, prior "
         "preservation on class images the model draws first (--class-prompt, --num-class-images, "
         "--class-data-dir, --prior-loss-weight); FSDP with remat."),
        _dreambooth(_large(SDXL, "dreambooth-sdxl", resolution=1024, steps=500, learning_rate=1e-4,
                           lora=LoraConfig(rank=4), sample_steps=30, sample_guidance_scale=5.0), "dreambooth-sdxl")),
    "dreambooth-flux": (
        ("DreamBooth LoRA of FLUX.1-dev's transformer at 512 px (diffusers' train_dreambooth_lora_flux.py): rank 4 on "
         "the attention and feed-forward layers, learning rate 1e-4, 500 steps, guidance 3.5 embedded, "
         "--instance-prompt for every image of --data, prior preservation on class images the model draws first "
         "(--class-prompt, --num-class-images, --class-data-dir, --prior-loss-weight); FSDP with remat."),
        _dreambooth(_large(FLUX_DEV, "dreambooth-flux", resolution=512, steps=500, learning_rate=1e-4,
                           lora=_LORA_FLUX, objective=Objective(weighting_scheme="none"),
                           family=FluxOptions(guidance_scale=3.5, max_sequence_length=512), sample_steps=28,
                           sample_guidance_scale=3.5), "dreambooth-flux")),
    "wan2.1-1.3b": (
        ("Flow-matching fine-tuning of Wan 2.1 T2V 1.3B on video clips (--data: a folder of mp4/webm/gif clips with "
         "captions; --frames.count / --frames.stride / --frames.start pick each clip's frames, 81 = 5 s at 16 fps) "
         "at 480 px: latents and UMT5 embeddings cached, FSDP over every device with remat, one clip per device."),
        _wan("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan2.1-1.3b", resolution=480, frames=81, batch_size=8, context=1,
             family=WanOptions())),
    "wan2.1-14b": (
        ("Flow-matching fine-tuning of Wan 2.1 T2V 14B on video clips (--data, --frames.*) at 720 px: latents and "
         "UMT5 embeddings cached, FSDP over the devices with each clip's tokens split over 2 (context parallel): 4 "
         "clips a step, half a clip per device on 8; full remat (--remat offload_dots keeps the matmuls in host "
         "memory instead)."),
        _wan("Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan2.1-14b", resolution=720, frames=81, batch_size=4, context=2,
             family=WanOptions())),
    "wan2.2-a14b": (
        ("Flow-matching fine-tuning of both experts of Wan 2.2 T2V A14B, each on its own timesteps (transformer at "
         "t >= boundary_ratio x 1000, transformer_2 below; --family.expert high / low trains one, on its range "
         "only) on video clips (--data, --frames.*) at 720 px: latents and UMT5 embeddings cached, FSDP with "
         "context parallel 2 and full remat, 4 clips a step."),
        _wan("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan2.2-a14b", resolution=720, frames=81, batch_size=4, context=2,
             family=WanOptions(expert="both"))),
    "wan2.2-ti2v-5b": (
        ("Flow-matching fine-tuning of Wan 2.2 TI2V 5B on video clips (--data, --frames.*) at 704 px and 121 "
         "frames (5 s at its 24 fps), text- and image-to-video: half the clips train conditioned on their clean "
         "first frame (--family.first-frame-probability); latents (the 2.2 VAE, 16x) and UMT5 embeddings cached, "
         "FSDP with context parallel 2 and full remat, 4 clips a step."),
        _wan("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "wan2.2-ti2v-5b", resolution=704, frames=121, batch_size=4,
             context=2, family=WanOptions())),
}


@dataclasses.dataclass(frozen=True)
class FolderNeeds:
    """What a preset's ``--model`` folder must hold beyond its family's pipeline, read from its ``model_index.json``
    before anything loads: ``components`` (entries naming a model) and ``settings`` (pipeline settings that must be
    true), each with what it is, in words."""

    components: Mapping[str, str] = dataclasses.field(default_factory=dict)
    settings: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def lacks(self, model_index: Mapping[str, Any]) -> list[str]:
        """What of these ``model_index`` (a folder's ``model_index.json``) lacks, in words."""
        def names_a_model(entry) -> bool:
            return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] is not None

        return ([f"{name} ({what})" for name, what in self.components.items()
                 if not names_a_model(model_index.get(name))]
                + [f"{name} true ({what})" for name, what in self.settings.items()
                   if model_index.get(name) is not True])


# preset: what its --model folder must hold (the others train any folder of their family).
PRESET_NEEDS: Mapping[str, FolderNeeds] = {
    "wan2.2-a14b": FolderNeeds(components={"transformer_2": "Wan 2.2 A14B's second, low-noise expert"}),
    "wan2.2-ti2v-5b": FolderNeeds(settings={"expand_timesteps": "Wan 2.2 TI2V-5B's per-token timesteps, which its "
                                                                "first-frame conditioning trains"}),
}
