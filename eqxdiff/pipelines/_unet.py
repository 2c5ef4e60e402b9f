"""What the UNet latent-diffusion pipelines share (Stable Diffusion 1.x/2.x and SDXL): the UNet in the loop, VAE
latents in and out, and one generation path for text-to-image, image-to-image (or a hand-off's second half) and
inpainting.

A family (``stable_diffusion.py``, ``stable_diffusion_xl.py``) encodes its prompts into the UNet's conditioning
arrays and calls :meth:`UNetPipeline.generate`; everything after the text encoders is here. The steps are plain
functions too (``encode_image_latents``, ``decode_latents``, ``prepare_latents``, ``guidance_embedding``).
"""

import dataclasses
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, PRNGKeyArray
from ._arguments import check_size, given_array
from ._checks import (
    CallLimits,
    InputError,
    check_image_size,
    check_output_type,
    image_size,
)
from ._denoise import Denoiser, Guidance, Schedule, denoise_loop, plan_schedule
from ._images import to_model_range
from ._inpaint import (
    IMAGE_LATENTS,
    INPAINT_KEYS,
    MASK,
    MASKED_IMAGE_LATENTS,
    NOISE,
    blend_known_region,
    latent_mask,
    mask_array,
    masked_pixels,
    prepare_mask,
    with_mask_channels,
)
from ._ip_adapter import IPAdapterMixin
from ._latents import LatentPipeline, noise_draws
from ._textual_inversion import TextualInversionMixin

LATENTS_LAYOUT = "[n, height/f, width/f, channels] (channels-last; f = the VAE's downsampling)"


class UNetDenoiser(Denoiser):
    """A ``UNet2DConditionModel`` in the loop. ``cond`` holds ``encoder_hidden_states`` and the other keyword
    arrays the UNet takes (SDXL's ``text_embeds`` / ``time_ids``, ``timestep_cond``, ControlNet residuals, the
    IP-Adapter masks' ``cross_attention_kwargs``), plus inpainting's arrays (:mod:`eqxdiff.pipelines._inpaint`): the
    mask channels of a 9-channel UNet's input, or the known region blended back after each step for an ordinary
    UNet."""

    unet: Any

    def __call__(self, x, t, cond, *, step):
        extra = {k: v for k, v in cond.items() if k != "encoder_hidden_states" and k not in INPAINT_KEYS}
        x = with_mask_channels(x, cond)
        return self.unet(x, jnp.broadcast_to(t, (x.shape[0],)), cond["encoder_hidden_states"], **extra)

    def after_step(self, x, t, cond, *, step, scheduler, state, last):
        return blend_known_region(x, cond, scheduler=scheduler, state=state, last=last)


def denoise(unet, scheduler, state, latents: Float[Array, "batch height width channels"],
            embeds: Float[Array, "embed_batch seq embed"], key: PRNGKeyArray, *, guidance: Guidance,
            unet_kwargs: dict | None = None, progress: bool = False):
    """Run the scheduler's remaining steps from ``state`` with ``unet`` (one ``lax.fori_loop``).

    With guidance, ``embeds`` is ``[negative; positive]`` (twice the latents' batch) and the UNet runs once
    per step on both halves, as diffusers does.
    """
    cond = {"encoder_hidden_states": embeds, **(unet_kwargs or {})}
    return denoise_loop(UNetDenoiser(unet), scheduler, state, latents, cond, key, guidance=guidance,
                        progress=progress)


def prepare_latents(key: PRNGKeyArray, shape: tuple[int, ...], scheduler, state, dtype=jnp.float32):
    """Initial noise ``[n, h/8, w/8, c]`` scaled by the scheduler's ``init_noise_sigma``."""
    return (jax.random.normal(key, shape, dtype) * scheduler.init_noise_sigma(state)).astype(dtype)


