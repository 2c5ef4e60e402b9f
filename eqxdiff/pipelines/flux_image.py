"""Flux.1 from an image: image-to-image (:class:`FluxImg2ImgPipeline`) and Kontext editing
(:class:`FluxKontextPipeline`), on :class:`~eqxdiff.pipelines.flux.FluxPipeline`'s prompts, guidance and loop.

>>> edit = eqxdiff.load_pipeline("black-forest-labs/FLUX.1-Kontext-dev", dtype="bfloat16")
>>> images = edit("make the fox red", image=fox)

**Image-to-image** noises the image's VAE latents to ``strength``; the output has the image's size. **Kontext**
appends the reference image's latent tokens (positions ``(1, row, col)``) to the noisy ones; the output size follows
diffusers (``height``/``width`` scaled to ``max_area``) and the reference is resized to the nearest of Kontext's
trained resolutions unless ``_auto_resize=False`` (diffusers' name, underscore included). Either takes pixels or
latents handed over (``[n, h, w, C]``).

The image batch is one image for every output or one per output (prompts x ``num_images_per_prompt``); other counts
are refused. diffusers' Flux image pipelines (these, inpainting, Kontext, the control ones) instead tile ``n`` images
over ``k * n`` outputs (output ``j`` takes image ``j mod n``), so one image per prompt with ``num_images_per_prompt``
2 pairs the first prompt with the first two images, not with its own twice (checked on Kontext in diffusers 0.42.1;
the control pipelines' control images, by contrast, repeat per prompt). To get diffusers' pairing pass the tiled
batch; to pair per prompt, repeat each image ``num_images_per_prompt`` times.
"""

import warnings
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from .._typing import PRNGKeyArray
from ._arguments import resolve_key
from ._call import checked_call
from ._checks import CallLimits, InputError, InputWarning, image_size, pixel_size
from ._images import resize_nearest, to_model_range
from ._inpaint import latent_mask, prepare_mask
from .flux import MAX_SEQUENCE_LENGTH, FluxPipeline, image_size_error

__all__ = ["KONTEXT_RESOLUTIONS", "FluxImg2ImgPipeline", "FluxKontextPipeline", "kontext_size"]

# (width, height) of the resolutions Kontext was trained at (diffusers' PREFERRED_KONTEXT_RESOLUTIONS)
KONTEXT_RESOLUTIONS = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184),
                       (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752),
                       (1456, 720), (1504, 688), (1568, 672))


def kontext_size(height: int, width: int, *, max_area: int, multiple_of: int) -> tuple[int, int]:
    """Kontext's output size, as diffusers': ``height`` x ``width``'s aspect ratio at ``max_area`` pixels, each side
    rounded down to ``multiple_of``."""
    aspect = width / height
    w, h = round((max_area * aspect) ** 0.5), round((max_area / aspect) ** 0.5)
    return h // multiple_of * multiple_of, w // multiple_of * multiple_of


def _image_size(image) -> tuple[int, int]:
    size = image_size(image)
    if size is None:
        raise InputError(f"image must be PIL image(s) or an array [n, height, width, 3] / [height, width, 3] (uint8, "
                         f"or floats in [0, 1]; channels-last RGB), got {type(image).__name__} of shape "
                         f"{np.shape(image)}")
    return size


def _resized(image, height: int, width: int):
    """``image`` resized to ``height`` x ``width`` as diffusers' ``VaeImageProcessor.resize`` does: PIL images with
    Lanczos, arrays (uint8, or floats in [0, 1]; channels-last) nearest-neighbour."""
    def one(im):
        return im.resize((width, height), resample=Image.Resampling.LANCZOS, reducing_gap=None)

    if isinstance(image, Image.Image):
        return one(image.convert("RGB"))
    if isinstance(image, Sequence) and image and isinstance(image[0], Image.Image):
        return [one(im.convert("RGB")) for im in image]
    arr = np.asarray(image)
    out = resize_nearest(arr if arr.ndim == 4 else arr[None], height, width)
    return out if arr.ndim == 4 else out[0]


