"""Fill an abstract module from a checkpoint, and the module's parameters back as a PyTorch state dict.

Names, layouts and stacked layers are :func:`eqxdiff.core.leaf_specs`'s.
"""

import re
import warnings
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from .. import nn
from ..core import LeafSpec, leaf_specs
from ._errors import CheckpointError


class AdaptersNotSavedWarning(UserWarning):
    """A model written out held adapters that were not fused into its weights: the checkpoint leaves them out."""


def _short(names: Iterable[str], limit: int = 12) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def keeps_float32(name: str, modules: Iterable[str]) -> bool:
    """Whether checkpoint name ``name`` belongs to one of ``modules``: one of its dot-separated parts is one of them
    (diffusers' and transformers' rule for ``_keep_in_fp32_modules``)."""
    return not set(name.split(".")).isdisjoint(modules)


def fill_module(abstract, checkpoint, *, dtype=None, sharding: Callable | None = None,
                ignore: Iterable[str] = (), where: str = "checkpoint",
                hint: str = "Check that config.json belongs to these weights.",
                keep_float32: Iterable[str] = ()):
    """Fill ``abstract`` (a module of ``ShapeDtypeStruct`` leaves) from ``checkpoint``.

    ``checkpoint`` offers ``names()``, ``shape(name)`` and ``get(name) -> numpy array``. Floating leaves take
    ``dtype`` (default: the abstract leaf's dtype), except those of the modules named in ``keep_float32``
    (:func:`keeps_float32`; a model's :meth:`~eqxdiff.models.PretrainedModel.keep_in_float32`), which take float32.
    ``sharding(spec, shape)`` (``spec`` the leaf's :class:`~eqxdiff.core.LeafSpec`: name and logical axes) may
    return a ``jax.sharding.Sharding`` for a leaf, in which case each device reads only its own slice (a stacked
    leaf is asked for with its ``*`` name and stacked shape, and each device reads only its layers' slices). Tensors
    whose names fully match a regex in ``ignore`` may be present without being used. Every leaf must be found and,
    apart from those, every tensor used; otherwise a :class:`CheckpointError` names them, then says ``hint``.
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
    wrong = [f"{name!r} has shape {tuple(checkpoint.shape(name))} where the model expects {want}"
             for leaf, spec in zip(leaves, specs) for want in [spec.torch_shape(leaf.shape)] for name in spec.names
             if name in available and tuple(checkpoint.shape(name)) != want]
    if wrong:  # a few named, as the lists above: a whole model of other widths is every tensor
        more = f" ... and {len(wrong) - 4} more" if len(wrong) > 4 else ""
        problems.append(f"{len(wrong)} tensor(s) of another shape in the {where}: {', '.join(wrong[:4])}{more}")
    if problems:
        raise CheckpointError("; ".join(problems) + ". " + hint)

    out, keep = [], frozenset(keep_float32)
    for leaf, spec in zip(leaves, specs):
        target = leaf.dtype
        if dtype is not None and jnp.issubdtype(leaf.dtype, jnp.floating):
            target = jnp.dtype(dtype)
        if keep and jnp.issubdtype(leaf.dtype, jnp.floating) and keeps_float32(spec.name, keep):
            target = jnp.dtype(jnp.float32)
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

    target = sharding(spec, tuple(shape)) if sharding is not None else None
    if target is None:  # a copy (never a view of the file's memmap); jnp.asarray compiles a program per shape
        return jax.device_put(read(), may_alias=False)
    return jax.make_array_from_callback(tuple(shape), target, read)


def without_adapters(module):
    """``(module, layers)``: ``module`` with its layers' adapter slots emptied (:mod:`eqxdiff.nn`'s LoRA / LyCORIS
    adapters, unfused), and how many layers held some."""
    held = nn.adapters_at(module)
    return nn.with_adapters(module, dict.fromkeys(held)), len(held)


def state_dict(module) -> dict[str, np.ndarray]:
    """The module's parameters as a PyTorch-layout ``{name: numpy array}`` mapping: its weights only. Adapters
    held unfused in its layers are left out, with an :class:`AdaptersNotSavedWarning` (a checkpoint in the model's
    names has no place for them: fusing merges them into the weights)."""
    module, adapted = without_adapters(module)
    if adapted:
        warnings.warn(f"{type(module).__name__} holds unfused LoRA/LyCORIS adapters in {adapted} layers: they are "
                      "left out, only the weights are written. To bake them in, fuse them first (pipe.fuse_lora(), "
                      "or eqxdiff.nn.fuse_adapters(model) for a model) and write it again", AdaptersNotSavedWarning,
                      stacklevel=3)
    leaves, specs, _ = leaf_specs(module)
    out = {}
    for leaf, spec in zip(leaves, specs):
        arr = np.asarray(jax.device_get(leaf))
        for name, layer in zip(spec.names, arr if spec.layers is not None else [arr]):
            if spec.perm is not None:
                layer = np.transpose(layer, np.argsort(spec.perm))
            out[name] = np.require(layer, requirements="C")  # C-contiguous; a 0-d array stays 0-d
    return out
