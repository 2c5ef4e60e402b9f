"""The embedded digits model: Stable Diffusion's classes (CLIP text encoder, UNet, AutoencoderKL) at a size that
trains on a laptop CPU in minutes, on scikit-learn's handwritten digits."""

import dataclasses

import jax.numpy as jnp

from ..models.clip import CLIPTextConfig, CLIPTextModel
from ..models.unet2d import UNet2DConditionConfig, UNet2DConditionModel
from ..models.vae import AutoencoderKL, AutoencoderKLConfig
from ._init import host_init
from ._sd import LatentDiffusion

# Stable Diffusion's training noise schedule; the saved pipeline samples with DPM-Solver++ on the same betas. Its
# scheduler_config.json keeps SD's sampling settings (no x0 clipping, no final alpha of one) for a swap to DDIM/DDPM:
# clip_sample defaults to true there, which blurs latents that are not confined to [-1, 1].
SD_NOISE_SCHEDULE = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                         steps_offset=1, clip_sample=False, set_alpha_to_one=False)


@dataclasses.dataclass(frozen=True)
class DigitsArchitecture:
    """Sizes of the from-scratch model. The VAE downsamples by ``2 ** (len(vae_channels) - 1)``."""

    image_size: int = 16
    """Image size the models are built for (the UNet's sample size is this over the VAE's factor)."""
    vae_channels: tuple[int, ...] = (16, 32, 64)
    """The VAE's channels per level; each level after the first halves the image."""
    latent_channels: int = 4
    """Channels of the VAE's latents (the UNet's input and output)."""
    unet_channels: tuple[int, ...] = (32, 64)
    """The UNet's channels per level (each level has one resnet and cross-attention)."""
    attention_heads: int = 4
    """Attention heads of the UNet's transformer blocks."""
    text_hidden_size: int = 32
    """Width of the CLIP text encoder (and the UNet's cross-attention input)."""
    text_layers: int = 2
    """Layers of the CLIP text encoder."""
    text_heads: int = 4
    """Attention heads of the CLIP text encoder."""
    norm_num_groups: int = 8
    """Group-norm groups of the UNet and VAE (divides every channel count)."""

    def __post_init__(self):
        sizes = {"image_size": self.image_size, "latent_channels": self.latent_channels,
                 "attention_heads": self.attention_heads, "text_hidden_size": self.text_hidden_size,
                 "text_layers": self.text_layers, "text_heads": self.text_heads,
                 "norm_num_groups": self.norm_num_groups}
        for key, value in {**sizes, **{f"{k}[{i}]": c for k in ("vae_channels", "unet_channels")
                                        for i, c in enumerate(getattr(self, k))}}.items():
            if value < 1:
                raise ValueError(f"architecture.{key}={value} must be >= 1")
        for key in ("vae_channels", "unet_channels"):
            if not getattr(self, key):
                raise ValueError(f"architecture.{key} is empty; give at least one channel count")
        factor = 2 ** (len(self.vae_channels) - 1)
        if self.image_size % factor:
            raise ValueError(f"architecture.image_size={self.image_size} must be a multiple of {factor} (the VAE's "
                             f"{len(self.vae_channels)} levels halve it {len(self.vae_channels) - 1} times)")

    def configs(self, tokenizer):
        latent = self.image_size // 2 ** (len(self.vae_channels) - 1)
        text = CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=self.text_hidden_size,
                              intermediate_size=2 * self.text_hidden_size, num_hidden_layers=self.text_layers,
                              num_attention_heads=self.text_heads, max_position_embeddings=tokenizer.model_max_length,
                              projection_dim=None, bos_token_id=0, eos_token_id=1, pad_token_id=1)
        n = len(self.unet_channels)
        unet = UNet2DConditionConfig(sample_size=latent, in_channels=self.latent_channels,
                                     out_channels=self.latent_channels, block_out_channels=self.unet_channels,
                                     layers_per_block=1, down_block_types=("CrossAttnDownBlock2D",) * n,
                                     up_block_types=("CrossAttnUpBlock2D",) * n,
                                     cross_attention_dim=self.text_hidden_size,
                                     attention_head_dim=self.attention_heads, norm_num_groups=self.norm_num_groups)
        vae = AutoencoderKLConfig(block_out_channels=self.vae_channels,
                                  down_block_types=("DownEncoderBlock2D",) * len(self.vae_channels),
                                  up_block_types=("UpDecoderBlock2D",) * len(self.vae_channels),
                                  latent_channels=self.latent_channels, norm_num_groups=self.norm_num_groups,
                                  sample_size=self.image_size)
        return text, unet, vae


def build_digits_model(arch: DigitsArchitecture, tokenizer, *, seed: int = 0) -> LatentDiffusion:
    """A randomly initialised :class:`LatentDiffusion` of ``arch`` (weights drawn on the host: seconds)."""
    text, unet, vae = arch.configs(tokenizer)
    null = tokenizer([""], padding="max_length", max_length=tokenizer.model_max_length, return_tensors="np").input_ids
    return LatentDiffusion(unet=host_init(UNet2DConditionModel, unet, seed=seed),
                           text_encoder=host_init(CLIPTextModel, text, seed=seed + 1),
                           vae=host_init(AutoencoderKL, vae, seed=seed + 2),
                           null_input_ids=jnp.asarray(null[0], jnp.int32))
