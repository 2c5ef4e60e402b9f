"""Channels-last building blocks whose parameters map one-to-one onto PyTorch checkpoints.

Each layer names its parameters as PyTorch does (``weight``, ``bias``). A layer whose layout differs from
PyTorch's declares ``TORCH_PERMUTATIONS``: ``ours = numpy.transpose(torch_tensor, perm)``. Each layer also declares
the logical axes of its parameters (``PARAM_AXES``, or ``param_axes()`` where the caller chooses them: a
:class:`Linear` is told whether its output runs over attention ``heads``, ``mlp`` units or the model dimension),
which the sharding rules map to mesh axes. The loader in :mod:`eqxdiff.loading` and :mod:`eqxdiff.parallel` read
these declarations; layers never load or place anything themselves.

The projections (:class:`Linear`, :class:`Conv2d`, and :class:`~eqxdiff.nn.Conv3d`) hold an ``adapters`` slot:
``None`` (their computation unchanged) or an :class:`~eqxdiff.nn.Adapters` stack (LoRA and its relatives, see
:mod:`eqxdiff.nn._adapters`) whose changes are added at call time. The affine norms (:class:`LayerNorm`,
:class:`RMSNorm`) hold one too, for whole differences of their scale (and shift).
"""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray, typechecked
from ._adapters import Adapters, adapted_conv, adapted_parameters
from ._init import init_normal, init_uniform


class Linear(eqx.Module):
    """``y = x @ weight.T + bias``; ``weight`` is stored as PyTorch stores it, ``[out_features, in_features]``.

    ``axes`` are the logical axes of ``weight``: ``(out, in)``. The default ``("out", "embed")`` shards the input
    features over FSDP; attention projections say ``("heads", "embed")`` / ``("embed", "heads")``, MLPs
    ``("mlp", "embed")`` / ``("embed", "mlp")``.

    ``names``: the checkpoint names of ``(weight, bias)`` where they are not ``weight`` / ``bias``, e.g.
    ``("in_proj_weight", "in_proj_bias")`` for ``torch.nn.MultiheadAttention``'s fused input projection (its parent
    then renames the field to ``""``). ``adapters``: see the module docstring."""

    weight: Float[Array, "out in"]
    bias: Float[Array, " out"] | None
    adapters: Adapters | None
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=("out", "embed"))
    names: tuple[str, str] | None = eqx.field(static=True, default=None)

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 axes: tuple[str | None, str | None] = ("out", "embed"), names: tuple[str, str] | None = None,
                 dtype=jnp.float32, key: PRNGKeyArray):
        wkey, bkey = jax.random.split(key)
        bound = 1.0 / math.sqrt(in_features)
        self.weight = init_uniform(wkey, (out_features, in_features), bound, dtype)
        self.bias = init_uniform(bkey, (out_features,), bound, dtype) if use_bias else None
        self.adapters = None
        self.axes = tuple(axes)
        self.names = None if names is None else tuple(names)

    def param_axes(self):
        return {"weight": self.axes, "bias": self.axes[:1]}

    def torch_renames(self):
        return {} if self.names is None else {"weight": self.names[0], "bias": self.names[1]}

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @typechecked
    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Linear expects {self.in_features} input features in the last axis, got x of shape "
                             f"{x.shape}")
        y = jnp.einsum("...i,oi->...o", x, self.weight.astype(x.dtype))
        if self.bias is not None:
            y = y + self.bias.astype(x.dtype)
        if self.adapters is not None:
            y = self.adapters.linear(x, self.weight, y)
        return y


class Conv2d(eqx.Module):
    """2-D convolution on ``[batch, height, width, channels]``; ``weight`` is ``[kh, kw, in, out]`` (HWIO)."""

    TORCH_PERMUTATIONS: ClassVar[dict[str, tuple[int, ...]]] = {"weight": (2, 3, 1, 0)}
    PARAM_AXES: ClassVar = {"weight": ("kernel", "kernel", "conv_in", "conv_out"), "bias": ("conv_out",)}

    weight: Float[Array, "kh kw cin cout"]
    bias: Float[Array, " cout"] | None
    adapters: Adapters | None
    stride: int = eqx.field(static=True)
    padding: int = eqx.field(static=True)

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int = 1,
                 padding: int = 0, use_bias: bool = True, dtype=jnp.float32, key: PRNGKeyArray):
        wkey, bkey = jax.random.split(key)
        bound = 1.0 / math.sqrt(in_channels * kernel_size * kernel_size)
        self.weight = init_uniform(wkey, (kernel_size, kernel_size, in_channels, out_channels), bound, dtype)
        self.bias = init_uniform(bkey, (out_channels,), bound, dtype) if use_bias else None
        self.adapters = None
        self.stride = stride
        self.padding = padding

    @typechecked
    def __call__(self, x: Float[Array, "batch height width cin"]) -> Float[Array, "batch h2 w2 cout"]:
        p = self.padding
        return adapted_conv(x, self.weight, self.bias, self.adapters, self.TORCH_PERMUTATIONS["weight"], layer="Conv2d",
                            window_strides=(self.stride, self.stride), padding=((p, p), (p, p)),
                            dimension_numbers=("NHWC", "HWIO", "NHWC"))


