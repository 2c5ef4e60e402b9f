"""LTX-Video's latent upsampler (0.9.7+): diffusers' ``LTXLatentUpsamplerModel``, which doubles the height and
width (or the frames) of video latents for the two-stage recipe (generate small, upsample the latents, refine), on
channels-last latents ``[batch, frames, height, width, channels]``.

>>> upsampler = eqxdiff.load("Lightricks/ltxv-spatial-upscaler-0.9.7", subfolder="latent_upsampler")
>>> bigger = upsampler(vae.unscale_latents(latents))      # [b, f, h, w, 128] -> [b, f, 2h, 2w, 128]

``initial_conv`` / GroupNorm (32 groups) / SiLU, ``res_blocks``, the ``upsampler`` (a convolution to 4x (2x, 8x)
channels and a pixel shuffle; the temporal ones drop the first frame: ``F -> 2F - 1``), ``post_upsample_res_blocks``
and ``final_conv``. With ``dims=3`` the convolutions are 3-D (zero-padded in time, not causal) and a spatial
upsampler runs frame by frame; with ``dims=2`` everything runs frame by frame. The ResNet blocks of each stage stack
under ``scan_layers`` (``SCAN_FIELDS``). The original checkpoints hold diffusers' names.
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import nn
from .._typing import Array, Float, PRNGKeyArray, typechecked
from ..core import ModelConfig
from ._base import PretrainedModel
from ._ltx_vae_blocks import depth_to_space

GROUPS = 32  # diffusers' GroupNorm(32, channels)


@dataclasses.dataclass(frozen=True)
class LTXLatentUpsamplerConfig(ModelConfig):
    """diffusers' ``LTXLatentUpsamplerModel`` config.json (defaults: the 0.9.7 / 0.9.8 spatial upscalers)."""

    SUPPORTED_VALUES: ClassVar = {"dims": (2, 3)}

    in_channels: int = 128
    mid_channels: int = 512
    num_blocks_per_stage: int = 4
    dims: int = 3
    spatial_upsample: bool = True
    temporal_upsample: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.check(self.in_channels > 0, "in_channels", "must be a positive integer")
        self.check(self.mid_channels > 0 and self.mid_channels % GROUPS == 0, "mid_channels",
                   f"must be a positive multiple of {GROUPS} (GroupNorm's groups)")
        self.check(self.num_blocks_per_stage >= 0, "num_blocks_per_stage", "must be a non-negative integer")
        self.check(self.spatial_upsample or self.temporal_upsample, "spatial_upsample",
                   "or temporal_upsample must be true: the model upsamples something")
        self.check(self.dims == 3 or not self.temporal_upsample, "temporal_upsample",
                   "needs dims=3 (a 2-D model runs frame by frame)")

    @property
    def stride(self) -> tuple[int, int, int]:
        """The upsampling factors (frames, height, width)."""
        t, s = 2 if self.temporal_upsample else 1, 2 if self.spatial_upsample else 1
        return t, s, s


def _conv(dims: int, cin: int, cout: int, *, dtype, key) -> nn.Conv2d | nn.Conv3d:
    cls = nn.Conv2d if dims == 2 else nn.Conv3d
    return cls(cin, cout, 3, padding=1, dtype=dtype, key=key)


