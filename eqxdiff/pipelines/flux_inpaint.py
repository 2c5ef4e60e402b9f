"""Flux.1 inpainting: any Flux.1 transformer with the known region blended back (:class:`FluxInpaintPipeline`), and
FLUX.1-Fill-dev, whose transformer sees the masked image and the mask (:class:`FluxFillPipeline`), on
:class:`~eqxdiff.pipelines.flux.FluxPipeline`'s prompts, guidance and loop.

>>> fill = eqxdiff.load_pipeline("black-forest-labs/FLUX.1-Fill-dev", dtype="bfloat16")
>>> images = fill("a white paper cup", image=photo, mask_image=mask)   # guidance_scale 30, as diffusers

The mask is white (``>= 0.5``) where the image is repainted and has the image's size (eqxdiff resizes neither; the
output has the image's size, sides multiples of 16). **Inpaint** noises the image's VAE latents to ``strength`` and,
after every step, puts back outside the mask the image's latents noised to the next step (clean after the last), as
diffusers' ``FluxInpaintPipeline`` does. **Fill** appends to each token's channels the packed latents of the masked
image (the repainted region grey) and the mask's pixels (each latent pixel's ``f x f`` pixels: the transformer's
``in_channels`` are ``4 * (2 * C + f * f)``, 384 for FLUX.1); ``strength`` below 1 starts from the noised image as
diffusers' ``FluxFillPipeline`` does. Both take ``latents`` as the noise (added to the image's latents at
``strength < 1``; diffusers would start from them as given there). Pass ``image=`` and ``mask_image=``; Inpaint takes
``padding_mask_crop`` as diffusers' does (Fill, as diffusers', does not). Both take diffusers'
``masked_image_latents``, unpacked and channels-last: Fill's replace the masked image and the mask it would compute
(``image`` and ``mask_image`` left out, at ``strength=1``); Inpaint's are checked and unused, as diffusers' Inpaint
computes, packs and drops them.
"""

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._typing import PRNGKeyArray
from ._arguments import resolve_key
from ._call import checked_call
from ._checks import CallLimits, InputError
from ._inpaint import mask_patches, masked_pixels
from ._latents import noise_draws
from ._mask_crop import mask_cropped
from .flux import MAX_SEQUENCE_LENGTH
from .flux_image import _FluxFromImage

__all__ = ["FluxFillPipeline", "FluxInpaintPipeline"]


