"""The blocks of :class:`~eqxdiff.models.wan_vae.AutoencoderKLWan`, with diffusers' names, on channels-last video
``[batch, frames, height, width, channels]``.

**Causal time, one pass.** diffusers runs the Wan VAE chunk by chunk (the encoder on frame 0, then 4 frames at a
time; the decoder one latent frame at a time), each causal 3-D convolution keeping the last two frames of its input
(``feat_cache``). Every other operation is per frame, so the same numbers come from whole sequences: each block here
maps ``(x, cache) -> (y, cache)``, where ``cache`` holds what the next chunk needs (``None``: ``x`` starts the
video). A whole video is one call with ``cache=None``; a decoder run in chunks (``lax.scan`` over them) carries the
caches and gives the same result. What ``cache=None`` means, op by op (diffusers' first chunk):

- a causal 3x3x3 convolution pads two zero frames in front (its cache: the last two input frames);
- a temporal downsample keeps frame 0 and runs a valid stride-2 convolution over the frames from 0 (its cache: the
  last frame); its 2.2 shortcut (:func:`avg_down`) pads one zero frame in front;
- a temporal upsample passes frame 0 through undoubled and runs its causal convolution over frames 1.. only, each
  giving two frames (its cache: the last two of those inputs, zeros while there are none); its 2.2 shortcut
  (:func:`dup_up`) drops the first ``factor_t - 1`` frames.
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import nn
from .._typing import Array, PRNGKeyArray
from ..core import VIDEO_AXES, Plan, checkpoint_block, constrain

VIDEO = VIDEO_AXES  # frames stay whole under the default rules: the convolutions are causal in time


def causal(conv: nn.CausalConv3d, x: Array, cache: Array | None) -> tuple[Array, Array | tuple]:
    """``conv`` over ``x`` after the cached frames (``None``: zeros), and the new cache: the last input frames."""
    front = conv.time_padding[0]
    if front == 0:
        return conv(x), ()
    if cache is None:
        cache = jnp.zeros((x.shape[0], front, *x.shape[2:]), x.dtype)
    full = jnp.concatenate([cache.astype(x.dtype), x], axis=1)
    return conv(x, cache=cache), full[:, -front:]


def avg_down(x: Array, out_channels: int, factor_t: int, factor_s: int) -> Array:
    """diffusers' ``AvgDown3D``: zero frames in front up to a multiple of ``factor_t``, space and time folded into
    channels (``(c, t, h, w)`` order), groups of them averaged down to ``out_channels``."""
    pad = (factor_t - x.shape[1] % factor_t) % factor_t
    x = jnp.pad(x, ((0, 0), (pad, 0), (0, 0), (0, 0), (0, 0)))
    b, t, h, w, c = x.shape
    x = x.reshape(b, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s, c)
    x = x.transpose(0, 1, 3, 5, 7, 2, 4, 6).reshape(b, t // factor_t, h // factor_s, w // factor_s, out_channels, -1)
    return jnp.mean(x.astype(jnp.float32), axis=-1).astype(x.dtype)


def dup_up(x: Array, out_channels: int, factor_t: int, factor_s: int, first: bool) -> Array:
    """diffusers' ``DupUp3D``: channels repeated, unfolded into ``factor_t`` frames and ``factor_s x factor_s``
    pixels; a video's first chunk loses its first ``factor_t - 1`` frames."""
    b, t, h, w, c = x.shape
    factor = factor_t * factor_s * factor_s
    x = jnp.repeat(x, out_channels * factor // c, axis=-1)
    x = x.reshape(b, t, h, w, out_channels, factor_t, factor_s, factor_s).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    x = x.reshape(b, t * factor_t, h * factor_s, w * factor_s, out_channels)
    return x[:, factor_t - 1:] if first else x


class WanRMSNorm(eqx.Module):
    """diffusers' ``WanRMS_norm``: ``x / max(||x||, 1e-12) * sqrt(C) * gamma`` over channels (an L2 normalisation,
    not a mean square plus eps). ``gamma`` keeps the checkpoint's shape: ``[C, 1, 1, 1]`` (video) or ``[C, 1, 1]``
    (``images``: the attention block's)."""

    gamma: Array

    def __init__(self, dim: int, *, images: bool = False, dtype=jnp.float32):
        self.gamma = jnp.ones((dim, 1, 1) if images else (dim, 1, 1, 1), dtype)

    def param_axes(self):
        return {"gamma": ("norm",) + (None,) * (self.gamma.ndim - 1)}

    def __call__(self, x: Array) -> Array:
        xf = x.astype(jnp.float32)
        norm = jnp.sqrt(jnp.sum(jnp.square(xf), axis=-1, keepdims=True))
        y = (xf / jnp.maximum(norm, 1e-12)).astype(x.dtype)
        c = self.gamma.shape[0]
        return y * jnp.asarray(c**0.5, x.dtype) * self.gamma.reshape(c).astype(x.dtype)


def _conv(cin: int, cout: int, kernel, *, dtype, key, **kwargs) -> nn.CausalConv3d:
    return nn.CausalConv3d(cin, cout, kernel, dtype=dtype, key=key, **kwargs)


class WanResidualBlock(eqx.Module):
    """norm1, SiLU, conv1 (causal 3x3x3), norm2, SiLU, conv2, plus ``conv_shortcut`` (1x1x1, when the width
    changes). Cache: the two convolutions'."""

    norm1: WanRMSNorm
    conv1: nn.CausalConv3d
    norm2: WanRMSNorm
    conv2: nn.CausalConv3d
    conv_shortcut: nn.CausalConv3d | None

    def __init__(self, cin: int, cout: int, *, dtype, key: PRNGKeyArray):
        k1, k2, ks = jax.random.split(key, 3)
        self.norm1 = WanRMSNorm(cin, dtype=dtype)
        self.conv1 = _conv(cin, cout, 3, dtype=dtype, key=k1)
        self.norm2 = WanRMSNorm(cout, dtype=dtype)
        self.conv2 = _conv(cout, cout, 3, dtype=dtype, key=k2)
        self.conv_shortcut = _conv(cin, cout, 1, dtype=dtype, key=ks) if cin != cout else None

    def __call__(self, x, cache=None):
        c1, c2 = (None, None) if cache is None else cache
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x, c1 = causal(self.conv1, nn.silu(self.norm1(x)), c1)
        x, c2 = causal(self.conv2, nn.silu(self.norm2(x)), c2)
        return x + h, (c1, c2)


class WanAttentionBlock(eqx.Module):
    """Single-head self-attention over each frame's pixels: ``norm``, ``to_qkv`` (1x1), attention, ``proj`` (1x1),
    residual. No cache (nothing crosses frames)."""

    norm: WanRMSNorm
    to_qkv: nn.Conv2d
    proj: nn.Conv2d
    attention: nn.ProjectedAttention  # the kernel and its settings: no parameters
    plan: Plan | None = eqx.field(static=True, default=None)

    def __init__(self, dim: int, *, dtype, key: PRNGKeyArray):
        kq, kp, ka = jax.random.split(key, 3)
        self.norm = WanRMSNorm(dim, images=True, dtype=dtype)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1, dtype=dtype, key=kq)
        self.proj = nn.Conv2d(dim, dim, 1, dtype=dtype, key=kp)
        self.attention = nn.ProjectedAttention(dim, heads=1, dim_head=dim, pre_only=True, token_axis=None,
                                               dtype=dtype, key=ka)

    def _frame(self, x):
        n, h, w, c = x.shape
        q, k, v = jnp.split(self.to_qkv(self.norm(x)).reshape(n, h * w, 3 * c), 3, axis=-1)
        return self.proj(self.attention(q, k, v).reshape(n, h, w, c))

    def __call__(self, x, cache=None):
        return x + nn.per_frame(self._frame, x, self.plan), ()


