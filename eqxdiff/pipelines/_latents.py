"""What every pipeline that diffuses in a VAE's latent space shares (the UNet families, Flux, the video families):
the Gaussian draws of a call, the VAE's way in and out (optionally in tiles and, for videos, frame chunks), the
denoising loop's run with its timing and progress bar, and the output: the final latents, or images
``[n, H, W, 3]`` / videos ``[n, F, H, W, 3]`` (uint8, float32 in ``[0, 1]`` or PIL images: ``output_type``),
checked for NaN with a hint that fits the call.

**The VAE protocol.** A pipeline reads its ``vae`` through these names only, so an image VAE (``AutoencoderKL``) and
a video VAE (``AutoencoderKLWan``, ``AutoencoderKLLTXVideo``) serve alike. The config: ``downsample_factor`` (pixels
per latent pixel along height and width), ``temporal_factor`` (frames per latent frame after the first: 1 for an
image VAE; a video of ``1 + k * t`` frames has ``1 + k`` latent frames) and ``latent_channels``. The model:
``scale_latents`` / ``unscale_latents`` (to and from the denoiser's latents), ``encode`` (a posterior with ``mean``
or ``mode()``) and ``decode``; an image VAE also ``encode_tiled`` / ``decode_tiled``, a video VAE's
``decode(z, *, tiled=, frame_chunk=)`` takes both bounded-memory settings (a decoder with more inputs, LTX-Video's
timestep and noise key, is called by its family's :meth:`LatentPipeline.decode`). Latents are channels-last and
unpacked: images ``[n, h, w, C]``, videos ``[n, F, h, w, C]``.
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, PRNGKeyArray
from ..core import program
from ._base import DiffusionPipeline
from ._checks import check_finite_output
from ._denoise import Guidance, denoise_loop
from ._images import to_pil, uint8_on_device, unit_on_device
from ._progress import progress_bar


@dataclasses.dataclass(frozen=True)
class NoiseDraws:
    """The Gaussian draws of one call, all from its key: the initial ``noise``, the VAE posterior samples of the
    ``image`` and of the ``masked_image`` (inpainting), and the key of the loop's own draws."""

    noise: Any
    image: Any
    masked_image: Any
    loop_key: Any


def noise_draws(key: PRNGKeyArray, shape: tuple[int, ...]) -> NoiseDraws:
    """What a latent pipeline's call draws from ``key`` for latents of ``shape`` (every family the same way: to
    reproduce a call, or to give diffusers the same noise)."""
    return NoiseDraws(*_draws(key, shape))


@program
def _draws(key, shape):
    noise_key, image_key, loop_key = jax.random.split(key, 3)
    masked_key = jax.random.fold_in(image_key, 1)
    return (*(jax.random.normal(k, shape) for k in (noise_key, image_key, masked_key)), loop_key)


@program
def encode_image_latents(vae, image: Float[Array, "batch height width 3"],
                         posterior_noise: Float[Array, "batch h w latent"], *, tiled: bool = False,
                         latent_norm: str | None = None):
    """VAE latents of ``[-1, 1]`` images, sampled with the given standard-normal noise, then scaled (``latent_norm``:
    :attr:`LatentPipeline.LATENT_NORM`); ``tiled`` encodes in overlapping tiles (``AutoencoderKL.encode_tiled``:
    bounded memory for large images)."""
    dist = vae.encode_tiled(image) if tiled else vae.encode(image)
    return vae.scale_latents(dist.mean + dist.std * posterior_noise, **_norm(latent_norm))


def _norm(latent_norm: str | None) -> dict:
    return {} if latent_norm is None else {"norm": latent_norm}


@program
def decode_latents(vae, latents: Float[Array, "batch *spatial latent"], *, tiled: bool = False,
                   frame_chunk: int | None = None, dtype=jnp.float32,
                   latent_norm: str | None = None) -> Float[Array, "batch *pixels 3"]:
    """Scaled latents back to ``[-1, 1]`` images ``[b, H, W, 3]`` or videos ``[b, F, H, W, 3]`` (from video latents
    ``[b, T, h, w, C]``). ``tiled`` decodes in overlapping spatial tiles (as diffusers' ``enable_vae_tiling()``);
    video latents are decoded ``frame_chunk`` latent frames at a time (``None``: all at once). The latents are
    un-scaled in float32, then the VAE runs in ``dtype`` (a pipeline's activations dtype: diffusers decodes in the
    VAE's dtype too)."""
    z = vae.unscale_latents(latents.astype(jnp.float32), **_norm(latent_norm)).astype(dtype)
    if z.ndim == 5:  # a video VAE (the module docstring's protocol)
        return vae.decode(z, tiled=tiled, frame_chunk=frame_chunk)
    return vae.decode_tiled(z) if tiled else vae.decode(z)


