"""What each parameter of a module is called in a PyTorch checkpoint, how it is laid out, and its logical axes.

A leaf's PyTorch name is its attribute path (``down_blocks.0.resnets.1.conv1.weight``). A module class may
declare ``TORCH_RENAMES = {"field": "torch.name"}`` (``""`` puts the field's contents at the parent's prefix; a
``torch_renames()`` method instead where the names depend on the instance, as the attention layers'
(:class:`~eqxdiff.nn.AbstractAttention`)) and its layers declare ``TORCH_PERMUTATIONS = {"weight": perm}`` with
``ours = transpose(torch, perm)``.

Every module that holds arrays directly declares their logical axes, for the sharding rules
(:mod:`eqxdiff.core._rules`): ``PARAM_AXES = {"weight": ("out", "embed"), ...}`` on the class, or a
``param_axes()`` method where they depend on the instance (a :class:`~eqxdiff.nn.Linear` used as a query
projection says ``("heads", "embed")``).

Stacked layers (``eqxdiff.nn.Stacked``, ``scan_layers``): a class naming a field in ``TORCH_STACKED`` holds in it
leaves with a leading axis over its ``num_layers`` layers. Such a leaf is named with ``*`` for the layer index
(``text_model.encoder.layers.*.mlp.fc1.weight``), its first logical axis is ``"layers"``, and checkpoints never
see the stacked layout: it is read from and written to ``...layers.0...`` ... ``...layers.{N-1}...``.
"""

from collections.abc import Mapping
from dataclasses import dataclass

import jax

STACKED = "*"  # the layer-index part of a stacked leaf's name

Axes = tuple[str | None, ...]


@dataclass(frozen=True)
class LeafSpec:
    name: str  # PyTorch state-dict name; a stacked leaf's has a "*" part where the layer index goes
    perm: tuple[int, ...] | None  # ours = transpose(torch, perm), per layer for a stacked leaf
    layers: int | None = None  # stacked: the leaf's leading axis runs over this many layers
    axes: Axes | None = None  # logical axes of our layout ("layers" first if stacked); None: not declared

    @property
    def names(self) -> tuple[str, ...]:
        """The PyTorch name(s) this leaf is read from and written to: one, or one per stacked layer."""
        if self.layers is None:
            return (self.name,)
        parts = self.name.split(".")
        at = parts.index(STACKED)
        return tuple(".".join(parts[:at] + [str(i)] + parts[at + 1:]) for i in range(self.layers))

    def torch_shape(self, shape) -> tuple[int, ...]:
        """The shape of each PyTorch tensor of a leaf of (our) ``shape``."""
        return torch_shape(shape[1:] if self.layers is not None else shape, self.perm)


def _declared(module, method: str, classvar: str) -> Mapping:
    fn = getattr(module, method, None)
    return fn() if callable(fn) else getattr(type(module), classvar, {})


def declared_axes(module) -> Mapping[str, Axes]:
    """The logical axes ``module`` declares for the arrays it holds directly (field name -> axes)."""
    return _declared(module, "param_axes", "PARAM_AXES")


def torch_renames(module) -> Mapping[str, str]:
    """The checkpoint names ``module`` gives its fields where they differ from the field names."""
    return _declared(module, "torch_renames", "TORCH_RENAMES")


def torch_shape(shape, perm) -> tuple[int, ...]:
    if perm is None:
        return tuple(shape)
    out = [0] * len(shape)
    for i, p in enumerate(perm):
        out[p] = shape[i]
    return tuple(out)


def _is_leaf(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def leaf_specs(module) -> tuple[list, list[LeafSpec], object]:
    """Return ``(leaves, specs, treedef)`` for every array leaf of ``module`` (arrays or ShapeDtypeStructs)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=_is_leaf)
    leaves, specs = [], []
    for path, leaf in flat:
        parts, obj, perm, layers, axes = [], module, None, None, None
        for entry in path:
            if isinstance(entry, jax.tree_util.GetAttrKey) and entry.name == getattr(type(obj), "TORCH_STACKED", None):
                if layers is not None:
                    raise TypeError(f"{'.'.join(parts)}: stacked layers inside stacked layers are not supported")
                parts.append(STACKED)
                layers = obj.num_layers
                obj, perm, axes = getattr(obj, entry.name), None, None
            elif isinstance(entry, jax.tree_util.GetAttrKey):
                name = torch_renames(obj).get(entry.name, entry.name)
                perm = getattr(type(obj), "TORCH_PERMUTATIONS", {}).get(entry.name)
                axes = declared_axes(obj).get(entry.name)
                if name:
                    parts.append(name)
                obj = getattr(obj, entry.name)
            elif isinstance(entry, jax.tree_util.SequenceKey):
                parts.append(str(entry.idx))
                obj, perm, axes = obj[entry.idx], None, None
            elif isinstance(entry, jax.tree_util.DictKey):
                parts.append(str(entry.key))
                obj, perm, axes = obj[entry.key], None, None
            else:  # pragma: no cover - flattened keys only come from custom pytrees we do not use
                raise TypeError(f"unsupported pytree path entry {entry!r}")
        if axes is not None:
            axes = tuple(axes)
            if layers is not None:
                axes = ("layers", *axes)
            shape = tuple(getattr(leaf, "shape", ()))
            if len(axes) != len(shape):
                raise TypeError(f"{'.'.join(parts)}: {len(axes)} logical axes {axes} declared for a parameter of "
                                f"shape {shape}")
        leaves.append(leaf)
        specs.append(LeafSpec(".".join(parts), perm, layers, axes))
    return leaves, specs, treedef
