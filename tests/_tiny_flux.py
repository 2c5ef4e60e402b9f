"""Tiny Flux.1 configs and helpers shared by the Flux tests (the transformer's now, the pipelines' next).

- :data:`TRANSFORMER` / :data:`VAE`: diffusers' own tiny Flux configs (its model and pipeline tests): patch 1,
  4 input channels (one latent channel packed 2x2), 1 + 1 blocks; a one-level VAE with 1 latent channel, no quant
  convs and a shift factor (vae scale factor 1: an 8x8 image packs to 16 tokens of 4 channels).
- :data:`DEV`, :data:`SCHNELL`, :data:`FILL`: the config.json of the real transformers (for names on the meta device).
- :func:`build_transformer`: a randomised diffusers ``FluxTransformer2DModel``.
- :func:`bfl_tensors`: a diffusers state dict in Black Forest Labs' single-file layout, and
  :func:`diffusers_bfl_converter`: diffusers' own BFL converter, usable at a tiny size.
"""

import types

import diffusers
import numpy as np
import torch
from diffusers.loaders import single_file_utils

from eqxdiff.loading import convert_tensors, formats, inverse

from ._util import randomize_torch

TRANSFORMER = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
VAE = dict(block_out_channels=(4,), layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
           use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035, sample_size=32)

# black-forest-labs/FLUX.1-dev, FLUX.1-schnell and FLUX.1-Fill-dev transformer/config.json
DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
           num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
           axes_dims_rope=[16, 56, 56])
SCHNELL = dict(DEV, guidance_embeds=False)
FILL = dict(DEV, in_channels=384, out_channels=64)


def build_transformer(config: dict, seed: int = 0) -> diffusers.FluxTransformer2DModel:
    """diffusers' transformer at ``config`` with every weight random (eval mode)."""
    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(**config).eval()
    randomize_torch(model, seed=seed)
    return model


def bfl_tensors(reference: torch.nn.Module, prefix: str = "") -> dict[str, np.ndarray]:
    """``reference``'s weights named and laid out as Black Forest Labs' files (through the inverse of
    :func:`eqxdiff.loading.formats.flux_bfl`; :func:`diffusers_bfl_converter` checks the result independently)."""
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    return {prefix + k: v for k, v in convert_tensors(state, inverse(formats.flux_bfl())).items()}


def diffusers_bfl_converter(width: int):
    """diffusers' ``convert_flux_transformer_checkpoint_to_diffusers`` with its one hard-coded size, the model width
    ``inner_dim = 3072`` (FLUX.1's), replaced by ``width``: the same code, usable on a tiny file. (Unpatched it
    cannot split a tiny single block's ``linear1``, so neither it nor ``from_single_file`` reads tiny files.)"""
    fn = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers
    consts = fn.__code__.co_consts
    if sum(type(c) is int and c == 3072 for c in consts) != 1:
        raise RuntimeError("diffusers' Flux converter changed: it no longer holds exactly one constant 3072")
    code = fn.__code__.replace(co_consts=tuple(width if type(c) is int and c == 3072 else c for c in consts))
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
