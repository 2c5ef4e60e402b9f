"""Tiny LTX-Video configs shared by the LTX tests (the models' now, the pipelines' next), and the config.json of the
real checkpoints (for names and shapes on the meta device; ``scripts/convert_ltx_to_diffusers.py``'s).

- :data:`TRANSFORMER`: 4 heads of 8 (a width of 32: 32 % 6 = 2 rotary channels padded in front, as diffusers' tiny
  pipeline config), in/out 8, caption 16, 2 layers. :data:`TRANSFORMER_PATCHED`: patches of 2 x 2 x 2, 3 heads of 8
  (24: no padding), affine block norms.
- :data:`VAE_090`, :data:`VAE_091`, :data:`VAE_095`: the three VAE generations at tiny widths, each with its real
  checkpoint's block structure (where the 0.9.0 encoder and decoder change width, 0.9.1's decoder, 0.9.5's
  space-to-depth encoder), so that diffusers' fixed original-name maps fit them too; ``patch_size`` 2 (16x spatial,
  8x temporal compression).
- :data:`UPSAMPLER`: the spatial latent upsampler at 32 channels (GroupNorm's 32 groups).
"""

import diffusers
from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel

TRANSFORMER = dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
                   attention_head_dim=8, cross_attention_dim=32, num_layers=2, caption_channels=16)
TRANSFORMER_PATCHED = dict(TRANSFORMER, in_channels=16, out_channels=16, patch_size=2, patch_size_t=2,
                           num_attention_heads=3, attention_head_dim=8, cross_attention_dim=24,
                           norm_elementwise_affine=True)

_ENCODER_090 = dict(block_out_channels=(8, 16, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
                    spatio_temporal_scaling=(True, True, True, False))
VAE_090 = dict(in_channels=3, out_channels=3, latent_channels=8, **_ENCODER_090,
               decoder_block_out_channels=(8, 16, 32, 32), decoder_layers_per_block=(1, 1, 1, 1, 1),
               decoder_spatio_temporal_scaling=(True, True, True, False), patch_size=2)
_DECODER_091 = dict(decoder_block_out_channels=(16, 32, 64), decoder_layers_per_block=(1, 1, 1, 1),
                    decoder_spatio_temporal_scaling=(True, True, True), upsample_residual=(True, True, True),
                    upsample_factor=(2, 2, 2), timestep_conditioning=True)
VAE_091 = dict(VAE_090, **_DECODER_091, decoder_inject_noise=(True, True, True, False))
VAE_095 = dict(VAE_090, **_DECODER_091, decoder_inject_noise=(False, False, False, False),
               block_out_channels=(8, 16, 32, 32, 64), down_block_types=("LTXVideo095DownBlock3D",) * 4,
               spatio_temporal_scaling=(True, True, True, True),
               downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
               spatial_compression_ratio=16, temporal_compression_ratio=8)

UPSAMPLER = dict(in_channels=8, mid_channels=32, num_blocks_per_stage=2, dims=3, spatial_upsample=True,
                 temporal_upsample=False)

# -- the real checkpoints ---------------------------------------------------------------------------------------------

LTX_2B = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
              attention_head_dim=64, cross_attention_dim=2048, num_layers=28, caption_channels=4096)
LTX_13B = dict(LTX_2B, attention_head_dim=128, cross_attention_dim=4096, num_layers=48)
REAL_VAE_090 = dict(in_channels=3, out_channels=3, latent_channels=128, block_out_channels=(128, 256, 512, 512),
                    decoder_block_out_channels=(128, 256, 512, 512), layers_per_block=(4, 3, 3, 3, 4),
                    decoder_layers_per_block=(4, 3, 3, 3, 4), spatio_temporal_scaling=(True, True, True, False),
                    decoder_spatio_temporal_scaling=(True, True, True, False), patch_size=4)
REAL_VAE_091 = dict(REAL_VAE_090, decoder_block_out_channels=(256, 512, 1024), decoder_layers_per_block=(5, 6, 7, 8),
                    decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(True, True, True, False),
                    upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True)
REAL_VAE_095 = dict(REAL_VAE_091, block_out_channels=(128, 256, 512, 1024, 2048),
                    down_block_types=("LTXVideo095DownBlock3D",) * 4, layers_per_block=(4, 6, 6, 2, 2),
                    decoder_layers_per_block=(5, 5, 5, 5), spatio_temporal_scaling=(True, True, True, True),
                    decoder_inject_noise=(False, False, False, False),
                    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
                    spatial_compression_ratio=32, temporal_compression_ratio=8)  # also 0.9.7 / 0.9.8's
REAL_UPSAMPLER = dict(in_channels=128, mid_channels=512, num_blocks_per_stage=4, dims=3, spatial_upsample=True,
                      temporal_upsample=False)

LTXVideoTransformer3DModel = diffusers.LTXVideoTransformer3DModel
AutoencoderKLLTXVideo = diffusers.AutoencoderKLLTXVideo

__all__ = ["AutoencoderKLLTXVideo", "LTXLatentUpsamplerModel", "LTXVideoTransformer3DModel"]