class WanResample(eqx.Module):
    """diffusers' ``WanResample``: ``upsample2d``/``upsample3d`` (nearest x2 per frame, ``resample.1`` 3x3 conv to
    ``out_dim``; 3d first doubles the frames through ``time_conv``, a causal (3, 1, 1) conv to twice the channels,
    interleaved), ``downsample2d``/``downsample3d`` (zero pad right and bottom, stride-2 3x3 conv per frame; 3d then
    halves the frames through ``time_conv``, a valid stride-2 (3, 1, 1) conv after frame 0)."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"conv": "resample.1"}

    conv: nn.Conv2d
    time_conv: nn.CausalConv3d | None
    mode: str = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)

    def __init__(self, dim: int, mode: str, out_dim: int | None = None, *, dtype, key: PRNGKeyArray):
        kc, kt = jax.random.split(key)
        up = mode.startswith("upsample")
        self.conv = nn.Conv2d(dim, out_dim if up else dim, 3, stride=1 if up else 2, padding=1 if up else 0,
                              dtype=dtype, key=kc)
        self.time_conv = (_conv(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0), dtype=dtype, key=kt) if mode == "upsample3d"
                          else _conv(dim, dim, (3, 1, 1), stride=(2, 1, 1), padding=0, dtype=dtype, key=kt)
                          if mode == "downsample3d" else None)
        self.mode = mode

    def _double_frames(self, x, cache):
        first = cache is None
        rest = x[:, 1:] if first else x
        if rest.shape[1] == 0:  # frame 0 alone: nothing through time_conv yet, its cache stays zeros
            return x, jnp.zeros((x.shape[0], 2, *x.shape[2:]), x.dtype)
        y, cache = causal(self.time_conv, rest, cache)
        y = nn.unfold_channels(constrain(y, self.plan, VIDEO), 2, axis=1)  # frame i: 2i from [:c], 2i + 1 from [c:]
        return (jnp.concatenate([x[:, :1], y], axis=1) if first else y), cache

    def _halve_frames(self, x, cache):
        if cache is None:  # frame 0 kept, then windows (0, 1, 2), (2, 3, 4) ...
            y = self.time_conv(x) if x.shape[1] >= 3 else x[:, :0]
            return jnp.concatenate([x[:, :1], y], axis=1), x[:, -1:]
        return self.time_conv(jnp.concatenate([cache.astype(x.dtype), x], axis=1)), x[:, -1:]

    def __call__(self, x, cache=None):
        if self.mode == "upsample3d":
            x, cache = self._double_frames(x, cache)
        if self.mode.startswith("upsample"):
            up = lambda f: jnp.repeat(jnp.repeat(f, 2, axis=1), 2, axis=2)  # noqa: E731
            x = nn.per_frame(lambda f: self.conv(up(f)), x, self.plan)
            return x, (cache if self.mode == "upsample3d" else ())
        x = nn.per_frame(lambda f: self.conv(jnp.pad(f, ((0, 0), (0, 1), (0, 1), (0, 0)))), x, self.plan)
        return self._halve_frames(x, cache) if self.mode == "downsample3d" else (x, ())


def run(layers, x, cache, plan: Plan | None):
    """``x`` through ``layers`` (each ``(x, cache) -> (x, cache)``), constrained between them, each rematerialised
    by ``plan``; returns ``(x, caches)``."""
    caches = []
    for i, layer in enumerate(layers):
        x, c = checkpoint_block(layer, plan)(constrain(x, plan, VIDEO), None if cache is None else cache[i])
        caches.append(c)
    return constrain(x, plan, VIDEO), tuple(caches)


class WanMidBlock(eqx.Module):
    """resnets.0, attentions.0, resnets.1 at the lowest resolution."""

    resnets: tuple[WanResidualBlock, WanResidualBlock]
    attentions: tuple[WanAttentionBlock]

    def __init__(self, dim: int, *, dtype, key: PRNGKeyArray):
        k0, k1, ka = jax.random.split(key, 3)
        self.resnets = tuple(WanResidualBlock(dim, dim, dtype=dtype, key=k) for k in (k0, k1))
        self.attentions = (WanAttentionBlock(dim, dtype=dtype, key=ka),)

    def __call__(self, x, cache=None):
        c0, c1 = (None, None) if cache is None else cache
        x, c0 = self.resnets[0](x, c0)
        x, _ = self.attentions[0](x)
        x, c1 = self.resnets[1](x, c1)
        return x, (c0, c1)


class WanResidualDownBlock(eqx.Module):
    """Wan 2.2's encoder level: resnets and a downsampler, plus the :func:`avg_down` shortcut of its input."""

    resnets: tuple[WanResidualBlock, ...]
    downsampler: WanResample | None
    factors: tuple[int, int, int] = eqx.field(static=True)  # (out_channels, factor_t, factor_s) of the shortcut

    def __init__(self, cin: int, cout: int, num_res_blocks: int, *, temporal: bool, down: bool, dtype,
                 key: PRNGKeyArray):
        keys = jax.random.split(key, num_res_blocks + 1)
        self.resnets = tuple(WanResidualBlock(cin if i == 0 else cout, cout, dtype=dtype, key=keys[i])
                             for i in range(num_res_blocks))
        mode = "downsample3d" if temporal else "downsample2d"
        self.downsampler = WanResample(cout, mode, dtype=dtype, key=keys[-1]) if down else None
        self.factors = (cout, 2 if temporal else 1, 2 if down else 1)

    def __call__(self, x, cache=None):
        shortcut = avg_down(x, *self.factors)
        layers = self.resnets + (() if self.downsampler is None else (self.downsampler,))
        x, cache = run(layers, x, cache, None)
        return x + shortcut, cache


