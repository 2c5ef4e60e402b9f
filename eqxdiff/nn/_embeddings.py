"""Conditioning embedders shared by the UNet and the diffusion transformers (Flux, Wan, LTX-Video), with diffusers'
names: the sinusoidal timestep embedding (``Timesteps``), ``GaussianFourierProjection``, ``TimestepEmbedding`` and
``PixArtAlphaTextProjection``."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ._activations import activation, gelu_tanh, silu
from ._layers import Linear


def timestep_frequencies(dim: int, *, freq_shift: float | int, max_period: float | int = 10000.0) -> np.ndarray:
    """The ``dim // 2`` float32 frequencies of :func:`timestep_embedding`, ``exp(-log(max_period) * i / (dim // 2 -
    freq_shift))``. The exponent is rounded in float32 step by step as PyTorch forms it (a frequency one ulp off moves
    the angle of t = 999 by ~3e-5); its exp is correctly rounded (from float64), where PyTorch's float32 exp is
    within one ulp of that."""
    half = dim // 2
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(half - freq_shift)
    return np.exp(exponent.astype(np.float64)).astype(np.float32)


@typechecked
def timestep_embedding(t: Float[Array, "*n"] | Int[Array, "*n"], dim: int, *, flip_sin_to_cos: bool,
                       freq_shift: float | int, scale: float | int = 1.0,
                       max_period: float | int = 10000.0) -> Float[Array, "*n dim"]:
    """Sinusoidal embeddings of (possibly fractional) timesteps, in float32, as diffusers' ``Timesteps`` /
    ``get_timestep_embedding`` (``freq_shift`` is its ``downscale_freq_shift``). ``t`` may have any shape (per-token
    timesteps: ``[batch, seq]``); the embedding is added as a last axis."""
    freqs = timestep_frequencies(dim, freq_shift=freq_shift, max_period=max_period)
    args = t.astype(jnp.float32)[..., None] * jnp.asarray(freqs)
    if scale != 1.0:
        args = scale * args
    sin, cos = jnp.sin(args), jnp.cos(args)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, [(0, 0)] * (emb.ndim - 1) + [(0, 1)])
    return emb


def token_timesteps(timestep, batch: int, seq: int, *, who: str, tokens: str = "tokens") -> Array:
    """A video transformer's ``timestep`` as ``[batch]`` (a scalar or one per sample) or ``[batch, seq]`` (one per
    token, in frame, row, column order); ``who`` and ``tokens`` (what the ``seq`` tokens are) name them in errors."""
    t = jnp.asarray(timestep)
    if t.ndim == 2:
        if t.shape[1] != seq:
            raise ValueError(f"{who}: per-token timesteps of shape {t.shape} for {seq} {tokens}; give [batch, {seq}] "
                             "(one per token, in frame, row, column order)")
        return jnp.broadcast_to(t, (batch, seq))
    if t.ndim > 1:
        raise ValueError(f"{who}: timestep of shape {t.shape}; give a scalar, [batch] or [batch, {seq}] (one per "
                         "token)")
    return jnp.broadcast_to(t, (batch,))


class GaussianFourierProjection(eqx.Module):
    """``[sin, cos](2 pi t w)`` (``[cos, sin]`` with ``flip_sin_to_cos``) of frequencies ``w`` drawn once and stored
    (``weight``), as diffusers' ``GaussianFourierProjection`` with ``log=False``: the UNet's
    ``time_embedding_type="fourier"``."""

    weight: Float[Array, " half"]
    flip_sin_to_cos: bool = eqx.field(static=True)

    def __init__(self, half: int, *, flip_sin_to_cos: bool, dtype=jnp.float32, key: PRNGKeyArray):
        self.weight = jax.random.normal(key, (half,), dtype)
        self.flip_sin_to_cos = flip_sin_to_cos

    def param_axes(self):
        return {"weight": ("embed",)}

    @typechecked
    def __call__(self, t: Float[Array, "*n"] | Int[Array, "*n"]) -> Float[Array, "*n dim"]:
        args = t.astype(jnp.float32)[..., None] * self.weight.astype(jnp.float32) * 2 * np.pi  # diffusers' order
        sin, cos = jnp.sin(args), jnp.cos(args)
        return jnp.concatenate([cos, sin] if self.flip_sin_to_cos else [sin, cos], axis=-1)


class TimestepEmbedding(eqx.Module):
    """``post_act(linear_2(act(linear_1(x + cond_proj(cond)))))``: diffusers' ``TimestepEmbedding``."""

    linear_1: Linear
    linear_2: Linear
    cond_proj: Linear | None
    act_fn: str = eqx.field(static=True)
    post_act_fn: str | None = eqx.field(static=True)

    def __init__(self, in_channels: int, dim: int, *, out_dim: int | None = None, act_fn: str = "silu",
                 post_act_fn: str | None = None, cond_proj_dim: int | None = None, dtype=jnp.float32,
                 key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.linear_1 = Linear(in_channels, dim, dtype=dtype, key=k1)
        self.linear_2 = Linear(dim, out_dim or dim, dtype=dtype, key=k2)
        self.cond_proj = (Linear(cond_proj_dim, in_channels, use_bias=False, dtype=dtype, key=k3)
                          if cond_proj_dim is not None else None)
        for name in (act_fn, post_act_fn):  # an unknown activation fails here, not when called
            if name is not None:
                activation(name)
        self.act_fn = act_fn
        self.post_act_fn = post_act_fn

    @typechecked
    def __call__(self, x: Float[Array, "*batch cin"],
                 cond: Float[Array, "*batch cond"] | None = None) -> Float[Array, "*batch dim"]:
        if cond is not None:
            if self.cond_proj is None:
                raise ValueError("timestep_cond was given but the model has no cond_proj (time_cond_proj_dim=None)")
            x = x + self.cond_proj(cond.astype(x.dtype))
        h = self.linear_2(activation(self.act_fn)(self.linear_1(x)))
        return activation(self.post_act_fn)(h) if self.post_act_fn else h


_TEXT_PROJECTION_ACTIVATIONS = {
    "gelu_tanh": gelu_tanh,
    "silu": silu,
    "silu_fp32": silu,  # diffusers' FP32SiLU: float32, then the input's dtype, as every activation here
}


class TextProjection(eqx.Module):
    """``linear_2(act(linear_1(x)))``: diffusers' ``PixArtAlphaTextProjection`` (Flux's pooled-text embedder with
    ``act_fn="silu"``, Wan's text embedder and LTX's caption projection with ``"gelu_tanh"``)."""

    linear_1: Linear
    linear_2: Linear
    act_fn: str = eqx.field(static=True)

    def __init__(self, in_features: int, hidden_size: int, out_features: int | None = None, *,
                 act_fn: str = "gelu_tanh", dtype=jnp.float32, key: PRNGKeyArray):
        if act_fn not in _TEXT_PROJECTION_ACTIVATIONS:
            raise ValueError(f"TextProjection: act_fn={act_fn!r}; choose one of {list(_TEXT_PROJECTION_ACTIVATIONS)}")
        k1, k2 = jax.random.split(key)
        self.linear_1 = Linear(in_features, hidden_size, axes=("mlp", "embed"), dtype=dtype, key=k1)
        self.linear_2 = Linear(hidden_size, out_features or hidden_size, axes=("embed", "mlp"), dtype=dtype, key=k2)
        self.act_fn = act_fn

    @typechecked
    def __call__(self, x: Float[Array, "*batch cin"]) -> Float[Array, "*batch cout"]:
        return self.linear_2(_TEXT_PROJECTION_ACTIVATIONS[self.act_fn](self.linear_1(x)))


__all__ = ["TextProjection", "TimestepEmbedding", "timestep_embedding", "timestep_frequencies", "token_timesteps"]
