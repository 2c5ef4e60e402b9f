"""LTX-Video's video VAE: diffusers' ``AutoencoderKLLTXVideo`` (0.9.0; 0.9.1's timestep-conditioned decoder with noise
injection and residual upsampling; 0.9.5+'s space-to-depth encoder) on channels-last video ``[batch, frames, height,
width, channels]``.

>>> vae = eqxdiff.load("Lightricks/LTX-Video-0.9.5", subfolder="vae")
>>> posterior = vae.encode(video)      # [b, 1 + 8k, H, W, 3] in [-1, 1] -> latents [b, 1 + k, H/32, W/32, 128]
>>> frames = vae.decode(vae.unscale_latents(latents), timestep=0.05, key=key, tiled=True, frame_chunk=2)

The encoder is causal in time (its convolutions pad the front by repeating the first frame); the decoder is not (it
repeats both edge frames). Pixels are patchified (``patch_size`` 4: 48 channels, order ``(c, pw, ph)``) before the
encoder and unpatchified after the decoder. The encoder's last convolution gives ``latent_channels + 1`` channels:
the means and one log-variance shared by every channel. ``latents_mean`` / ``latents_std`` are the checkpoint's
per-channel statistics (tensors, not config): :meth:`~AutoencoderKLLTXVideo.scale_latents` normalises latents for
the transformer, :meth:`~AutoencoderKLLTXVideo.unscale_latents` undoes it.

**Timestep conditioning** (0.9.1+, ``timestep_conditioning``): the decoder takes the pipelines' ``decode_timestep``
(times ``timestep_scale_multiplier``, a tensor of the checkpoint) and modulates its ResNet blocks and output with it.
**Noise injection** (``decoder_inject_noise``) draws its noise from ``key`` (see :mod:`._ltx_vae_blocks`).

``decode(..., tiled=True)`` decodes overlapping spatial tiles of ``tile_sample_min`` pixels every
``tile_sample_stride`` and ``frame_chunk=n`` overlapping windows of ``n + 1`` latent frames every ``frame_stride``,
blended as diffusers' ``enable_tiling()`` and framewise decoding do (the same numbers as diffusers'; not those of
the whole decode: the decoder sees each piece alone).

Lightricks' original files name the blocks by their position in one list per encoder and decoder:
:func:`eqxdiff.loading.formats.ltx_vae` holds the mapping as conversion rules.
"""

import itertools
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import nn
from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ._base import PretrainedModel, check_channels_last
from ._ltx_vae_blocks import (
    RMS_EPS,
    LTXVideoDownBlock3D,
    LTXVideoDownsampler3d,
    LTXVideoMidBlock3d,
    LTXVideoResnetBlock3d,
    LTXVideoUpBlock3d,
    LTXVideoUpsampler3d,
    TimestepEmbedder,
    causal_conv,
)
from ._ltx_vae_config import DOWNSAMPLE_STRIDES, AutoencoderKLLTXVideoConfig
from ._posterior import DiagonalGaussian
from ._tiling import blend, blend_tiles

TimestepLike = int | float | Float[Array, ""] | Float[Array, " videos"] | Int[Array, " videos"]  # checked by decode