class GroupNorm(eqx.Module):
    """Group normalisation over a channels-last tensor, statistics in float32."""

    PARAM_AXES: ClassVar = {"weight": ("norm",), "bias": ("norm",)}

    weight: Float[Array, " channels"] | None
    bias: Float[Array, " channels"] | None
    num_groups: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)

    def __init__(self, num_groups: int, num_channels: int, *, eps: float = 1e-5, affine: bool = True,
                 dtype=jnp.float32):
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels={num_channels} is not divisible by "
                             f"num_groups={num_groups}; choose a norm_num_groups that divides every width.")
        self.weight = jnp.ones((num_channels,), dtype) if affine else None
        self.bias = jnp.zeros((num_channels,), dtype) if affine else None
        self.num_groups = num_groups
        self.eps = eps

    @typechecked
    def __call__(self, x: Float[Array, "batch *spatial channels"]) -> Float[Array, "batch *spatial channels"]:
        c = x.shape[-1]
        g = x.astype(jnp.float32).reshape(*x.shape[:-1], self.num_groups, c // self.num_groups)
        axes = tuple(range(1, x.ndim - 1)) + (x.ndim,)
        mean = jnp.mean(g, axis=axes, keepdims=True)
        var = jnp.mean(jnp.square(g - mean), axis=axes, keepdims=True)
        y = ((g - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        if self.weight is not None:
            y = y * self.weight.astype(jnp.float32) + self.bias.astype(jnp.float32)
        return y.astype(x.dtype)


class LayerNorm(eqx.Module):
    """Layer normalisation over the last axis, statistics in float32; affine parameters optional."""

    PARAM_AXES: ClassVar = {"weight": ("norm",), "bias": ("norm",)}

    weight: Float[Array, " dim"] | None
    bias: Float[Array, " dim"] | None
    adapters: Adapters | None
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, elementwise_affine: bool = True, use_bias: bool = True,
                 dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype) if elementwise_affine else None
        self.bias = jnp.zeros((dim,), dtype) if elementwise_affine and use_bias else None
        self.adapters = None
        self.eps = eps

    @typechecked
    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        weight, bias = (self.weight, self.bias) if self.weight is None else \
            adapted_parameters(self.adapters, self.weight, self.bias)
        if weight is not None:
            y = y * weight.astype(jnp.float32)
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        return y.astype(x.dtype)


class RMSNorm(eqx.Module):
    """Root-mean-square normalisation over the last axis (no mean subtraction), statistics in float32, with an
    optional scale ``weight`` (T5's ``T5LayerNorm``, diffusers' ``RMSNorm``)."""

    PARAM_AXES: ClassVar = {"weight": ("norm",)}

    weight: Float[Array, " dim"] | None
    adapters: Adapters | None
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-6, elementwise_affine: bool = True, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype) if elementwise_affine else None
        self.adapters = None
        self.eps = eps

    @typechecked
    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)
        if self.weight is not None:
            weight, _ = adapted_parameters(self.adapters, self.weight, has_bias=False, owner="RMSNorm")
            y = y * weight.astype(jnp.float32)
        return y.astype(x.dtype)


class Embedding(eqx.Module):
    """A lookup table ``[num_embeddings, dim]``, as PyTorch's ``nn.Embedding``; ``axes`` are the table's logical
    axes (a token table ``("vocab", "embed")``, a position table ``("position", "embed")``)."""

    weight: Float[Array, "num dim"]
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=("vocab", "embed"))

    def __init__(self, num_embeddings: int, dim: int, *, axes: tuple[str | None, str | None] = ("vocab", "embed"),
                 dtype=jnp.float32, key: PRNGKeyArray):
        self.weight = init_normal(key, (num_embeddings, dim), dtype)
        self.axes = tuple(axes)

    def param_axes(self):
        return {"weight": self.axes}

    def __call__(self, ids: Array) -> Array:
        return jnp.take(self.weight, ids, axis=0)