class LatentPipeline(DiffusionPipeline):
    """Base of the pipelines with a ``vae`` component, image or video (the module docstring's VAE protocol)."""

    # Bounded VAE memory (enable_vae_tiling): overlapping spatial tiles and, for videos, this many latent frames
    # decoded at a time.
    vae_tiling: bool = False
    vae_frame_chunk: int | None = None
    # Which of the VAE config's latent statistics the family's diffusers pipeline reads (an image VAE's
    # scale_latents(norm=...): "shift", "mean_std" or "scale"); None: all the VAE's (its scale_latents' default).
    LATENT_NORM: ClassVar[str | None] = None
    SETTINGS: ClassVar[tuple[str, ...]] = ("vae_tiling", "vae_frame_chunk")
    DEFAULT_FRAME_CHUNK: ClassVar[int] = 1  # diffusers' video VAEs decode one latent frame at a time
    # A family whose diffusers VAE decodes windows of a number of output frames (its tile_sample_min_num_frames, every
    # half of it) sets that number: the default chunk is then that many output frames in latent frames (at least 1)
    FRAME_CHUNK_SAMPLE_FRAMES: ClassVar[int | None] = None

    @classmethod
    def runs_folder(cls, read_json) -> bool:
        """Whether this class drives the models of a pipeline folder (``read_json`` as for
        :meth:`~eqxdiff.pipelines.DiffusionPipeline.folder_limits`) beyond having its components
        (:func:`~eqxdiff.pipelines.pipeline_class_for`): a family whose tasks need other models of the same classes
        (another denoiser input width) says so here. True by default and when the folder does not say."""
        return True

    def enable_vae_tiling(self, enabled: bool = True, *, frame_chunk: int | None = None) -> None:
        """Bound the VAE's memory at large sizes (diffusers' ``enable_vae_tiling()``): encode and decode in
        overlapping tiles of the VAE's tile size (seams blended) and decode videos ``frame_chunk`` latent frames at a
        time (default :attr:`default_frame_chunk`, diffusers' chunk; the same numbers as one pass, the activations of
        one chunk). ``enable_vae_tiling(False)`` turns both off."""
        if frame_chunk is not None and (isinstance(frame_chunk, bool) or not isinstance(frame_chunk, int)
                                        or frame_chunk < 1):
            raise ValueError(f"enable_vae_tiling: frame_chunk={frame_chunk!r} must be a positive int (latent frames "
                             f"decoded at a time) or None (the default, {self.default_frame_chunk})")
        self.vae_tiling = bool(enabled)
        self.vae_frame_chunk = (frame_chunk or self.default_frame_chunk) if enabled else None

    @property
    def default_frame_chunk(self) -> int:
        """Latent frames decoded at a time under :meth:`enable_vae_tiling` by default: diffusers' framewise decoding
        of this VAE (``FRAME_CHUNK_SAMPLE_FRAMES`` output frames over the VAE's temporal factor, or
        ``DEFAULT_FRAME_CHUNK``)."""
        if self.FRAME_CHUNK_SAMPLE_FRAMES is None:
            return self.DEFAULT_FRAME_CHUNK
        return max(1, self.FRAME_CHUNK_SAMPLE_FRAMES // self.vae_temporal_factor)

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent pixel along height and width."""
        return self.vae.config.downsample_factor

    @property
    def vae_temporal_factor(self) -> int:
        """Frames per latent frame after the first (1: an image VAE)."""
        return self.vae.config.temporal_factor

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of a video of ``num_frames`` frames (``1 + k * t`` frames give ``1 + k``)."""
        return (num_frames - 1) // self.vae_temporal_factor + 1

    def video_latents_shape(self, batch: int, num_frames: int, height: int, width: int,
                            channels: int | None = None) -> tuple[int, int, int, int, int]:
        """``[batch, T, h, w, C]``: the (unpacked, channels-last) latents of ``batch`` videos of ``num_frames``
        frames at ``height x width`` pixels; ``C`` defaults to the VAE's latent channels."""
        f = self.vae_scale_factor
        c = self.vae.config.latent_channels if channels is None else channels
        return (batch, self.latent_frames(num_frames), height // f, width // f, c)

    def run_loop(self, denoiser, scheduler, state, latents, cond, key, *, guidance: Guidance, num_steps: int,
                 progress: bool):
        """:func:`~eqxdiff.pipelines.denoise_loop` for ``num_steps`` steps, timed as ``denoise``, with a progress
        bar; the latents once they are ready."""
        with self.timed("denoise"), progress_bar(num_steps, "denoising", enabled=progress):
            return jax.block_until_ready(denoise_loop(
                denoiser, scheduler, state, latents, cond, key, guidance=guidance,
                num_steps=jnp.asarray(num_steps, jnp.int32), progress=progress))

    def finish(self, latents, output_type: str, *, guided_by: str | None = None, **decode_options):
        """The call's result from the final (unpacked, channels-last) latents: the latents themselves for
        ``output_type="latent"``, else the decoded images ``[n, H, W, 3]`` or videos ``[n, F, H, W, 3]``: uint8
        (``"uint8"``), float32 in ``[0, 1]`` (``"np"``, as diffusers') or PIL images (``"pil"``: a list of images,
        or for videos a list per video of its frames, as diffusers'), through :meth:`decode`, given
        ``decode_options`` (the call's own decoder inputs, for a family whose :meth:`decode` takes them). Either is
        checked for NaN/inf, with a hint naming the float32 settings and, if the call guided, the guidance setting
        (``guided_by``, e.g. ``"guidance_scale (now 7.5)"``) that usually cure it."""
        dtype = jnp.dtype(self.activations_dtype)
        hint = (f"the {dtype.name} activations may have overflowed: run in float32 (activations_dtype, "
                "--activations-dtype/--weights-dtype float32)" if dtype.itemsize < 4 else
                "check the weights (a NaN in the checkpoint?)")
        if guided_by is not None:
            hint += f" or lower {guided_by}"
        if output_type == "latent":
            latents = self.gather(latents)
            check_finite_output(latents, what="latents", hint=hint)
            return latents
        with self.timed("decode"):
            images = self.gather(self.decode(latents, **decode_options))
            # uint8 (and PIL): a quarter of float32's bytes cross to the host; "np": the floats before quantisation
            finite, pixels = (unit_on_device if output_type == "np" else uint8_on_device)(images)
            check_finite_output(images, what="videos" if images.ndim == 5 else "images", hint=hint, finite=finite)
            pixels = np.asarray(pixels)
            return to_pil(pixels) if output_type == "pil" else pixels

    @property
    def vae_dtype(self):
        """The dtype the VAE decodes in: the activations', except float32 for a float16 pipeline whose VAE config says
        ``force_upcast`` (diffusers' rule: the SD / SDXL VAEs overflow in float16)."""
        if self.activations_dtype == jnp.float16 and getattr(self.vae.config, "force_upcast", False):
            return jnp.dtype(jnp.float32)
        return self.activations_dtype

    def encode_pixels(self, pixels, noise) -> Array:
        """Scaled latents of ``[-1, 1]`` images ``[b, H, W, 3]``, sampled with ``noise``, through the VAE with the
        pipeline's tiling setting and the family's ``LATENT_NORM`` (:func:`encode_image_latents`): the way in that
        :meth:`decode` is the way out of."""
        return encode_image_latents(self.vae, pixels, noise, tiled=self.vae_tiling, latent_norm=self.LATENT_NORM)

    @classmethod
    def scale_latents(cls, vae, z) -> Array:
        """VAE latents ``z`` as the family's denoiser sees them: ``vae.scale_latents`` with the statistics its
        diffusers pipeline reads (``LATENT_NORM``); training scales its latents here too."""
        return vae.scale_latents(z, **_norm(cls.LATENT_NORM))

    def decode(self, latents) -> Array:
        """The final latents as ``[-1, 1]`` pixels through the VAE, with the pipeline's tiling settings
        (:meth:`enable_vae_tiling`). A family whose VAE decodes with more inputs overrides this and takes them as
        keywords, which its calls hand to :meth:`finish` (LTX-Video: the decode timestep, noise scale and key)."""
        return decode_latents(self.vae, latents, tiled=self.vae_tiling, dtype=self.vae_dtype,
                              frame_chunk=self.vae_frame_chunk if latents.ndim == 5 else None,
                              latent_norm=self.LATENT_NORM)
