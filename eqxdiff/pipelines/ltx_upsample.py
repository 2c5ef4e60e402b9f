"""LTX-Video's spatial latent upsampler (diffusers' ``LTXLatentUpsamplePipeline``; ``Lightricks/ltxv-spatial-upscaler-
0.9.7`` / ``-0.9.8`` folders: the VAE and the ``latent_upsampler``), the middle of the two-stage recipe: generate at a
third of the size below the target, upsample the latents 2x, refine them with a few steps of
:class:`~eqxdiff.pipelines.ltx_condition.LTXConditionPipeline` (``latents=``, ``denoise_strength`` 0.4), decode.

>>> base = eqxdiff.load_pipeline("Lightricks/LTX-Video-0.9.7-dev", pipeline_class=LTXConditionPipeline)
>>> upsampler = eqxdiff.load_pipeline("Lightricks/ltxv-spatial-upscaler-0.9.7")
>>> low = base(prompt=prompt, height=320, width=512, num_frames=121, num_inference_steps=30, output_type="latent")
>>> high = upsampler(latents=low, output_type="latent")            # [n, T, 2h, 2w, C], normalised
>>> video = base(prompt=prompt, latents=high, height=640, width=1024, num_frames=121, denoise_strength=0.4,
...              num_inference_steps=10, decode_timestep=0.05, image_cond_noise_scale=0.025)

**Input**: ``latents`` (channels-last, normalised ``[n, T, h, w, C]``: a pipeline's ``output_type="latent"`` result)
or a ``video`` clip (uint8 frames ``[F, H, W, 3]``, its frames cut to ``8k + 1``), encoded by the VAE with its posterior
sampled from the call's key. ``height`` / ``width`` are diffusers' (the size it resizes the video to; it ignores them
beside latents): here the input's size, the default; eqxdiff does not resize the input, so another size is refused.
The latents are un-normalised by the VAE's statistics, upsampled, optionally matched to the input's per-channel
statistics (``adain_factor``: AdaIN, blended) and tone-mapped (``tone_map_compression_ratio``);
``output_type="latent"`` returns them normalised again, otherwise they are decoded as the text-to-video pipeline
decodes (``decode_timestep``, ``decode_noise_scale``, the noise drawn from the call's key). ``adain_factor``,
``tone_map_compression_ratio`` and the decode values are traced: changing them compiles nothing.
"""

from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp

from .._typing import Array, PRNGKeyArray
from ..core import program
from ..models.ltx_upsampler import LTXLatentUpsamplerModel
from ._arguments import resolve_key
from ._call import checked_call
from ._checks import CallLimits, InputError, pixel_size
from ._components import Component
from ._images import to_model_range
from ._latents import LatentPipeline, noise_draws
from .ltx import DEFAULT_FRAME_RATE, LTXPipeline, decode_options, decode_video, sampled_latents

__all__ = ["LTXLatentUpsamplePipeline", "adain", "tone_map", "upsampled_latents"]


def adain(latents, reference, factor):
    """diffusers' ``adain_filter_latent``: each channel of each video moved to the ``reference``'s mean and (unbiased)
    std over frames, height and width, blended in by ``factor`` (``torch.lerp``)."""
    axes = (1, 2, 3)
    r_mean, r_std = jnp.mean(reference, axes, keepdims=True), jnp.std(reference, axes, keepdims=True, ddof=1)
    i_mean, i_std = jnp.mean(latents, axes, keepdims=True), jnp.std(latents, axes, keepdims=True, ddof=1)
    moved = (latents - i_mean) / i_std * r_std + r_mean
    return jnp.where(factor < 0.5, latents + factor * (moved - latents), moved - (moved - latents) * (1.0 - factor))


def tone_map(latents, compression):
    """diffusers' ``tone_map_latents``: ``x * (1 - 0.8 s sigmoid(4 s (|x| - 1)))`` with ``s = 0.75 compression``."""
    s = compression * 0.75
    return latents * (1.0 - 0.8 * s * jax.nn.sigmoid(4.0 * s * (jnp.abs(latents) - 1.0)))


