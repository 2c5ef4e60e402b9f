"""Flux.1 structural control (:class:`FluxControlPipeline`, diffusers' ``FluxControlPipeline``): FLUX.1-Canny-dev and
FLUX.1-Depth-dev, whose transformers take the control image's latents beside the noisy ones, on
:class:`~eqxdiff.pipelines.flux.FluxPipeline`'s prompts, distilled guidance and loop.

>>> pipe = eqxdiff.load_pipeline("black-forest-labs/FLUX.1-Canny-dev", dtype="bfloat16")
>>> images = pipe("a robot made of wood", control_image=edges, guidance_scale=30.0)

The control image (an edge or depth map: PIL, uint8 ``[n, H, W, 3]`` or floats in [0, 1]) is resized to the output
size (PIL with Lanczos, arrays nearest-neighbour, as diffusers' image processor), VAE-encoded (a posterior sample),
shifted and scaled as latents are, packed into 2x2 patches and concatenated to the noisy latents along the channels
at every step: the transformer's ``in_channels`` are twice the packed latent channels (128 for FLUX.1's 16 latent
channels). The output size defaults to diffusers' (1024 x 1024 for FLUX.1), not the control image's.

:class:`FluxControlImg2ImgPipeline` and :class:`FluxControlInpaintPipeline` (diffusers' classes of those names) start
from ``image`` as :class:`~eqxdiff.pipelines.flux_image.FluxImg2ImgPipeline` and
:class:`~eqxdiff.pipelines.flux_inpaint.FluxInpaintPipeline` do (noised to ``strength``; for inpainting the region
outside ``mask_image`` blended back after every step), the control image's latents beside the noisy ones. The output
has the image's size: eqxdiff resizes the control image to it, not the image (diffusers resizes both to
``height`` x ``width``, default 1024 x 1024). Their image's VAE posterior sample takes ``noise_draws(key, shape).image``
and the control image's ``.masked_image`` (diffusers' inpainting class also encodes the masked image, then does not
use it).

A FLUX.1-dev pipeline with one of Black Forest Labs' control LoRAs runs the same way: loading it widens the
transformer's input (see :meth:`~eqxdiff.pipelines.DiffusionPipeline.load_lora_weights`), then

>>> pipe = eqxdiff.load_pipeline("black-forest-labs/FLUX.1-dev", dtype="bfloat16")
>>> pipe.load_lora_weights("black-forest-labs/FLUX.1-Canny-dev-lora", weight_name="flux1-canny-dev-lora.safetensors")
>>> images = FluxControlPipeline.from_pipe(pipe)("a robot", control_image=edges, guidance_scale=30.0)
"""

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax.numpy as jnp

from .._typing import PRNGKeyArray
from ._arguments import resolve_key
from ._call import checked_call
from ._checks import CallLimits, InputError, InputTypeError, prompt_count
from ._controlnet import per_output, prepare_control_image
from ._latents import noise_draws
from .flux import MAX_SEQUENCE_LENGTH, FluxPipeline
from .flux_image import _FluxFromImage
from .flux_inpaint import _FluxMasked

__all__ = ["FluxControlImg2ImgPipeline", "FluxControlInpaintPipeline", "FluxControlPipeline"]


