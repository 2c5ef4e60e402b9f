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