class _FluxFromImage(FluxPipeline):
    """What the Flux pipelines taking an ``image`` share: it is required, and is pixels or latents handed over."""

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any], limits: CallLimits | None = None) -> None:
        if "image" in arguments and arguments["image"] is None:
            what = "the picture to edit" if cls.RESCALES_SIZE else "the picture to start from"
            raise InputError(f"{cls.__name__} needs image= ({what}); for text-to-image use FluxPipeline")
        super().check_arguments(arguments, CallLimits() if limits is None else limits)

    def _from_image(self, call: Mapping[str, Any], mask_image=None):
        """Image-to-image and inpainting (``call``: the call's ``locals()``): the image's VAE latents (the posterior
        sample drawn from ``noise_draws(key, shape).image``'s key) noised to ``strength`` and denoised; with
        ``mask_image``, checked before the image is encoded, the known region blended back after every step; with
        :meth:`_more_inputs`, what else the transformer reads."""
        key = resolve_key(call["seed"], call["key"])
        image = call["image"]
        size = self._start_size(image, call["height"], call["width"])
        text = self._prepare(call)
        mask = None if mask_image is None else latent_mask(self._mask(mask_image, text[2], size), self.vae_scale_factor)
        with self.timed("encode_image"):
            clean = self._image_latents(image, text[2], jax.random.split(key, 3)[1], sample=True)
            inputs = self._more_inputs(call, text[2], size, key)
        return self._generate(call, text, size, key, image=clean, strength=call["strength"], mask=mask, **inputs)

    def _more_inputs(self, call: Mapping[str, Any], batch: int, size: tuple[int, int], key) -> dict:
        """What :meth:`_from_image` passes :meth:`generate` beside the image (a class whose transformer reads more,
        as the control ones, says): nothing."""
        return {}

    def _mask(self, mask_image, batch: int, size: tuple[int, int]):
        """The binary pixel mask ``[batch, H, W, 1]`` (1 = repaint) at the image's size."""
        try:
            return prepare_mask(mask_image, batch=batch, height=size[0], width=size[1])
        except ValueError as e:
            raise InputError(str(e)) from None

    def _given_latents(self, image) -> bool:
        """Whether ``image`` is latents handed over (floats ``[n, h, w, C]``, ``C`` the latent channels) rather than
        pixels."""
        c = self.latent_channels
        return (isinstance(image, (jax.Array, np.ndarray)) and np.issubdtype(image.dtype, np.floating)
                and image.ndim == 4 and image.shape[-1] == c and c != 3)

    def _start_size(self, image, height: int | None, width: int | None) -> tuple[int, int]:
        """The output's ``(height, width)``: the image's (pixels, or latents times the VAE's factor); ``height`` /
        ``width`` if given must equal it (eqxdiff does not resize input images)."""
        f = self.vae_scale_factor
        size = (image.shape[1] * f, image.shape[2] * f) if self._given_latents(image) else _image_size(image)
        for name, want, have in (("height", height, size[0]), ("width", width, size[1])):
            if want is not None and want != have:
                raise InputError(f"{name}={want} but the image's {name} is {have}; resize the image (eqxdiff does not "
                                 f"resize) or leave {name} unset")
        return size

    def _pixels(self, image, batch: int):
        """``image`` (uint8 ``[n, H, W, 3]``, PIL, floats in [0, 1]) in ``[-1, 1]``, one per output ``[batch, H, W,
        3]``."""
        f = 2 * self.vae_scale_factor
        height, width = _image_size(image)
        if height % f or width % f:
            raise image_size_error(height, width, f)
        pixels = to_model_range(image)
        if pixels.shape[0] not in (1, batch):
            raise InputError(f"got {pixels.shape[0]} images for {batch} outputs; pass one image or one per output")
        return jnp.broadcast_to(pixels, (batch, *pixels.shape[1:]))

    def _image_latents(self, image, batch: int, key, *, sample: bool):
        """``image`` as VAE latents ``[batch, h, w, C]`` (channels-last, scaled): pixels (uint8 ``[n, H, W, 3]``,
        PIL, floats in [0, 1]) encoded, sampled with the posterior noise drawn from ``key`` (``sample``) or its
        mean; or latents handed over as they are (floats ``[n, h, w, C]``)."""
        if self._given_latents(image):
            latents = jnp.asarray(image, jnp.float32)
            if latents.shape[0] not in (1, batch):
                raise InputError(f"got {latents.shape[0]} image latents for {batch} outputs; pass one or one per "
                                 "output")
            return jnp.broadcast_to(latents, (batch, *latents.shape[1:]))
        pixels = self._pixels(image, batch)
        shape = (batch, pixels.shape[1] // self.vae_scale_factor, pixels.shape[2] // self.vae_scale_factor,
                 self.vae.config.latent_channels)
        noise = jax.random.normal(key, shape) if sample else jnp.zeros(shape, jnp.float32)
        return self.encode_pixels(pixels, noise)


