"""From a host batch (NumPy) to a global ``jax.Array`` sharded over the mesh's batch axes.

The batch's sharding is :func:`eqxdiff.parallel.batch_sharding`'s (the logical ``batch`` axis of the rules: data
and fsdp by default); this module only adds the multi-host assembly and the check that the batch really splits.
"""

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from ..parallel import DEFAULT_RULES, AxisRules, batch_sharding, batch_shards
from ._common import DataError


def _batch_shards(sharding: jax.sharding.Sharding) -> int:
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > 0 and sharding.spec[0] is not None:
        axes = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
        return math.prod(sharding.mesh.shape[a] for a in axes)
    return 1


def to_global_batch(batch: dict[str, np.ndarray], mesh_or_sharding: Mesh | jax.sharding.Sharding, *,
                    rules: AxisRules = DEFAULT_RULES) -> dict[str, jax.Array]:
    """Make each host's batch part of one global ``jax.Array`` per key (``jax.make_array_from_process_local_data``).

    Args:
        batch: this host's batch, ``{name: array [host_batch, ...]}`` (as ``make_dataset`` yields).
        mesh_or_sharding: a ``Mesh`` (then each key gets :func:`eqxdiff.parallel.batch_sharding` under ``rules``:
            the batch over the data and fsdp axes, the rest replicated) or a sharding used for every key.
        rules: the logical-axis rules giving the batch axes when a mesh is given.

    Returns:
        ``{name: jax.Array [host_batch * process_count, ...]}`` with the given sharding.

    Raises:
        DataError: the global batch does not split evenly over the mesh's batch axes.
    """
    out = {}
    for name, value in batch.items():
        value = np.asarray(value)
        global_batch = value.shape[0] * jax.process_count()
        if isinstance(mesh_or_sharding, Mesh):
            shards = batch_shards(mesh_or_sharding, rules)
            shape = (global_batch, *value.shape[1:])
            sharding = batch_sharding(mesh_or_sharding, shape, rules)
        else:
            sharding = mesh_or_sharding
            shards = _batch_shards(sharding)
        if global_batch % shards:
            raise DataError(f"{name}: the global batch of {global_batch} ({value.shape[0]} per host x "
                            f"{jax.process_count()} hosts) is not divisible by the {shards} batch shards of "
                            f"{sharding}; choose a batch size that is a multiple of {shards}")
        out[name] = jax.make_array_from_process_local_data(sharding, value)
    return out