@program
def upsampled_latents(upsampler, vae, latents, adain_factor, compression):
    """Normalised latents ``[n, T, h, w, C]`` upsampled (un-normalised; the upsampler's output, AdaIN-matched to the
    input where ``adain_factor > 0`` and tone-mapped): ``[n, T, 2h, 2w, C]``, not normalised again."""
    z = vae.unscale_latents(latents.astype(jnp.float32))
    up = upsampler(z.astype(upsampler.initial_conv.weight.dtype)).astype(jnp.float32)
    up = jnp.where(adain_factor > 0, adain(up, z, adain_factor), up)
    return jnp.where(compression > 0, tone_map(up, compression), up)


class LTXLatentUpsamplePipeline(LatentPipeline):
    """LTX-Video's latent upsampler (diffusers' ``LTXLatentUpsamplePipeline``): normalised latents ``[n, T, 2h, 2w,
    C]`` (``output_type="latent"``) or uint8 frames ``[n, F, 2H, 2W, 3]`` from latents or a video; see the module
    docstring."""

    CLASS_NAME: ClassVar[str] = "LTXLatentUpsamplePipeline"
    COMPONENTS: ClassVar[tuple[Component, ...]] = (
        Component("vae", "diffusers", classes=("AutoencoderKLLTXVideo",), scan=False),
        Component("latent_upsampler", "diffusers", classes=("LTXLatentUpsamplerModel",), scan=False),
    )
    INIT_IMAGE: ClassVar[str | None] = None
    FRAME_CHUNK_SAMPLE_FRAMES: ClassVar[int | None] = LTXPipeline.FRAME_CHUNK_SAMPLE_FRAMES  # the same VAE windows
    latent_upsampler: LTXLatentUpsamplerModel

    @property
    def default_fps(self) -> int:
        return DEFAULT_FRAME_RATE

    LIMIT_COMPONENTS: ClassVar[tuple[str, ...]] = ("vae",)

    @classmethod
    def limits_from(cls, c) -> CallLimits:
        if c is None:
            return CallLimits()
        return CallLimits(frame_factor=c.temporal_factor, size_factor=c.downsample_factor,
                          size_why=f"the VAE downsamples by {c.downsample_factor}")

    @classmethod
    def check_arguments(cls, arguments, limits=None) -> None:
        """Checks before loading too: one input (``video`` or ``latents``), the AdaIN factor and tone mapping in
        range."""
        for name, most in (("adain_factor", 10), ("tone_map_compression_ratio", 1)):
            value = arguments.get(name, 0.0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= most:
                raise InputError(f"{name}={value!r} must be a number in [0, {most}] (0 turns it off)")
        if "video" in arguments and (arguments["video"] is None) == (arguments.get("latents") is None):
            either = "pass video= (frames to encode) or latents= (a pipeline's output_type='latent' result)"
            raise InputError(either if arguments["video"] is None else f"{either}, not both")
        super().check_arguments(arguments, limits)

    def decode(self, latents, *, timestep=None, noise_scale=None, key=None) -> Array:
        """Normalised latents as ``[-1, 1]`` videos (:func:`~eqxdiff.pipelines.ltx.decode_video`), with the
        pipeline's tiling settings."""
        return decode_video(self.vae, latents, timestep, noise_scale, jax.random.key(0) if key is None else key,
                            tiled=self.vae_tiling, frame_chunk=self.vae_frame_chunk, dtype=self.vae_dtype)

    def check_size(self, height: int | None, width: int | None, size: tuple[int, int], what: str) -> None:
        """The call's ``height`` / ``width`` (diffusers' size the input video is resized to) are the input's ``size``
        or left out: eqxdiff does not resize the input, so another size is refused, not ignored."""
        if (height is None or height == size[0]) and (width is None or width == size[1]):
            return
        asked = pixel_size(size[0] if height is None else height, size[1] if width is None else width)
        raise InputError(f"{asked} pixels asked, but {what} {pixel_size(*size)} pixels and eqxdiff does not resize "
                         f"the input (diffusers resizes a video to height x width): leave height and width out (the "
                         f"input's size; the output is twice it, {pixel_size(2 * size[0], 2 * size[1])}), or resize "
                         "the frames first")

    def video_latents(self, video, key: PRNGKeyArray, *, height: int | None = None, width: int | None = None
                      ) -> Array:
        """A clip's normalised latents ``[1, T, h, w, C]``, its posterior sampled with ``noise_draws(key, ...).image``
        (frames cut to ``8k + 1``, as diffusers does); ``height`` / ``width``: :meth:`check_size`."""
        pixels = to_model_range(video, "video")
        self.check_size(height, width, pixels.shape[1:3], "the video's frames have")
        t, f = self.vae_temporal_factor, self.vae_scale_factor
        pixels = pixels[:(pixels.shape[0] - 1) // t * t + 1]
        if pixels.shape[1] % f or pixels.shape[2] % f:
            raise InputError(f"video frames of {pixels.shape[2]}x{pixels.shape[1]} pixels: width and height must be "
                             f"multiples of {f} (the VAE downsamples by {f}); crop or resize them")
        shape = self.video_latents_shape(1, pixels.shape[0], *pixels.shape[1:3])
        return sampled_latents(self.vae, pixels[None], noise_draws(key, shape).image)

    @checked_call
    def __call__(self, video=None, *, height: int | None = None, width: int | None = None, latents=None,
                 adain_factor: float = 0.0, tone_map_compression_ratio: float = 0.0,
                 decode_timestep: float | Sequence[float] = 0.0,
                 decode_noise_scale: float | Sequence[float] | None = None,
                 seed: int | None = None, key: PRNGKeyArray | None = None, output_type: str = "uint8",
                 progress: bool = True):
        """Upsampled latents or videos with diffusers' ``LTXLatentUpsamplePipeline`` arguments.

        Args:
            video: A clip to upsample (uint8 frames [F, H, W, 3]), instead of latents.
            height: The input's height in pixels (default: the video's, or the latents' times the VAE's factor;
                eqxdiff does not resize the input, so only that is accepted); the output is twice it.
            width: The input's width in pixels (the same).
            latents: Normalised latents [n, T, h, w, C] (channels-last: a pipeline's output_type="latent" result).
            adain_factor: Match the upsampled latents' per-channel statistics to the input's (0 = off, 1 = fully).
            tone_map_compression_ratio: Compress the upsampled latents' range (0 = off, up to 1).
            decode_timestep: The timestep a timestep-conditioned VAE decodes at (0.9.1+; 0.03-0.05 recommended).
            decode_noise_scale: How much fresh noise is mixed into the latents before decoding (default:
                decode_timestep).
            seed: Random seed (the video's posterior sample and the decode noise).
            output_type: ``"uint8"`` frames, ``"np"`` (float32 in [0, 1]), ``"pil"`` (per video a list of PIL
                frames) or ``"latent"`` (normalised, channels-last latents: the refine stage's
                input).
            progress: Unused (no loop); accepted as the other pipelines accept it.
        """
        key = resolve_key(seed, key)
        with self.timed("encode"):
            if latents is None:
                latents = self.video_latents(video, key, height=height, width=width)
            else:
                latents = jnp.asarray(latents, jnp.float32)
                c = self.vae.config.latent_channels
                if latents.ndim != 5 or latents.shape[-1] != c:
                    raise InputError(f"latents must be [n, T, h, w, {c}] (normalised, channels-last: a pipeline's "
                                     f"output_type='latent' result), got shape {latents.shape}")
                f = self.vae_scale_factor
                self.check_size(height, width, (latents.shape[2] * f, latents.shape[3] * f),
                                f"latents {latents.shape[2]}x{latents.shape[3]} (x{f}, the VAE's factor) are frames of")
        with self.timed("upsample"):
            up = jax.block_until_ready(upsampled_latents(
                self.latent_upsampler, self.vae, latents, jnp.asarray(adain_factor, jnp.float32),
                jnp.asarray(tone_map_compression_ratio, jnp.float32)))
        return self.finish(self.vae.scale_latents(up), output_type,
                           **decode_options(self.vae, decode_timestep, decode_noise_scale, up.shape[0], key))