class WanUpBlock(eqx.Module):
    """Wan 2.1's decoder level: ``num_res_blocks + 1`` resnets, then ``upsamplers.0`` (halving the channels)."""

    resnets: tuple[WanResidualBlock, ...]
    upsamplers: tuple[WanResample] | None

    def __init__(self, cin: int, cout: int, num_res_blocks: int, mode: str | None, *, dtype, key: PRNGKeyArray):
        keys = jax.random.split(key, num_res_blocks + 2)
        self.resnets = tuple(WanResidualBlock(cin if i == 0 else cout, cout, dtype=dtype, key=keys[i])
                             for i in range(num_res_blocks + 1))
        self.upsamplers = None if mode is None else (WanResample(cout, mode, cout // 2, dtype=dtype, key=keys[-1]),)

    def __call__(self, x, cache=None):
        return run(self.resnets + (self.upsamplers or ()), x, cache, None)


class WanResidualUpBlock(eqx.Module):
    """Wan 2.2's decoder level: resnets and an ``upsampler`` (keeping the width), plus the :func:`dup_up` shortcut of
    its input."""

    resnets: tuple[WanResidualBlock, ...]
    upsampler: WanResample | None
    factors: tuple[int, int, int] | None = eqx.field(static=True)  # (out_channels, factor_t, factor_s) or none

    def __init__(self, cin: int, cout: int, num_res_blocks: int, *, temporal: bool, up: bool, dtype,
                 key: PRNGKeyArray):
        keys = jax.random.split(key, num_res_blocks + 2)
        self.resnets = tuple(WanResidualBlock(cin if i == 0 else cout, cout, dtype=dtype, key=keys[i])
                             for i in range(num_res_blocks + 1))
        mode = "upsample3d" if temporal else "upsample2d"
        self.upsampler = WanResample(cout, mode, cout, dtype=dtype, key=keys[-1]) if up else None
        self.factors = (cout, 2 if temporal else 1, 2) if up else None

    def __call__(self, x, cache=None):
        layers = self.resnets + (() if self.upsampler is None else (self.upsampler,))
        y, new = run(layers, x, cache, None)
        if self.factors is not None:
            y = y + dup_up(x, *self.factors, first=cache is None)
        return y, new


__all__ = ["VIDEO", "WanAttentionBlock", "WanMidBlock", "WanRMSNorm", "WanResample", "WanResidualBlock",
           "WanResidualDownBlock", "WanResidualUpBlock", "WanUpBlock", "avg_down", "causal", "dup_up", "run"]
