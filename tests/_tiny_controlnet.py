"""Tiny ControlNet configs (diffusers' own test configs, ``tests/pipelines/controlnet``) and tiny random diffusers
ControlNet pipelines saved to a folder, every weight randomised (the zero-initialised ControlNet convolutions too)."""

import numpy as np
import torch

from ._util import randomize_torch

# diffusers' tests/pipelines/controlnet/test_controlnet.py
SD_UNET = dict(block_out_channels=(4, 8), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
               down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
               up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32, norm_num_groups=1)
SD_CONTROLNET = dict(block_out_channels=(4, 8), layers_per_block=2, in_channels=4,
                     down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), cross_attention_dim=32,
                     conditioning_embedding_out_channels=(16, 32), norm_num_groups=1)
SD_VAE = dict(block_out_channels=(4, 8), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=2,
              down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)

# diffusers' tests/pipelines/controlnet/test_controlnet_sdxl.py
_SDXL_COMMON = dict(block_out_channels=(32, 64), layers_per_block=2, in_channels=4,
                    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), attention_head_dim=(2, 4),
                    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                    transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
                    cross_attention_dim=64)
SDXL_UNET = dict(_SDXL_COMMON, sample_size=32, out_channels=4, up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))
SDXL_CONTROLNET = dict(_SDXL_COMMON, conditioning_embedding_out_channels=(16, 32))
SDXL_VAE = dict(block_out_channels=(32, 64), in_channels=3, out_channels=3, latent_channels=4,
                down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
# diffusers' tiny CLIP, with eqxdiff's character tokenizer (no download): its vocabulary, length and special ids
CLIP = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=5, hidden_act="gelu",
            projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1)

SCHEDULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000,
                 steps_offset=1)


def controlnet(config: dict, seed: int, **overrides):
    """A diffusers ControlNetModel with every weight random."""
    import diffusers

    torch.manual_seed(seed)
    model = diffusers.ControlNetModel(**{**config, **overrides}).eval()
    randomize_torch(model, seed=seed)
    return model


def _randomized(model, seed: int):
    randomize_torch(model, seed=seed)
    return model.eval()


def _tokenizer():
    from eqxdiff.data import character_tokenizer

    return character_tokenizer()


def build_sd(folder, controlnets, *, seed: int = 0):
    """Save a tiny ``StableDiffusionControlNetPipeline`` (one ControlNet, or a list: a MultiControlNetModel) in
    ``folder`` and return diffusers' pipeline."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    text_encoder = CLIPTextModel(CLIPTextConfig(**{**CLIP, "vocab_size": len(tokenizer),
                                                   "max_position_embeddings": tokenizer.model_max_length}))
    pipe = diffusers.StableDiffusionControlNetPipeline(
        vae=_randomized(diffusers.AutoencoderKL(**SD_VAE), seed + 1),
        text_encoder=_randomized(text_encoder, seed + 2), tokenizer=tokenizer,
        unet=_randomized(diffusers.UNet2DConditionModel(**SD_UNET), seed + 3),
        controlnet=controlnets, scheduler=diffusers.DDIMScheduler(clip_sample=False, set_alpha_to_one=False,
                                                                  **SCHEDULER),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


def build_sdxl(folder, controlnets, *, seed: int = 0):
    """Save a tiny ``StableDiffusionXLControlNetPipeline`` in ``folder`` and return diffusers' pipeline."""
    import diffusers
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    tokenizer = _tokenizer()
    clip = CLIPTextConfig(**{**CLIP, "vocab_size": len(tokenizer),
                             "max_position_embeddings": tokenizer.model_max_length})
    pipe = diffusers.StableDiffusionXLControlNetPipeline(
        vae=_randomized(diffusers.AutoencoderKL(**SDXL_VAE), seed + 1),
        text_encoder=_randomized(CLIPTextModel(clip), seed + 2), tokenizer=tokenizer,
        text_encoder_2=_randomized(CLIPTextModelWithProjection(clip), seed + 3), tokenizer_2=_tokenizer(),
        unet=_randomized(diffusers.UNet2DConditionModel(**SDXL_UNET), seed + 4), controlnet=controlnets,
        scheduler=diffusers.EulerDiscreteScheduler(timestep_spacing="leading", **SCHEDULER))
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


def control_images(n: int, size: int, seed: int) -> np.ndarray:
    """uint8 control images ``[n, size, size, 3]``: smooth enough that resizing is not the whole test."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (n, size // 4, size // 4, 3)).astype(np.uint8)
    return np.repeat(np.repeat(coarse, 4, axis=1), 4, axis=2)