class _FluxMasked(_FluxFromImage):
    """What the Flux pipelines taking an ``image`` and a ``mask_image`` share."""

    INIT_IMAGE: ClassVar[str | None] = "image"
    LATENTS_REPLACE: ClassVar[bool] = False  # masked_image_latents replace image= and mask_image= (Fill)

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any], limits: CallLimits | None = None) -> None:
        replaced = cls.LATENTS_REPLACE and arguments.get("masked_image_latents") is not None
        for name, what in (("image", "the picture to repaint"), ("mask_image", "white where the image is repainted, "
                                                                              "black where it is kept")):
            if name in arguments and arguments[name] is None and not replaced:
                raise InputError(f"{cls.__name__} needs {name}= ({what}); for text-to-image use FluxPipeline")
        if replaced:  # neither is needed (given, the call says to leave them out)
            arguments = {k: v for k, v in arguments.items() if k not in ("image", "mask_image") or v is not None}
        super().check_arguments(arguments, limits)

    def _masked_image_latents(self, value, channels: int, size: tuple[int, int], batch: int):
        """``masked_image_latents`` checked: floats ``[1 or batch, h, w, channels]`` at the latents' size ``size``
        (pixels over the VAE's factor), broadcast to ``batch`` rows; an :class:`InputError` naming the shape
        wanted otherwise."""
        h, w = (side // self.vae_scale_factor for side in size)
        shape = getattr(value, "shape", None)
        if not isinstance(value, (jax.Array, np.ndarray)) or not np.issubdtype(value.dtype, np.floating) \
                or len(shape) != 4 or shape[0] not in (1, batch) or tuple(shape[1:]) != (h, w, channels):
            got = f"shape {tuple(shape)} {value.dtype}" if shape is not None else type(value).__name__
            raise InputError(f"masked_image_latents must be floats [1 or {batch}, {h}, {w}, {channels}] (unpacked, "
                             f"channels-last, at the latents' size of a {size[0]}x{size[1]} image), got {got}; "
                             "diffusers' NCHW tensor x is x.permute(0, 2, 3, 1) here")
        return jnp.broadcast_to(jnp.asarray(value, jnp.float32), (batch, h, w, channels))


class FluxInpaintPipeline(_FluxMasked):
    """Flux inpainting with any Flux.1 text-to-image transformer (diffusers' ``FluxInpaintPipeline``): the image's
    latents noised to ``strength``, the known region (outside the mask) blended back after every step."""

    CLASS_NAME: ClassVar[str] = "FluxInpaintPipeline"

    @checked_call
    @mask_cropped
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 image=None, mask_image=None, strength: float = 0.6, negative_prompt: str | Sequence[str] | None = None,
                 negative_prompt_2: str | Sequence[str] | None = None, true_cfg_scale: float = 1.0,
                 height: int | None = None, width: int | None = None, num_inference_steps: int = 28,
                 sigmas: Sequence[float] | None = None, guidance_scale: float = 7.0, num_images_per_prompt: int = 1,
                 seed: int | None = None, key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None,
                 pooled_prompt_embeds=None, negative_prompt_embeds=None, negative_pooled_prompt_embeds=None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, padding_mask_crop: int | None = None,
                 masked_image_latents=None, output_type: str = "uint8", progress: bool = True):
        """Repaint ``image`` under ``mask_image`` toward ``prompt``, with diffusers' ``FluxInpaintPipeline``
        arguments (see :meth:`FluxPipeline.__call__` for the shared ones).

        Args:
            image: The picture to repaint: uint8 ``[n, H, W, 3]``, PIL, floats in [0, 1] (sides multiples of 16), or
                latents ``[n, h, w, C]`` channels-last.
            mask_image: White (>= 0.5) where the image is repainted: PIL, or ``[H, W]`` / ``[n, H, W]`` uint8, bool
                or floats in [0, 1], at the image's size.
            strength: How much of the schedule to run (1.0 repaints from pure noise).
            height: Must equal the image's height if given (eqxdiff does not resize).
            width: Must equal the image's width if given (eqxdiff does not resize).
            guidance_scale: The distilled guidance (models with guidance_embeds).
            latents: The noise added to the image's latents ``[n, height/f, width/f, C]`` (channels-last).
            masked_image_latents: diffusers' precomputed latents of the masked image, ``[1 or n, height/f,
                width/f, C]`` here (diffusers' ``[n, C, h, w]`` tensor transposed to channels-last). Checked, and
                unused, as in diffusers: its Inpaint pipeline packs them and never reads them (the known region comes
                from ``image``; ``mask_image`` is still needed).
        """
        return self._from_image(locals(), mask_image=mask_image)

    def _more_inputs(self, call: Mapping[str, Any], batch: int, size: tuple[int, int], key) -> dict:
        """``masked_image_latents`` checked against the output's ``batch`` and ``size``, then dropped, as diffusers'
        Inpaint drops them."""
        if call.get("masked_image_latents") is not None:
            self._masked_image_latents(call["masked_image_latents"], self.latent_channels, size, batch)
        return super()._more_inputs(call, batch, size, key)


