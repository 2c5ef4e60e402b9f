"""The blocks of :class:`~eqxdiff.models.ltx_vae.AutoencoderKLLTXVideo`, with diffusers' names, on channels-last
video ``[batch, frames, height, width, channels]``: the 3-D ResNet block (RMS norms, replicate-padded causal or
centred convolutions, optional timestep modulation and noise injection), the space-to-depth downsampler and
depth-to-space upsampler of 0.9.1+ / 0.9.5+, and the down, mid and up blocks.

**Noise injection** (0.9.1's ``decoder_inject_noise``): a ResNet block built with ``noise_index = n`` adds
``per_channel_scale1 * noise`` after ``conv1`` and ``per_channel_scale2 * noise'`` after ``conv2``, each noise one
``[height, width]`` draw shared by the batch, frames and channels (diffusers' ``torch.randn(spatial_shape)``), drawn as
``jax.random.normal(jax.random.fold_in(key, 2n))`` and ``fold_in(key, 2n + 1)``. The decoder numbers its blocks in the
order diffusers runs them, so the ``k``-th draw of a decode is ``fold_in(key, k)``.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import nn
from .._typing import Array, Float, PRNGKeyArray

RMS_EPS = 1e-8  # the blocks' RMS norms (no affine)


def causal_conv(cin: int, cout: int, kernel: int = 3, *, stride=1, causal: bool, dtype, key) -> nn.CausalConv3d:
    """``LTXVideoCausalConv3d``: time padded by repeating the first frame (causal) or both edge frames (centred),
    height and width zero-padded; its parameters under ``conv.``."""
    return nn.CausalConv3d(cin, cout, kernel, stride=stride, causal=causal, pad_mode="replicate", torch_prefix="conv",
                           dtype=dtype, key=key)


def space_to_depth(x: Array, stride: tuple[int, int, int]) -> Array:
    """``[b, F, H, W, C]`` -> ``[b, F / s0, H / s1, W / s2, C * s0 * s1 * s2]``, channels ``(c, s0, s1, s2)``."""
    b, f, h, w, c = x.shape
    s0, s1, s2 = stride
    x = x.reshape(b, f // s0, s0, h // s1, s1, w // s2, s2, c).transpose(0, 1, 3, 5, 7, 2, 4, 6)
    return x.reshape(b, f // s0, h // s1, w // s2, c * s0 * s1 * s2)


def depth_to_space(x: Array, stride: tuple[int, int, int]) -> Array:
    """The inverse of :func:`space_to_depth`."""
    b, f, h, w, c = x.shape
    s0, s1, s2 = stride
    x = x.reshape(b, f, h, w, c // (s0 * s1 * s2), s0, s1, s2).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, f * s0, h * s1, w * s2, -1)


class TimestepEmbedder(eqx.Module):
    """``time_embedder`` (diffusers' ``PixArtAlphaCombinedTimestepSizeEmbeddings`` without size conditions): the
    timestep's 256-channel sinusoid (cos first) through ``timestep_embedder``."""

    timestep_embedder: nn.TimestepEmbedding

    def __init__(self, dim: int, *, dtype, key: PRNGKeyArray):
        self.timestep_embedder = nn.TimestepEmbedding(256, dim, dtype=dtype, key=key)

    def __call__(self, timestep: Array, dtype) -> Array:
        sinusoid = nn.timestep_embedding(timestep, 256, flip_sin_to_cos=True, freq_shift=0)
        return self.timestep_embedder(sinusoid.astype(dtype))


def _noise(key: PRNGKeyArray, n: int, x: Array) -> Array:
    noise = jax.random.normal(jax.random.fold_in(key, n), x.shape[2:4], jnp.float32).astype(x.dtype)
    return noise[None, None, :, :, None]


class LTXVideoResnetBlock3d(eqx.Module):
    """``x + conv2(silu(mod2(norm2(conv1(silu(mod1(norm1(x)))) + noise1))) + noise2``, the shortcut through
    ``norm3`` (LayerNorm) and a 1x1x1 ``conv_shortcut`` when the width changes. ``mod1`` / ``mod2``: with
    ``timestep_conditioning``, ``x * (1 + scale) + shift`` from ``scale_shift_table (4, C) + temb`` (shift1, scale1,
    shift2, scale2); ``noise``: see the module docstring."""

    PARAM_AXES: ClassVar = {"per_channel_scale1": ("norm", None, None), "per_channel_scale2": ("norm", None, None)}

    norm1: nn.RMSNorm
    conv1: nn.CausalConv3d
    norm2: nn.RMSNorm
    conv2: nn.CausalConv3d
    norm3: nn.LayerNorm | None
    conv_shortcut: nn.CausalConv3d | None
    per_channel_scale1: Float[Array, "c 1 1"] | None
    per_channel_scale2: Float[Array, "c 1 1"] | None
    scale_shift_table: nn.ScaleShiftTable | None
    noise_index: int | None = eqx.field(static=True)

    def __init__(self, cin: int, cout: int, *, causal: bool, eps: float = 1e-6, timestep_conditioning: bool = False,
                 noise_index: int | None = None, dtype, key: PRNGKeyArray):
        k1, k2, ks, kt = jax.random.split(key, 4)
        self.norm1 = nn.RMSNorm(cin, eps=RMS_EPS, elementwise_affine=False, dtype=dtype)
        self.conv1 = causal_conv(cin, cout, causal=causal, dtype=dtype, key=k1)
        self.norm2 = nn.RMSNorm(cout, eps=RMS_EPS, elementwise_affine=False, dtype=dtype)
        self.conv2 = causal_conv(cout, cout, causal=causal, dtype=dtype, key=k2)
        change = cin != cout
        self.norm3 = nn.LayerNorm(cin, eps=eps, dtype=dtype) if change else None
        self.conv_shortcut = causal_conv(cin, cout, 1, causal=causal, dtype=dtype, key=ks) if change else None
        inject = noise_index is not None
        self.per_channel_scale1 = jnp.zeros((cin, 1, 1), dtype) if inject else None
        self.per_channel_scale2 = jnp.zeros((cin, 1, 1), dtype) if inject else None
        self.scale_shift_table = nn.ScaleShiftTable(4, cin, dtype=dtype, key=kt) if timestep_conditioning else None
        self.noise_index = noise_index

    def _inject(self, x, scale, n, key):
        if scale is None:
            return x
        return x + _noise(key, n, x) * scale.reshape(-1).astype(x.dtype)

    def __call__(self, x: Array, temb: Array | None = None, key: PRNGKeyArray | None = None) -> Array:
        h = self.norm1(x)
        mods = None if self.scale_shift_table is None else self.scale_shift_table(temb)
        if mods is not None:
            h = nn.modulate(h, mods[0], mods[1])
        h = self.conv1(nn.silu(h))
        n = 2 * (self.noise_index or 0)
        h = self.norm2(self._inject(h, self.per_channel_scale1, n, key))
        if mods is not None:
            h = nn.modulate(h, mods[2], mods[3])
        h = self._inject(self.conv2(nn.silu(h)), self.per_channel_scale2, n + 1, key)
        if self.norm3 is not None:
            x = self.norm3(x)
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return h + x


class LTXVideoDownsampler3d(eqx.Module):
    """0.9.5's space-to-depth downsampler: the first ``s0 - 1`` frames repeated in front, then
    ``space_to_depth(conv(x)) + mean over groups of space_to_depth(x)``, from ``cin`` to ``cout`` channels."""

    conv: nn.CausalConv3d
    stride: tuple[int, int, int] = eqx.field(static=True)
    group_size: int = eqx.field(static=True)

    def __init__(self, cin: int, cout: int, stride: tuple[int, int, int], *, causal: bool, dtype, key: PRNGKeyArray):
        volume = stride[0] * stride[1] * stride[2]
        self.conv = causal_conv(cin, cout // volume, causal=causal, dtype=dtype, key=key)
        self.stride = stride
        self.group_size = cin * volume // cout

    def __call__(self, x: Array) -> Array:
        x = jnp.concatenate([x[:, :self.stride[0] - 1], x], axis=1)
        residual = space_to_depth(x, self.stride)
        residual = residual.reshape(*residual.shape[:-1], -1, self.group_size).mean(axis=-1)
        return space_to_depth(self.conv(x), self.stride) + residual


class LTXVideoUpsampler3d(eqx.Module):
    """The depth-to-space upsampler: ``conv`` to ``C * 8 / upscale_factor`` channels, depth-to-space by (2, 2, 2),
    the first frame dropped; ``residual`` (0.9.1+): plus the input's depth-to-space, its channels tiled."""

    conv: nn.CausalConv3d
    stride: tuple[int, int, int] = eqx.field(static=True)
    residual: bool = eqx.field(static=True)
    upscale_factor: int = eqx.field(static=True)

    def __init__(self, channels: int, *, causal: bool, residual: bool, upscale_factor: int, dtype,
                 key: PRNGKeyArray):
        self.stride = (2, 2, 2)
        self.conv = causal_conv(channels, channels * 8 // upscale_factor, causal=causal, dtype=dtype, key=key)
        self.residual = residual
        self.upscale_factor = upscale_factor

    def __call__(self, x: Array) -> Array:
        drop = self.stride[0] - 1
        h = depth_to_space(self.conv(x), self.stride)[:, drop:]
        if not self.residual:
            return h
        repeats = 8 // self.upscale_factor
        return h + jnp.tile(depth_to_space(x, self.stride), (1, 1, 1, 1, repeats))[:, drop:]


def _run_resnets(resnets, x, temb, key):
    for resnet in resnets:
        x = resnet(x, temb, key)
    return x


class LTXVideoDownBlock3D(eqx.Module):
    """An encoder block (``LTXVideoDownBlock3D`` and ``LTXVideo095DownBlock3D``): ``resnets``, then the
    ``downsamplers`` (a stride-2 convolution, or 0.9.5's space-to-depth downsampler), then ``conv_out`` (a ResNet
    block changing the width; the 0.9.0 block's)."""

    resnets: tuple[LTXVideoResnetBlock3d, ...]
    downsamplers: tuple[nn.CausalConv3d | LTXVideoDownsampler3d, ...] | None
    conv_out: LTXVideoResnetBlock3d | None

    def __init__(self, resnets, downsampler, conv_out):
        self.resnets = tuple(resnets)
        self.downsamplers = None if downsampler is None else (downsampler,)
        self.conv_out = conv_out

    def __call__(self, x: Array) -> Array:
        x = _run_resnets(self.resnets, x, None, None)
        for down in self.downsamplers or ():
            x = down(x)
        return x if self.conv_out is None else self.conv_out(x)


class LTXVideoMidBlock3d(eqx.Module):
    """``resnets``, conditioned (``timestep_conditioning``) on ``time_embedder`` of the decoder's timestep."""

    time_embedder: TimestepEmbedder | None
    resnets: tuple[LTXVideoResnetBlock3d, ...]

    def __init__(self, time_embedder, resnets):
        self.time_embedder = time_embedder
        self.resnets = tuple(resnets)

    def __call__(self, x: Array, timestep: Array | None = None, key: PRNGKeyArray | None = None) -> Array:
        temb = None if self.time_embedder is None else self.time_embedder(timestep, x.dtype)
        return _run_resnets(self.resnets, x, temb, key)


class LTXVideoUpBlock3d(eqx.Module):
    """A decoder block: ``conv_in`` (a ResNet block changing the width, 0.9.0), the ``upsamplers``, ``resnets``;
    the ResNet blocks after the upsampler conditioned on ``time_embedder`` of the timestep (0.9.1+)."""

    time_embedder: TimestepEmbedder | None
    conv_in: LTXVideoResnetBlock3d | None
    upsamplers: tuple[LTXVideoUpsampler3d, ...] | None
    resnets: tuple[LTXVideoResnetBlock3d, ...]

    def __init__(self, time_embedder, conv_in, upsampler, resnets):
        self.time_embedder = time_embedder
        self.conv_in = conv_in
        self.upsamplers = None if upsampler is None else (upsampler,)
        self.resnets = tuple(resnets)

    def __call__(self, x: Array, timestep: Array | None = None, key: PRNGKeyArray | None = None) -> Array:
        if self.conv_in is not None:
            x = self.conv_in(x, None, key)
        temb = None if self.time_embedder is None else self.time_embedder(timestep, x.dtype)
        for up in self.upsamplers or ():
            x = up(x)
        return _run_resnets(self.resnets, x, temb, key)


__all__ = ["LTXVideoDownBlock3D", "LTXVideoDownsampler3d", "LTXVideoMidBlock3d", "LTXVideoResnetBlock3d",
           "LTXVideoUpBlock3d", "LTXVideoUpsampler3d", "TimestepEmbedder", "causal_conv", "depth_to_space",
           "space_to_depth"]
