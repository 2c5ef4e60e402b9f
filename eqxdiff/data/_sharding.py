"""From a host batch (NumPy) to a global ``jax.Array`` sharded over the mesh's batch axes."""

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

BATCH_AXES = ("data", "fsdp")


def batch_sharding(mesh: Mesh, batch_axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
    """Leading (batch) axis split over those of ``batch_axes`` the mesh has; the other axes replicated."""
    axes = tuple(a for a in batch_axes if a in mesh.axis_names)
    if not axes:
        raise ValueError(f"the mesh has none of the batch axes {tuple(batch_axes)}; its axes are {mesh.axis_names}")
    return NamedSharding(mesh, PartitionSpec(axes))


def _batch_shards(sharding: jax.sharding.Sharding) -> int:
    if isinstance(sharding, NamedSharding) and len(sharding.spec) > 0 and sharding.spec[0] is not None:
        axes = sharding.spec[0] if isinstance(sharding.spec[0], tuple) else (sharding.spec[0],)
        return int(np.prod([sharding.mesh.shape[a] for a in axes]))
    return 1


def to_global_batch(batch: dict[str, np.ndarray], mesh_or_sharding: Mesh | jax.sharding.Sharding, *,
                    batch_axes: Sequence[str] = BATCH_AXES) -> dict[str, jax.Array]:
    """Make each host's batch part of one global ``jax.Array`` per key (``jax.make_array_from_process_local_data``).

    Args:
        batch: this host's batch, ``{name: array [host_batch, ...]}`` (as ``make_dataset`` yields).
        mesh_or_sharding: a ``Mesh`` (then the batch is split over ``batch_axes``, see ``batch_sharding``) or a
            sharding used for every key (e.g. one from the logical-axis rules' ``batch`` axis).
        batch_axes: mesh axes the batch dimension is split over when a mesh is given.

    Returns:
        ``{name: jax.Array [host_batch * process_count, ...]}`` with the given sharding.
    """
    sharding = batch_sharding(mesh_or_sharding, batch_axes) if isinstance(mesh_or_sharding, Mesh) else mesh_or_sharding
    out = {}
    for name, value in batch.items():
        value = np.asarray(value)
        global_batch = value.shape[0] * jax.process_count()
        shards = _batch_shards(sharding)
        if global_batch % shards:
            raise ValueError(f"{name}: the global batch of {global_batch} ({value.shape[0]} per host x "
                             f"{jax.process_count()} hosts) is not divisible by the {shards} batch shards of "
                             f"{sharding}; choose a batch size that is a multiple of {shards}")
        out[name] = jax.make_array_from_process_local_data(sharding, value)
    return out
