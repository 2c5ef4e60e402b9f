"""Adaptive-norm modulation of the diffusion transformers: a conditioning embedding gives per-channel ``shift``,
``scale`` and ``gate`` vectors; tokens are normalised, then ``x * (1 + scale) + shift``, and a block's output is
added back gated, ``x + gate * y``.

Where the vectors come from differs per family, with diffusers' names and chunk orders:

- :class:`AdaLayerNormZero`: ``linear(silu(emb))`` split into 6 chunks (Flux's double block ``norm1`` /
  ``norm1_context``: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) or 3 (``num_chunks=3``,
  ``AdaLayerNormZeroSingle``: shift, scale, gate), applied to a LayerNorm without affine.
- :class:`AdaLayerNormContinuous`: 2 chunks in the order **(scale, shift)** (Flux's ``norm_out``).
- :class:`ScaleShiftTable`: a learned ``(n, dim)`` table (``(1, n, dim)`` for Wan) plus the timestep projection
  (Wan and LTX blocks: shift, scale, gate, shift_mlp, scale_mlp, gate_mlp; their output heads: shift, scale).

:func:`modulate` and :func:`gated_residual` compute in float32 (diffusers' Wan does; for float32 models it is the
same arithmetic as Flux's and LTX's) and return the input's dtype.
"""

from collections.abc import Sequence
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray, typechecked
from ._activations import silu
from ._adapters import Adapters, adapted_parameters
from ._init import init_normal
from ._layers import LayerNorm, Linear, RMSNorm


def _per_token(v: Array, x: Array) -> Array:
    """``v [batch, (tokens...,) dim]`` with axes inserted after the batch axis to broadcast against ``x``."""
    if v.ndim > x.ndim:
        raise ValueError(f"modulation vector of shape {v.shape} for tokens of shape {x.shape}")
    return v.reshape(v.shape[0], *([1] * (x.ndim - v.ndim)), *v.shape[1:])


@typechecked
def modulate(x: Float[Array, "batch *tokens dim"], shift: Float[Array, "batch *#tokens dim"],
             scale: Float[Array, "batch *#tokens dim"]) -> Float[Array, "batch *tokens dim"]:
    """``x * (1 + scale) + shift``; ``shift``/``scale`` are ``[batch, dim]`` (one per sample) or per token."""
    y = x.astype(jnp.float32) * (1 + _per_token(scale, x).astype(jnp.float32)) + _per_token(shift, x)
    return y.astype(x.dtype)


@typechecked
def gated_residual(x: Float[Array, "batch *tokens dim"], y: Float[Array, "batch *tokens dim"],
                   gate: Float[Array, "batch *#tokens dim"]) -> Float[Array, "batch *tokens dim"]:
    """``x + gate * y`` (a block's output ``y`` added to the residual stream ``x``)."""
    return (x.astype(jnp.float32) + _per_token(gate, x).astype(jnp.float32) * y.astype(jnp.float32)).astype(x.dtype)


class AdaLayerNormZero(eqx.Module):
    """``linear(silu(emb))`` split into ``num_chunks`` (6: diffusers' ``AdaLayerNormZero``; 3:
    ``AdaLayerNormZeroSingle``); returns ``(modulate(norm(x), shift, scale), *the other chunks)``: with 6 chunks
    ``(x, gate_msa, shift_mlp, scale_mlp, gate_mlp)``, with 3 ``(x, gate)``. ``norm`` is a LayerNorm without affine
    parameters (float32 statistics, ``eps``)."""

    linear: Linear
    norm: LayerNorm
    num_chunks: int = eqx.field(static=True)

    def __init__(self, dim: int, *, num_chunks: int = 6, cond_dim: int | None = None, eps: float = 1e-6,
                 bias: bool = True, dtype=jnp.float32, key: PRNGKeyArray):
        if num_chunks not in (3, 6):
            raise ValueError(f"AdaLayerNormZero: num_chunks={num_chunks}; 6 (AdaLayerNormZero) or 3 (...Single)")
        self.linear = Linear(cond_dim or dim, num_chunks * dim, use_bias=bias, axes=("modulation", "embed"),
                             dtype=dtype, key=key)
        self.norm = LayerNorm(dim, eps=eps, elementwise_affine=False, dtype=dtype)
        self.num_chunks = num_chunks

    @typechecked
    def __call__(self, x: Float[Array, "batch *tokens dim"],
                 emb: Float[Array, "batch *#tokens cond"]) -> tuple[Float[Array, "batch *#tokens dim"], ...]:
        chunks = jnp.split(self.linear(silu(emb)), self.num_chunks, axis=-1)
        shift, scale = chunks[:2]
        return (modulate(self.norm(x), shift, scale), *chunks[2:])


