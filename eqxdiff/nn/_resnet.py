"""ResNet, down- and up-sampling blocks shared by the UNet and the VAE (diffusers names and semantics)."""

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray, typechecked
from ._activations import activation
from ._layers import Conv2d, GroupNorm, Linear


class ResnetBlock2D(eqx.Module):
    """``x + conv2(act(norm2(conv1(act(norm1(x))) + temb)))``, with a 1x1 shortcut when widths differ. With
    ``time_embedding_norm="scale_shift"`` the time embedding gives a scale and a shift instead, applied after
    ``norm2``: ``norm2(h) * (1 + scale) + shift`` (diffusers' ``resnet_time_scale_shift``)."""

    norm1: GroupNorm
    conv1: Conv2d
    time_emb_proj: Linear | None
    norm2: GroupNorm
    conv2: Conv2d
    conv_shortcut: Conv2d | None
    act_fn: str = eqx.field(static=True)
    output_scale_factor: float = eqx.field(static=True)
    time_embedding_norm: str = eqx.field(static=True)

    def __init__(self, in_channels: int, out_channels: int | None = None, *, temb_channels: int | None = 512,
                 groups: int = 32, groups_out: int | None = None, eps: float = 1e-6, act_fn: str = "silu",
                 output_scale_factor: float = 1.0, use_in_shortcut: bool | None = None,
                 conv_shortcut_bias: bool = True, time_embedding_norm: str = "default", dtype=jnp.float32,
                 key: PRNGKeyArray):
        if time_embedding_norm not in ("default", "scale_shift"):
            raise ValueError(f"time_embedding_norm={time_embedding_norm!r}: use 'default' or 'scale_shift'")
        out_channels = out_channels or in_channels
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.norm1 = GroupNorm(groups, in_channels, eps=eps, dtype=dtype)
        self.conv1 = Conv2d(in_channels, out_channels, 3, padding=1, dtype=dtype, key=k1)
        temb_out = 2 * out_channels if time_embedding_norm == "scale_shift" else out_channels
        self.time_emb_proj = Linear(temb_channels, temb_out, dtype=dtype, key=k2) if temb_channels else None
        self.norm2 = GroupNorm(groups_out or groups, out_channels, eps=eps, dtype=dtype)
        self.conv2 = Conv2d(out_channels, out_channels, 3, padding=1, dtype=dtype, key=k3)
        shortcut = in_channels != out_channels if use_in_shortcut is None else use_in_shortcut
        self.conv_shortcut = (Conv2d(in_channels, out_channels, 1, use_bias=conv_shortcut_bias, dtype=dtype, key=k4)
                              if shortcut else None)
        self.act_fn = act_fn
        self.output_scale_factor = output_scale_factor
        self.time_embedding_norm = time_embedding_norm

    @typechecked
    def __call__(self, x: Float[Array, "batch height width cin"],
                 temb: Float[Array, "batch temb"] | None = None) -> Float[Array, "batch height width cout"]:
        act = activation(self.act_fn)
        h = self.conv1(act(self.norm1(x)))
        t = self.time_emb_proj(act(temb))[:, None, None, :] if self.time_emb_proj is not None and temb is not None \
            else None
        if self.time_embedding_norm == "scale_shift":
            if t is None:
                raise ValueError("ResnetBlock2D: time_embedding_norm='scale_shift' needs a time embedding")
            scale, shift = jnp.split(t, 2, axis=-1)
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h if t is None else h + t)
        h = self.conv2(act(h))
        shortcut = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return (shortcut + h) / self.output_scale_factor


class Downsample2D(eqx.Module):
    """Stride-2 3x3 convolution; ``padding=0`` pads right and bottom by one first, as diffusers does."""

    conv: Conv2d
    padding: int = eqx.field(static=True)

    def __init__(self, channels: int, out_channels: int | None = None, *, padding: int = 1, dtype=jnp.float32,
                 key: PRNGKeyArray):
        self.conv = Conv2d(channels, out_channels or channels, 3, stride=2, padding=padding, dtype=dtype, key=key)
        self.padding = padding

    @typechecked
    def __call__(self, x: Float[Array, "batch height width channels"]) -> Float[Array, "batch h2 w2 cout"]:
        if self.padding == 0:
            x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        return self.conv(x)


class Upsample2D(eqx.Module):
    """Nearest-neighbour 2x upsampling (or to ``output_size``) followed by a 3x3 convolution."""

    conv: Conv2d

    def __init__(self, channels: int, out_channels: int | None = None, *, dtype=jnp.float32, key: PRNGKeyArray):
        self.conv = Conv2d(channels, out_channels or channels, 3, padding=1, dtype=dtype, key=key)

    @typechecked
    def __call__(self, x: Float[Array, "batch height width channels"],
                 output_size: tuple[int, int] | None = None) -> Float[Array, "batch h2 w2 cout"]:
        b, h, w, c = x.shape
        if output_size is None:
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        else:  # nearest: source index floor(i * in / out), as torch's interpolate(mode="nearest")
            rows = (jnp.arange(output_size[0]) * h) // output_size[0]
            cols = (jnp.arange(output_size[1]) * w) // output_size[1]
            x = x[:, rows][:, :, cols]
        return self.conv(x)