class FluxControlPipeline(FluxPipeline):
    """Flux with a control image (diffusers' ``FluxControlPipeline``): its packed VAE latents are appended to the
    noisy latents' channels at every step, for transformers trained so (FLUX.1-Canny-dev, FLUX.1-Depth-dev). The
    image-to-image and inpainting classes extend it."""

    CLASS_NAME: ClassVar[str] = "FluxControlPipeline"
    INDEX_EXTRAS: ClassVar = {}  # diffusers' classes take no image_encoder / feature_extractor (no IP-Adapter)
    PACKED_INPUTS: ClassVar[int] = 2
    WITHOUT_CONTROL: ClassVar[str] = "for text-to-image use FluxPipeline"  # the refusal of a missing control_image

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any], limits: CallLimits = CallLimits()) -> None:
        if "control_image" in arguments and arguments["control_image"] is None:
            raise InputError(f"{cls.__name__} needs control_image= (the edge or depth map to follow); "
                             f"{cls.WITHOUT_CONTROL}")
        super().check_arguments(arguments, limits)
        if arguments.get("control_image") is not None:  # its form, channels and count before anything is encoded
            pixels = _control_pixels(arguments["control_image"], multiple=1)
            prompts = prompt_count(arguments)
            if prompts is not None and len(pixels) not in (1, prompts):
                raise InputError(f"got {len(pixels)} control images for {prompts} prompts; pass one control image "
                                 "or one per prompt")

    def control_latents(self, control_image, *, batch: int, num_images_per_prompt: int, height: int, width: int,
                        key: PRNGKeyArray, draw: str = "image"):
        """``control_image`` as the transformer takes it: resized to ``height`` x ``width``, one per output (one
        image for all, or one per prompt repeated ``num_images_per_prompt`` times, as diffusers' ``prepare_image``),
        VAE-encoded with the posterior noise ``noise_draws(key, shape)``'s ``draw``, scaled: ``[batch, h, w, C]``
        channels-last."""
        pixels = per_output(_control_pixels(control_image, height=height, width=width), batch, num_images_per_prompt)
        f = self.vae_scale_factor
        noise = getattr(noise_draws(key, (batch, height // f, width // f, self.vae.config.latent_channels)), draw)
        return self.encode_pixels(jnp.asarray(pixels * 2.0 - 1.0), noise)

    def _more_inputs(self, call: Mapping[str, Any], batch: int, size: tuple[int, int], key) -> dict:
        """The control latents, for the subclasses starting from an image (whose posterior sample takes
        ``noise_draws(key, shape).image``; the control image's takes ``.masked_image``)."""
        return {"control": (self.control_latents(
            call["control_image"], batch=batch, num_images_per_prompt=call["num_images_per_prompt"], height=size[0],
            width=size[1], key=key, draw="masked_image"),)}

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 control_image=None, height: int | None = None, width: int | None = None,
                 num_inference_steps: int = 28, sigmas: Sequence[float] | None = None, guidance_scale: float = 3.5,
                 num_images_per_prompt: int = 1, seed: int | None = None, key: PRNGKeyArray | None = None,
                 latents=None, prompt_embeds=None, pooled_prompt_embeds=None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Images for ``prompt`` following ``control_image``, with diffusers' ``FluxControlPipeline`` arguments (see
        :meth:`FluxPipeline.__call__` for the shared ones; like diffusers', no true CFG).

        Args:
            control_image: The edge or depth map to follow: PIL, uint8 ``[n, H, W, 3]`` or floats in [0, 1]; one for
                every output or one per prompt, resized to the output size.
            height: Height in pixels, a multiple of 16 (2x the VAE's factor); default 1024 (not the control
                image's, as diffusers).
            width: Width in pixels, a multiple of 16 (2x the VAE's factor); default 1024.
            guidance_scale: The distilled guidance the transformer is conditioned on (30 for FLUX.1-Canny-dev, 10 for
                FLUX.1-Depth-dev in Black Forest Labs' examples).
            latents: The initial noise ``[n, height/f, width/f, C]``, unpacked and channels-last (an array).
        """
        key = resolve_key(seed, key)
        text = self._prepare(locals())
        default = self.default_size()
        size = default[0] if height is None else height, default[1] if width is None else width
        with self.timed("encode_image"):  # the posterior sample is noise_draws(key, shape).image
            control = self.control_latents(
                control_image, batch=text[2], num_images_per_prompt=num_images_per_prompt, height=size[0],
                width=size[1], key=key)
        return self._generate(locals(), text, size, key, control=(control,))


class FluxControlImg2ImgPipeline(FluxControlPipeline, _FluxFromImage):
    """Flux image-to-image with a control image (diffusers' ``FluxControlImg2ImgPipeline``): the image's VAE latents
    noised to ``strength`` and denoised with the control image's latents beside them. The output has the image's
    size (eqxdiff does not resize input images; diffusers resizes them to ``height`` x ``width``, default 1024)."""

    CLASS_NAME: ClassVar[str] = "FluxControlImg2ImgPipeline"
    INIT_IMAGE: ClassVar[str | None] = "image"
    WITHOUT_CONTROL: ClassVar[str] = "without one use FluxImg2ImgPipeline"

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 image=None, control_image=None, height: int | None = None, width: int | None = None,
                 strength: float = 0.6, num_inference_steps: int = 28, sigmas: Sequence[float] | None = None,
                 guidance_scale: float = 7.0, num_images_per_prompt: int = 1, seed: int | None = None,
                 key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None, pooled_prompt_embeds=None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Images for ``prompt`` starting from ``image`` and following ``control_image``, with diffusers'
        ``FluxControlImg2ImgPipeline`` arguments and defaults (see :meth:`FluxPipeline.__call__` for the shared
        ones; like diffusers', no true CFG).

        Args:
            image: The picture to start from: uint8 ``[n, H, W, 3]``, PIL, floats in [0, 1] (sides multiples of
                16), or latents ``[n, h, w, C]`` channels-last.
            control_image: The edge or depth map to follow: PIL, uint8 ``[n, H, W, 3]`` or floats in [0, 1]; one for
                every output or one per prompt, resized to the image's size.
            height: Must equal the image's height if given (eqxdiff does not resize).
            width: Must equal the image's width if given (eqxdiff does not resize).
            strength: How much of the schedule to run (1.0 ignores the image's content).
            guidance_scale: The distilled guidance the transformer is conditioned on.
            latents: The noise added to the image's latents ``[n, height/f, width/f, C]`` (channels-last).
        """
        return self._from_image(locals())


class FluxControlInpaintPipeline(FluxControlPipeline, _FluxMasked):
    """Flux inpainting with a control image (diffusers' ``FluxControlInpaintPipeline``): as
    :class:`~eqxdiff.pipelines.flux_inpaint.FluxInpaintPipeline` (the known region blended back after every step),
    the control image's latents beside the noisy ones."""

    CLASS_NAME: ClassVar[str] = "FluxControlInpaintPipeline"
    WITHOUT_CONTROL: ClassVar[str] = "without one use FluxInpaintPipeline"

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 image=None, control_image=None, mask_image=None, height: int | None = None,
                 width: int | None = None, strength: float = 0.6, num_inference_steps: int = 28,
                 sigmas: Sequence[float] | None = None, guidance_scale: float = 7.0, num_images_per_prompt: int = 1,
                 seed: int | None = None, key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None,
                 pooled_prompt_embeds=None, max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8",
                 progress: bool = True):
        """Repaint ``image`` under ``mask_image`` toward ``prompt`` following ``control_image``, with diffusers'
        ``FluxControlInpaintPipeline`` arguments and defaults (see :meth:`FluxPipeline.__call__` for the shared
        ones; like diffusers', no true CFG and no ``padding_mask_crop``).

        Args:
            image: The picture to repaint: uint8 ``[n, H, W, 3]``, PIL, floats in [0, 1] (sides multiples of 16), or
                latents ``[n, h, w, C]`` channels-last.
            control_image: The edge or depth map to follow: PIL, uint8 ``[n, H, W, 3]`` or floats in [0, 1]; one for
                every output or one per prompt, resized to the image's size.
            mask_image: White (>= 0.5) where the image is repainted: PIL, or ``[H, W]`` / ``[n, H, W]`` uint8, bool
                or floats in [0, 1], at the image's size.
            height: Must equal the image's height if given (eqxdiff does not resize).
            width: Must equal the image's width if given (eqxdiff does not resize).
            strength: How much of the schedule to run (1.0 repaints from pure noise).
            guidance_scale: The distilled guidance the transformer is conditioned on.
            latents: The noise added to the image's latents ``[n, height/f, width/f, C]`` (channels-last; diffusers'
                class fails when given latents).
        """
        return self._from_image(locals(), mask_image=mask_image)


def _control_pixels(control_image, **size):
    """:func:`~eqxdiff.pipelines._controlnet.prepare_control_image` (``size``: its height, width, multiple) of an
    RGB control image, its errors named ``control_image`` (a type error stays one)."""
    try:
        pixels = prepare_control_image(control_image, **size)
    except ValueError as e:
        raise (InputTypeError if isinstance(e, TypeError) else InputError)(f"control_image: {e}") from None
    if pixels.shape[-1] != 3:
        raise InputError(f"control_image must be RGB (3 channels, channels-last), got {pixels.shape[-1]} channels; "
                         "convert a grayscale map to RGB")
    return pixels