class AdaLayerNormContinuous(eqx.Module):
    """``norm(x) * (1 + scale) + shift`` with ``(scale, shift) = linear(silu(cond))``: diffusers'
    ``AdaLayerNormContinuous`` (Flux's ``norm_out``: ``elementwise_affine=False, eps=1e-6``). ``norm_type`` is
    ``"layer_norm"`` or ``"rms_norm"``."""

    linear: Linear
    norm: LayerNorm | RMSNorm

    def __init__(self, dim: int, cond_dim: int, *, elementwise_affine: bool = True, eps: float = 1e-5,
                 bias: bool = True, norm_type: str = "layer_norm", dtype=jnp.float32, key: PRNGKeyArray):
        self.linear = Linear(cond_dim, 2 * dim, use_bias=bias, axes=("modulation", "embed"), dtype=dtype, key=key)
        if norm_type == "layer_norm":
            self.norm = LayerNorm(dim, eps=eps, elementwise_affine=elementwise_affine, use_bias=bias, dtype=dtype)
        elif norm_type == "rms_norm":
            self.norm = RMSNorm(dim, eps=eps, elementwise_affine=elementwise_affine, dtype=dtype)
        else:
            raise ValueError(f"AdaLayerNormContinuous: norm_type={norm_type!r}; choose 'layer_norm' or 'rms_norm'")

    @typechecked
    def __call__(self, x: Float[Array, "batch *tokens dim"],
                 cond: Float[Array, "batch *#tokens cond"]) -> Float[Array, "batch *tokens dim"]:
        scale, shift = jnp.split(self.linear(silu(cond).astype(x.dtype)), 2, axis=-1)
        return modulate(self.norm(x), shift, scale)


class ScaleShiftTable(eqx.Module):
    """A learned table of ``num`` modulation vectors, held as the checkpoint's ``scale_shift_table`` parameter
    (``shape``: ``(num, dim)`` for LTX, ``(1, num, dim)`` for Wan), added to a timestep embedding.

    Calling it with ``temb`` gives ``num`` vectors ``[batch, (seq,) dim]`` in float32: ``temb`` is
    ``[batch, (seq,) num, dim]`` (one embedding per vector, Wan's blocks) or ``[batch, (seq,) num * dim]`` (the same,
    flat: LTX's blocks); with ``shared=True`` it is ``[batch, (seq,) dim]``, one embedding for all (the output heads).
    The caller says which: by shape alone, per-token ``[batch, seq, dim]`` with ``seq == num`` reads as one
    embedding per vector."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"weight": ""}  # the parameter is the field itself

    # The table, named as every adaptable parameter is: an ``adapters`` slot holds whole differences of it
    # (lightx2v's ``diff_m`` files), added at call time.
    weight: Float[Array, "*one num dim"]
    adapters: Adapters | None
    # The table's leading axes of size one ((1, num, dim): 1): declared at construction, since a stacked table
    # (scan_layers) has one more axis than the one whose axes are declared.
    leading_ones: int = eqx.field(static=True)

    def __init__(self, num: int, dim: int, *, shape: Sequence[int] | None = None, dtype=jnp.float32,
                 key: PRNGKeyArray):
        shape = tuple(shape) if shape is not None else (num, dim)
        if shape[-2:] != (num, dim) or any(s != 1 for s in shape[:-2]):
            raise ValueError(f"ScaleShiftTable: shape={shape} must be (..., 1, {num}, {dim})")
        self.weight = init_normal(key, shape, dtype) / dim**0.5
        self.adapters = None
        self.leading_ones = len(shape) - 2

    def param_axes(self):
        return {"weight": (None,) * self.leading_ones + ("modulation", "embed")}

    @property
    def table(self) -> Array:
        """The table (the checkpoint's ``scale_shift_table``)."""
        return self.weight

    @property
    def num(self) -> int:
        return self.table.shape[-2]

    @typechecked
    def __call__(self, temb: Float[Array, "batch *rest"], *,
                 shared: bool = False) -> tuple[Float[Array, "batch *seq dim"], ...]:
        num, dim = self.table.shape[-2:]
        if shared and temb.shape[-1] == dim:
            temb = temb[..., None, :]
        elif not shared and temb.shape[-1] == num * dim and temb.shape[-1] != dim:
            temb = temb.reshape(*temb.shape[:-1], num, dim)
        elif not shared and temb.ndim >= 3 and temb.shape[-2:] == (num, dim):
            pass
        else:
            expected = (f"[batch, (seq,) {dim}] (shared=True)" if shared else
                        f"[batch, (seq,) {num}, {dim}] or [batch, (seq,) {num * dim}]")
            raise ValueError(f"ScaleShiftTable: temb of shape {temb.shape} for a table of {num} x {dim}; expected "
                             f"{expected}")
        table, _ = adapted_parameters(self.adapters, self.weight, has_bias=False, owner="ScaleShiftTable")
        values = table.reshape(num, dim).astype(jnp.float32) + temb.astype(jnp.float32)
        return tuple(values[..., i, :] for i in range(num))


__all__ = ["AdaLayerNormContinuous", "AdaLayerNormZero", "ScaleShiftTable", "gated_residual", "modulate"]
