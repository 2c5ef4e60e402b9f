"""IP-Adapter Plus's image projection: diffusers' ``IPAdapterPlusImageProjection`` (the original code's
``Resampler``), which turns a CLIP image encoder's penultimate hidden states into ``num_queries`` tokens through
learned queries attending, block by block, to the image tokens and themselves. Read from the original file layout
(``latents``, ``proj_in``, ``layers.{i}.0.norm1/norm2/to_q/to_kv/to_out``, ``layers.{i}.1.{0,1,3}``, ``proj_out``,
``norm_out``), converted as diffusers' ``_convert_ip_adapter_image_proj_to_diffusers`` does."""

from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, typechecked
from ..nn import CrossAttention, LayerNorm, Linear

__all__ = ["IPAdapterPlusImageProjection", "plus_image_projection"]

DIM_HEAD = 64  # diffusers builds the resampler's attention with 64-wide heads (heads = to_q rows // 64)


def _linear(weight, bias, dtype) -> Linear:
    weight = np.asarray(weight)
    shape = eqx.filter_eval_shape(lambda: Linear(weight.shape[1], weight.shape[0], use_bias=bias is not None,
                                                 dtype=dtype, key=jax.random.key(0)))
    layer = eqx.tree_at(lambda lin: lin.weight, shape, jnp.asarray(weight, dtype))
    return layer if bias is None else eqx.tree_at(lambda lin: lin.bias, layer, jnp.asarray(bias, dtype))


def _norm(state, prefix: str, dtype) -> LayerNorm:
    norm = LayerNorm(np.shape(state[prefix + ".weight"])[0], dtype=dtype)
    return eqx.tree_at(lambda n: (n.weight, n.bias), norm, (jnp.asarray(state[prefix + ".weight"], dtype),
                                                             jnp.asarray(state[prefix + ".bias"], dtype)))


class ResamplerBlock(eqx.Module):
    """diffusers' ``IPAdapterPlusImageProjectionBlock``: the queries (``ln1``) attend to ``[ln0(image), ln1(queries)]``
    (``attn``, no output bias), then a GELU feed-forward without biases behind its own LayerNorm, each residual."""

    ln0: LayerNorm
    ln1: LayerNorm
    attn: CrossAttention
    ff_norm: LayerNorm
    ff_in: Linear
    ff_out: Linear

    def __init__(self, state: Mapping[str, np.ndarray], prefix: str, dtype):
        to_q = np.asarray(state[f"{prefix}.0.to_q.weight"])
        to_k, to_v = np.split(np.asarray(state[f"{prefix}.0.to_kv.weight"]), 2)
        hidden, heads = to_q.shape[1], to_q.shape[0] // DIM_HEAD
        attn = eqx.filter_eval_shape(lambda: CrossAttention(hidden, hidden, heads=heads, dim_head=DIM_HEAD,
                                                            out_bias=False, key=jax.random.key(0)))
        self.attn = eqx.tree_at(lambda a: (a.to_q, a.to_k, a.to_v, a.to_out), attn, tuple(
            _linear(w, None, dtype) for w in (to_q, to_k, to_v, state[f"{prefix}.0.to_out.weight"])))
        self.ln0, self.ln1 = _norm(state, f"{prefix}.0.norm1", dtype), _norm(state, f"{prefix}.0.norm2", dtype)
        self.ff_norm = _norm(state, f"{prefix}.1.0", dtype)
        self.ff_in = _linear(state[f"{prefix}.1.1.weight"], None, dtype)
        self.ff_out = _linear(state[f"{prefix}.1.3.weight"], None, dtype)

    def __call__(self, x: Array, latents: Array) -> Array:
        queries = self.ln1(latents)
        latents = self.attn(queries, jnp.concatenate([self.ln0(x), queries], axis=1)) + latents
        return self.ff_out(jax.nn.gelu(self.ff_in(self.ff_norm(latents)), approximate=False)) + latents


class IPAdapterPlusImageProjection(eqx.Module):
    """The resampler: ``latents`` (learned queries) through the blocks over ``proj_in`` of the image tokens, then
    ``proj_out`` and ``norm_out``. ``num_tokens``: the queries, the adapter's image tokens in the UNet."""

    READS_HIDDEN_STATES: ClassVar[bool] = True  # the image encoder's penultimate hidden states
    PARAM_AXES: ClassVar = {"latents": (None, None, "embed")}

    latents: Float[Array, "1 queries hidden"]
    proj_in: Linear
    layers: tuple[ResamplerBlock, ...]
    proj_out: Linear
    norm_out: LayerNorm
    num_tokens: int = eqx.field(static=True)

    def __init__(self, state: Mapping[str, np.ndarray], dtype=jnp.float32):
        depth = len({k.split(".")[1] for k in state if k.startswith("layers.") and k.endswith(".0.to_q.weight")})
        self.latents = jnp.asarray(state["latents"], dtype)
        self.proj_in = _linear(state["proj_in.weight"], state["proj_in.bias"], dtype)
        self.layers = tuple(ResamplerBlock(state, f"layers.{i}", dtype) for i in range(depth))
        self.proj_out = _linear(state["proj_out.weight"], state["proj_out.bias"], dtype)
        self.norm_out = _norm(state, "norm_out", dtype)
        self.num_tokens = int(self.latents.shape[1])

    @property
    def embed_dim(self) -> int:
        """The width of the image encoder's hidden states it reads."""
        return self.proj_in.in_features

    @property
    def out_dim(self) -> int:
        return self.norm_out.weight.shape[0]

    @typechecked
    def __call__(self, hidden_states: Float[Array, "batch tokens embed"]) -> Float[Array, "batch queries dim"]:
        x = self.proj_in(hidden_states.astype(self.latents.dtype))
        latents = jnp.broadcast_to(self.latents, (x.shape[0], *self.latents.shape[1:]))
        for block in self.layers:
            latents = block(x, latents)
        return self.norm_out(self.proj_out(latents))


def plus_image_projection(state: Mapping[str, np.ndarray], *, dtype=jnp.float32) -> IPAdapterPlusImageProjection:
    """IP-Adapter Plus's projection of an adapter file's ``image_proj`` tensors (``ValueError`` if any is missing)."""
    missing = [k for k in ("latents", "proj_in.weight", "proj_out.weight", "norm_out.weight",
                           "layers.0.0.to_kv.weight") if k not in state]
    if missing:
        raise ValueError(f"the IP-Adapter Plus image_proj misses {missing}: eqxdiff reads the original layout "
                         "(image_proj.latents, proj_in, layers.{i}.0.to_q/to_kv/to_out, ...); Face ID variants are "
                         "not supported")
    return IPAdapterPlusImageProjection(state, dtype)