def _patchify(x: Array, p: int) -> Array:
    """``p x p`` pixel patches folded into channels ``(c, pw, ph)`` (diffusers' encoder order)."""
    b, f, h, w, c = x.shape
    x = x.reshape(b, f, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, f, h // p, w // p, c * p * p)


def _unpatchify(x: Array, p: int) -> Array:
    b, f, h, w, cp = x.shape
    x = x.reshape(b, f, h, w, cp // (p * p), p, p).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, f, h * p, w * p, cp // (p * p))


class LTXVideoEncoder3d(eqx.Module):
    """``conv_in`` (of patchified pixels), ``down_blocks``, ``mid_block``, RMS norm, SiLU, ``conv_out`` to
    ``latent_channels + 1``; causal in time unless ``encoder_causal`` is false."""

    conv_in: nn.CausalConv3d
    down_blocks: tuple[LTXVideoDownBlock3D, ...]
    mid_block: LTXVideoMidBlock3d
    norm_out: nn.RMSNorm
    conv_out: nn.CausalConv3d

    def __init__(self, c: AutoencoderKLLTXVideoConfig, *, dtype, key: PRNGKeyArray):
        ki, kd, km, ko = jax.random.split(key, 4)
        causal, eps, blocks = c.encoder_causal, c.resnet_norm_eps, c.encoder_blocks()
        res = lambda cin, cout, k: LTXVideoResnetBlock3d(cin, cout, causal=causal, eps=eps, dtype=dtype, key=k)  # noqa: E731
        self.conv_in = causal_conv(c.in_channels * c.patch_size ** 2, c.block_out_channels[0], causal=causal,
                                   dtype=dtype, key=ki)
        down = []
        for b, k in zip(blocks, jax.random.split(kd, len(blocks))):
            kr, ks, kc = jax.random.split(k, 3)
            sampler = (None if b.downsample is None else
                       causal_conv(b.cin, b.cin, stride=2, causal=causal, dtype=dtype, key=ks) if b.downsample == "conv"
                       else LTXVideoDownsampler3d(b.cin, b.cout, DOWNSAMPLE_STRIDES[b.downsample], causal=causal,
                                                  dtype=dtype, key=ks))
            down.append(LTXVideoDownBlock3D([res(b.cin, b.cin, kk) for kk in jax.random.split(kr, b.layers)], sampler,
                                            res(b.cin, b.cout, kc) if b.conv_out else None))
        self.down_blocks = tuple(down)
        width = c.encoder_width
        self.mid_block = LTXVideoMidBlock3d(None, [res(width, width, k) for k in
                                                   jax.random.split(km, c.layers_per_block[-1])])
        self.norm_out = nn.RMSNorm(width, eps=RMS_EPS, elementwise_affine=False, dtype=dtype)
        self.conv_out = causal_conv(width, c.latent_channels + 1, causal=causal, dtype=dtype, key=ko)

    def __call__(self, x: Array) -> Array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(nn.silu(self.norm_out(self.mid_block(x))))


class LTXVideoDecoder3d(eqx.Module):
    """``conv_in``, ``mid_block``, ``up_blocks``, RMS norm (modulated by ``scale_shift_table + time_embedder``
    with timestep conditioning), SiLU, ``conv_out`` to patchified pixels; centred in time unless
    ``decoder_causal``."""

    PARAM_AXES: ClassVar = {"timestep_scale_multiplier": ()}

    conv_in: nn.CausalConv3d
    mid_block: LTXVideoMidBlock3d
    up_blocks: tuple[LTXVideoUpBlock3d, ...]
    norm_out: nn.RMSNorm
    conv_out: nn.CausalConv3d
    time_embedder: TimestepEmbedder | None
    scale_shift_table: nn.ScaleShiftTable | None
    timestep_scale_multiplier: Float[Array, ""] | None

    def __init__(self, c: AutoencoderKLLTXVideoConfig, *, dtype, key: PRNGKeyArray):
        ki, km, ku, ko, kt, ks = jax.random.split(key, 6)
        causal, eps, tc, blocks = c.decoder_causal, c.resnet_norm_eps, c.timestep_conditioning, c.decoder_blocks()
        counter = itertools.count()  # noise indices, in the order the blocks run

        def res(cin, cout, inject, k):
            return LTXVideoResnetBlock3d(cin, cout, causal=causal, eps=eps, timestep_conditioning=tc,
                                         noise_index=next(counter) if inject else None, dtype=dtype, key=k)

        embedder = (lambda dim, k: TimestepEmbedder(dim, dtype=dtype, key=k) if tc else None)  # noqa: E731
        width = c.decoder_width
        self.conv_in = causal_conv(c.latent_channels, width, causal=causal, dtype=dtype, key=ki)
        mid_inject, k1, k2 = c.decoder_inject_noise[-1], *jax.random.split(km)
        self.mid_block = LTXVideoMidBlock3d(embedder(4 * width, k1), [
            res(width, width, mid_inject, k) for k in jax.random.split(k2, c.decoder_layers_per_block[-1])])
        up = []
        for b, k in zip(blocks, jax.random.split(ku, len(blocks))):
            ke, kc, kup, kr = jax.random.split(k, 4)
            conv_in = res(b.cin, b.cout, b.inject, kc) if b.conv_in else None
            sampler = (LTXVideoUpsampler3d(b.cout * b.factor, causal=causal, residual=b.residual,
                                           upscale_factor=b.factor, dtype=dtype, key=kup) if b.upsample else None)
            resnets = [res(b.cout, b.cout, b.inject, kk) for kk in jax.random.split(kr, b.layers)]
            up.append(LTXVideoUpBlock3d(embedder(4 * b.cin, ke), conv_in, sampler, resnets))
        self.up_blocks = tuple(up)
        out = blocks[-1].cout if blocks else width
        self.norm_out = nn.RMSNorm(out, eps=RMS_EPS, elementwise_affine=False, dtype=dtype)
        self.conv_out = causal_conv(out, c.out_channels * c.patch_size ** 2, causal=causal, dtype=dtype, key=ko)
        self.time_embedder = embedder(2 * out, kt)
        self.scale_shift_table = nn.ScaleShiftTable(2, out, dtype=dtype, key=ks) if tc else None
        self.timestep_scale_multiplier = jnp.asarray(1000.0, dtype) if tc else None

    def __call__(self, z: Array, timestep: Array | None, key: PRNGKeyArray | None) -> Array:
        x = self.conv_in(z)
        if self.timestep_scale_multiplier is not None:
            timestep = timestep * self.timestep_scale_multiplier.astype(jnp.float32)
        x = self.mid_block(x, timestep, key)
        for block in self.up_blocks:
            x = block(x, timestep, key)
        x = self.norm_out(x)
        if self.time_embedder is not None:
            shift, scale = self.scale_shift_table(self.time_embedder(timestep, x.dtype))
            x = nn.modulate(x, shift, scale)
        return self.conv_out(nn.silu(x))


class LTXLatentDistribution(DiagonalGaussian):
    """The posterior ``N(mean, exp(logvar))`` over video latents ``[batch, frames, h, w, latent]`` (diffusers'
    ``DiagonalGaussianDistribution``; ``logvar`` clipped to ``[-30, 20]``, one value shared by the channels)."""


def blend_windows(fn, z: Array, *, window: int, stride: int, out_stride: int, blend_extent: int,
                  frames: int) -> Array:
    """diffusers' ``_temporal_tiled_decode``: ``fn`` on windows of ``window + 1`` latent frames every ``stride``;
    every window after the first loses its last output frame, is blended into the previous (blended) window over
    ``blend_extent`` frames and keeps ``out_stride`` frames (the first keeps ``out_stride + 1``); joined and cut to
    ``frames``. Windows of one shape go through one ``lax.map``."""
    starts = list(range(0, z.shape[1], stride))
    pieces = {i: z[:, i:i + window + 1] for i in starts}
    out = {}
    for shape in dict.fromkeys(p.shape for p in pieces.values()):
        group = [i for i in starts if pieces[i].shape == shape]
        results = jax.lax.map(fn, jnp.stack([pieces[i] for i in group]))
        out.update({i: results[n] for n, i in enumerate(group)})
    kept, previous = [out[0][:, :out_stride + 1]], out[0]
    for i in starts[1:]:
        previous = blend(previous, out[i][:, :-1], blend_extent, axis=1)
        kept.append(previous[:, :out_stride])
    return jnp.concatenate(kept, axis=1)[:, :frames]


def _pair(value, what: str) -> tuple[int, int]:
    out = (value, value) if isinstance(value, int) else tuple(value)
    if len(out) != 2 or not all(isinstance(v, int) and v > 0 for v in out):
        raise ValueError(f"AutoencoderKLLTXVideo.decode: {what}={value!r} must be a positive int or (height, width)")
    return out


def _frame_stride(frame_chunk, frame_stride) -> int | None:
    if frame_chunk is None:
        if frame_stride is not None:
            raise ValueError("AutoencoderKLLTXVideo.decode: frame_stride= needs frame_chunk=")
        return None
    stride = max(frame_chunk // 2, 1) if frame_stride is None and isinstance(frame_chunk, int) else frame_stride
    if not (isinstance(frame_chunk, int) and isinstance(stride, int) and 1 <= stride <= frame_chunk):
        raise ValueError(f"AutoencoderKLLTXVideo.decode: frame_chunk={frame_chunk!r} and frame_stride={frame_stride!r}"
                         " must be positive ints, the stride at most the chunk")
    return stride


class AutoencoderKLLTXVideo(PretrainedModel):
    """diffusers' ``AutoencoderKLLTXVideo`` on channels-last video (see the module docstring)."""

    config_class: ClassVar[type] = AutoencoderKLLTXVideoConfig
    PARAM_AXES: ClassVar = {"latents_mean": (None,), "latents_std": (None,)}

    encoder: LTXVideoEncoder3d
    decoder: LTXVideoDecoder3d
    latents_mean: Float[Array, " latent"]
    latents_std: Float[Array, " latent"]
    config: AutoencoderKLLTXVideoConfig = eqx.field(static=True)

    def __init__(self, config: AutoencoderKLLTXVideoConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        ke, kd = jax.random.split(key)
        self.encoder = LTXVideoEncoder3d(config, dtype=dtype, key=ke)
        self.decoder = LTXVideoDecoder3d(config, dtype=dtype, key=kd)
        self.latents_mean = jnp.zeros((config.latent_channels,), dtype)
        self.latents_std = jnp.ones((config.latent_channels,), dtype)
        self.config = config

    # -- encode ------------------------------------------------------------------------------------------------------

    @typechecked
    def encode(self, x: Float[Array, "batch frames height width channels"]) -> LTXLatentDistribution:
        """The posterior over latents of videos ``x`` in [-1, 1]: ``1 + k * temporal_factor`` frames, height and
        width multiples of ``downsample_factor`` (8 and 32 for LTX-Video) where the encoder folds space or time into
        channels (0.9.5+); an encoder of strided convolutions only (0.9.0 / 0.9.1) takes any frame count and
        multiples of ``patch_size``, rounding the latents up as diffusers'."""
        c = self.config
        check_channels_last("AutoencoderKLLTXVideo", "encode", "videos", x, c.in_channels, "frames, height, width")
        t, s = c.temporal_factor, c.downsample_factor
        if not any(b.downsample not in (None, "conv") for b in c.encoder_blocks()):
            # strided convolutions only (0.9.0 / 0.9.1): they round up any size and frame count, as diffusers'
            t, s = 1, c.patch_size
        if (x.shape[1] - 1) % t:
            low = 1 + (x.shape[1] - 1) // t * t
            raise ValueError(f"AutoencoderKLLTXVideo.encode: a video of {x.shape[1]} frames; the VAE takes 1 + {t}k "
                             f"frames (nearest: {low} or {low + t})")
        if x.shape[2] % s or x.shape[3] % s:
            raise ValueError(f"AutoencoderKLLTXVideo.encode: frames of {x.shape[2]}x{x.shape[3]}; height and width "
                             f"must be multiples of {s}")
        h = self.encoder(_patchify(x, c.patch_size))
        mean, logvar = h[..., :-1], jnp.repeat(h[..., -1:], c.latent_channels, axis=-1)
        return LTXLatentDistribution(mean, jnp.clip(logvar, -30.0, 20.0))

    # -- decode ------------------------------------------------------------------------------------------------------

    def _timestep(self, timestep, batch: int) -> Array | None:
        if not self.config.timestep_conditioning:
            if timestep is not None:
                raise ValueError("AutoencoderKLLTXVideo.decode: this VAE's decoder takes no timestep "
                                 "(timestep_conditioning is false: LTX-Video 0.9.0); leave timestep out")
            return None
        if timestep is None:
            raise ValueError("AutoencoderKLLTXVideo.decode: this VAE conditions its decoder on a timestep "
                             "(timestep_conditioning, 0.9.1+): pass timestep= (the pipelines' decode_timestep, e.g. "
                             "0.05)")
        t = jnp.asarray(timestep, jnp.float32)
        if t.ndim > 1 or t.size not in (1, batch):
            raise ValueError(f"AutoencoderKLLTXVideo.decode: timestep of shape {t.shape}; give a scalar or one per "
                             f"video [{batch}]")
        return jnp.broadcast_to(t.reshape(-1), (batch,))

    def _frames(self, z, timestep, key, tiled, tile_sample_min, tile_sample_stride):
        """The decoder (and unpatchify) on ``z``, in spatial tiles when ``tiled`` and ``z`` exceeds one tile,
        blended in pixels as diffusers' (its decoder unpatchifies)."""
        c = self.config
        fn = lambda zz: _unpatchify(self.decoder(zz, timestep, key), c.patch_size)  # noqa: E731
        size, stride = _pair(tile_sample_min, "tile_sample_min"), _pair(tile_sample_stride, "tile_sample_stride")
        f = c.downsample_factor
        if not all(f <= s <= m for s, m in zip(stride, size)):
            raise ValueError(f"AutoencoderKLLTXVideo.decode: tile_sample_stride={stride} must lie between "
                             f"downsample_factor={f} and tile_sample_min={size} (pixels)")
        if not tiled or (z.shape[2] <= size[0] // f and z.shape[3] <= size[1] // f):
            return fn(z)
        x = blend_tiles(fn, z, axes=(2, 3), tile=tuple(s // f for s in size), stride=tuple(s // f for s in stride),
                        blend_extent=tuple(m - s for m, s in zip(size, stride)), keep=stride)
        return x[:, :, :z.shape[2] * f, :z.shape[3] * f]

    @typechecked
    def decode(self, z: Float[Array, "batch frames h w latent"], timestep: TimestepLike | None = None, *,
               key: PRNGKeyArray | None = None, tiled: bool = False, tile_sample_min: int | tuple[int, int] = 512,
               tile_sample_stride: int | tuple[int, int] = 448, frame_chunk: int | None = None,
               frame_stride: int | None = None) -> Float[Array, "batch frames2 height width out"]:
        """Videos of ``1 + 2^n (T - 1)`` frames (``n``: the decoder's upsamplings; 8 for LTX-Video) from (unscaled)
        latents ``z``, not clamped (as diffusers' ``decode``).

        ``timestep``: the decoder's conditioning (0.9.1+; the pipelines' ``decode_timestep``), a scalar or one per
        video. ``key``: draws the injected noise of decoders that inject it. ``tiled``: overlapping spatial tiles of
        ``tile_sample_min`` pixels every ``tile_sample_stride`` (diffusers' ``enable_tiling()`` defaults: 512, 448),
        for latents larger than one tile. ``frame_chunk``: windows of ``frame_chunk + 1`` latent frames every
        ``frame_stride`` (default ``frame_chunk // 2``, at least 1) for latents of more than ``frame_chunk`` frames
        (diffusers' framewise decoding: ``tile_sample_min_num_frames = frame_chunk * temporal_factor``, its
        defaults 2 and 1 here); each window tiled too."""
        c = self.config
        check_channels_last("AutoencoderKLLTXVideo", "decode", "latents", z, c.latent_channels,
                            "frames, height, width")
        t = self._timestep(timestep, z.shape[0])
        if c.injects_noise and key is None:
            raise ValueError("AutoencoderKLLTXVideo.decode: this decoder injects noise (decoder_inject_noise); pass "
                             "key=jax.random.key(...) to draw it")
        stride = _frame_stride(frame_chunk, frame_stride)
        fn = lambda zz: self._frames(zz, t, key, tiled, tile_sample_min, tile_sample_stride)  # noqa: E731
        if frame_chunk is None or z.shape[1] <= frame_chunk:
            x = fn(z)
        else:
            up = 2 ** c.decoder_upsamplings
            x = blend_windows(fn, z, window=frame_chunk, stride=stride, out_stride=stride * up,
                              blend_extent=(frame_chunk - stride) * up, frames=1 + (z.shape[1] - 1) * up)
        return x

    @typechecked
    def __call__(self, x: Float[Array, "batch frames height width channels"], timestep: TimestepLike | None = None,
                 *, key: PRNGKeyArray | None = None, sample_posterior: bool = False
                 ) -> Float[Array, "batch frames height width out"]:
        """Reconstruct ``x``: decode the posterior's mode (or a sample), diffusers' ``forward``. ``key`` draws the
        sample and the decoder's noise (split in two)."""
        if sample_posterior and key is None:
            raise ValueError("AutoencoderKLLTXVideo: sample_posterior=True needs a PRNG key: pass "
                             "key=jax.random.key(0)")
        ks, kd = jax.random.split(key) if key is not None else (None, None)
        posterior = self.encode(x)
        return self.decode(posterior.sample(key=ks) if sample_posterior else posterior.mode(), timestep, key=kd)

    # -- latent normalisation ----------------------------------------------------------------------------------------

    @typechecked
    def scale_latents(self, z: Float[Array, "*batch latent"]) -> Float[Array, "*batch latent"]:
        """VAE latents -> the transformer's: ``(z - latents_mean) * scaling_factor / latents_std`` per channel
        (diffusers' pipelines' ``_normalize_latents``)."""
        mean, std = self.latents_mean.astype(z.dtype), self.latents_std.astype(z.dtype)
        return (z - mean) * self.config.scaling_factor / std

    @typechecked
    def unscale_latents(self, z: Float[Array, "*batch latent"]) -> Float[Array, "*batch latent"]:
        """The inverse of :meth:`scale_latents`: ``z * latents_std / scaling_factor + latents_mean``."""
        mean, std = self.latents_mean.astype(z.dtype), self.latents_std.astype(z.dtype)
        return z * std / self.config.scaling_factor + mean


__all__ = ["AutoencoderKLLTXVideo", "AutoencoderKLLTXVideoConfig", "LTXLatentDistribution"]
