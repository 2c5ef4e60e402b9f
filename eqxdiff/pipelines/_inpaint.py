"""Inpainting's pieces, for any latent image family: the mask, the masked image, and what the denoiser does with
them, as diffusers' inpainting pipelines do.

- A mask is white (``>= 0.5``) where the image is repainted; it is binarised, the masked image keeps the pixels
  under black, and the latent mask is the pixel mask sampled at every ``factor``-th pixel (``F.interpolate``'s
  nearest neighbour for an integer factor).
- An inpainting model (SD's 9-channel UNets) sees ``[latents, mask, masked-image latents]`` on its channels:
  :func:`with_mask_channels`. A model may instead see the pixel mask itself, each latent pixel's ``factor x factor``
  pixels on the channels: :func:`mask_patches`.
- An ordinary model keeps the known region by blending after every step: the image latents noised to the next
  timestep outside the mask (the clean latents after the last step), the model's latents inside:
  :func:`blend_known_region`.

The denoiser reads these arrays from its ``cond`` under the keys in :data:`INPAINT_KEYS`, at the latents' batch
(not doubled for guidance: they are the same for both halves; with guidance in two passes, ``cond`` is the pair of
halves' dicts and either half's arrays serve). They are elementwise to the latents: a family that reshapes its
latents (packed patches) hands them over reshaped alike.
"""


import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float
from ._checks import InputError, pixel_size
from ._images import pil_to_array

# cond keys: the 9-channel model's inputs, and the 4-channel blend's.
MASK, MASKED_IMAGE_LATENTS, IMAGE_LATENTS, NOISE = "mask", "masked_image_latents", "image_latents", "noise"
INPAINT_KEYS = (MASK, MASKED_IMAGE_LATENTS, IMAGE_LATENTS, NOISE)


def prepare_mask(mask_image, *, batch: int, height: int, width: int) -> Float[Array, "batch height width 1"]:
    """``mask_image`` as a binary float mask ``[batch, height, width, 1]`` (1 = repaint).

    Accepts a PIL image (or a list: converted to grayscale), or an array ``[H, W]``, ``[H, W, 1]``, ``[n, H, W]``
    or ``[n, H, W, 1]``: uint8 (0-255), bool, or floats in ``[0, 1]``. ``n`` is 1 or ``batch``; the size must be
    the image's (resize the mask, not the other way round)."""
    arr = mask_array(mask_image, height=height, width=width)
    if arr.shape[0] not in (1, batch):
        raise InputError(f"got {arr.shape[0]} masks for {batch} outputs; pass one mask or one per output")
    mask = np.where(arr >= 0.5, 1.0, 0.0).astype(np.float32)
    return jnp.broadcast_to(jnp.asarray(mask), (batch, height, width, 1))


def mask_array(mask_image, *, height: int, width: int) -> np.ndarray:
    """:func:`prepare_mask`'s checks but the count: ``mask_image`` as floats ``[n, height, width, 1]`` in [0, 1]
    (also run before the call encodes anything, when the outputs' count is not known yet)."""
    arr = np.asarray(pil_to_array(mask_image, "L"))
    if arr.ndim == 3 and arr.shape[-1] in (3, 4) and arr.shape[:2] == (height, width):
        # [H, W, 3] would otherwise read as H masks of width 3 (diffusers reads it so too, and fails later)
        raise InputError(f"mask_image of shape {arr.shape} looks like an RGB(A) picture; pass one channel: "
                         "[height, width] (e.g. mask[..., 0]) or a PIL image (converted to grayscale)")
    if arr.ndim == 2:
        arr = arr[None, :, :, None]
    elif arr.ndim == 3:
        arr = arr[None] if arr.shape[-1] == 1 else arr[..., None]
    if arr.ndim != 4 or arr.shape[-1] != 1:
        raise InputError(f"mask_image must be [height, width] or [n, height, width] (one channel), got shape "
                         f"{np.shape(mask_image)}")
    if arr.dtype == np.uint8:
        arr = arr.astype(np.float32) / 255.0
    elif arr.dtype == np.bool_:
        arr = arr.astype(np.float32)
    elif not np.issubdtype(arr.dtype, np.floating) or arr.min() < 0 or arr.max() > 1:
        raise InputError(f"mask_image must be uint8 (0-255), bool, or floats in [0, 1]; got {arr.dtype} values in "
                         f"[{arr.min()}, {arr.max()}]")
    if arr.shape[1:3] != (height, width):
        raise InputError(f"mask_image has {pixel_size(arr.shape[1], arr.shape[2])} but the image has "
                         f"{pixel_size(height, width)}; resize the mask to the image's size")
    return arr


def masked_pixels(pixels: Float[Array, "batch height width 3"],
                  mask: Float[Array, "batch height width 1"]) -> Float[Array, "batch height width 3"]:
    """The image with the region to repaint set to 0 (grey in ``[-1, 1]``), as diffusers builds ``masked_image``."""
    return pixels * (mask < 0.5)


def latent_mask(mask: Float[Array, "batch height width 1"], factor: int) -> Float[Array, "batch h w 1"]:
    """The mask at the latents' size: every ``factor``-th pixel (nearest neighbour)."""
    return mask[:, ::factor, ::factor, :]


def mask_patches(mask: Float[Array, "batch height width 1"], factor: int) -> Float[Array, "batch h w factor2"]:
    """The pixel mask at the latents' size with each latent pixel's ``factor x factor`` pixels on the channels,
    channel ``dy * factor + dx`` (row-major within the patch), as diffusers' Flux Fill pipeline folds its mask."""
    b, height, width, _ = mask.shape
    patches = mask.reshape(b, height // factor, factor, width // factor, factor).transpose(0, 1, 3, 2, 4)
    return patches.reshape(b, height // factor, width // factor, factor * factor)


def _tile(a, batch: int):
    return a if a.shape[0] == batch else jnp.concatenate([a] * (batch // a.shape[0]))


def with_mask_channels(x: Float[Array, "batch h w c"], cond) -> Float[Array, "batch h w c2"]:
    """An inpainting model's input: ``[x, mask, masked-image latents]`` on the channel axis (unchanged when
    ``cond`` has no masked-image latents)."""
    if MASKED_IMAGE_LATENTS not in cond:
        return x
    parts = [_tile(cond[MASK], x.shape[0]), _tile(cond[MASKED_IMAGE_LATENTS], x.shape[0])]
    return jnp.concatenate([x] + [p.astype(x.dtype) for p in parts], axis=-1)


def blend_known_region(x: Float[Array, "batch h w c"], cond, *, scheduler, state, last) -> Float[Array, "batch h w c"]:
    """After a step: outside the mask, the image latents noised (with the call's initial noise) to the state's
    current timestep, or clean after the last step; inside, ``x`` (unchanged when ``cond`` has no image latents).
    ``cond`` may be the pair of halves' dicts of guidance in two passes (their arrays are the same)."""
    if isinstance(cond, tuple):
        cond = cond[-1]
    if IMAGE_LATENTS not in cond:
        return x
    clean = cond[IMAGE_LATENTS].astype(jnp.float32)
    noisy = scheduler.add_noise_at_step(state, clean, cond[NOISE].astype(jnp.float32))
    known = jnp.where(last, clean, noisy)
    mask = cond[MASK].astype(jnp.float32)
    return ((1 - mask) * known + mask * x.astype(jnp.float32)).astype(x.dtype)