class LTXUpsamplerResBlock(eqx.Module):
    """``silu(norm2(conv2(silu(norm1(conv1(x))))) + x)`` (diffusers' ``ResBlock``)."""

    conv1: nn.Conv2d | nn.Conv3d
    norm1: nn.GroupNorm
    conv2: nn.Conv2d | nn.Conv3d
    norm2: nn.GroupNorm

    def __init__(self, channels: int, dims: int, *, dtype, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.conv1 = _conv(dims, channels, channels, dtype=dtype, key=k1)
        self.norm1 = nn.GroupNorm(GROUPS, channels, dtype=dtype)
        self.conv2 = _conv(dims, channels, channels, dtype=dtype, key=k2)
        self.norm2 = nn.GroupNorm(GROUPS, channels, dtype=dtype)

    def __call__(self, x: Array) -> Array:
        h = self.norm2(self.conv2(nn.silu(self.norm1(self.conv1(x)))))
        return nn.silu(h + x)


class PixelShuffleUpsampler(eqx.Module):
    """``upsampler``: a convolution (``upsampler.0``) to ``channels x`` the upsampling volume, then a pixel shuffle
    (channels ``(c, pf, ph, pw)``); a temporal one drops the first frame. A spatial-only one is a 2-D convolution
    run frame by frame."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"conv": "0"}

    conv: nn.Conv2d | nn.Conv3d
    stride: tuple[int, int, int] = eqx.field(static=True)

    def __init__(self, channels: int, stride: tuple[int, int, int], *, dtype, key: PRNGKeyArray):
        dims = 2 if stride[0] == 1 else 3
        self.conv = _conv(dims, channels, channels * stride[0] * stride[1] * stride[2], dtype=dtype, key=key)
        self.stride = stride

    def __call__(self, x: Array) -> Array:
        if self.stride[0] == 1:
            return depth_to_space(nn.per_frame(self.conv, x), self.stride)
        return depth_to_space(self.conv(x), self.stride)[:, 1:]


class LTXLatentUpsamplerModel(PretrainedModel):
    """diffusers' ``LTXLatentUpsamplerModel`` on channels-last latents (see the module docstring)."""

    config_class: ClassVar[type] = LTXLatentUpsamplerConfig
    SCAN_FIELDS: ClassVar[tuple[str, ...]] = ("res_blocks", "post_upsample_res_blocks")

    initial_conv: nn.Conv2d | nn.Conv3d
    initial_norm: nn.GroupNorm
    res_blocks: tuple[LTXUpsamplerResBlock, ...] | nn.Stacked[LTXUpsamplerResBlock]
    upsampler: PixelShuffleUpsampler
    post_upsample_res_blocks: tuple[LTXUpsamplerResBlock, ...] | nn.Stacked[LTXUpsamplerResBlock]
    final_conv: nn.Conv2d | nn.Conv3d
    config: LTXLatentUpsamplerConfig = eqx.field(static=True)

    def __init__(self, config: LTXLatentUpsamplerConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        c = config
        ki, kr, ku, kp, kf = jax.random.split(key, 5)
        n, mid = c.num_blocks_per_stage, c.mid_channels
        self.initial_conv = _conv(c.dims, c.in_channels, mid, dtype=dtype, key=ki)
        self.initial_norm = nn.GroupNorm(GROUPS, mid, dtype=dtype)
        self.res_blocks = tuple(LTXUpsamplerResBlock(mid, c.dims, dtype=dtype, key=k) for k in jax.random.split(kr, n))
        self.upsampler = PixelShuffleUpsampler(mid, c.stride, dtype=dtype, key=ku)
        self.post_upsample_res_blocks = tuple(LTXUpsamplerResBlock(mid, c.dims, dtype=dtype, key=k)
                                              for k in jax.random.split(kp, n))
        self.final_conv = _conv(c.dims, mid, c.in_channels, dtype=dtype, key=kf)
        self.config = config

    def _stage(self, x: Array, blocks) -> Array:
        x, _ = nn.run_layers(blocks, lambda block, h: block(h), x)
        return x

    @typechecked
    def __call__(self, latents: Float[Array, "batch frames height width channels"]
                 ) -> Float[Array, "batch frames2 height2 width2 channels"]:
        """Upsampled latents: ``[b, f, 2h, 2w, c]`` (spatial), ``[b, 2f - 1, h, w, c]`` (temporal) or both. The
        latents are the VAE's (unscaled: diffusers' pipeline denormalises them first)."""
        c = self.config
        if latents.shape[-1] != c.in_channels:
            raise ValueError(f"LTXLatentUpsamplerModel expects latents [batch, frames, height, width, "
                             f"{c.in_channels}] (channels last), got shape {latents.shape}")

        def before(x):
            x = nn.silu(self.initial_norm(self.initial_conv(x)))
            return self._stage(x, self.res_blocks)

        def after(x):
            return self.final_conv(self._stage(x, self.post_upsample_res_blocks))

        if c.dims == 2:
            return nn.per_frame(after, self.upsampler(nn.per_frame(before, latents)))
        return after(self.upsampler(before(latents)))


__all__ = ["LTXLatentUpsamplerConfig", "LTXLatentUpsamplerModel"]
