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
- :func:`build_pipeline` / :func:`build_upsampler`: the pipelines' tiny folders (tests/test_ltx_pipeline.py,
  tests/test_recompile.py): a character tokenizer and a tiny random T5 (width 16, the transformer's caption channels),
  :data:`TRANSFORMER`, the 0.9.5 VAE (timestep-conditioned decoder, random latent statistics, scaling_factor 0.8)
  and diffusers' default flow-matching Euler; the upsampler folder holds :data:`UPSAMPLER` beside the same VAE, as
  ``Lightricks/ltxv-spatial-upscaler-0.9.7`` does.
"""

import diffusers
import torch
from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel

from ._util import randomize_torch

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

# -- tiny pipelines ---------------------------------------------------------------------------------------------------

# timestep-conditioned decoder (decode_timestep, decode_noise_scale), no injected noise; a scaling_factor other than 1
# (diffusers' image-to-video, condition and upsample pipelines normalise encoded latents without it, decode with it)
PIPELINE_VAE = dict(VAE_095, scaling_factor=0.8)


def _random(model, seed: int):
    randomize_torch(model, seed=seed)
    return model.eval()


def text_components(seed: int = 0) -> dict:
    """A character tokenizer (offline; the same ids on both sides) and a tiny random T5 as wide as the transformer's
    captions (16), gated-GELU as T5 v1.1-XXL."""
    from transformers import T5Config, T5EncoderModel

    from eqxdiff.data import character_tokenizer

    tokenizer = character_tokenizer(16)
    torch.manual_seed(seed)
    encoder = T5EncoderModel(T5Config(vocab_size=len(tokenizer) + 3, d_model=TRANSFORMER["caption_channels"],
                                      d_kv=8, d_ff=37, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                      feed_forward_proj="gated-gelu", pad_token_id=1, eos_token_id=1))
    return dict(tokenizer=tokenizer, text_encoder=_random(encoder, seed + 1))


def vae(config: dict = PIPELINE_VAE, seed: int = 5) -> diffusers.AutoencoderKLLTXVideo:
    """diffusers' VAE with every weight random and random latent statistics (state-dict buffers)."""
    model = _random(diffusers.AutoencoderKLLTXVideo(**config), seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.latents_mean.copy_(0.3 * torch.randn(model.latents_mean.shape, generator=g))
        model.latents_std.copy_(0.7 + 0.5 * torch.rand(model.latents_std.shape, generator=g))
    return model


def transformer(config: dict = TRANSFORMER, seed: int = 7) -> diffusers.LTXVideoTransformer3DModel:
    torch.manual_seed(seed)
    return _random(diffusers.LTXVideoTransformer3DModel(**config), seed)


def build_pipeline(folder, seed: int = 0) -> diffusers.LTXPipeline:
    """A tiny LTX-Video text-to-video folder (``model_index.json`` names ``LTXPipeline``; the image-to-video and
    condition pipelines load it too, as they load Lightricks' folders)."""
    pipe = diffusers.LTXPipeline(**text_components(seed), vae=vae(seed=seed + 5),
                                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
                                 transformer=transformer(seed=seed + 7))
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


def build_upsampler(folder, vae_model, seed: int = 9) -> diffusers.LTXLatentUpsamplePipeline:
    """A tiny latent-upsampler folder (``LTXLatentUpsamplePipeline``: the VAE and the upsampler)."""
    torch.manual_seed(seed)
    upsampler = _random(LTXLatentUpsamplerModel(**UPSAMPLER), seed)
    pipe = diffusers.LTXLatentUpsamplePipeline(vae=vae_model, latent_upsampler=upsampler)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


__all__ = ["AutoencoderKLLTXVideo", "LTXLatentUpsamplerModel", "LTXVideoTransformer3DModel", "build_pipeline",
           "build_upsampler", "text_components", "transformer", "vae"]
