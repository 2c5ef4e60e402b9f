"""Wan's video VAE: diffusers' ``AutoencoderKLWan``, Wan 2.1's (z 16, 8x spatial, 4x temporal) and Wan 2.2's
(z 48, ``is_residual`` levels with averaging/duplicating shortcuts, 2x2 ``patch_size`` patchified pixels, 16x spatial,
a wider decoder through ``decoder_base_dim``), on channels-last video ``[batch, frames, height, width, channels]``.

>>> vae = eqxdiff.load("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", subfolder="vae")
>>> posterior = vae.encode(video)      # [b, 1 + 4k, H, W, 3] in [-1, 1] -> latents [b, 1 + k, H/8, W/8, 16]
>>> frames = vae.decode(vae.unscale_latents(latents), frame_chunk=4, tiled=True)   # clamped to [-1, 1]

The convolutions are causal in time. diffusers runs them chunk by chunk with a feature cache; here the encoder and,
by default, the decoder make one pass over the whole sequence with the same numbers (the derivation is in
:mod:`eqxdiff.models._wan_vae_blocks`). ``decode(z, frame_chunk=n)`` runs the decoder over ``n`` latent frames at a
time inside one ``lax.scan``, carrying the caches (the same numbers, a fraction of the activations); ``tiled=True``
decodes overlapping spatial tiles blended as diffusers' ``enable_tiling()`` (tiles of ``tile_sample_min`` pixels every
``tile_sample_stride``; each tile frame-chunked too): both bound the memory of long 720p videos. ``encode(x,
tiled=True)`` is diffusers' ``tiled_encode`` likewise (image-to-video's condition video under ``enable_tiling()``).

Videos must have ``1 + 4k`` frames, whatever the temporal factor: diffusers' encoder reads the first frame, then
chunks of :data:`ENCODE_CHUNK` frames, and silently drops the frames after the last whole chunk (a VAE halving time
once would otherwise take ``1 + 2k``); a VAE that shortens time by more than 4 (three temporal levels) encodes one
frame only, as diffusers' can.
``latents_mean`` / ``latents_std`` normalise latents for the transformer (:meth:`AutoencoderKLWan.scale_latents`).
The config's ``scale_factor_spatial`` / ``scale_factor_temporal`` (diffusers' pipelines size latents by them, its
tiling crops by the spatial one) must be null or the layers' factors.
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import nn
from .._typing import Array, Float, PRNGKeyArray, typechecked
from ..core import ModelConfig, Plan
from ._base import PretrainedModel, check_channels_last
from ._posterior import DiagonalGaussian
from ._tiling import blend_tiles
from ._wan_vae_blocks import (
    WanAttentionBlock,
    WanMidBlock,
    WanResample,
    WanResidualBlock,
    WanResidualDownBlock,
    WanResidualUpBlock,
    WanRMSNorm,
    WanUpBlock,
    causal,
    run,
)

# diffusers' defaults: Wan 2.1's per-channel latent statistics
WAN21_LATENTS_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
                      -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_LATENTS_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
                     1.6382, 1.1253, 2.8251, 1.9160)
ENCODE_CHUNK = 4  # frames diffusers' encoder reads per call after the first (hard-coded there)


@dataclasses.dataclass(frozen=True)
class AutoencoderKLWanConfig(ModelConfig):
    """diffusers' ``AutoencoderKLWan`` config.json (``temperal_downsample`` is diffusers' spelling). ``dropout`` is
    training-only in diffusers and unused here (0 in every release)."""

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = WAN21_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN21_LATENTS_STD
    is_residual: bool = False
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8

    def __post_init__(self):
        super().__post_init__()
        for key in ("base_dim", "z_dim", "in_channels", "out_channels"):
            self.check(getattr(self, key) > 0, key, "must be a positive integer")
        self.check(self.num_res_blocks >= 0, "num_res_blocks", "must be a non-negative integer")
        self.check(len(self.dim_mult) >= 1 and all(m > 0 for m in self.dim_mult), "dim_mult",
                   "must be a non-empty list of positive multipliers")
        self.check(len(self.temperal_downsample) == len(self.dim_mult) - 1, "temperal_downsample",
                   f"must have one entry per downsampling level, len(dim_mult) - 1 = {len(self.dim_mult) - 1}")
        self.check(self.decoder_base_dim is None or self.decoder_base_dim > 0, "decoder_base_dim",
                   "must be a positive integer or null (base_dim)")
        self.check(self.patch_size is None or self.patch_size > 0, "patch_size", "must be a positive integer or null")
        p = (self.patch_size or 1) ** 2
        for key in ("in_channels", "out_channels"):
            self.check(getattr(self, key) % p == 0, key, f"must be a multiple of patch_size ** 2 = {p} (it counts the "
                       "channels of patchified pixels)")
        for key in ("latents_mean", "latents_std"):
            self.check(len(getattr(self, key)) == self.z_dim, key, f"must have z_dim={self.z_dim} entries")
        # diffusers' pipelines size latents and its tiling crops by these; the layers fix the true factors
        for key, factor, by in (("scale_factor_spatial", self.downsample_factor, "2 ** (len(dim_mult) - 1) * "
                                 "(patch_size or 1)"), ("scale_factor_temporal", self.temporal_factor,
                                                        "2 ** sum(temperal_downsample)")):
            self.check(getattr(self, key) in (None, factor), key, f"must be null or the layers' factor {by} = "
                       f"{factor}: diffusers builds this VAE, but its pipelines size latents by {key} and its tiling "
                       "crops by the spatial one, so they make videos of the wrong size; set it to the layers' "
                       "factor")

    @property
    def downsample_factor(self) -> int:
        """Pixels per latent along height and width: ``2 ** levels`` times the patch size."""
        return 2 ** (len(self.dim_mult) - 1) * (self.patch_size or 1)

    @property
    def video_channels(self) -> tuple[int, int]:
        """The channels of the videos encoded and decoded: ``in_channels`` / ``out_channels`` count patchified
        pixels (2.2: 12 = 3 x 2 x 2)."""
        p = (self.patch_size or 1) ** 2
        return self.in_channels // p, self.out_channels // p

    @property
    def temporal_factor(self) -> int:
        """Frames per latent frame after the first: ``2 ** temporal levels`` (a video of ``1 + 4k`` frames has
        ``1 + k`` latent frames at 4)."""
        return 2 ** sum(self.temperal_downsample)

    @property
    def latent_channels(self) -> int:
        """Channels of the latents (``z_dim``), under the name every VAE config gives them."""
        return self.z_dim


def patchify(x: Array, patch: int | None) -> Array:
    """``p x p`` pixel patches folded into channels, channel ``c * p * p + dx * p + dy`` (diffusers' ``patchify``:
    ``(c, pw, ph)`` order); ``patch`` ``None`` or 1: unchanged."""
    if not patch or patch == 1:
        return x
    b, f, h, w, c = x.shape
    x = x.reshape(b, f, h // patch, patch, w // patch, patch, c).transpose(0, 1, 2, 4, 6, 5, 3)
    return x.reshape(b, f, h // patch, w // patch, c * patch * patch)


def unpatchify(x: Array, patch: int | None) -> Array:
    """The inverse of :func:`patchify`."""
    if not patch or patch == 1:
        return x
    b, f, h, w, cp = x.shape
    x = x.reshape(b, f, h, w, cp // (patch * patch), patch, patch).transpose(0, 1, 2, 6, 3, 5, 4)
    return x.reshape(b, f, h * patch, w * patch, cp // (patch * patch))


def _check_frames(frames: int, factor: int, what: str) -> None:
    if (frames - 1) % factor:
        low = 1 + (frames - 1) // factor * factor
        raise ValueError(f"AutoencoderKLWan: {what} of {frames} frames; the VAE takes 1 + {factor}k frames (nearest: "
                         f"{low} or {low + factor})")


class WanEncoder3d(eqx.Module):
    """``conv_in``, the ``down_blocks`` (2.1: resnets, attention at ``attn_scales``, resamples as one list; 2.2:
    one :class:`WanResidualDownBlock` per level), ``mid_block``, ``norm_out``, SiLU, ``conv_out`` to ``2 z``."""

    conv_in: nn.CausalConv3d
    down_blocks: tuple
    mid_block: WanMidBlock
    norm_out: WanRMSNorm
    conv_out: nn.CausalConv3d
    plan: Plan | None = eqx.field(static=True, default=None)

    def __init__(self, c: AutoencoderKLWanConfig, in_channels: int, *, dtype, key: PRNGKeyArray):
        ki, kd, km, ko = jax.random.split(key, 4)
        dims = [c.base_dim * m for m in (1, *c.dim_mult)]
        keys, blocks, scale, last = iter(jax.random.split(kd, 64)), [], 1.0, len(c.dim_mult) - 1
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            temporal = c.temperal_downsample[i] if i != last else False
            if c.is_residual:
                blocks.append(WanResidualDownBlock(cin, cout, c.num_res_blocks, temporal=temporal, down=i != last,
                                                   dtype=dtype, key=next(keys)))
                continue
            for _ in range(c.num_res_blocks):
                blocks.append(WanResidualBlock(cin, cout, dtype=dtype, key=next(keys)))
                if scale in c.attn_scales:
                    blocks.append(WanAttentionBlock(cout, dtype=dtype, key=next(keys)))
                cin = cout
            if i != last:
                mode = "downsample3d" if temporal else "downsample2d"
                blocks.append(WanResample(cout, mode, dtype=dtype, key=next(keys)))
                scale /= 2.0
        self.conv_in = nn.CausalConv3d(in_channels, dims[0], 3, dtype=dtype, key=ki)
        self.down_blocks = tuple(blocks)
        self.mid_block = WanMidBlock(dims[-1], dtype=dtype, key=km)
        self.norm_out = WanRMSNorm(dims[-1], dtype=dtype)
        self.conv_out = nn.CausalConv3d(dims[-1], 2 * c.z_dim, 3, dtype=dtype, key=ko)

    def __call__(self, x: Array) -> Array:
        x, _ = causal(self.conv_in, x, None)
        x, _ = run((*self.down_blocks, self.mid_block), x, None, self.plan)
        x, _ = causal(self.conv_out, nn.silu(self.norm_out(x)), None)
        return x


class WanDecoder3d(eqx.Module):
    """``conv_in``, ``mid_block``, the ``up_blocks`` (2.1: :class:`WanUpBlock`, 2.2: :class:`WanResidualUpBlock`),
    ``norm_out``, SiLU, ``conv_out``. Called on a chunk of latent frames with the previous chunk's cache (``None``:
    the first chunk of a video); returns the frames and the cache for the next chunk."""

    conv_in: nn.CausalConv3d
    mid_block: WanMidBlock
    up_blocks: tuple[WanUpBlock, ...] | tuple[WanResidualUpBlock, ...]
    norm_out: WanRMSNorm
    conv_out: nn.CausalConv3d
    plan: Plan | None = eqx.field(static=True, default=None)

    def __init__(self, c: AutoencoderKLWanConfig, out_channels: int, *, dtype, key: PRNGKeyArray):
        ki, km, ku, ko = jax.random.split(key, 4)
        base = c.decoder_base_dim or c.base_dim
        dims = [base * m for m in (c.dim_mult[-1], *c.dim_mult[::-1])]
        temporal, last, blocks = c.temperal_downsample[::-1], len(c.dim_mult) - 1, []
        for i, (cin, cout), k in zip(range(last + 1), zip(dims[:-1], dims[1:]), jax.random.split(ku, last + 1)):
            up = i != last
            if c.is_residual:
                blocks.append(WanResidualUpBlock(cin, cout, c.num_res_blocks, temporal=up and temporal[i], up=up,
                                                 dtype=dtype, key=k))
            else:
                mode = None if not up else "upsample3d" if temporal[i] else "upsample2d"
                blocks.append(WanUpBlock(cin // 2 if i > 0 else cin, cout, c.num_res_blocks, mode, dtype=dtype,
                                         key=k))
        self.conv_in = nn.CausalConv3d(c.z_dim, dims[0], 3, dtype=dtype, key=ki)
        self.mid_block = WanMidBlock(dims[0], dtype=dtype, key=km)
        self.up_blocks = tuple(blocks)
        self.norm_out = WanRMSNorm(dims[-1], dtype=dtype)
        self.conv_out = nn.CausalConv3d(dims[-1], out_channels, 3, dtype=dtype, key=ko)

    def __call__(self, z: Array, cache=None) -> tuple[Array, tuple]:
        c_in, c_blocks, c_out = (None, None, None) if cache is None else cache
        x, c_in = causal(self.conv_in, z, c_in)
        x, c_blocks = run((self.mid_block, *self.up_blocks), x, c_blocks, self.plan)
        x, c_out = causal(self.conv_out, nn.silu(self.norm_out(x)), c_out)
        return x, (c_in, c_blocks, c_out)


class WanLatentDistribution(DiagonalGaussian):
    """The posterior ``N(mean, exp(logvar))`` over video latents ``[batch, frames, h, w, z]`` (diffusers'
    ``DiagonalGaussianDistribution``; ``logvar`` clipped to ``[-30, 20]``). Pipelines take its ``mode()``."""


class AutoencoderKLWan(PretrainedModel):
    """diffusers' ``AutoencoderKLWan`` on channels-last video (see the module docstring)."""

    config_class: ClassVar[type] = AutoencoderKLWanConfig

    encoder: WanEncoder3d
    quant_conv: nn.CausalConv3d
    post_quant_conv: nn.CausalConv3d
    decoder: WanDecoder3d
    config: AutoencoderKLWanConfig = eqx.field(static=True)

    def __init__(self, config: AutoencoderKLWanConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        ke, kq, kp, kd = jax.random.split(key, 4)
        c = config
        self.encoder = WanEncoder3d(c, c.in_channels, dtype=dtype, key=ke)
        self.quant_conv = nn.CausalConv3d(2 * c.z_dim, 2 * c.z_dim, 1, dtype=dtype, key=kq)
        self.post_quant_conv = nn.CausalConv3d(c.z_dim, c.z_dim, 1, dtype=dtype, key=kp)
        self.decoder = WanDecoder3d(c, c.out_channels, dtype=dtype, key=kd)
        self.config = config

    # -- encode ------------------------------------------------------------------------------------------------
    def _check_video(self, x, tiled: bool = False) -> None:
        c = self.config
        check_channels_last("AutoencoderKLWan", "encode", "videos", x, c.video_channels[0], "frames, height, width")
        _check_frames(x.shape[1], ENCODE_CHUNK, "a video")
        if x.shape[1] > 1 and ENCODE_CHUNK % c.temporal_factor:
            raise ValueError(f"AutoencoderKLWan.encode: a video of {x.shape[1]} frames with temporal_factor="
                             f"{c.temporal_factor}; diffusers' encoder reads {ENCODE_CHUNK} frames at a time, which a "
                             "VAE shortening time by more than that cannot encode: give one frame")
        # diffusers' 2.1 encoder takes any size (its zero-padded stride-2 convolutions round down), as ours does;
        # its residual (2.2) levels reshape by 2 and its patchify by the patch, and its tiles assume whole latents
        multiple = c.downsample_factor if c.is_residual or tiled else c.patch_size or 1
        if x.shape[2] % multiple or x.shape[3] % multiple or min(x.shape[2:4]) < c.downsample_factor:
            raise ValueError(f"AutoencoderKLWan.encode: frames of width {x.shape[3]}, height {x.shape[2]}; both must "
                             f"be multiples of {multiple}{' (tiled)' if tiled else ''} and at least "
                             f"{c.downsample_factor}")

    @typechecked
    def encode(self, x: Float[Array, "batch frames height width channels"], *, tiled: bool = False,
               tile_sample_min: int | tuple[int, int] = 256,
               tile_sample_stride: int | tuple[int, int] = 192) -> WanLatentDistribution:
        """The posterior over latents of videos ``x`` in [-1, 1] (``1 + 4k`` frames; height and width at least
        :attr:`~AutoencoderKLWanConfig.downsample_factor`, and multiples of it for the residual 2.2 VAE or ``tiled``,
        else of ``patch_size``: the latents round down as diffusers'), in one causal pass over the frames.

        ``tiled``: encode overlapping spatial tiles and blend their moments, as diffusers' ``tiled_encode`` (under
        ``enable_tiling()``) does. Like it, the tiles are measured in the encoder's input pixels, which the 2.2 VAE
        patchifies first: there ``tile_sample_min`` / ``tile_sample_stride`` count 2x2 patches (a 256 tile spans 512
        pixels, twice the decode's). Videos that fit in one tile are encoded whole, as there."""
        c = self.config
        self._check_video(x, tiled)
        x = patchify(x, c.patch_size)
        fn = lambda xx: self.quant_conv(self.encoder(xx))  # noqa: E731
        e = c.downsample_factor // (c.patch_size or 1)  # the encoder's input pixels per latent
        size, stride = self._tiles(tile_sample_min, tile_sample_stride, method="encode", f=e)
        if tiled and (x.shape[2] > size[0] or x.shape[3] > size[1]):
            moments = blend_tiles(fn, x, axes=(2, 3), tile=size, stride=stride,
                                  blend_extent=tuple(m // e - s // e for m, s in zip(size, stride)),
                                  keep=tuple(s // e for s in stride))
            moments = moments[:, :, :x.shape[2] // e, :x.shape[3] // e]
        else:
            moments = fn(x)
        return WanLatentDistribution.from_moments(moments)

    # -- decode ------------------------------------------------------------------------------------------------
    def _decode_frames(self, z, frame_chunk: int | None):
        """The decoder (before unpatchify and clamp) over all latent frames, ``frame_chunk`` at a time: the first
        chunk (``1 + (T - 1) % frame_chunk`` frames) starts the caches, a ``lax.scan`` carries them through the rest."""
        z = self.post_quant_conv(z)
        t = z.shape[1]
        if frame_chunk is None or frame_chunk >= t:
            return self.decoder(z)[0]
        first = 1 + (t - 1) % frame_chunk
        head, cache = self.decoder(z[:, :first])
        rest = z[:, first:]
        if rest.shape[1] == 0:
            return head
        b, n = rest.shape[0], rest.shape[1] // frame_chunk
        chunks = jnp.moveaxis(rest.reshape(b, n, frame_chunk, *rest.shape[2:]), 1, 0)
        cache, out = jax.lax.scan(lambda cache, chunk: self.decoder(chunk, cache)[::-1], cache, chunks)
        out = jnp.moveaxis(out, 0, 1).reshape(b, -1, *out.shape[3:])
        return jnp.concatenate([head, out], axis=1)

    def _tiles(self, tile_sample_min, tile_sample_stride, *, method: str = "decode",
               f: int | None = None) -> tuple[tuple[int, int], tuple[int, int]]:
        """(height, width) tile sizes and strides, checked to span at least ``f`` input pixels per latent (the
        decode's pixels: ``downsample_factor``; the encode's patchified ones: ``downsample_factor / patch_size``)."""
        pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
        size, stride, f = pair(tile_sample_min), pair(tile_sample_stride), f or self.config.downsample_factor
        if len(size) != 2 or len(stride) != 2 or min(size) < f or not all(f <= s <= m for s, m in zip(stride, size)):
            raise ValueError(f"AutoencoderKLWan.{method}: tile_sample_min={size} and tile_sample_stride={stride} must "
                             f"be (height, width) sizes of at least {f} (input pixels per latent), strides no larger "
                             "than the tiles")
        return size, stride

    @typechecked
    def decode(self, z: Float[Array, "batch frames h w latent"], *, frame_chunk: int | None = None,
               tiled: bool = False, tile_sample_min: int | tuple[int, int] = 256,
               tile_sample_stride: int | tuple[int, int] = 192) -> Float[Array, "batch frames2 height width out"]:
        """Videos (in [-1, 1], clamped) of ``1 + 4(T - 1)`` frames from (unscaled) latents ``z``.

        ``frame_chunk``: decode that many latent frames at a time (one ``lax.scan``, the same numbers; memory of one
        chunk's activations). ``tiled``: decode overlapping spatial tiles of ``tile_sample_min`` pixels every
        ``tile_sample_stride`` pixels (diffusers' ``enable_tiling()`` defaults: 256 and 192) and blend them as
        diffusers' ``tiled_decode``; a latent that fits in one tile is decoded whole, as there."""
        c = self.config
        check_channels_last("AutoencoderKLWan", "decode", "latents", z, c.z_dim, "frames, height, width")
        if frame_chunk is not None and (not isinstance(frame_chunk, int) or frame_chunk < 1):
            raise ValueError(f"AutoencoderKLWan.decode: frame_chunk={frame_chunk!r} must be a positive int or None")
        fn = lambda zz: self._decode_frames(zz, frame_chunk)  # noqa: E731
        size, stride = self._tiles(tile_sample_min, tile_sample_stride)
        f = c.downsample_factor
        if tiled and (z.shape[2] > size[0] // f or z.shape[3] > size[1] // f):
            p = c.patch_size or 1  # decoded tiles are blended in patchified pixels, as diffusers' tiled_decode
            x = blend_tiles(fn, z, axes=(2, 3), tile=tuple(s // f for s in size), stride=tuple(s // f for s in stride),
                            blend_extent=tuple(m // p - s // p for m, s in zip(size, stride)),
                            keep=tuple(s // p for s in stride))
            x = x[:, :, :z.shape[2] * f // p, :z.shape[3] * f // p]
        else:
            x = fn(z)
        return jnp.clip(unpatchify(x, c.patch_size), -1.0, 1.0)

    @typechecked
    def __call__(self, x: Float[Array, "batch frames height width channels"], *, key: PRNGKeyArray | None = None,
                 sample_posterior: bool = False) -> Float[Array, "batch frames height width out"]:
        """Reconstruct ``x``: decode the posterior's mode (or a sample drawn with ``key``), diffusers' ``forward``."""
        if sample_posterior and key is None:
            raise ValueError("AutoencoderKLWan: sample_posterior=True needs a PRNG key: pass key=jax.random.key(0)")
        posterior = self.encode(x)
        return self.decode(posterior.sample(key=key) if sample_posterior else posterior.mode())

    # -- latent normalisation ----------------------------------------------------------------------------------
    @typechecked
    def scale_latents(self, z: Float[Array, "*batch latent"]) -> Float[Array, "*batch latent"]:
        """VAE latents -> the transformer's: ``(z - latents_mean) / latents_std`` per channel (the pipelines')."""
        c = self.config
        return (z - jnp.asarray(c.latents_mean, z.dtype)) / jnp.asarray(c.latents_std, z.dtype)

    @typechecked
    def unscale_latents(self, z: Float[Array, "*batch latent"]) -> Float[Array, "*batch latent"]:
        """The inverse of :meth:`scale_latents`: ``z * latents_std + latents_mean``, ready for :meth:`decode`."""
        c = self.config
        return z * jnp.asarray(c.latents_std, z.dtype) + jnp.asarray(c.latents_mean, z.dtype)


__all__ = ["AutoencoderKLWan", "AutoencoderKLWanConfig", "WanLatentDistribution"]
