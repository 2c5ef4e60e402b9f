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

A FLUX.1-dev pipeline with one of Black Forest Labs' control LoRAs runs the same way: loading it widens the
transformer's input (see :meth:`~eqxdiff.pipelines.DiffusionPipeline.load_lora_weights`), then

>>> pipe = eqxdiff.load_pipeline("black-forest-labs/FLUX.1-dev", dtype="bfloat16")
>>> pipe.load_lora_weights("black-forest-labs/FLUX.1-Canny-dev-lora", weight_name="flux1-canny-dev-lora.safetensors")
>>> images = FluxControlPipeline.from_pipe(pipe)("a robot", control_image=edges, guidance_scale=30.0)
"""

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from .._typing import PRNGKeyArray
from ._arguments import resolve_key
from ._call import checked_call
from ._checks import CallLimits, InputError
from ._controlnet import per_output, prepare_control_image
from .flux import MAX_SEQUENCE_LENGTH, FluxPipeline

__all__ = ["FluxControlPipeline"]


class FluxControlPipeline(FluxPipeline):
    """Flux with a control image (diffusers' ``FluxControlPipeline``): its packed VAE latents are appended to the
    noisy latents' channels at every step, for transformers trained so (FLUX.1-Canny-dev, FLUX.1-Depth-dev)."""

    CLASS_NAME: ClassVar[str] = "FluxControlPipeline"
    INDEX_EXTRAS: ClassVar = {}  # diffusers' class takes no image_encoder / feature_extractor (no IP-Adapter)
    PACKED_INPUTS: ClassVar[int] = 2

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any], limits: CallLimits = CallLimits()) -> None:
        if "control_image" in arguments and arguments["control_image"] is None:
            raise InputError("FluxControlPipeline needs control_image= (the edge or depth map to follow); for "
                             "text-to-image use FluxPipeline")
        super().check_arguments(arguments, limits)

    def control_latents(self, control_image, *, batch: int, num_images_per_prompt: int, height: int, width: int,
                        key: PRNGKeyArray):
        """``control_image`` as the transformer takes it: resized to ``height`` x ``width``, one per output (one
        image for all, or one per prompt repeated ``num_images_per_prompt`` times, as diffusers' ``prepare_image``),
        VAE-encoded with the posterior noise drawn from ``key``, scaled: ``[batch, h, w, C]`` channels-last."""
        try:
            pixels = prepare_control_image(control_image, height=height, width=width)
        except ValueError as e:
            raise InputError(f"control_image: {e}") from None
        if pixels.shape[-1] != 3:
            raise InputError(f"control_image must be RGB (3 channels, channels-last), got {pixels.shape[-1]} "
                             "channels; convert a grayscale map to RGB")
        pixels = per_output(pixels, batch, num_images_per_prompt)
        f = self.vae_scale_factor
        noise = jax.random.normal(key, (batch, height // f, width // f, self.vae.config.latent_channels))
        return self.encode_pixels(jnp.asarray(pixels * 2.0 - 1.0), noise)

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
        with self.timed("encode_image"):  # the posterior sample draws from noise_draws(key, shape).image's key
            control = self.control_latents(
                control_image, batch=text[2], num_images_per_prompt=num_images_per_prompt, height=size[0],
                width=size[1], key=jax.random.split(key, 3)[1])
        return self._generate(locals(), text, size, key, control=(control,))
