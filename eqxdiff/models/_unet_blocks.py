"""The UNet's pieces: the down, mid and up blocks, each built from a typed spec (the timestep embeddings are
``eqxdiff.nn``'s).

One class covers diffusers' ``DownBlock2D`` and ``CrossAttnDownBlock2D`` (``attentions`` is ``None`` for the
former), one covers ``UpBlock2D`` and ``CrossAttnUpBlock2D``; the state-dict names are diffusers' either way.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .._typing import Array, Bool, Float, PRNGKeyArray
from ..nn import Downsample2D, ResnetBlock2D, Upsample2D
from ._transformer2d import Transformer2DModel


@dataclasses.dataclass(frozen=True)
class ResnetSpec:
    """What every ResNet of a UNet shares."""

    temb_channels: int
    groups: int
    eps: float
    act_fn: str
    output_scale_factor: float = 1.0
    time_embedding_norm: str = "default"  # diffusers' resnet_time_scale_shift


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The spatial transformers of one block: ``layers[i]`` transformer blocks after the block's ``i``-th ResNet."""

    heads: int
    cross_attention_dim: int
    layers: tuple[int, ...]
    use_linear_projection: bool
    only_cross_attention: bool


@dataclasses.dataclass(frozen=True)
class DownBlockSpec:
    in_channels: int
    out_channels: int
    num_layers: int
    attention: AttentionSpec | None
    downsample: bool
    downsample_padding: int


@dataclasses.dataclass(frozen=True)
class MidBlockSpec:
    channels: int
    # len(attention.layers) (transformer, ResNet) pairs after a first ResNet; None: the ResNet alone (UNetMidBlock2D)
    attention: AttentionSpec | None


@dataclasses.dataclass(frozen=True)
class UpBlockSpec:
    prev_channels: int  # channels coming from the block below
    out_channels: int
    skip_channels: tuple[int, ...]  # of the skip concatenated before each ResNet, in the order they are used
    attention: AttentionSpec | None
    upsample: bool

    @property
    def num_layers(self) -> int:
        return len(self.skip_channels)


def _resnet(cin: int, cout: int, spec: ResnetSpec, *, dtype, key) -> ResnetBlock2D:
    return ResnetBlock2D(cin, cout, temb_channels=spec.temb_channels, groups=spec.groups, eps=spec.eps,
                         act_fn=spec.act_fn, output_scale_factor=spec.output_scale_factor,
                         time_embedding_norm=spec.time_embedding_norm, dtype=dtype, key=key)


def _transformers(channels: int, spec: AttentionSpec | None, groups: int, *, dtype, key):
    if spec is None:
        return None
    return [Transformer2DModel(channels, heads=spec.heads, dim_head=channels // spec.heads,
                               cross_attention_dim=spec.cross_attention_dim, num_layers=n, groups=groups,
                               use_linear_projection=spec.use_linear_projection,
                               only_cross_attention=spec.only_cross_attention, dtype=dtype, key=k)
            for n, k in zip(spec.layers, jax.random.split(key, len(spec.layers)))]


Context = Float[Array, "batch ctx_seq ctx_dim"]
Mask = Bool[Array, "batch ctx_seq"] | None
AttentionKwargs = Mapping[str, Any] | None  # the UNet's cross_attention_kwargs, for every cross-attention


class DownBlock(eqx.Module):
    """ResNets (each followed by a spatial transformer if ``attentions``), then an optional stride-2 conv.

    Returns the output and the skips the up path consumes: every ResNet/transformer output and the downsampled one.
    """

    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("resnet", "transformer")

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"downsampler": "downsamplers.0"}

    resnets: list[ResnetBlock2D]
    attentions: list[Transformer2DModel] | None
    downsampler: Downsample2D | None

    def __init__(self, spec: DownBlockSpec, resnet: ResnetSpec, *, dtype=jnp.float32, key: PRNGKeyArray):
        kr, ka, kd = jax.random.split(key, 3)
        cout = spec.out_channels
        self.resnets = [_resnet(spec.in_channels if i == 0 else cout, cout, resnet, dtype=dtype, key=k)
                        for i, k in enumerate(jax.random.split(kr, spec.num_layers))]
        self.attentions = _transformers(cout, spec.attention, resnet.groups, dtype=dtype, key=ka)
        self.downsampler = (Downsample2D(cout, cout, padding=spec.downsample_padding, dtype=dtype, key=kd)
                            if spec.downsample else None)

    def __call__(self, x, temb, context: Context, mask: Mask, kwargs: AttentionKwargs = None):
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = checkpoint_name(resnet(x, temb), "resnet")
            if self.attentions is not None:
                x = checkpoint_name(self.attentions[i](x, context, mask=mask, cross_attention_kwargs=kwargs),
                                    "transformer")
            skips.append(x)
        if self.downsampler is not None:
            x = self.downsampler(x)
            skips.append(x)
        return x, skips


