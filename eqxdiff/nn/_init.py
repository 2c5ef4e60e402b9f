"""Random initialisers of the layers' parameters, and :func:`build_abstract`, which builds a module's shapes alone.

A module built to be filled from a checkpoint is built abstractly (``eqx.filter_eval_shape``): its constructor is
traced and every array becomes a ``jax.ShapeDtypeStruct``. Tracing a random draw per parameter was most of the cost
of that (a nested ``jit`` traced for each of a UNet's ~300 parameters: about 0.4 s of the digits pipeline's load on
a CPU), and the values are thrown away. Inside :func:`build_abstract` the initialisers return zeros of the same shape
and dtype instead (one cheap operation each); the traced shapes, dtypes and static fields are unchanged, and outside
it (a model built for training from scratch, ``eqxdiff.models.*(config, key=...)``) they draw as before.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

_SHAPES_ONLY = contextvars.ContextVar("eqxdiff_nn_shapes_only", default=False)


@contextlib.contextmanager
def _shapes_only() -> Iterator[None]:
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def init_uniform(key, shape, bound: float, dtype) -> jax.Array:
    """``U(-bound, bound)`` of ``shape`` (PyTorch's default for linear and convolution layers)."""
    if _SHAPES_ONLY.get():
        return jnp.zeros(shape, dtype)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def init_normal(key, shape, dtype) -> jax.Array:
    """``N(0, 1)`` of ``shape``, drawn in ``dtype`` (callers scale it)."""
    if _SHAPES_ONLY.get():
        return jnp.zeros(shape, dtype)
    return jax.random.normal(key, shape, dtype)


def build_abstract(build: Callable[..., Any], *args, **kwargs) -> Any:
    """``eqx.filter_eval_shape(build, *args, **kwargs)`` with the layers' initialisers drawing nothing: the module's
    structure, with ``jax.ShapeDtypeStruct`` leaves, for a loader to fill."""
    with _shapes_only():
        return eqx.filter_eval_shape(build, *args, **kwargs)
