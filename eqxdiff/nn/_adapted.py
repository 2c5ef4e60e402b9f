"""Adapters across a whole model: where they can go (:func:`adapter_sites`), putting them there
(:func:`with_adapters`), stacking one per layer of a scanned stack (:func:`stack_layers`), giving several adapters
of one layer a shape they share (:func:`harmonise`) and merging them into the weights (:func:`fuse`).

A *site* is a layer with an ``adapters`` slot (``Linear``, ``Conv2d``, ``Conv3d``; the affine norms and modulation
tables for whole differences), named by its checkpoint name
(``down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q``); inside a :class:`~eqxdiff.nn.Stacked` one site
stands for its ``layers`` layers (``...layers.*.self_attn.q_proj``) and its adapters hold a leading layers axis,
every layer the same structure: a layer a file skips holds zeros of the others' rank.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import equinox as eqx
import jax
import numpy as np

from ..core import STACKED, has_field, leaf_specs, torch_shape
from ._adapters import Adapter, Adapters, Diff, DoRA, LoRA, xp, zeros_like


@dataclasses.dataclass(frozen=True)
class Site:
    """A layer that can hold adapters. ``path``: its key path in the model; ``name``: its checkpoint name (``*``
    for the layer index of a stacked one); ``layers``: how many layers a stacked site stands for (``None``: one);
    ``shape`` / ``axes``: its weight's PyTorch shape ``[out, in, *kernel]`` and logical axes in that order;
    ``perm``: our weight layout, ``ours = transpose(torch, perm)``."""

    path: tuple
    name: str
    layers: int | None
    shape: tuple[int, ...]
    axes: tuple
    perm: tuple[int, ...] | None

    @property
    def names(self) -> tuple[str, ...]:
        """The checkpoint name of each layer it stands for."""
        if self.layers is None:
            return (self.name,)
        return tuple(self.name.replace(STACKED, str(i), 1) for i in range(self.layers))


def resolve(tree, path):
    """The node of ``tree`` at key path ``path``."""
    for entry in path:
        if isinstance(entry, jax.tree_util.GetAttrKey):
            tree = getattr(tree, entry.name)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            tree = tree[entry.idx]
        elif isinstance(entry, jax.tree_util.DictKey):
            tree = tree[entry.key]
        else:  # pragma: no cover
            raise TypeError(f"unsupported pytree path entry {entry!r}")
    return tree


def resolve_site(model, site: "Site | tuple"):
    """The layer of ``model`` at ``site`` (a :class:`Site` or its key path)."""
    return resolve(model, site.path if isinstance(site, Site) else site)


def _module_name(weight_name: str) -> str:
    if weight_name in ("weight", "_weight"):
        return ""
    for suffix in (".weight", "_weight"):
        if weight_name.endswith(suffix):
            return weight_name[:-len(suffix)]
    return weight_name


def adapter_sites(model) -> list[Site]:
    """Every layer of ``model`` with an ``adapters`` slot, in the model's order."""
    leaves, specs, _ = leaf_specs(model)
    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    sites = []
    for (path, leaf), spec in zip(flat, specs):
        last = path[-1] if path else None
        if not (isinstance(last, jax.tree_util.GetAttrKey) and last.name == "weight"):
            continue
        layer = resolve(model, path[:-1])
        if not has_field(layer, "adapters"):
            continue
        perm = spec.perm
        axes = spec.axes[1:] if spec.layers is not None else spec.axes
        sites.append(Site(tuple(path[:-1]), _module_name(spec.name), spec.layers, spec.torch_shape(leaf.shape),
                          torch_shape(axes, perm), perm))
    return sites


def with_adapters(model, adapters: Mapping[tuple, Adapters | None]):
    """``model`` with the ``adapters`` slot of the layer at each key path set (``None`` empties it)."""
    if not adapters:
        return model
    paths = list(adapters)
    return eqx.tree_at(lambda m: [resolve(m, p).adapters for p in paths], model, [adapters[p] for p in paths],
                       is_leaf=lambda x: x is None)


def adapters_at(model) -> dict[tuple, Adapters]:
    """The non-empty ``adapters`` slots of ``model`` by key path."""
    out = {}
    for site in adapter_sites(model):
        value = resolve(model, site.path).adapters
        if value is not None:
            out[site.path] = value
    return out


