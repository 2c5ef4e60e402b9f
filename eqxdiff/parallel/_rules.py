"""Logical-axis rules: one table mapping logical names to mesh axes, separately for parameters and activations.

A parameter's logical axes come from its PyTorch name and rank (:func:`param_logical_axes`); the rules turn them
into a ``PartitionSpec`` (:func:`logical_to_spec`). A dimension that does not divide by its mesh axes falls back to
fewer axes, down to replication, and the fallback is logged at debug level.
"""

import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger("eqxdiff.parallel")

MeshAxes = tuple[str, ...]


def _freeze(table: Mapping[str, str | Sequence[str] | None]) -> tuple[tuple[str, MeshAxes], ...]:
    out = []
    for name, axes in table.items():
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        out.append((name, axes))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> mesh axes, one table with a column for parameters and one for activations.

    Hashable (tuples inside) so that models can hold it in a static field. Build with :meth:`make` from dicts;
    names missing from a column are replicated.
    """

    params: tuple[tuple[str, MeshAxes], ...]
    activations: tuple[tuple[str, MeshAxes], ...]

    @classmethod
    def make(cls, params: Mapping, activations: Mapping) -> "AxisRules":
        return cls(_freeze(params), _freeze(activations))

    def replace(self, *, params: Mapping | None = None, activations: Mapping | None = None) -> "AxisRules":
        """These rules with some entries changed (``None`` as a value replicates that logical axis)."""
        p, a = dict(self.params), dict(self.activations)
        p.update(_freeze(params or {}))
        a.update(_freeze(activations or {}))
        return AxisRules(tuple(p.items()), tuple(a.items()))

    def lookup(self, kind: str, name: str | None) -> MeshAxes:
        if name is None:
            return ()
        return dict(getattr(self, kind)).get(name, ())


# The one table. Parameters: FSDP shards the model dimension ("embed") and convolution outputs over "fsdp";
# tensor parallelism puts attention heads and the MLP's hidden units on "tensor" (Megatron: column-parallel in,
# row-parallel out). Activations: the batch over data+fsdp, the token sequence over "context",
# heads and MLP units over "tensor".
DEFAULT_RULES = AxisRules.make(
    params={
        "embed": "fsdp",
        "conv_out": "fsdp",
        "conv_in": None,
        "heads": "tensor",
        "mlp": "tensor",
        "vocab": "tensor",
        "out": None,
        "norm": None,
        "kernel": None,
        "position": None,
        "layers": None,
    },
    activations={
        "batch": ("data", "fsdp"),
        "seq": "context",
        # Image rows stay whole because of an XLA bug (jax 0.10.2, GSPMD and Shardy alike, not our Conv2d: a bare
        # lax.conv under jax.grad shows it). When a 3x3 convolution's rows are split over one mesh axis and some
        # other mesh axis holds replicas of it (fsdp+context+tensor: the batch is on fsdp, "tensor" replicates the
        # convs), the SPMD partitioner all-reduces the kernel gradient over every device, not only over those
        # holding different rows: the gradient comes out multiplied by the replica count, and is garbage if the
        # kernel is also split over the replica axis. Rows over "context" are right when every other axis splits
        # the batch (e.g. data x context), and 1x1 convs are always right. The minimal reproduction is the
        # xfail(strict) test_row_sharded_conv_with_a_replica_axis_xla_bug in tests/test_parallel.py: when it
        # starts passing, "height": "context" can become the default. The tokens of the spatial transformers are
        # still split over "context" (their image-shaped tensors are constrained back to whole rows).
        "height": None,
        "width": None,
        "kv_seq": None,  # all-gathered keys/values unless a ring/ulysses kernel keeps them sharded
        "heads": "tensor",
        "mlp": "tensor",
        "embed": None,
        "channels": None,
        "head_dim": None,
    },
)

# PyTorch-name patterns -> logical axes of *our* layout (Linear [out, in], Conv2d HWIO). First match wins; a
# leaf no pattern names gets the generic axes of its rank below.
PARAM_PATTERNS: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"(.*\.)?(to_q|to_k|to_v|q_proj|k_proj|v_proj)\.weight", ("heads", "embed")),
    (r"(.*\.)?(to_q|to_k|to_v|q_proj|k_proj|v_proj)\.bias", ("heads",)),
    (r"(.*\.)?(to_out\.0|out_proj)\.weight", ("embed", "heads")),
    (r"(.*\.)?(ff\.net\.0\.proj|fc1)\.weight", ("mlp", "embed")),
    (r"(.*\.)?(ff\.net\.0\.proj|fc1)\.bias", ("mlp",)),
    (r"(.*\.)?(ff\.net\.2|fc2)\.weight", ("embed", "mlp")),
    (r"(.*\.)?token_embedding\.weight", ("vocab", "embed")),
    (r"(.*\.)?position_embedding\.weight", ("position", "embed")),
)
_GENERIC = {1: ("norm",), 2: ("out", "embed"), 4: ("kernel", "kernel", "conv_in", "conv_out")}


def param_logical_axes(name: str, shape: Sequence[int]) -> tuple[str | None, ...]:
    """The logical axes of the parameter called ``name`` (PyTorch state-dict name) with our-layout ``shape``.

    A leading stacked-layers axis (``scan_layers``) is named ``"layers"``; a stacked leaf's name has a ``*`` part
    (``encoder.layers.*.fc1.weight``) and its other axes are those of one layer.
    """
    parts = name.split(".")
    if "*" in parts:
        return ("layers", *param_logical_axes(".".join("0" if p == "*" else p for p in parts), shape[1:]))
    ndim = len(shape)
    for pattern, axes in PARAM_PATTERNS:
        if re.fullmatch(pattern, name):
            if ndim == len(axes):
                return axes
            if ndim == len(axes) + 1:
                return ("layers", *axes)
    if ndim in _GENERIC:
        return _GENERIC[ndim]
    if ndim - 1 in _GENERIC:
        return ("layers", *_GENERIC[ndim - 1])
    return (None,) * ndim


def logical_to_spec(logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: AxisRules,
                    kind: str = "params", what: str = "array") -> P:
    """A ``PartitionSpec`` for ``shape`` from its logical axes. Mesh axes of size 1 are dropped; a dimension that
    does not divide by its axes keeps the longest prefix that divides (possibly none: replicated); a mesh axis
    already used by an earlier dimension is not used twice."""
    if len(logical) != len(shape):
        raise ValueError(f"{what}: {len(logical)} logical axes {tuple(logical)} for shape {tuple(shape)}")
    used: set[str] = set()
    spec = []
    for dim, name in zip(shape, logical):
        axes = [a for a in rules.lookup(kind, name) if a in mesh.shape and mesh.shape[a] > 1 and a not in used]
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            dropped = axes.pop()
            logger.debug("%s: dim of size %d (%s) does not divide over %s; not sharding it on %r", what, dim, name,
                         {a: mesh.shape[a] for a in axes + [dropped]}, dropped)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def param_spec(name: str, shape: Sequence[int], mesh: Mesh, rules: AxisRules = DEFAULT_RULES) -> P:
    return logical_to_spec(param_logical_axes(name, shape), shape, mesh, rules, "params", what=name)


def sharding_fn(mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """``fn(name, shape) -> NamedSharding`` for ``eqxdiff.load(..., sharding=fn)``: each device reads only its
    slice of every tensor, so a checkpoint loads straight onto an FSDP mesh."""

    def fn(name: str, shape: tuple[int, ...]) -> NamedSharding:
        return NamedSharding(mesh, param_spec(name, shape, mesh, rules))

    return fn


def param_shardings(model, mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """A pytree like ``model`` (arrays or ``ShapeDtypeStruct`` s) holding each parameter's ``NamedSharding``."""
    from ..loading import leaf_specs

    leaves, specs, treedef = leaf_specs(model)
    fn = sharding_fn(mesh, rules)
    return jax.tree_util.tree_unflatten(treedef, [fn(s.name, tuple(x.shape)) for x, s in zip(leaves, specs)])


def shard_params(model, mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """``model`` with every parameter placed on its rule-given ``NamedSharding``. ``ShapeDtypeStruct`` leaves
    get the sharding attached instead (abstract models, for compiling without weights)."""
    from ..loading import leaf_specs

    leaves, specs, treedef = leaf_specs(model)
    fn = sharding_fn(mesh, rules)
    out = []
    for x, s in zip(leaves, specs):
        target = fn(s.name, tuple(x.shape))
        if isinstance(x, jax.ShapeDtypeStruct):
            out.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=target))
        else:
            out.append(jax.device_put(x, target))
    return jax.tree_util.tree_unflatten(treedef, out)


def activation_sharding(mesh: Mesh, logical: Sequence[str | None], shape: Sequence[int],
                        rules: AxisRules = DEFAULT_RULES) -> NamedSharding:
    """The ``NamedSharding`` of an activation (or a batch of inputs) with these logical axes."""
    return NamedSharding(mesh, logical_to_spec(logical, shape, mesh, rules, "activations",
                                               what=f"activation {tuple(logical)}"))
