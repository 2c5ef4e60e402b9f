"""What every pipeline that diffuses in an ``AutoencoderKL``'s latent space shares (the UNet families and Flux): the
Gaussian draws of a call, the VAE's way in and out (optionally in tiles), the denoising loop's run with its timing
and progress bar, and the output: the final latents, or uint8 images, checked for NaN with a hint that fits the
call."""

import dataclasses
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray
from ._base import DiffusionPipeline
from ._checks import check_finite_output
from ._denoise import Guidance, denoise_loop
from ._images import to_uint8
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
    noise_key, image_key, loop_key = jax.random.split(key, 3)
    masked_key = jax.random.fold_in(image_key, 1)
    return NoiseDraws(*(jax.random.normal(k, shape) for k in (noise_key, image_key, masked_key)), loop_key)


@eqx.filter_jit
def encode_image_latents(vae, image: Float[Array, "batch height width 3"],
                         posterior_noise: Float[Array, "batch h w latent"], *, tiled: bool = False):
    """VAE latents of ``[-1, 1]`` images, sampled with the given standard-normal noise, then scaled; ``tiled``
    encodes in overlapping tiles (``AutoencoderKL.encode_tiled``: bounded memory for large images)."""
    dist = vae.encode_tiled(image) if tiled else vae.encode(image)
    return vae.scale_latents(dist.mean + dist.std * posterior_noise)


@eqx.filter_jit
def decode_latents(vae, latents: Float[Array, "batch h w latent"], *,
                   tiled: bool = False) -> Float[Array, "batch height width 3"]:
    """Scaled latents back to ``[-1, 1]`` images; ``tiled`` decodes in overlapping tiles
    (``AutoencoderKL.decode_tiled``, as diffusers' ``enable_vae_tiling()``)."""
    z = vae.unscale_latents(latents).astype(jnp.float32)
    return vae.decode_tiled(z) if tiled else vae.decode(z)


class LatentPipeline(DiffusionPipeline):
    """Base of the pipelines with a ``vae`` (``AutoencoderKL``) component."""

    # Encode and decode with the VAE in overlapping tiles (enable_vae_tiling): bounded memory at large sizes.
    vae_tiling: bool = False
    SETTINGS: ClassVar[tuple[str, ...]] = ("vae_tiling",)

    def enable_vae_tiling(self, enabled: bool = True) -> None:
        """Encode and decode images with the VAE in overlapping tiles of its ``sample_size`` (diffusers'
        ``enable_vae_tiling()``): the VAE's memory stays bounded at large sizes, seams are blended."""
        self.vae_tiling = bool(enabled)

    @property
    def vae_scale_factor(self) -> int:
        return self.vae.config.downsample_factor

    def run_loop(self, denoiser, scheduler, state, latents, cond, key, *, guidance: Guidance, num_steps: int,
                 progress: bool):
        """:func:`~eqxdiff.pipelines.denoise_loop` for ``num_steps`` steps, timed as ``denoise``, with a progress
        bar; the latents once they are ready."""
        with self.timed("denoise"), progress_bar(num_steps, "denoising", enabled=progress):
            return jax.block_until_ready(denoise_loop(
                denoiser, scheduler, state, latents, cond, key, guidance=guidance,
                num_steps=jnp.asarray(num_steps, jnp.int32), progress=progress))

    def finish(self, latents, output_type: str, *, guided_by: str | None = None):
        """The call's result from the final (unpacked, channels-last) latents: the latents themselves for
        ``output_type="latent"``, else the decoded uint8 images. Either is checked for NaN/inf, with a hint naming
        the float32 settings and, if the call guided, the guidance setting (``guided_by``, e.g. ``"guidance_scale
        (now 7.5)"``) that usually cure it."""
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
            images = self.gather(decode_latents(self.vae, latents, tiled=self.vae_tiling))
            check_finite_output(images, what="images", hint=hint)
            return to_uint8(images)
