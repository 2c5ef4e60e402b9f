"""Repeated identical layers stacked into one module and run with ``lax.scan`` (``scan_layers``).

:class:`Stacked` holds ``N`` layers of one structure as ONE layer whose array leaves have a leading ``[layers, ...]``
axis; XLA then compiles the layer once instead of ``N`` times, with the numbers of the unrolled layers. Models
run their repeated layers through :func:`run_layers` with a ``step(layer, x) -> x`` function, so the unrolled
(a tuple of layers) and the scanned path share one body; a model class lists the fields that may be stacked in
``SCAN_FIELDS`` and :func:`scan_layers` converts between the two layouts.

Checkpoints keep the unrolled names: ``eqxdiff.loading`` reads ``layers.0.x`` ... ``layers.{N-1}.x`` straight into
the stacked leaf (named ``layers.*.x``) and writes them back the same way.
"""

from collections.abc import Callable, Sequence
from typing import ClassVar, Generic, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import PRNGKeyArray
from ..core import map_modules

L = TypeVar("L")


def _index(x, i):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[i]


def _stack_leaves(*xs):
    if isinstance(xs[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
    return jnp.stack(xs)


class Stacked(eqx.Module, Generic[L]):
    """``num_layers`` layers of one structure held as one layer whose arrays have a leading layers axis.

    ``Stacked(make, n, key=key)`` builds them with ``eqx.filter_vmap(make)`` over ``jax.random.split(key, n)``:
    the same weights as ``[make(k) for k in jax.random.split(key, n)]``. ``Stacked.from_layers(layers)`` stacks
    existing layers; ``unstack()`` gives them back.
    """

    TORCH_STACKED: ClassVar[str] = "layers"  # eqxdiff.loading: this field's leaves run over layers.<i>.

    layers: L
    num_layers: int = eqx.field(static=True)

    def __init__(self, make: Callable[[PRNGKeyArray], L], num_layers: int, *, key: PRNGKeyArray):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"Stacked: num_layers={num_layers!r} must be a positive integer")
        self.layers = eqx.filter_vmap(make)(jax.random.split(key, num_layers))
        self.num_layers = num_layers

    @classmethod
    def from_layers(cls, layers: Sequence[L]) -> "Stacked[L]":
        """Stack ``layers`` (arrays or ``ShapeDtypeStruct`` s); they must share one structure, static fields and
        leaf shapes included."""
        layers = list(layers)
        if not layers:
            raise ValueError("Stacked.from_layers: no layers to stack")
        first = jax.tree.structure(layers[0])
        for i, layer in enumerate(layers[1:], 1):
            if jax.tree.structure(layer) != first:
                raise ValueError(f"Stacked.from_layers: layer {i} differs in structure from layer 0 (a different "
                                 f"class, static field or sub-layer); only identical layers can be stacked")
            for a, b in zip(jax.tree.leaves(layers[0]), jax.tree.leaves(layer)):
                if (a.shape, a.dtype) != (b.shape, b.dtype):
                    raise ValueError(f"Stacked.from_layers: layer {i} has a leaf of {b.shape} {b.dtype} where "
                                     f"layer 0 has {a.shape} {a.dtype}; only identical layers can be stacked")
        new = object.__new__(cls)
        object.__setattr__(new, "layers", jax.tree.map(_stack_leaves, *layers))
        object.__setattr__(new, "num_layers", len(layers))
        return new

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, i: int) -> L:
        """Layer ``i`` as an ordinary (unstacked) layer."""
        if not -self.num_layers <= i < self.num_layers:
            raise IndexError(f"layer {i} of a Stacked of {self.num_layers} layers")
        return jax.tree.map(lambda x: _index(x, i), self.layers)

    def unstack(self) -> list[L]:
        return [self[i] for i in range(self.num_layers)]

    def scan(self, step: Callable, x, *, collect: bool = False):
        """``x`` through the layers in order with ``lax.scan``: ``x = step(layer, x)``. Returns ``(x, outputs)``,
        ``outputs`` each layer's ``x`` (a tuple) if ``collect`` else ``None``. Any other inputs the layers need
        (masks, encoder states, embeddings) are closed over by ``step``; a remat policy goes inside ``step``."""
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def body(carry, layer_arrays):
            y = step(eqx.combine(layer_arrays, static), carry)
            return y, (y if collect else None)

        x, ys = jax.lax.scan(body, x, dynamic)
        if not collect:
            return x, None
        return x, tuple(jax.tree.map(lambda y: y[i], ys) for i in range(self.num_layers))


def run_layers(layers: "Sequence | Stacked", step: Callable, x, *, collect: bool = False):
    """``x`` through ``layers`` (a sequence, unrolled; or a :class:`Stacked`, scanned) with ``x = step(layer, x)``.

    Returns ``(x, outputs)``: ``outputs`` is the tuple of each layer's output if ``collect``, else ``None``."""
    if isinstance(layers, Stacked):
        return layers.scan(step, x, collect=collect)
    outputs = []
    for layer in layers:
        x = step(layer, x)
        outputs.append(x)
    return x, (tuple(outputs) if collect else None)


def scan_layers(model, scan: bool = True):
    """``model`` with its repeated layers stacked (``scan=True``) or unstacked back into tuples (``scan=False``).

    A module class names the fields holding repeated identical layers in ``SCAN_FIELDS``; those with two or more
    layers become a :class:`Stacked` (one layer gains nothing from a scan). Works on modules of arrays or of
    ``ShapeDtypeStruct`` s, and on any pytree shaped like a model (e.g. its gradients). Raises ``ValueError`` if no
    module in ``model`` declares ``SCAN_FIELDS``: it has no repeated layers to scan.
    """
    found = []

    def convert(module, name, value):
        if name not in getattr(type(module), "SCAN_FIELDS", ()):
            return value
        found.append(type(module).__name__)
        if scan and isinstance(value, (list, tuple)) and len(value) >= 2:
            return Stacked.from_layers(list(value))
        if not scan and isinstance(value, Stacked):
            return tuple(value.unstack())
        return value

    out = map_modules(lambda m: m, model, fields=convert)
    if not found:
        raise ValueError(f"{type(model).__name__} has no repeated layers that scan_layers stacks (no module in it "
                         "declares SCAN_FIELDS)")
    return out
