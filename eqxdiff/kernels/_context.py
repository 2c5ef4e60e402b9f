"""Context parallelism plumbing shared by "ring" and "ulysses": the mesh's axes, padding and the ``shard_map``.

The sequence axis of ``q``, ``k``, ``v`` (and of the key mask) is split over the mesh axis ``"context"``; the batch
axis over ``"data"``/``"fsdp"`` and the heads over ``"tensor"`` where the mesh has them and they divide the batch
and the heads (as ``eqxdiff.parallel``'s rules lay activations out); head_dim is replicated.
Sequences that do not divide by the context size are padded (padded keys are masked, padded queries dropped).
"""

import math

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ._common import AttentionUnavailableError, key_valid, pad_axis, round_up

CONTEXT_AXIS = "context"
CONTEXT_KERNELS = ("ring", "ulysses")  # the implementations that split the sequence over CONTEXT_AXIS
BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"


def context_problem(mesh_axes: tuple[str, ...] | None, what: str) -> str | None:
    """Why a mesh with these axes cannot run ``what`` ("ring", "ulysses") attention, or ``None``."""
    if mesh_axes is None:
        return f"{what} attention needs mesh=jax.sharding.Mesh(...) with a {CONTEXT_AXIS!r} axis"
    if CONTEXT_AXIS not in mesh_axes:
        return (f"{what} attention shards the sequence over a {CONTEXT_AXIS!r} mesh axis, but the mesh's axes are "
                f"{mesh_axes}")
    return None


def context_size(mesh, what: str) -> int:
    """The size of ``mesh``'s context axis; a clear error when there is no mesh or no such axis."""
    problem = context_problem(None if mesh is None else tuple(mesh.axis_names), what)
    if problem:
        raise AttentionUnavailableError(problem)
    return mesh.shape[CONTEXT_AXIS]


def _batch_axes(mesh, batch: int):
    axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
    if not axes or batch % math.prod(mesh.shape[a] for a in axes):
        return None
    return axes[0] if len(axes) == 1 else axes


def head_shards(mesh_shape, heads: int) -> int:
    """How many ways the heads are split over the ``"tensor"`` axis of a mesh with this ``{axis: size}`` shape."""
    size = dict(mesh_shape).get(HEAD_AXIS, 1)
    return size if heads % size == 0 else 1


def shard_over_context(local_fn, mesh, q, k, v, mask):
    """``local_fn(q, k, v, mask)`` on each device's sequence shard of ``[batch, seq, heads, head_dim]`` inputs.

    ``mask`` reaching ``local_fn`` is a ``[batch, kv_shard]`` key mask, or ``None`` when every key counts.
    """
    size = mesh.shape[CONTEXT_AXIS]
    q_len, kv_len = q.shape[1], k.shape[1]
    explicit = AxisType.Explicit in tuple(mesh.axis_types)
    q_spec = jax.typeof(q).sharding.spec if explicit else None
    kv_pad = round_up(kv_len, size)
    q = pad_axis(q, 1, round_up(q_len, size))
    k, v = pad_axis(k, 1, kv_pad), pad_axis(v, 1, kv_pad)
    mask = key_valid(mask, kv_len, kv_pad)
    batch = _batch_axes(mesh, q.shape[0])
    spec = P(batch, CONTEXT_AXIS, HEAD_AXIS if head_shards(mesh.shape, q.shape[2]) > 1 else None, None)
    if mask is None:
        fn, args, in_specs = (lambda q, k, v: local_fn(q, k, v, None)), (q, k, v), (spec, spec, spec)
    else:
        mask = jax.numpy.broadcast_to(mask, (q.shape[0], kv_pad))
        fn, args, in_specs = local_fn, (q, k, v, mask), (spec, spec, spec, P(batch, CONTEXT_AXIS))
    if explicit:  # explicitly sharded arrays are laid out for shard_map first, and the output like q after
        args = tuple(jax.reshard(x, NamedSharding(mesh, s)) for x, s in zip(args, in_specs))
    out = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)(*args)
    if explicit:
        out = jax.reshard(out, NamedSharding(mesh, q_spec))
    return out[:, :q_len]
