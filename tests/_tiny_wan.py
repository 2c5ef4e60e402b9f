"""Tiny Wan 2.1 / 2.2 configs shared by the Wan tests (the models' now, the pipelines' next), and the config.json of
the real checkpoints (for names and shapes on the meta device).

- :data:`TRANSFORMER`: diffusers' tiny model-test config (``tests/models/transformers/test_models_transformer_wan.py``):
  2 heads of 12, in/out 4, text 16, ffn 32, 2 layers, cross-attention norm. :data:`T2V_PIPELINE`: its pipeline tests'
  (in/out 16, text 32).
- :data:`VAE_21`, :data:`VAE_22`: diffusers' tiny Wan 2.1 VAE (``base_dim=3``, z 16) and Wan 2.2 TI2V VAE (z 48,
  residual levels, 2x2 patchified pixels: 12 channels in and out).
- ``WAN21_*``, ``WAN22_*``: the real transformers (``scripts/convert_wan_to_diffusers.py``) and VAEs.
"""

import diffusers
import torch

from ._util import randomize_torch

TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
                   text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                   qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
T2V_PIPELINE = dict(TRANSFORMER, in_channels=16, out_channels=16, text_dim=32)

VAE_21 = dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
VAE_22 = dict(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
              latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
              scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])

_REAL = dict(patch_size=[1, 2, 2], attention_head_dim=128, cross_attn_norm=True, eps=1e-6, freq_dim=256,
             qk_norm="rms_norm_across_heads", text_dim=4096, in_channels=16, out_channels=16)
WAN21_T2V_1_3B = dict(_REAL, num_attention_heads=12, ffn_dim=8960, num_layers=30)
WAN21_T2V_14B = dict(_REAL, num_attention_heads=40, ffn_dim=13824, num_layers=40)
WAN21_I2V_14B = dict(WAN21_T2V_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120)
WAN21_FLF2V_14B = dict(WAN21_I2V_14B, pos_embed_seq_len=257 * 2)
WAN22_TI2V_5B = dict(_REAL, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48)

WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True])
# Wan2.2-TI2V-5B-Diffusers/vae (its latents_mean/std are 48 statistics; the shapes do not depend on them)
WAN22_VAE = dict(WAN21_VAE, base_dim=160, decoder_base_dim=256, z_dim=48, in_channels=12, out_channels=12,
                 is_residual=True, patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48,
                 latents_std=[1.0] * 48)


class WanTransformer3DModel(diffusers.WanTransformer3DModel):
    """diffusers' transformer, loadable without ``accelerate``: its ``_keep_in_fp32_modules`` (float32 norms and
    time embedder when loading in half precision) make ``from_pretrained`` demand ``low_cpu_mem_usage``, which needs
    ``accelerate``. The tests load float32 checkpoints, where the list changes nothing. Same class name, so its
    ``save_pretrained`` folders are diffusers' own."""

    _keep_in_fp32_modules = None


def build_transformer(config: dict, seed: int = 0) -> WanTransformer3DModel:
    """diffusers' transformer at ``config`` with every weight random (eval mode)."""
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config).eval()
    randomize_torch(model, seed=seed)
    return model


# -- tiny pipelines (tests/test_wan_pipeline.py, tests/test_recompile.py) ------------------------------------------

TEXT_DIM = 32  # T2V_PIPELINE's text_dim: the tiny UMT5's width
# Wan 2.1 image-to-video: latents (16) + mask (4) + image latents (16) in, CLIP's tiny image tokens through added k/v
I2V_PIPELINE = dict(T2V_PIPELINE, in_channels=36, image_dim=4, added_kv_proj_dim=24)
FLF2V_PIPELINE = dict(I2V_PIPELINE, pos_embed_seq_len=2 * 1025)  # two images of 32x32 CLIP patches + class token
TI2V_PIPELINE = dict(T2V_PIPELINE, in_channels=48, out_channels=48)  # Wan 2.2 TI2V: the 2.2 VAE's 48 channels
CLIP_VISION = dict(hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                   intermediate_size=16, patch_size=1)  # diffusers' Wan I2V tests
# Wan's scheduler_config.json (2.1 and 2.2 A14B: flow_shift 3)
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=3.0)


def text_components(seed: int = 0) -> dict:
    """A character tokenizer (offline, the same ids on both sides) and a tiny random UMT5 of width 32."""
    from transformers import UMT5Config, UMT5EncoderModel

    from eqxdiff.data import character_tokenizer

    tokenizer = character_tokenizer(16)
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer) + 3, d_model=TEXT_DIM, d_kv=8, d_ff=37,
                                          num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                          feed_forward_proj="gated-gelu", pad_token_id=1, eos_token_id=1))
    randomize_torch(encoder, seed=seed + 1)
    return dict(tokenizer=tokenizer, text_encoder=encoder.eval())


def vae(config: dict, seed: int) -> diffusers.AutoencoderKLWan:
    model = diffusers.AutoencoderKLWan(**config).eval()
    randomize_torch(model, seed=seed)
    return model


def image_components(seed: int = 0) -> dict:
    """diffusers' tiny Wan I2V image encoder (random) and its 32-pixel CLIP image processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(**CLIP_VISION)).eval()
    randomize_torch(encoder, seed=seed)
    return dict(image_encoder=encoder, image_processor=CLIPImageProcessor(crop_size=32, size=32))


def scheduler() -> diffusers.UniPCMultistepScheduler:
    return diffusers.UniPCMultistepScheduler(**SCHEDULER)


def save(pipe, folder):
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


def build_a14b(folder, seed: int = 0) -> diffusers.WanPipeline:
    """A tiny Wan 2.2 A14B-style text-to-video folder: two experts with different random weights, boundary 0.875
    (at 3 steps of Wan's UniPC the timesteps are 999, 857, 600: one high-noise step, two low-noise ones)."""
    return save(diffusers.WanPipeline(**text_components(seed), vae=vae(VAE_21, seed + 5), scheduler=scheduler(),
                                      transformer=build_transformer(T2V_PIPELINE, seed=seed + 7),
                                      transformer_2=build_transformer(T2V_PIPELINE, seed=seed + 8),
                                      boundary_ratio=0.875), folder)


def build_i2v(folder, seed: int = 0) -> diffusers.WanImageToVideoPipeline:
    """A tiny Wan 2.1 image-to-video folder: CLIP image tokens through added k/v, 36 input channels."""
    return save(diffusers.WanImageToVideoPipeline(
        **text_components(seed), vae=vae(VAE_21, seed + 5), scheduler=scheduler(), **image_components(seed + 6),
        transformer=build_transformer(I2V_PIPELINE, seed=seed + 9)), folder)


def build_ti2v(folder, seed: int = 0) -> diffusers.WanPipeline:
    """A tiny Wan 2.2 TI2V-5B-style folder: a ``WanPipeline`` with ``expand_timesteps``, the 2.2 VAE (z 48, 16x), no
    CLIP; image-to-video loads it as ``WanImageToVideoPipeline`` (as Wan2.2-TI2V-5B-Diffusers)."""
    return save(diffusers.WanPipeline(
        **text_components(seed), vae=vae(VAE_22, seed + 5), scheduler=scheduler(),
        transformer=build_transformer(TI2V_PIPELINE, seed=seed + 10), expand_timesteps=True), folder)
