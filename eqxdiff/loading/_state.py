"""Map a module's leaves to PyTorch state-dict names, fill an abstract module from a checkpoint, and back.

A leaf's PyTorch name is its attribute path (``down_blocks.0.resnets.1.conv1.weight``). A module class may
declare ``TORCH_RENAMES = {"field": "torch.name"}`` (``""`` puts the field's contents at the parent's
prefix) and its layers declare ``TORCH_PERMUTATIONS = {"weight": perm}`` with ``ours = transpose(torch, perm)``.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint does not match the model it is loaded into, or cannot be read."""


@dataclass(frozen=True)
class LeafSpec:
    name: str  # PyTorch state-dict name
    perm: tuple[int, ...] | None  # ours = transpose(torch, perm)


def _is_array_leaf(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))


def leaf_specs(module) -> tuple[list, list[LeafSpec], object]:
    """Return ``(leaves, specs, treedef)`` for every array leaf of ``module`` (arrays or ShapeDtypeStructs)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    leaves, specs = [], []
    for path, leaf in flat:
        parts, obj, perm = [], module, None
        for entry in path:
            if isinstance(entry, jax.tree_util.GetAttrKey):
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
        specs.append(LeafSpec(".".join(parts), perm))
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
    ``jax.sharding.Sharding`` for a leaf, in which case each device reads only its own slice. Tensors whose
    names fully match a regex in ``ignore`` may be present without being used. Every leaf must be found and,
    apart from those, every tensor used; otherwise a :class:`CheckpointError` names them.
    """
    leaves, specs, treedef = leaf_specs(abstract)
    available = set(checkpoint.names())
    wanted = {s.name for s in specs}
    missing = wanted - available
    unexpected = {n for n in available - wanted if not any(re.fullmatch(p, n) for p in ignore)}
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing from the {where}: {_short(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) in the {where} that the model does not use: "
                        f"{_short(unexpected)}")
    for leaf, spec in zip(leaves, specs):
        if spec.name in available:
            want = _torch_shape(leaf.shape, spec.perm)
            got = tuple(checkpoint.shape(spec.name))
            if want != got:
                problems.append(f"tensor {spec.name!r} has shape {got} in the {where} but the model expects {want}")
    if problems:
        raise CheckpointError("; ".join(problems) + ". Check that config.json belongs to these weights.")

    out = []
    for leaf, spec in zip(leaves, specs):
        target = leaf.dtype
        if dtype is not None and jnp.issubdtype(leaf.dtype, jnp.floating):
            target = jnp.dtype(dtype)
        out.append(_load_leaf(checkpoint, spec, leaf.shape, target, sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def _load_leaf(checkpoint, spec: LeafSpec, shape, dtype, sharding):
    def read(index=None):
        arr = checkpoint.get(spec.name)
        if index is not None:
            torch_index = [slice(None)] * arr.ndim
            for i, sl in enumerate(index):
                torch_index[spec.perm[i] if spec.perm else i] = sl
            arr = arr[tuple(torch_index)]
        if spec.perm is not None:
            arr = np.transpose(arr, spec.perm)
        return np.asarray(arr, dtype=dtype)

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
        if spec.perm is not None:
            arr = np.transpose(arr, np.argsort(spec.perm))
        out[spec.name] = np.ascontiguousarray(arr)
    return out
