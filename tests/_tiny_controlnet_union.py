"""Tiny random ControlNet-Union SDXL pipelines saved to a folder: the SDXL ControlNet pipeline tests' components
(:mod:`tests._tiny_sdxl`, compiled encoders and VAE shared) with union nets mirroring their UNet. Every weight is
random, the zero-initialised ones (``spatial_ch_projs``, the zero convolutions) too."""

import torch

from . import _tiny_controlnet, _tiny_sdxl
from ._util import randomize_torch

# The SDXL pipeline tests' UNet's encoder with the union's keys; four control types, two token layers.
SDXL_PIPE_UNION = dict(_tiny_controlnet.SDXL_PIPE_CONTROLNET, num_control_type=4, num_trans_channel=16,
                       num_trans_head=2, num_trans_layer=2, num_proj_channel=16)


def union_net(seed: int, **overrides):
    """A diffusers ControlNetUnionModel with every weight random."""
    import diffusers

    torch.manual_seed(seed)
    model = diffusers.ControlNetUnionModel(**{**SDXL_PIPE_UNION, **overrides}).eval()
    randomize_torch(model, seed=seed)
    return model


def build_sdxl(folder, controlnets):
    """Save a tiny ``StableDiffusionXLControlNetUnionPipeline`` (one net, or a list: a MultiControlNetUnionModel)
    in ``folder`` and return diffusers' pipeline."""
    import diffusers

    pipe = diffusers.StableDiffusionXLControlNetUnionPipeline(**_tiny_sdxl.base_components(), controlnet=controlnets,
                                                              add_watermarker=False)
    return _tiny_sdxl.save(pipe, folder)