# -- one shape for several adapters ---------------------------------------------------------------------------


def _signature(a: Adapter):
    return jax.tree.structure(a), tuple(x.shape for x in jax.tree.leaves(a))


def as_diff(a: Adapter) -> Diff:
    """``a`` materialised as a whole difference (the same change)."""
    if isinstance(a, DoRA):
        raise ValueError("a DoRA adapter's change depends on its strength and cannot be stored as a difference; "
                         "it cannot share a stacked layer with adapters of another kind (load without scan_layers)")
    if isinstance(a, Diff):
        return a
    return Diff(a.axes, a.shape, a.delta(), a.delta_bias())


def _fill_bias(adapters: list[Adapter]) -> list[Adapter]:
    """LoRA / Diff adapters whose optional bias (or weight) difference only some hold: zeros for the others."""
    out = []
    for a in adapters:
        if isinstance(a, LoRA) and a.bias is None and any(isinstance(b, LoRA) and b.bias is not None for b in adapters):
            a = LoRA(a.axes, a.shape, a.down, a.up, a.mid, xp(a.up).zeros((a.shape[0],), a.up.dtype))
        if isinstance(a, Diff):
            if a.diff_b is None and any(isinstance(b, Diff) and b.diff_b is not None for b in adapters):
                a = Diff(a.axes, a.shape, a.diff, xp(a.diff).zeros((a.shape[0],), np.float32))
            if a.diff is None and any(isinstance(b, Diff) and b.diff is not None for b in adapters):
                a = Diff(a.axes, a.shape, xp(a.diff_b).zeros(a.shape, np.float32), a.diff_b)
        out.append(a)
    return out


def harmonise(adapters: Sequence[Adapter], rank: int | None = None) -> list[Adapter]:
    """``adapters`` (of one layer shape) given one structure and one set of shapes: ranks zero-padded to the largest
    (or to ``rank``), an optional bias filled with zeros; adapters of different kinds become :class:`Diff` s. The
    changes are the same."""
    adapters = list(adapters)
    if not adapters:
        return adapters
    top = max(a.rank for a in adapters) if rank is None else rank
    if rank is not None and any(a.rank > rank for a in adapters):
        worst = max(a.rank for a in adapters)
        raise ValueError(f"an adapter of rank {worst} does not fit max_rank={rank}; raise max_rank to at least "
                         f"{worst}")
    try:
        padded = [a.with_rank(top) if a.rank else a for a in adapters]
    except (NotImplementedError, ValueError):
        padded = adapters
    padded = _fill_bias(padded)
    if len({_signature(a) for a in padded}) == 1:
        return padded
    return _fill_bias([as_diff(a) for a in adapters])


def stack_layers(per_layer: Sequence[Adapter | None], rank: int | None = None) -> Adapter:
    """One adapter with a leading layers axis from one adapter (or ``None``: zeros) per layer of a stack."""
    present = [a for a in per_layer if a is not None]
    if not present:
        raise ValueError("stack_layers: no layer holds an adapter")
    same = harmonise(present, rank)
    template = same[0]
    it = iter(same)
    full = [next(it) if a is not None else zeros_like(template) for a in per_layer]
    return jax.tree.map(lambda *xs: xp(*xs).stack(xs), *full)


# -- merging into the weights ---------------------------------------------------------------------------------


def _fused_layer(layer):
    """``layer`` with its adapters' changes added to its weight and bias (float32 sums, cast back) and no
    adapters. A layer without a bias gets one if an adapter changes it; a layer with no bias field (an RMSNorm, a
    modulation table) refuses such a change."""
    adapters = layer.adapters
    perm = getattr(type(layer), "TORCH_PERMUTATIONS", {}).get("weight")
    dw, db = adapters.weight_update(layer.weight, perm)
    weight = layer.weight if dw is None else (layer.weight.astype(np.float32) + dw).astype(layer.weight.dtype)
    bias = getattr(layer, "bias", None)
    if db is not None:
        if not has_field(layer, "bias"):
            raise ValueError(f"{type(layer).__name__} has no bias, but an adapter changes one: the file is not for "
                             "this layer")
        dtype = layer.weight.dtype if bias is None else bias.dtype
        bias = (db if bias is None else bias.astype(np.float32) + db).astype(dtype)
    out = eqx.tree_at(lambda m: (m.weight, m.adapters), layer, (weight, None), is_leaf=lambda x: x is None)
    if bias is not getattr(layer, "bias", None):
        out = eqx.tree_at(lambda m: m.bias, out, bias, is_leaf=lambda x: x is None)
    return out