class FluxImg2ImgPipeline(_FluxFromImage):
    """Flux image-to-image (diffusers' ``FluxImg2ImgPipeline``): the image's VAE latents noised to ``strength``
    and denoised from there. The output has the image's size (eqxdiff does not resize input images)."""

    CLASS_NAME: ClassVar[str] = "FluxImg2ImgPipeline"
    INIT_IMAGE: ClassVar[str | None] = "image"

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 image=None, strength: float = 0.6, negative_prompt: str | Sequence[str] | None = None,
                 negative_prompt_2: str | Sequence[str] | None = None, true_cfg_scale: float = 1.0,
                 height: int | None = None, width: int | None = None, num_inference_steps: int = 28,
                 sigmas: Sequence[float] | None = None, guidance_scale: float = 7.0, num_images_per_prompt: int = 1,
                 seed: int | None = None, key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None,
                 pooled_prompt_embeds=None, negative_prompt_embeds=None, negative_pooled_prompt_embeds=None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, output_type: str = "uint8", progress: bool = True):
        """Images for ``prompt`` starting from ``image``, with diffusers' ``FluxImg2ImgPipeline`` arguments (see
        :meth:`FluxPipeline.__call__` for the shared ones).

        Args:
            image: The picture to start from: uint8 ``[n, H, W, 3]``, PIL, floats in [0, 1] (sides multiples of
                16), or latents ``[n, h, w, C]`` channels-last.
            strength: How much of the schedule to run (1.0 ignores the image's content).
            height: Must equal the image's height if given (eqxdiff does not resize).
            width: Must equal the image's width if given (eqxdiff does not resize).
            guidance_scale: The distilled guidance (models with guidance_embeds).
            latents: The noise added to the image's latents ``[n, height/f, width/f, C]`` (channels-last).
        """
        return self._from_image(locals())


