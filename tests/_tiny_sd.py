"""A tiny random Stable Diffusion pipeline built with diffusers/transformers and saved to a folder."""

import numpy as np
import torch

from eqxdiff.data import character_tokenizer


def randomize_(module: torch.nn.Module, std: float = 0.05, seed: int = 0) -> None:
    """Non-trivial values for every parameter (norm scales around 1) so a wrong mapping cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + noise)
            elif name.endswith("bias") or "norm" in name:
                p.copy_(noise)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / max(1.0, float(np.sqrt(p[0].numel()))))


def build_pipeline(folder, *, scheduler: str = "pndm", prediction_type: str = "epsilon", seed: int = 0,
                   sd2: bool = False, vae_stats: bool = False):
    """Save a tiny StableDiffusionPipeline in ``folder`` and return the diffusers pipeline (``vae_stats``: the VAE
    config sets a shift_factor, latents_mean and latents_std, which diffusers' SD pipeline does not read)."""
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        EulerDiscreteScheduler,
        PNDMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    tokenizer = character_tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=tokenizer.model_max_length, projection_dim=32,
        hidden_act="gelu" if sd2 else "quick_gelu", bos_token_id=0, eos_token_id=1, pad_token_id=1))
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=(2, 4) if sd2 else 4, norm_num_groups=8,
        use_linear_projection=sd2, upcast_attention=sd2)
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        latent_channels=4, norm_num_groups=8, sample_size=16,
                        **(dict(shift_factor=0.3, latents_mean=[0.5, -0.2, 0.1, 0.0], latents_std=[2.0, 0.5, 1.0, 1.5])
                           if vae_stats else {}))
    for i, m in enumerate((text_encoder, unet, vae)):
        randomize_(m, seed=seed + i)
    common = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                  prediction_type=prediction_type, steps_offset=1)
    sched = {"pndm": lambda: PNDMScheduler(skip_prk_steps=True, set_alpha_to_one=False, **common),
             "ddim": lambda: DDIMScheduler(clip_sample=False, set_alpha_to_one=False, **common),
             "euler": lambda: EulerDiscreteScheduler(**common)}[scheduler]()
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=sched, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe
