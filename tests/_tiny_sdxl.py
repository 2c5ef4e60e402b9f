"""Tiny random SDXL pipelines (base, refiner, inpainting) built with diffusers/transformers and saved to folders.

Two text encoders of different widths (32 + 48 = 80 = the base UNet's cross-attention width; the refiner attends
to the second one's 48 only), a two-level VAE (32x32 images, 16x16 latents) and UNets small enough to compile in
seconds. Every weight is random (``randomize_``), so a wrong mapping cannot hide behind zeros or ones.
"""

import torch

from eqxdiff.data import character_tokenizer

from ._tiny_sd import randomize_

POOLED = 24  # text_encoder_2's projection_dim
EULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
             timestep_spacing="leading")

# UNet configs: two base variants (different depth, heads, projections, time-id width) and the refiner's.
UNET_A = dict(block_out_channels=(16, 32), layers_per_block=1, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
              up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
              use_linear_projection=True, addition_time_embed_dim=8, transformer_layers_per_block=(1, 2),
              cross_attention_dim=80, projection_class_embeddings_input_dim=6 * 8 + POOLED)
UNET_B = dict(block_out_channels=(16, 16, 32), layers_per_block=1,
              down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
              up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=2,
              use_linear_projection=False, addition_time_embed_dim=4, transformer_layers_per_block=1,
              cross_attention_dim=80, projection_class_embeddings_input_dim=6 * 4 + POOLED, upcast_attention=True)
UNET_REFINER = dict(block_out_channels=(16, 32), layers_per_block=1,
                    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=(4, 4),
                    use_linear_projection=True, addition_time_embed_dim=8, transformer_layers_per_block=1,
                    cross_attention_dim=48, projection_class_embeddings_input_dim=5 * 8 + POOLED)


def unet(config: dict, *, in_channels: int = 4, seed: int = 0, **overrides):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    model = UNet2DConditionModel(sample_size=16, in_channels=in_channels, out_channels=4,
                                 addition_embed_type="text_time", **{"norm_num_groups": 8, **config, **overrides})
    randomize_(model, seed=seed)
    return model.eval()


def text_encoders(tokenizer, seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    common = dict(vocab_size=len(tokenizer), num_attention_heads=4, max_position_embeddings=tokenizer.model_max_length,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(seed)
    first = CLIPTextModel(CLIPTextConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                         projection_dim=32, hidden_act="quick_gelu", **common))
    second = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=3,
                                                        projection_dim=POOLED, hidden_act="gelu", **common))
    randomize_(first, seed=seed + 1)
    randomize_(second, seed=seed + 2)
    return first.eval(), second.eval()


def vae(seed: int = 0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    model = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                          down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                          latent_channels=4, norm_num_groups=8, sample_size=32, scaling_factor=0.13025)
    randomize_(model, seed=seed + 3)
    return model.eval()


def scheduler(**overrides):
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(**{**EULER, **overrides})


def base_components(*, unet_config: dict = UNET_A, in_channels: int = 4, seed: int = 0) -> dict:
    tokenizer = character_tokenizer()
    first, second = text_encoders(tokenizer, seed)
    return dict(tokenizer=tokenizer, tokenizer_2=character_tokenizer(), text_encoder=first, text_encoder_2=second,
                unet=unet(unet_config, in_channels=in_channels, seed=seed + 4), vae=vae(seed), scheduler=scheduler())


def save(pipe, folder):
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


def build_base(folder, *, unet_config: dict = UNET_A, force_zeros_for_empty_prompt: bool = True, seed: int = 0):
    """A tiny ``StableDiffusionXLPipeline`` saved in ``folder``; returns the diffusers pipeline."""
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline(**base_components(unet_config=unet_config, seed=seed),
                                     force_zeros_for_empty_prompt=force_zeros_for_empty_prompt, add_watermarker=False)
    return save(pipe, folder)


def build_refiner(folder, base, *, seed: int = 10):
    """A tiny refiner (``StableDiffusionXLImg2ImgPipeline`` without the first text encoder, aesthetic-score
    conditioning) sharing the base's second encoder and VAE, as SDXL's refiner does; saved in ``folder``."""
    from diffusers import StableDiffusionXLImg2ImgPipeline

    pipe = StableDiffusionXLImg2ImgPipeline(
        vae=base.vae, text_encoder=None, text_encoder_2=base.text_encoder_2, tokenizer=None,
        tokenizer_2=base.tokenizer_2, unet=unet(UNET_REFINER, seed=seed), scheduler=scheduler(),
        requires_aesthetics_score=True, force_zeros_for_empty_prompt=False, add_watermarker=False)
    return save(pipe, folder)


def build_inpaint(folder, *, seed: int = 20):
    """A tiny ``StableDiffusionXLInpaintPipeline`` with a 9-channel UNet (latents, mask, masked-image latents)."""
    from diffusers import StableDiffusionXLInpaintPipeline

    pipe = StableDiffusionXLInpaintPipeline(**base_components(in_channels=9, seed=seed),
                                            requires_aesthetics_score=False, add_watermarker=False)
    return save(pipe, folder)