class FluxKontextPipeline(_FluxFromImage):
    """Flux Kontext image editing (diffusers' ``FluxKontextPipeline``): the reference ``image``'s latent tokens are
    appended to the noisy ones at positions ``(1, row, col)``; the transformer edits toward the prompt."""

    CLASS_NAME: ClassVar[str] = "FluxKontextPipeline"
    RESCALES_SIZE: ClassVar[bool] = True
    INIT_IMAGE: ClassVar[str | None] = None  # the reference image is no image-to-image start: any size, resized

    def reference_image(self, image, *, auto_resize: bool = True):
        """``image`` as Kontext takes it: rounded down to multiples of ``2 * f``, and with ``auto_resize`` resized to
        the trained resolution of the nearest aspect ratio (:data:`KONTEXT_RESOLUTIONS`), as diffusers does."""
        m = 2 * self.vae_scale_factor
        height, width = _image_size(image)
        height, width = height // m * m, width // m * m
        if auto_resize:
            aspect = width / height
            _, width, height = min((abs(aspect - w / h), w, h) for w, h in KONTEXT_RESOLUTIONS)
            height, width = height // m * m, width // m * m
        if min(height, width) < m:
            raise InputError(f"image has {pixel_size(*_image_size(image))} pixels; Kontext needs at least "
                             f"{pixel_size(m, m)}")
        return image if (height, width) == _image_size(image) else _resized(image, height, width)

    @checked_call
    def __call__(self, prompt: str | Sequence[str] | None = None, prompt_2: str | Sequence[str] | None = None, *,
                 image=None, negative_prompt: str | Sequence[str] | None = None,
                 negative_prompt_2: str | Sequence[str] | None = None, true_cfg_scale: float = 1.0,
                 height: int | None = None, width: int | None = None, num_inference_steps: int = 28,
                 sigmas: Sequence[float] | None = None, guidance_scale: float = 3.5, num_images_per_prompt: int = 1,
                 seed: int | None = None, key: PRNGKeyArray | None = None, latents=None, prompt_embeds=None,
                 pooled_prompt_embeds=None, negative_prompt_embeds=None, negative_pooled_prompt_embeds=None,
                 max_sequence_length: int = MAX_SEQUENCE_LENGTH, max_area: int = 1024**2, _auto_resize: bool = True,
                 output_type: str = "uint8", progress: bool = True):
        """Edit ``image`` toward ``prompt`` with diffusers' ``FluxKontextPipeline`` arguments (see
        :meth:`FluxPipeline.__call__` for the shared ones).

        Args:
            image: The reference picture: uint8 ``[n, H, W, 3]``, PIL, floats in [0, 1], or latents ``[n, h, w, C]``
                channels-last.
            height: With width, the output's aspect ratio (default 1024x1024), scaled to max_area.
            width: With height, the output's aspect ratio (default 1024x1024), scaled to max_area.
            max_area: The output's area in pixels (diffusers' default 1024**2); height and width are rounded down
                to multiples of 16.
            _auto_resize: Resize the reference to Kontext's trained resolution of the nearest aspect ratio
                (diffusers' name, underscore included; on the command line ``--auto-resize`` /
                ``--no-auto-resize``).
            latents: The initial noise ``[n, height/f, width/f, C]`` at the final size (channels-last).
        """
        if isinstance(max_area, bool) or not isinstance(max_area, int) or max_area < 1:
            raise InputError(f"max_area={max_area!r} must be a positive int number of pixels")
        key = resolve_key(seed, key)
        default = self.default_size()
        asked = (default[0] if height is None else height, default[1] if width is None else width)
        for name, value in zip(("height", "width"), asked):
            if not isinstance(value, int) or value <= 0:
                raise InputError(f"{name}={value!r} must be a positive int number of pixels")
        size = kontext_size(*asked, max_area=max_area, multiple_of=2 * self.vae_scale_factor)
        if min(size) < 2 * self.vae_scale_factor:
            raise InputError(f"max_area={max_area} at the aspect ratio of {pixel_size(*asked)} leaves "
                             f"{pixel_size(*size)} pixels; raise max_area")
        if size != asked and (height is not None or width is not None):
            warnings.warn(f"Kontext generates {pixel_size(*size)} pixels: the aspect ratio of {pixel_size(*asked)} "
                          f"at max_area={max_area} (pass max_area=height*width to keep the size)", InputWarning,
                          stacklevel=2)
        text = self._prepare(locals())
        with self.timed("encode_image"):
            image = image if self._given_latents(image) else self.reference_image(image, auto_resize=_auto_resize)
            reference = self._image_latents(image, text[2], None, sample=False)
        return self._generate(locals(), text, size, key, reference=reference)
