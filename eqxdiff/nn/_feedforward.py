"""diffusers' ``FeedForward``: ``net.2(act(net.0.proj(x)))`` (``net.1`` is dropout), the MLP of every diffusers
transformer block: GEGLU in the UNets' spatial transformers, tanh-GELU in Flux, Wan and LTX, exact GELU in Wan's
image embedder."""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray, typechecked
from ..core import Plan, constrain
from ._activations import activation as named_activation
from ._activations import gelu, gelu_tanh, silu
from ._layers import Linear

# diffusers' FeedForward activation_fn values: gated ones (proj_in twice as wide, [h, gate]) and plain ones
_GATED = {"geglu": gelu, "swiglu": silu}
_PLAIN = {"gelu": gelu, "gelu-approximate": gelu_tanh, "geglu-approximate": named_activation("quick_gelu"),
          "linear-silu": silu}
FEEDFORWARD_ACTIVATIONS = (*_GATED, *_PLAIN)


class FeedForward(eqx.Module):
    """``proj_out(act(proj_in(x)))`` with diffusers' names (``net.0.proj``, ``net.2``).

    ``activation`` (diffusers' ``activation_fn``): ``"geglu"`` / ``"swiglu"`` (``h * gelu(gate)`` / ``h *
    silu(gate)`` with ``[h, gate] = proj_in(x)``, so ``proj_in`` is twice as wide), ``"gelu"`` (exact),
    ``"gelu-approximate"`` (tanh), ``"geglu-approximate"`` (diffusers' ``ApproximateGELU``, not gated: ``x *
    sigmoid(1.702 x)``) or ``"linear-silu"``. The hidden width is ``inner_dim`` (default ``dim * mult``)."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"proj_in": "net.0.proj", "proj_out": "net.2"}

    proj_in: Linear
    proj_out: Linear
    activation: str = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, dim: int, dim_out: int | None = None, *, mult: int = 4, inner_dim: int | None = None,
                 activation: str = "geglu", bias: bool = True, dtype=jnp.float32, key: PRNGKeyArray):
        if activation not in FEEDFORWARD_ACTIVATIONS:
            raise ValueError(f"FeedForward: activation={activation!r}; choose one of {FEEDFORWARD_ACTIVATIONS}")
        k1, k2 = jax.random.split(key)
        inner = inner_dim or dim * mult
        width = 2 * inner if activation in _GATED else inner
        self.proj_in = Linear(dim, width, use_bias=bias, axes=("mlp", "embed"), dtype=dtype, key=k1)
        self.proj_out = Linear(inner, dim_out or dim, use_bias=bias, axes=("embed", "mlp"), dtype=dtype, key=k2)
        self.activation = activation

    @typechecked
    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim_out"]:
        h = self.proj_in(x)
        if self.activation in _GATED:
            h, gate = jnp.split(h, 2, axis=-1)
            h = h * _GATED[self.activation](gate)
        else:
            h = _PLAIN[self.activation](h)
        return self.proj_out(constrain(h, self.plan, ("batch", "seq", "mlp")))


__all__ = ["FEEDFORWARD_ACTIVATIONS", "FeedForward"]