class FluxFillPipeline(_FluxMasked):
    """FLUX.1-Fill-dev inpainting and outpainting (diffusers' ``FluxFillPipeline``): the masked image's latents and
    the mask's pixel patches, packed, are appended to the noisy latents' channels at every step."""

    CLASS_NAME: ClassVar[str] = "FluxFillPipeline"
    LATENTS_REPLACE: ClassVar[bool] = True
    INDEX_EXTRAS: ClassVar = {}  # diffusers' class takes no image_encoder / feature_extractor (no IP-Adapter)

    @property
    def latent_channels(self) -> int:
        """Channels of the unpacked latents: the transformer's output channels over the 2x2 packing (its input
        holds the masked image's latents and the mask too)."""
        config = self.transformer.config
        return (config.out_channels or config.in_channels) // 4

    @classmethod
    def transformer_in_channels(cls, latent_channels: int, vae_scale_factor: int) -> int:
        """``4 * (2 * C + f * f)``: the noisy and the masked image's latents, and the ``f x f`` mask pixels of each
        latent pixel, all packed 2x2 (384 for FLUX.1: 64 + 64 + 256)."""
        return 4 * (2 * latent_channels + vae_scale_factor ** 2)

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 image=None, mask_image=None, strength: float = 1.0, height: int | None = None,
                 width: int | None = None, num_inference_steps: int = 50, sigmas: Sequence[float] | None = None,
                 guidance_scale: float = 30.0, num_images_per_prompt: int = 1, seed: int | None = None,
                 key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None, pooled_prompt_embeds=None,
                 masked_image_latents=None, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
                 output_type: str = "uint8", progress: bool = True):
        """Fill ``image`` under ``mask_image`` toward ``prompt``, with diffusers' ``FluxFillPipeline`` arguments
        (see :meth:`FluxPipeline.__call__` for the shared ones; like diffusers', no true CFG).

        Args:
            image: The picture to fill: uint8 ``[n, H, W, 3]``, PIL or floats in [0, 1] (sides multiples of 16).
            mask_image: White (>= 0.5) where the image is filled: PIL, or ``[H, W]`` / ``[n, H, W]`` uint8, bool or
                floats in [0, 1], at the image's size.
            strength: How much of the schedule to run: 1.0 (diffusers' default) starts from pure noise, less from
                the image's latents noised so far.
            height: Must equal the image's height if given (eqxdiff does not resize).
            width: Must equal the image's width if given (eqxdiff does not resize).
            num_inference_steps: Number of denoising steps (diffusers' default 50).
            guidance_scale: The distilled guidance (diffusers' default 30 for FLUX.1-Fill-dev).
            latents: The noise ``[n, height/f, width/f, C]`` (channels-last), added to the image's latents at
                ``strength < 1``.
            masked_image_latents: What the transformer reads beside the noisy latents, precomputed, instead of
                ``image`` and ``mask_image`` (diffusers' meaning; at ``strength=1``, the size taken from it):
                ``[1 or n, height/f, width/f, C + f*f]``, the masked image's VAE latents (scaled and shifted) on the
                first ``C`` channels and each latent pixel's ``f x f`` mask pixels (channel ``dy * f + dx``) on the
                rest. diffusers' tensor is the two packed and concatenated, ``torch.cat((pack(m), pack(k)), -1)``
                ``[n, h/2 * w/2, 4 * C + 4 * f * f]``, where ``m`` and ``k`` are these two parts as NCHW tensors
                and ``pack`` is ``FluxPipeline._pack_latents``.
        """
        if masked_image_latents is not None:
            return self._fill_from_latents(locals())
        if self._given_latents(image):
            raise InputError("FluxFillPipeline needs image= as pixels (its masked image is encoded), not latents")
        key = resolve_key(seed, key)
        size = self._start_size(image, height, width)
        text = self._prepare(locals())
        n, f = text[2], self.vae_scale_factor
        mask = self._mask(mask_image, n, size)
        with self.timed("encode_image"):  # the posterior samples: noise_draws(key, shape).image and .masked_image
            pixels = self._pixels(image, n)
            draws = noise_draws(key, (n, size[0] // f, size[1] // f, self.vae.config.latent_channels))
            clean = self.encode_pixels(pixels, draws.image)
            masked = self.encode_pixels(masked_pixels(pixels, mask), draws.masked_image)
        return self._generate(locals(), text, size, key, image=clean, strength=strength,
                              control=(masked, mask_patches(mask, f)))

    def _fill_from_latents(self, call: Mapping[str, Any]):
        """:meth:`__call__` with ``masked_image_latents``: the transformer's extra channels as given, from pure
        noise."""
        for name, why in (("image", "holds the masked image's latents"), ("mask_image", "holds the mask too (its "
                                                                                        "last f*f channels)")):
            if call[name] is not None:
                raise InputError(f"pass {name}= or masked_image_latents=, not both: masked_image_latents {why}")
        if call["strength"] != 1.0:
            raise InputError(f"strength={call['strength']} starts from the image's latents, which "
                             "masked_image_latents does not give: pass image= and mask_image= instead, or strength=1")
        value, f, c = call["masked_image_latents"], self.vae_scale_factor, self.latent_channels
        shape = getattr(value, "shape", ())
        size = (shape[1] * f, shape[2] * f) if len(shape) == 4 else (call["height"] or 0, call["width"] or 0)
        for name, want, have in (("height", call["height"], size[0]), ("width", call["width"], size[1])):
            if want is not None and want != have:
                raise InputError(f"{name}={want} but masked_image_latents give {name} {have} ({f} x their "
                                 f"{'h' if name == 'height' else 'w'}); leave {name} unset")
        if size[0] % (2 * f) or size[1] % (2 * f):
            raise InputError(f"masked_image_latents' height and width ({shape[1:3]}) must be even (2x2 packing)")
        key = resolve_key(call["seed"], call["key"])
        text = self._prepare(call)
        condition = self._masked_image_latents(value, c + f * f, size, text[2])
        return self._generate(call, text, size, key, control=(condition[..., :c], condition[..., c:]))