class MidBlock(eqx.Module):
    """``UNetMidBlock2DCrossAttn``: a ResNet, then (transformer, ResNet) pairs; ``UNetMidBlock2D`` (as the UNet
    builds it, without attention): the ResNet alone."""

    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("resnet", "transformer")

    resnets: list[ResnetBlock2D]
    attentions: list[Transformer2DModel] | None

    def __init__(self, spec: MidBlockSpec, resnet: ResnetSpec, *, dtype=jnp.float32, key: PRNGKeyArray):
        kr, ka = jax.random.split(key)
        c = spec.channels
        pairs = len(spec.attention.layers) if spec.attention is not None else 0
        self.resnets = [_resnet(c, c, resnet, dtype=dtype, key=k) for k in jax.random.split(kr, pairs + 1)]
        self.attentions = _transformers(c, spec.attention, resnet.groups, dtype=dtype, key=ka)

    def __call__(self, x, temb, context: Context, mask: Mask, kwargs: AttentionKwargs = None):
        x = checkpoint_name(self.resnets[0](x, temb), "resnet")
        for attn, resnet in zip(self.attentions or (), self.resnets[1:]):
            x = checkpoint_name(attn(x, context, mask=mask, cross_attention_kwargs=kwargs), "transformer")
            x = checkpoint_name(resnet(x, temb), "resnet")
        return x


class UpBlock(eqx.Module):
    """For each ResNet: concatenate the next skip, ResNet, optional transformer; then optional 2x upsampling."""

    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("resnet", "transformer")

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"upsampler": "upsamplers.0"}

    resnets: list[ResnetBlock2D]
    attentions: list[Transformer2DModel] | None
    upsampler: Upsample2D | None

    def __init__(self, spec: UpBlockSpec, resnet: ResnetSpec, *, dtype=jnp.float32, key: PRNGKeyArray):
        kr, ka, ku = jax.random.split(key, 3)
        cout = spec.out_channels
        self.resnets = [_resnet((spec.prev_channels if i == 0 else cout) + skip, cout, resnet, dtype=dtype, key=k)
                        for i, (skip, k) in enumerate(zip(spec.skip_channels,
                                                          jax.random.split(kr, spec.num_layers)))]
        self.attentions = _transformers(cout, spec.attention, resnet.groups, dtype=dtype, key=ka)
        self.upsampler = Upsample2D(cout, cout, dtype=dtype, key=ku) if spec.upsample else None

    def __call__(self, x, skips, temb, context: Context, mask: Mask, upsample_size: tuple[int, int] | None = None,
                 freeu: tuple[Array, Array] | None = None, kwargs: AttentionKwargs = None):
        """``skips`` in the order the down path produced them; the last one is used first. ``freeu``: this block's
        FreeU ``(s, b)`` (each ``[batch]``), applied before each concatenation (:func:`apply_freeu`)."""
        for i, resnet in enumerate(self.resnets):
            h, skip = (x, skips[-1 - i]) if freeu is None else apply_freeu(x, skips[-1 - i], *freeu)
            x = checkpoint_name(resnet(jnp.concatenate([h, skip], axis=-1), temb), "resnet")
            if self.attentions is not None:
                x = checkpoint_name(self.attentions[i](x, context, mask=mask, cross_attention_kwargs=kwargs),
                                    "transformer")
        if self.upsampler is not None:
            x = self.upsampler(x, upsample_size)
        return x


def apply_freeu(x: Array, skip: Array, s: Array, b: Array) -> tuple[Array, Array]:
    """FreeU (Si et al. 2023; diffusers' ``apply_freeu``): the first half of the backbone's channels times ``b``, and
    the skip's lowest frequencies times ``s`` (:func:`fourier_filter`); ``s`` and ``b`` are ``[batch]``."""
    half = x.shape[-1] // 2
    x = jnp.concatenate([x[..., :half] * b[:, None, None, None].astype(x.dtype), x[..., half:]], axis=-1)
    return x, fourier_filter(skip, s)


def fourier_filter(x: Float[Array, "batch height width channels"], scale: Float[Array, " batch"]) -> Array:
    """diffusers' ``fourier_filter`` at threshold 1: the centred 2x2 (or fewer, on a side under 2) lowest spatial
    frequencies of each channel times ``scale``, in float32 (a 2-D FFT over height and width)."""
    h, w = x.shape[1:3]
    low = np.zeros((h, w), bool)
    low[h // 2 - 1:h // 2 + 1, w // 2 - 1:w // 2 + 1] = True  # torch's slice of the shifted spectrum
    freq = jnp.fft.fftshift(jnp.fft.fft2(x.astype(jnp.float32), axes=(1, 2)), axes=(1, 2))
    freq = jnp.where(low[None, :, :, None], freq * scale.astype(jnp.float32)[:, None, None, None], freq)
    return jnp.fft.ifft2(jnp.fft.ifftshift(freq, axes=(1, 2)), axes=(1, 2)).real.astype(x.dtype)


def add_residuals(skips, residuals):
    """ControlNet residuals added to the UNet's skips (checked: one per skip, its shape or a spatial mean's)."""
    shapes = [tuple(s.shape) for s in skips]
    got = [tuple(r.shape) for r in residuals]
    pooled = [(s[0], 1, 1, s[3]) for s in shapes]  # spatial means (global_pool_conditions ControlNets)
    if len(got) != len(shapes) or any(g not in (s, p) for g, s, p in zip(got, shapes, pooled)):
        raise ValueError(f"UNet2DConditionModel: down_block_additional_residuals must be {len(shapes)} arrays of "
                         f"shapes {shapes} (one per skip, channels-last; or [batch, 1, 1, channels]), got {got}")
    return [s + r.astype(s.dtype) for s, r in zip(skips, residuals)]