def guidance_embedding(guidance_scale: float, dim: int, batch: int) -> Float[Array, "batch dim"]:
    """The guidance-scale embedding of guidance-distilled UNets (``time_cond_proj_dim``, LCM): sinusoids of
    ``(guidance_scale - 1) * 1000``, sines then cosines, as diffusers' ``get_guidance_scale_embedding``."""
    half = dim // 2
    w = jnp.full((batch, 1), (guidance_scale - 1.0) * 1000.0, jnp.float32)
    freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(jnp.log(jnp.float32(10000.0)) / (half - 1)))
    emb = jnp.concatenate([jnp.sin(w * freqs), jnp.cos(w * freqs)], axis=1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """A call's ``image``: ``[-1, 1]`` pixels, or latents handed over (a base pipeline's ``output_type="latent"``),
    already broadcast to the batch; ``height``/``width`` in pixels."""

    pixels: Any
    latents: Any
    height: int
    width: int


class UNetPipeline(IPAdapterMixin, TextualInversionMixin, LatentPipeline):
    """Base of the UNet pipelines: ``unet``, ``vae`` and ``scheduler`` components, and :meth:`generate`.

    ``DEFAULT_STRENGTH`` is the family's default ``strength`` for image-to-image and for inpainting."""

    DEFAULT_STRENGTH: ClassVar[tuple[float, float]] = (0.8, 1.0)
    # What a call must be given (diffusers' task classes: image-to-image needs image, inpainting image and mask).
    REQUIRED_INPUTS: ClassVar[tuple[str, ...]] = ()
    # Layers from the end that the default text embedding already skips: clip_skip may go up to the text encoders'
    # layer count minus this (SD takes the last layer's output: 0; SDXL the penultimate: 1).
    CLIP_SKIP_OFFSET: ClassVar[int] = 0
    SETTINGS: ClassVar[tuple[str, ...]] = (*LatentPipeline.SETTINGS, "freeu", "ip_adapter")
    freeu: tuple[float, float, float, float] | None = None  # enable_freeu's (s1, s2, b1, b2)

    def enable_freeu(self, s1: float, s2: float, b1: float, b2: float) -> None:
        """FreeU (diffusers' ``enable_freeu``): in the UNet's first two up blocks, the skips' lowest frequencies
        scaled by ``s1`` / ``s2`` and the first half of the backbone's channels by ``b1`` / ``b2``. The values are
        traced (changing them compiles nothing); as diffusers, FreeU is off while any of them is 0. Carried by
        :meth:`from_pipe` (diffusers sets it on the shared UNet)."""
        values = tuple(float(v) for v in (s1, s2, b1, b2))
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"enable_freeu: s1, s2, b1, b2 = {values} must be finite numbers")
        self.freeu = values if all(values) else None

    def disable_freeu(self) -> None:
        """Turn FreeU off (diffusers' ``disable_freeu``)."""
        self.freeu = None

    def call_limits(self) -> CallLimits:
        layers = [getattr(getattr(self, c.name).config, "num_hidden_layers", None) for c in self.COMPONENTS
                  if c.encoder and getattr(self, c.name, None) is not None]
        return self._limits(self.vae_scale_factor, self.unet.config.sample_size, layers)

    @classmethod
    def folder_limits(cls, read_json) -> CallLimits:
        vae, unet = cls.folder_config(read_json, "vae"), cls.folder_config(read_json, "unet")
        if vae is None or unet is None:
            return CallLimits()
        layers = [getattr(cls.folder_config(read_json, c.name), "num_hidden_layers", None) for c in cls.COMPONENTS
                  if c.encoder]
        return cls._limits(vae.downsample_factor, unet.sample_size, layers)

    def check_call(self, arguments) -> dict:
        """The schedule a call asks for exists (the steps, ``strength``, a hand-off's fractions, a custom
        schedule: :func:`~eqxdiff.pipelines.plan_schedule` on the host), before the prompt is encoded. A call that
        passes its arguments on to another ``__call__`` (a ControlNet pipeline's) leaves this to that one. Given
        ``masked_image_latents`` need an inpainting UNet and ``mask_image``; the IP-Adapter inputs fit the loaded
        adapters (:meth:`~eqxdiff.pipelines._ip_adapter.IPAdapterMixin.check_ip_adapter_arguments`, whose resolved
        ``ip_adapter_masks`` it returns for the call to take)."""
        resolved = IPAdapterMixin.check_ip_adapter_arguments(self, arguments)  # (self: maybe eqxdiff-generate's class)
        if arguments.get("masked_image_latents") is not None and (
                arguments.get("mask_image") is None or self.unet.config.in_channels != 2 * self.latent_channels + 1):
            raise InputError("masked_image_latents are an inpainting UNet's input (9 channels), with mask_image=; "
                             "this call's UNet has no such input: leave them out")
        image = arguments.get(self.INIT_IMAGE) if self.INIT_IMAGE else None
        size = image_size(image) if image is not None else None
        if arguments.get("mask_image") is not None and size is not None:
            mask_array(arguments["mask_image"], height=size[0], width=size[1])  # its form and size
        if "num_inference_steps" not in arguments:
            return resolved
        strength = arguments.get("strength")
        if image is not None and strength is None:
            strength = self.DEFAULT_STRENGTH[arguments.get("mask_image") is not None]
        plan_schedule(self.scheduler, arguments.get("num_inference_steps"),
                      sample_shape=(1, 1, 1, self.latent_channels), strength=None if image is None else strength,
                      denoising_start=arguments.get("denoising_start") if image is not None else None,
                      denoising_end=arguments.get("denoising_end"), timesteps=arguments.get("timesteps"),
                      sigmas=arguments.get("sigmas"))
        return resolved

    @classmethod
    def _limits(cls, factor: int, sample_size, layers) -> CallLimits:
        size = sample_size or 64
        h, w = (size, size) if isinstance(size, int) else size
        layers = [n for n in layers if isinstance(n, int)]
        return CallLimits(size_factor=factor, native_size=(h * factor, w * factor),
                          max_clip_skip=min(layers) - cls.CLIP_SKIP_OFFSET if layers else None)

    @property
    def latent_channels(self) -> int:
        return self.vae.config.latent_channels

    def default_size(self) -> tuple[int, int]:
        """``(height, width)`` the UNet was trained at: its ``sample_size`` times the VAE's factor."""
        size = self.unet.config.sample_size or 64
        h, w = (size, size) if isinstance(size, int) else size
        return h * self.vae_scale_factor, w * self.vae_scale_factor

    def guidance(self, guidance_scale: float, guidance_rescale: float = 0.0) -> Guidance:
        """Classifier-free guidance for this UNet: off for guidance-distilled UNets (``time_cond_proj_dim``),
        which take the scale as an embedding instead, as in diffusers."""
        scale = 1.0 if self.unet.config.time_cond_proj_dim is not None else float(guidance_scale)
        return Guidance(scale, float(guidance_rescale))

    def image_input(self, image, batch: int, height: int | None = None, width: int | None = None) -> ImageInput:
        """``image`` (uint8 ``[n, H, W, 3]``, PIL image(s), floats in ``[0, 1]``, or latents ``[n, h, w, c]``
        channels-last) for ``batch`` outputs; ``height``/``width``, if given, must be the image's size."""
        f, c = self.vae_scale_factor, self.latent_channels
        arr = image if isinstance(image, jax.Array) else None
        if arr is None and isinstance(image, np.ndarray) and np.issubdtype(image.dtype, np.floating):
            arr = image
        if arr is not None and arr.ndim == 4 and arr.shape[-1] == c and c != 3:
            latents, pixels = jnp.asarray(arr, jnp.float32), None
            size = (latents.shape[1] * f, latents.shape[2] * f)
            what = "latents"
        else:
            check_image_size("image", image, f)
            pixels, latents = to_model_range(image), None
            size = pixels.shape[1:3]
            what = "images"
        given = pixels if pixels is not None else latents
        if given.shape[0] not in (1, batch):
            raise InputError(f"got {given.shape[0]} {what} for {batch} outputs; pass one image or one per output")
        given = jnp.broadcast_to(given, (batch, *given.shape[1:]))
        for name, want, have in (("height", height, size[0]), ("width", width, size[1])):
            if want is not None and want != have:
                raise InputError(f"{name}={want} but the image's {name} is {have}; resize the image (eqxdiff does not "
                                 f"resize) or leave {name} unset")
        return ImageInput(given if pixels is not None else None, given if latents is not None else None,
                          int(size[0]), int(size[1]))

    def output_size(self, height, width, image: ImageInput | None) -> tuple[int, int]:
        """The call's ``(height, width)`` in pixels: the image's, else the arguments', else :meth:`default_size`."""
        if image is not None:
            return image.height, image.width
        default = self.default_size()
        height, width = default[0] if height is None else height, default[1] if width is None else width
        f = self.vae_scale_factor
        check_size(height, width, f, f"the VAE downsamples by {f}")
        return height, width

    def image_inputs(self, embeds, guidance: Guidance, image, mask_image, height, width, strength) -> tuple:
        """What a call's image input decides: ``(batch, image, height, width, strength)``, the outputs (``embeds``'
        rows, halved with guidance), the image input (:meth:`image_input`), the output size (:meth:`output_size`)
        and the ``strength`` (:attr:`DEFAULT_STRENGTH`'s image-to-image or inpainting one where the call gives none).
        """
        n = embeds.shape[0] // (2 if guidance.enabled else 1)
        source = None if image is None else self.image_input(image, n, height, width)
        height, width = self.output_size(height, width, source)
        if strength is None:
            strength = self.DEFAULT_STRENGTH[mask_image is not None]
        return n, source, height, width, strength

    def check_inputs(self, **given) -> None:
        """The class's :attr:`REQUIRED_INPUTS` are among ``given`` (name -> value or ``None``)."""
        missing = [k for k in self.REQUIRED_INPUTS if given.get(k) is None]
        if missing:
            raise InputError(f"{type(self).__name__} needs {' and '.join(k + '=' for k in missing)} (image: the "
                             "picture, or latents handed over; mask_image: white = repaint)")

    def denoiser(self, cond: dict, *, guidance: Guidance, schedule: Schedule, batch: int, height: int,
                 width: int) -> tuple[Denoiser, dict]:
        """The model call inside the loop and the conditioning arrays it gets (a ControlNet pipeline adds its nets
        and control images)."""
        return UNetDenoiser(self.unet), cond

    def masked_latents(self, image: ImageInput, mask, draws, given, shape: tuple[int, ...]):
        """An inpainting UNet's masked-image latents: ``given`` (diffusers' ``masked_image_latents``, channels-last
        ``[1 or n, h, w, c]``, scaled as the VAE's latents are) or the image's masked pixels encoded."""
        if given is not None:
            given = jnp.asarray(given, jnp.float32)
            if given.ndim == 4 and given.shape[0] == 1:
                given = jnp.broadcast_to(given, (shape[0], *given.shape[1:]))
            return given_array(given, shape, "masked_image_latents", LATENTS_LAYOUT)
        if image.pixels is None:
            raise InputError("an inpainting UNet needs image= as pixels (its masked image is encoded) or "
                             "masked_image_latents=, not image latents alone")
        return self.encode_pixels(masked_pixels(image.pixels, mask), draws.masked_image)

    def _check_unet_inputs(self, image, mask_image, denoising_start) -> bool:
        """Refuse inputs this UNet cannot take; whether it is an inpainting UNet (``2 * latent + 1`` channels)."""
        c, unet_channels = self.latent_channels, self.unet.config.in_channels
        inpainting_unet = unet_channels == 2 * c + 1
        if unet_channels not in (c, 2 * c + 1):
            raise ValueError(f"the UNet takes {unet_channels} input channels; this pipeline drives UNets of {c} "
                             f"(the VAE's latent channels) or {2 * c + 1} (inpainting) channels")
        if mask_image is not None and image is None:
            raise InputError("mask_image needs image= (the picture to inpaint)")
        if inpainting_unet and mask_image is None:
            raise ValueError(f"this UNet takes {unet_channels} input channels (an inpainting UNet: latents, mask and "
                             "masked-image latents); pass image= and mask_image=")
        if image is None and denoising_start is not None:
            raise InputError("denoising_start needs image= (the latents the first pipeline handed over)")
        return inpainting_unet

    def generate(self, cond: dict, *, guidance: Guidance, guidance_scale: float, batch: int, height: int,
                 width: int, num_inference_steps: int | None, key: PRNGKeyArray, latents=None,
                 image: ImageInput | None = None, mask_image=None, strength: float | None = None,
                 denoising_start: float | None = None, denoising_end: float | None = None, eta: float = 0.0,
                 schedule: dict | None = None, output_type: str = "uint8", progress: bool = True,
                 masked_image_latents=None, ip_adapter_masks=None):
        """Everything after the text encoders: initial latents, the denoising loop, decoding.

        ``cond``: the UNet's conditioning arrays (``[negative; positive]`` along the batch with ``guidance``).
        Without ``image``: text-to-image from ``latents`` (the initial noise, :data:`LATENTS_LAYOUT`) or noise from
        ``key``. With ``image``: image-to-image by ``strength``, or from ``denoising_start`` on (latents handed
        over as they are). With ``mask_image`` too: inpainting (a 9-channel UNet gets the mask and the masked
        image's latents; an ordinary UNet has the known region blended back after each step); at ``strength=1``
        it starts from pure noise. ``denoising_end`` stops early (a hand-off's first half: use
        ``output_type="latent"``). ``latents`` is always the noise, never finished latents; with ``mask_image``
        and ``strength < 1`` it is added to the image's latents (diffusers would ignore the image there).
        ``eta`` goes to schedulers that take one (DDIM, TCD), as diffusers' pipelines pass it to ``step``;
        ``schedule`` (``timesteps=`` / ``sigmas=``) replaces ``num_inference_steps``; ``masked_image_latents``
        (:meth:`masked_latents`) those of an inpainting UNet; ``ip_adapter_masks`` where each IP-Adapter's images act
        (:meth:`~eqxdiff.pipelines._ip_adapter.IPAdapterMixin.ip_adapter_conditioning`).
        """
        check_output_type(output_type)
        f, c = self.vae_scale_factor, self.latent_channels
        inpainting_unet = self._check_unet_inputs(image, mask_image, denoising_start)
        shape = (batch, height // f, width // f, c)
        scheduler = self.scheduler
        if "eta" in {field.name for field in dataclasses.fields(scheduler)}:
            scheduler = dataclasses.replace(scheduler, eta=jnp.asarray(eta, jnp.float32))  # traced: no recompile
        schedule = plan_schedule(scheduler, num_inference_steps, sample_shape=shape,
                                 strength=None if image is None else strength, denoising_start=denoising_start,
                                 denoising_end=denoising_end, **(schedule or {}))
        state = schedule.state
        draws = noise_draws(key, shape)
        noise = draws.noise if latents is None else given_array(latents, shape, "latents", LATENTS_LAYOUT)

        with self.timed("prepare"):
            extra = {}
            x = noise * scheduler.init_noise_sigma(state)  # text-to-image's start, and inpainting's at strength 1
            if image is not None:
                from_noise = mask_image is not None and strength == 1.0 and schedule.adds_noise
                clean = image.latents
                if clean is None:  # at strength 1 too: a new strength then runs what this call ran (no compile)
                    clean = self.encode_pixels(image.pixels, draws.image)
                if schedule.adds_noise:
                    noised = scheduler.add_noise_at_step(state, clean, noise)
                    x = x if from_noise else noised
                else:
                    x = clean
                if mask_image is not None:
                    mask = prepare_mask(mask_image, batch=batch, height=height, width=width)
                    extra[MASK] = latent_mask(mask, f)
                    if inpainting_unet:
                        extra[MASKED_IMAGE_LATENTS] = self.masked_latents(image, mask, draws, masked_image_latents,
                                                                          shape)
                    else:
                        extra[IMAGE_LATENTS], extra[NOISE] = clean, noise
            rows = cond["encoder_hidden_states"].shape[0]
            extra.update(self.ip_adapter_conditioning(ip_adapter_masks, rows, height // f, width // f))
            if self.freeu is not None:
                extra["freeu"] = jnp.broadcast_to(jnp.asarray(self.freeu, jnp.float32), (rows, 4))
            if self.unet.config.time_cond_proj_dim is not None:
                extra["timestep_cond"] = guidance_embedding(guidance_scale, self.unet.config.time_cond_proj_dim, rows)
            denoiser, cond = self.denoiser({**cond, **extra}, guidance=guidance, schedule=schedule, batch=batch,
                                           height=height, width=width)
            dtype = self.activations_dtype
            cond = jax.tree.map(lambda v: v.astype(dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v, cond)
            x = jax.block_until_ready(x.astype(dtype))

        x = self.run_loop(denoiser, scheduler, state, self.shard(x), self.shard(cond), draws.loop_key,
                          guidance=guidance, num_steps=schedule.num_steps, progress=progress)
        return self.finish(x, output_type, guided_by=f"guidance_scale (now {guidance_scale:g})" if guidance.enabled
                           else None)
