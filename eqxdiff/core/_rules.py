"""Logical-axis rules: one table mapping logical names to mesh axes, separately for parameters and activations.

Every layer declares the logical axes of its parameters (``param_axes``, read by :func:`eqxdiff.core.leaf_specs`)
and models name those of their activations where they constrain them; the rules turn logical axes into a
``PartitionSpec`` (:func:`logical_to_spec`). Every name must be in the rules (``None`` as a name, or as a name's
value, replicates): an unknown name is an error, not a silent replication, so a typo cannot go unseen. A dimension
that does not divide by its mesh axes falls back to fewer axes, down to replication, and the fallback is logged at
debug level.
"""

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

logger = logging.getLogger("eqxdiff.parallel")

MeshAxes = tuple[str, ...]
_KINDS = ("params", "activations")


def _freeze(table: Mapping[str, str | Sequence[str] | None]) -> tuple[tuple[str, MeshAxes], ...]:
    out = []
    for name, axes in table.items():
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        out.append((name, axes))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> mesh axes, one table with a column for parameters and one for activations.

    Hashable (tuples inside) so that models can hold it in a static field. Build with :meth:`make` from dicts
    (``None`` as a value replicates that name). A name missing from a column is an error when looked up
    (:meth:`lookup`): add it with :meth:`replace`.
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
        """The mesh axes of logical axis ``name`` in the ``kind`` column (``"params"`` or ``"activations"``);
        ``None`` is replicated. Raises ``ValueError`` for a name the column does not list."""
        if kind not in _KINDS:
            raise ValueError(f"AxisRules.lookup: kind={kind!r}; choose one of {_KINDS}")
        if name is None:
            return ()
        table = dict(getattr(self, kind))
        if name not in table:
            raise ValueError(f"logical axis {name!r} is not in the sharding rules' {kind}, which know "
                             f"{sorted(table)}: fix the name, or add it to the rules, e.g. "
                             f"rules.replace({kind}={{{name!r}: None}}) to replicate it (or a mesh axis name to "
                             "split it)")
        return table[name]


# The one table. Parameters: FSDP shards the model dimension ("embed") and convolution outputs over "fsdp";
# tensor parallelism puts attention heads and the MLP's hidden units on "tensor" (Megatron: column-parallel in,
# row-parallel out). Activations: the batch over data+fsdp, the token sequence over "context",
# heads and MLP units over "tensor"; video latents are [batch, frames, height, width, channels].
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
        "modulation": None,
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
        # Video frames stay whole: the video VAEs' convolutions are causal in time (each frame reads the frames
        # before it), and a transformer's video tokens are split over "context" as "seq" instead.
        "frames": None,
        "kv_seq": None,  # all-gathered keys/values unless a ring/ulysses kernel keeps them sharded
        "heads": "tensor",
        "mlp": "tensor",
        "embed": None,
        "channels": None,
        "head_dim": None,
    },
)


# The logical axes of channels-last video activations (a video VAE's, a video transformer's latents in and out).
VIDEO_AXES = ("batch", "frames", "height", "width", "channels")


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
        try:
            mesh_axes = rules.lookup(kind, name)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        axes = [a for a in mesh_axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used]
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            dropped = axes.pop()
            logger.debug("%s: dim of size %d (%s) does not divide over %s; not sharding it on %r", what, dim, name,
                         {a: mesh.shape[a] for a in axes + [dropped]}, dropped)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def activation_sharding(mesh: Mesh, logical: Sequence[str | None], shape: Sequence[int],
                        rules: AxisRules = DEFAULT_RULES) -> NamedSharding:
    """The ``NamedSharding`` of an activation (or a batch of inputs) with these logical axes."""
    return NamedSharding(mesh, logical_to_spec(logical, shape, mesh, rules, "activations",
                                               what=f"activation {tuple(logical)}"))
