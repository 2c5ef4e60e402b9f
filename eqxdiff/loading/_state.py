"""Map a module's leaves to PyTorch state-dict names, fill an abstract module from a checkpoint, and back.

A leaf's PyTorch name is its attribute path (``down_blocks.0.resnets.1.conv1.weight``). A module class may
declare ``TORCH_RENAMES = {"field": "torch.name"}`` (``""`` puts the field's contents at the parent's
prefix) and its layers declare ``TORCH_PERMUTATIONS = {"weight": perm}`` with ``ours = transpose(torch, perm)``.

Stacked layers (``eqxdiff.nn.Stacked``, ``scan_layers``): a class naming a field in ``TORCH_STACKED`` holds in it
leaves with a leading axis over its ``num_layers`` layers. Such a leaf is named with ``*`` for the layer index
(``text_model.encoder.layers.*.mlp.fc1.weight``), is read from the ``N`` tensors ``...layers.0.mlp.fc1.weight``,
``...layers.1...`` and written back as them; checkpoints never see the stacked layout.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint does not match the model it is loaded into, or cannot be read."""


STACKED = "*"  # the layer-index part of a stacked leaf's name


@dataclass(frozen=True)
class LeafSpec:
    name: str  # PyTorch state-dict name; a stacked leaf's has a "*" part where the layer index goes
    perm: tuple[int, ...] | None  # ours = transpose(torch, perm), per layer for a stacked leaf
    layers: int | None = None  # stacked: the leaf's leading axis runs over this many layers

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
        return _torch_shape(shape[1:] if self.layers is not None else shape, self.perm)


def _is_array_leaf(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def leaf_specs(module) -> tuple[list, list[LeafSpec], object]:
    """Return ``(leaves, specs, treedef)`` for every array leaf of ``module`` (arrays or ShapeDtypeStructs)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    leaves, specs = [], []
    for path, leaf in flat:
        parts, obj, perm, layers = [], module, None, None
        for entry in path:
            if isinstance(entry, jax.tree_util.GetAttrKey) and entry.name == getattr(type(obj), "TORCH_STACKED", None):
                if layers is not None:
                    raise TypeError(f"{'.'.join(parts)}: stacked layers inside stacked layers are not supported")
                parts.append(STACKED)
                layers = obj.num_layers
                obj, perm = getattr(obj, entry.name), None
            elif isinstance(entry, jax.tree_util.GetAttrKey):
                renames = getattr(type(obj), "TORCH_RENAMES", {})
                perms = getattr(type(obj), "TORCH_PERMUTATIONS", {})
                name = renames.get(entry.name, entry.name)
                perm = perms.get(entry.name)
                if name:
                    parts.append(name)
                obj = getattr(obj, entry.name)
            elif isinstance(entry, jax.tree_util.SequenceKey):
                parts.append(str(entry.idx))
                obj, perm = obj[entry.idx], None
            elif isinstance(entry, jax.tree_util.DictKey):
                parts.append(str(entry.key))
                obj, perm = obj[entry.key], None
            else:  # pragma: no cover - flattened keys only come from custom pytrees we do not use
                raise TypeError(f"unsupported pytree path entry {entry!r}")
        leaves.append(leaf)
        specs.append(LeafSpec(".".join(parts), perm, layers))
    return leaves, specs, treedef


def _torch_shape(shape, perm):
    if perm is None:
        return tuple(shape)
    out = [0] * len(shape)
    for i, p in enumerate(perm):
        out[p] = shape[i]
    return tuple(out)


def _short(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def fill_module(abstract, checkpoint, *, dtype=None, sharding: Callable | None = None,
                ignore: Iterable[str] = (), where: str = "checkpoint"):
    """Fill ``abstract`` (a module of ``ShapeDtypeStruct`` leaves) from ``checkpoint``.

    ``checkpoint`` offers ``names()``, ``shape(name)`` and ``get(name) -> numpy array``. Floating leaves take
    ``dtype`` (default: the abstract leaf's dtype). ``sharding(name, shape)`` may return a
    ``jax.sharding.Sharding`` for a leaf, in which case each device reads only its own slice (a stacked leaf is
    asked for with its ``*`` name and stacked shape, and each device reads only its layers' slices). Tensors whose
    names fully match a regex in ``ignore`` may be present without being used. Every leaf must be found and,
    apart from those, every tensor used; otherwise a :class:`CheckpointError` names them.
    """
    leaves, specs, treedef = leaf_specs(abstract)
    available = set(checkpoint.names())
    wanted = {n for s in specs for n in s.names}
    missing = wanted - available
    unexpected = {n for n in available - wanted if not any(re.fullmatch(p, n) for p in ignore)}
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the {where}: {_short(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) in the {where} that the model does not use: "
                        f"{_short(unexpected)}")
    for leaf, spec in zip(leaves, specs):
        want = spec.torch_shape(leaf.shape)
        for name in spec.names:
            if name in available and tuple(checkpoint.shape(name)) != want:
                problems.append(f"tensor {name!r} has shape {tuple(checkpoint.shape(name))} in the {where} but "
                                f"the model expects {want}")
    if problems:
        raise CheckpointError("; ".join(problems) + ". Check that config.json belongs to these weights.")

    out = []
    for leaf, spec in zip(leaves, specs):
        target = leaf.dtype
        if dtype is not None and jnp.issubdtype(leaf.dtype, jnp.floating):
            target = jnp.dtype(dtype)
        out.append(_load_leaf(checkpoint, spec, leaf.shape, target, sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def _read(checkpoint, name: str, perm, index, dtype) -> np.ndarray:
    """Tensor ``name`` in our layout (``transpose(torch, perm)``), only the part ``index`` (ours) selects."""
    arr = checkpoint.get(name)
    if index is not None:
        torch_index = [slice(None)] * arr.ndim
        for i, sl in enumerate(index):
            torch_index[perm[i] if perm else i] = sl
        arr = arr[tuple(torch_index)]
    if perm is not None:
        arr = np.transpose(arr, perm)
    return np.asarray(arr, dtype=dtype)


def _load_leaf(checkpoint, spec: LeafSpec, shape, dtype, sharding):
    def read(index=None):
        if spec.layers is None:
            return _read(checkpoint, spec.name, spec.perm, index, dtype)
        index = tuple(index) if index is not None else (slice(None),)
        names = spec.names[index[0]]  # a device reads only the layers, and the parts of them, it holds
        return np.stack([_read(checkpoint, n, spec.perm, index[1:], dtype) for n in names])

    target = sharding(spec.name, tuple(shape)) if sharding is not None else None
    if target is None:
        return jnp.asarray(read())
    return jax.make_array_from_callback(tuple(shape), target, read)


def state_dict(module) -> dict[str, np.ndarray]:
    """The module's parameters as a PyTorch-layout ``{name: numpy array}`` mapping."""
    leaves, specs, _ = leaf_specs(module)
    out = {}
    for leaf, spec in zip(leaves, specs):
        arr = np.asarray(jax.device_get(leaf))
        for name, layer in zip(spec.names, arr if spec.layers is not None else [arr]):
            if spec.perm is not None:
                layer = np.transpose(layer, np.argsort(spec.perm))
            out[name] = np.ascontiguousarray(layer)
    return out
