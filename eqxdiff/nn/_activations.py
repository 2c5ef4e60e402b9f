"""Activations computed in float32 and rounded once to the input's dtype, as PyTorch computes its activation kernels
(``F.silu``, ``F.gelu``, ``F.mish``) for bfloat16 and float16 tensors.

``jax.nn.silu`` on a bfloat16 array rounds after each of its operations (``sigmoid``, then the product): about 40% of
its results differ from PyTorch's by a bfloat16 unit, and a GELU's polynomial and ``tanh`` round more often. The
helpers here give the float32 function's result, rounded once: :func:`silu` equals ``torch.nn.functional.silu`` in
bfloat16 bit for bit, :func:`gelu` and :func:`gelu_tanh` do wherever PyTorch's formula keeps its float32 accuracy (it
loses it in the far negative tail, ``x < -3``, where the result is below a few 1e-4 and XLA's ``erfc`` form is the
more accurate one). Float32 (and float64) inputs take the ``jax.nn`` function unchanged: the same bits as before.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .._typing import Array


def in_float32(fn: Callable[[Array], Array]) -> Callable[[Array], Array]:
    """``fn`` computed in float32 for half-precision inputs (bfloat16, float16), its result rounded once to the
    input's dtype; inputs of float32 or wider go to ``fn`` as they are."""

    def rounded_once(x: Array) -> Array:
        if not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).bits >= 32:
            return fn(x)
        return fn(x.astype(jnp.float32)).astype(x.dtype)

    rounded_once.__name__ = getattr(fn, "__name__", "activation")
    return rounded_once


def _gelu(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=True)


def _quick_gelu(x: Array) -> Array:
    return x * jax.nn.sigmoid(1.702 * x)


def _mish(x: Array) -> Array:
    return x * jnp.tanh(jax.nn.softplus(x))


silu = in_float32(jax.nn.silu)
silu.__doc__ = "``x * sigmoid(x)`` in float32, rounded once to ``x``'s dtype (PyTorch's ``F.silu``)."
gelu = in_float32(_gelu)
gelu.__doc__ = "The exact (erf) GELU in float32, rounded once to ``x``'s dtype (PyTorch's ``F.gelu``)."
gelu_tanh = in_float32(_gelu_tanh)
gelu_tanh.__doc__ = ("The tanh GELU in float32, rounded once to ``x``'s dtype (PyTorch's "
                     "``F.gelu(approximate='tanh')``).")

_ACTIVATIONS = {
    "silu": silu,
    "swish": silu,
    "gelu": gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    # transformers' FastGELUActivation and AccurateGELUActivation: the tanh GELU again, in other float32 orders; and
    # GELUActivation(use_gelu_python=True): the erf GELU
    "gelu_fast": gelu_tanh,
    "gelu_accurate": gelu_tanh,
    "gelu_python": gelu,
    # transformers' NewGELUActivation and QuickGELUActivation run op by op (rounding after each in half precision);
    # one rounding of the float32 result is closer to the float32 model
    "gelu_new": gelu_tanh,
    "quick_gelu": in_float32(_quick_gelu),
    "relu": jax.nn.relu,  # exact in any dtype
    "mish": in_float32(_mish),
}


# The names :func:`activation` takes, as configs spell them (transformers' ``ACT2FN`` keys): what a config's activation
# key may say (CLIP's ``hidden_act``, T5's ``feed_forward_proj``)
ACTIVATIONS: tuple[str, ...] = tuple(_ACTIVATIONS)


def activation(name: str) -> Callable[[Array], Array]:
    """Return the activation function PyTorch configs name ``name`` (``silu``, ``gelu``, ``quick_gelu`` ...), computed
    in float32 for half-precision inputs and rounded once (:func:`in_float32`)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


__all__ = ["ACTIVATIONS", "activation", "gelu", "gelu_tanh", "in_float32", "silu"]
