"""Tiny ControlNet configs and tiny random diffusers ControlNet pipelines saved to a folder.

The model tests use diffusers' own tiny ControlNet configs (``tests/pipelines/controlnet``). The pipelines reuse
the SD and SDXL pipeline tests' components (:mod:`tests._tiny_sd`, :mod:`tests._tiny_sdxl`: their compiled text
encoders and VAE are shared) with ControlNets mirroring those UNets. Every weight is random, the zero-initialised
ControlNet convolutions too."""

import numpy as np
import torch

from eqxdiff.pipelines._latents import noise_draws

from . import _tiny_sd, _tiny_sdxl
from ._util import nhwc_to_nchw, randomize_torch

# diffusers' tests/pipelines/controlnet/test_controlnet.py
SD_CONTROLNET = dict(block_out_channels=(4, 8), layers_per_block=2, in_channels=4,
                     down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), cross_attention_dim=32,
                     conditioning_embedding_out_channels=(16, 32), norm_num_groups=1)

# diffusers' tests/pipelines/controlnet/test_controlnet_sdxl.py
_SDXL_COMMON = dict(block_out_channels=(32, 64), layers_per_block=2, in_channels=4,
                    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), attention_head_dim=(2, 4),
                    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                    transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
                    cross_attention_dim=64)
SDXL_UNET = dict(_SDXL_COMMON, sample_size=32, out_channels=4, up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"))
SDXL_CONTROLNET = dict(_SDXL_COMMON, conditioning_embedding_out_channels=(16, 32))

# ControlNets for the pipeline tests' UNets (the VAEs downsample by 2: two conditioning widths)
SD_PIPE_CONTROLNET = dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
                          down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=32,
                          attention_head_dim=4, conditioning_embedding_out_channels=(16, 32))
SDXL_PIPE_CONTROLNET = dict({k: v for k, v in _tiny_sdxl.UNET_A.items() if k != "up_block_types"},
                            norm_num_groups=8, addition_embed_type="text_time",
                            conditioning_embedding_out_channels=(16, 32))


def controlnet(config: dict, seed: int, **overrides):
    """A diffusers ControlNetModel with every weight random."""
    import diffusers

    torch.manual_seed(seed)
    model = diffusers.ControlNetModel(**{**config, **overrides}).eval()
    randomize_torch(model, seed=seed)
    return model


def build_sd(folder, controlnets):
    """Save a tiny ``StableDiffusionControlNetPipeline`` (one ControlNet, or a list: a MultiControlNetModel) in
    ``folder`` and return diffusers' pipeline."""
    import diffusers

    base = _tiny_sd.build_pipeline(f"{folder}-base", scheduler="ddim")
    pipe = diffusers.StableDiffusionControlNetPipeline(**base.components, controlnet=controlnets,
                                                       requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder, safe_serialization=True)
    return pipe


def build_sdxl(folder, controlnets):
    """Save a tiny ``StableDiffusionXLControlNetPipeline`` in ``folder`` and return diffusers' pipeline."""
    import diffusers

    pipe = diffusers.StableDiffusionXLControlNetPipeline(**_tiny_sdxl.base_components(), controlnet=controlnets,
                                                         add_watermarker=False)
    return _tiny_sdxl.save(pipe, folder)


def control_images(n: int, size: int, seed: int) -> np.ndarray:
    """uint8 control images ``[n, size, size, 3]`` in 4x4 blocks (edges and flat areas, as a control map has)."""
    rng = np.random.default_rng(seed)
    coarse = rng.integers(0, 256, (n, size // 4, size // 4, 3)).astype(np.uint8)
    return np.repeat(np.repeat(coarse, 4, axis=1), 4, axis=2)


def with_our_draws(module, monkeypatch, key, shape, posterior_calls=("image",)) -> None:
    """diffusers' pipeline ``module`` draws what our call with ``key`` draws for latents of ``shape``: the initial
    noise, and the VAE posterior samples its retrieve_latents takes in the order ``posterior_calls`` names them."""
    draws = noise_draws(key, shape)
    posterior = iter([{"image": draws.image, "masked": draws.masked_image}[k] for k in posterior_calls])
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(draws.noise))
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(next(posterior)))