_fused_jit = eqx.filter_jit(_fused_layer)
_fused_stack_jit = eqx.filter_jit(eqx.filter_vmap(_fused_layer))
FUSE_MODES = ("jit", "host", "trace")


def _host(x):
    return np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else x


def _fused_on_host(layer, layers: int | None):
    """``_fused_layer`` in NumPy on the host (nothing compiles), the results placed where the weights were."""
    host = jax.tree.map(_host, layer)
    if layers is None:
        new = _fused_layer(host)
    else:
        new = jax.tree.map(lambda *xs: np.stack(xs),
                           *(_fused_layer(jax.tree.map(lambda x: x[i], host)) for i in range(layers)))
    new = eqx.tree_at(lambda m: m.weight, new, place_like(new.weight, layer.weight))
    if not has_field(layer, "bias"):
        return new
    bias = new.bias if layer.bias is None else place_like(new.bias, layer.bias)
    if bias is not None and not isinstance(bias, jax.Array) and isinstance(layer.weight, jax.Array):
        bias = place_like(bias, layer.weight)
    return eqx.tree_at(lambda m: m.bias, new, bias, is_leaf=lambda x: x is None)


def fuse(model, sites: Sequence[Site] | None = None, *, how: str = "jit"):
    """``model`` with every adapter merged into its layer's weight (``W + change`` summed in float32 and cast back
    to the weight's dtype) and the slots emptied: the model's structure without adapters. ``how``: ``"jit"``, each
    layer merged by a compiled program (one per layer structure, shared by the layers of it; the sums keep each
    weight's sharding: for models on a mesh); ``"host"``, in NumPy on the host, the results put where the weights
    were (nothing compiles: for models on one device); ``"trace"``, as it is (inside a caller's trace)."""
    if how not in FUSE_MODES:
        raise ValueError(f"fuse: how={how!r}; choose one of {FUSE_MODES}")
    sites = adapter_sites(model) if sites is None else sites
    updates = {}
    for site in sites:
        layer = resolve(model, site.path)
        if layer.adapters is None:
            continue
        if how == "host":
            updates[site.path] = _fused_on_host(layer, site.layers)
        elif site.layers is None:
            updates[site.path] = (_fused_jit if how == "jit" else _fused_layer)(layer)
        else:
            updates[site.path] = (_fused_stack_jit if how == "jit" else eqx.filter_vmap(_fused_layer))(layer)
    if not updates:
        return model
    paths = list(updates)
    return eqx.tree_at(lambda m: [resolve(m, p) for p in paths], model, [updates[p] for p in paths])


def map_adapters(model, fn: Callable[[Site, Adapters], Adapters | None]):
    """``model`` with each non-empty slot replaced by ``fn(site, adapters)``."""
    changes = {}
    for site in adapter_sites(model):
        value = resolve(model, site.path).adapters
        if value is not None:
            new = fn(site, value)
            if new is not value:
                changes[site.path] = new
    return with_adapters(model, changes)


def entries_kept(adapters: Adapters, keep: Sequence[int]) -> Adapters | None:
    """``adapters`` with only the entries at positions ``keep`` (``None`` when none is left)."""
    keep = list(keep)
    if not keep:
        return None
    idx = np.asarray(keep)

    def take(x):
        return place_like(np.asarray(jax.device_get(x))[..., idx], x)
    return Adapters(tuple(adapters.entries[i] for i in keep), take(adapters.scales), take(adapters.enabled))


def place_like(new: np.ndarray, old):
    """Host array ``new`` placed as ``old`` is: on its sharding if ``old`` is committed to one, else uncommitted
    (a compiled program keys on that), or left on the host if ``old`` is a host array."""
    if not isinstance(old, jax.Array):
        return new
    return jax.device_put(new, old.sharding) if old.committed else jax.device_put(new)


__all__ = ["Site", "adapter_sites", "adapters_at", "as_diff", "entries_kept", "fuse", "harmonise", "map_adapters",
           "place_like", "resolve", "resolve_site", "stack_layers", "with_adapters"]
