"""Running on a mesh: batch sizes (fractional per device), placing inputs, and ``eqx.filter_jit`` with shardings."""

import logging
import math

import equinox as eqx
import jax
from jax.sharding import Mesh, Sharding

from ..core import DEFAULT_RULES, AxisRules, activation_sharding

logger = logging.getLogger("eqxdiff.parallel")


def global_batch_size(per_device_batch_size: float, mesh_or_count: Mesh | int) -> int:
    """The global batch for a per-device batch size, which may be fractional: 0.25 per device on 4 devices is one
    sample (the batch is then replicated over the data axes and the devices split the work some other way,
    e.g. over "context")."""
    n = mesh_or_count if isinstance(mesh_or_count, int) else mesh_or_count.size
    total = per_device_batch_size * n
    if per_device_batch_size <= 0 or abs(total - round(total)) > 1e-9 or round(total) < 1:
        raise ValueError(f"per_device_batch_size={per_device_batch_size} x {n} devices = {total:g} is not a "
                         f"whole number of samples (>= 1); pick a multiple of 1/{n}")
    return int(round(total))


def batch_shards(mesh: Mesh | None, rules: AxisRules = DEFAULT_RULES) -> int:
    """How many ways the rules split a batch on ``mesh`` (the product of the mesh's batch axes, data x fsdp by
    default; 1 without a mesh). :func:`batch_sharding` falls back to fewer axes when a batch does not divide."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in rules.lookup("activations", "batch") if a in mesh.shape)


def batch_sharding(mesh: Mesh, shape, rules: AxisRules = DEFAULT_RULES, logical=None):
    """The ``NamedSharding`` of a batch-major array: the batch over data+fsdp (the largest prefix of those axes
    that divides it), other axes replicated unless ``logical`` names them."""
    logical = logical or ("batch",) + (None,) * (len(shape) - 1)
    return activation_sharding(mesh, logical, shape, rules)


def shard_batch(tree, mesh: Mesh, rules: AxisRules = DEFAULT_RULES):
    """Every array in ``tree`` placed batch-major on ``mesh`` (see :func:`batch_sharding`)."""
    return jax.tree.map(lambda x: jax.device_put(x, batch_sharding(mesh, x.shape, rules)) if eqx.is_array(x) else x,
                        tree)


def host_local_batch(global_array_shape, mesh: Mesh, data, rules: AxisRules = DEFAULT_RULES):
    """A global ``jax.Array`` from the rows this host holds (multi-host: each host loads only its own slice of
    the batch; ``data(index)`` returns the numpy rows for a device's index)."""
    sharding = batch_sharding(mesh, global_array_shape, rules)
    return jax.make_array_from_callback(tuple(global_array_shape), sharding, data)


def _place(tree, shardings):
    if shardings is None:
        return tree
    if isinstance(shardings, Sharding):
        return jax.tree.map(lambda x: jax.device_put(x, shardings) if eqx.is_array(x) else x, tree)
    return jax.tree.map(lambda s, x: _place(x, s), shardings, tree,
                        is_leaf=lambda s: s is None or isinstance(s, Sharding))


def _constrain(tree, shardings):
    if shardings is None:
        return tree
    if isinstance(shardings, Sharding):
        return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, shardings) if eqx.is_array(x) else x,
                            tree)
    return jax.tree.map(lambda s, x: _constrain(x, s), shardings, tree,
                        is_leaf=lambda s: s is None or isinstance(s, Sharding))


def sharded_jit(fn, *, in_shardings=None, out_shardings=None, donate: str = "none"):
    """``eqx.filter_jit(fn)`` whose array arguments are placed on ``in_shardings`` (one entry per positional
    argument: a ``Sharding`` for every array in it, a pytree of them matching it, or ``None`` = as given) and
    whose outputs are constrained to ``out_shardings`` (same forms). ``donate`` is ``eqx.filter_jit``'s:
    ``"all-except-first"`` donates e.g. the optimiser state and batch of a training step, ``"all"`` everything.
    Non-array arguments stay static, as with ``eqx.filter_jit``."""

    @eqx.filter_jit(donate=donate)
    def jitted(*args, **kwargs):
        return _constrain(fn(*args, **kwargs), out_shardings)

    def call(*args, **kwargs):
        if in_shardings is not None:
            if len(in_shardings) != len(args):
                raise ValueError(f"sharded_jit: {len(in_shardings)} in_shardings for {len(args)} positional "
                                 "arguments; give one entry (None to leave as is) per argument")
            args = tuple(_place(a, s) for a, s in zip(args, in_shardings))
        return jitted(*args, **kwargs)

    call.jitted = jitted
    return call


def per_device_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays held on the first addressable device (what FSDP shrinks)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            shard = x.addressable_shards[0]
            total += math.prod(shard.data.shape) * x.dtype.itemsize
    return total
