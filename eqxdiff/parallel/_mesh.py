"""The device mesh (``data, fsdp, context, tensor``) from MaxDiffusion-style parallelism settings, and multi-host
start-up on JAX's own distributed runtime.

``ici_*`` sizes split the devices of one slice (one host, or one TPU slice); ``dcn_*`` sizes split across slices
(hosts over the data-centre network). At most one ``ici_*`` and one ``dcn_*`` size may be ``-1``: it takes
whatever the device count leaves.
"""

import dataclasses
import logging
import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

logger = logging.getLogger("eqxdiff.parallel")

MESH_AXES = ("data", "fsdp", "context", "tensor")


class MeshError(ValueError):
    """Parallelism settings that do not fit the devices."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh sizes per axis within a slice (``ici_*``) and across slices (``dcn_*``); ``-1`` = fill.

    The defaults give pure data parallelism over every device (MaxDiffusion's SD defaults); FSDP over one host is
    ``MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1)``.
    """

    ici_data_parallelism: int = -1
    """Devices of a host (slice) that split the batch, each holding whole weights (-1: the rest)."""
    ici_fsdp_parallelism: int = 1
    """Devices of a host that split the batch and shard the weights and optimizer state (FSDP)."""
    ici_context_parallelism: int = 1
    """Devices of a host that split the tokens (ring / Ulysses attention)."""
    ici_tensor_parallelism: int = 1
    """Devices of a host that split attention heads and MLP channels (tensor parallel)."""
    dcn_data_parallelism: int = -1
    """Hosts (slices) that split the batch (-1: every host)."""
    dcn_fsdp_parallelism: int = 1
    """Hosts that shard the weights between them (FSDP across hosts)."""
    dcn_context_parallelism: int = 1
    """Hosts that split the tokens."""
    dcn_tensor_parallelism: int = 1
    """Hosts that split heads and MLP channels."""

    def __post_init__(self):
        for kind in ("ici", "dcn"):
            sizes = self._sizes(kind)
            for axis, n in zip(MESH_AXES, sizes):
                if not isinstance(n, int) or (n < 1 and n != -1):
                    raise MeshError(f"{kind}_{axis}_parallelism={n!r} must be a positive int, or -1 to fill "
                                    "from the device count")
            if sizes.count(-1) > 1:
                filled = [f"{kind}_{a}_parallelism" for a, n in zip(MESH_AXES, sizes) if n == -1]
                raise MeshError(f"only one {kind}_* parallelism may be -1, got {filled}")

    def _sizes(self, kind: str) -> list[int]:
        return [getattr(self, f"{kind}_{axis}_parallelism") for axis in MESH_AXES]

    def shapes(self, num_devices: int, num_slices: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(ici_shape, dcn_shape)`` with ``-1`` filled, for ``num_devices`` devices in ``num_slices`` slices."""
        if num_devices % num_slices:
            raise MeshError(f"{num_devices} devices do not split into {num_slices} equal slices")
        dcn = _fill(self._sizes("dcn"), num_slices, "dcn", f"{num_slices} slice(s)/host(s)")
        ici = _fill(self._sizes("ici"), num_devices // num_slices, "ici",
                    f"{num_devices // num_slices} device(s) per slice")
        return ici, dcn

    def mesh_shape(self, num_devices: int, num_slices: int = 1) -> dict[str, int]:
        ici, dcn = self.shapes(num_devices, num_slices)
        return {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn)}


def _fill(sizes: list[int], total: int, kind: str, what: str) -> tuple[int, ...]:
    """``sizes`` with ``-1`` filled so that they multiply to ``total``; a :class:`MeshError` naming each setting
    and the sizes to change otherwise (``what``: the devices, in words)."""
    known = math.prod(n for n in sizes if n != -1)
    settings = ", ".join(f"{kind}_{a}_parallelism={n}" for a, n in zip(MESH_AXES, sizes))
    if -1 in sizes:
        if total % known:
            fixed = " or ".join(f"{kind}_{a}_parallelism={n}" for a, n in zip(MESH_AXES, sizes) if n > 1)
            raise MeshError(f"{settings}: the fixed sizes multiply to {known}, which does not divide the {what}; "
                            f"change {fixed} so that the fixed sizes multiply to a divisor of {total}")
        sizes = [total // known if n == -1 else n for n in sizes]
    elif known != total:
        raise MeshError(f"{settings} multiply to {known} but there are {what}; make the product {total} or set "
                        f"one of them to -1")
    return tuple(sizes)


def _process_is_granule(devices) -> bool:
    """Whether the ``dcn`` granules are processes (hosts) rather than TPU slices. Off TPU, devices report no
    ``slice_index`` or (CPUs) 0 on every host: there each process is one granule."""
    slices = {getattr(d, "slice_index", None) for d in devices}
    return None in slices or (len(slices) == 1 and devices[0].platform != "tpu")


def _num_slices(devices) -> int:
    if _process_is_granule(devices):
        return len({d.process_index for d in devices})
    return len({d.slice_index for d in devices})


def make_mesh(config: MeshConfig = MeshConfig(), devices=None) -> Mesh:
    """A :class:`jax.sharding.Mesh` with axes ``("data", "fsdp", "context", "tensor")`` over ``devices``
    (default: every device of every process). Axes are ``Auto``: the compiler partitions what the sharding
    rules leave open. Raises :class:`MeshError` when the settings do not multiply to the device count."""
    devices = list(jax.devices() if devices is None else devices)
    slices = _num_slices(devices)
    ici, dcn = config.shapes(len(devices), slices)
    shape = tuple(i * d for i, d in zip(ici, dcn))
    if math.prod(dcn) > 1:
        arr = _hybrid(ici, dcn, devices, process_is_granule=_process_is_granule(devices))
    else:
        try:
            arr = _device_grid(shape, devices)
        except Exception as e:  # noqa: BLE001 - topology-aware placement failed: plain order is still correct
            logger.debug("make_mesh: topology-aware placement failed (%s); using device order", e)
            arr = np.asarray(devices, dtype=object).reshape(shape)
    mesh = Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    logger.info("make_mesh: %s", dict(mesh.shape))
    return mesh


def _device_grid(shape, devices):
    from jax.experimental import mesh_utils

    return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)


def _hybrid(ici, dcn, devices, process_is_granule):
    from jax.experimental import mesh_utils

    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=process_is_granule,
                                                allow_split_physical_axes=True)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, **kwargs) -> None:
    """Start JAX's distributed runtime (``jax.distributed.initialize``) once per host, before any other JAX call.

    Arguments default to the environment: ``EQXDIFF_COORDINATOR`` (``host:port`` of process 0),
    ``EQXDIFF_NUM_PROCESSES``, ``EQXDIFF_PROCESS_ID``. With none of them set, JAX's own cluster detection runs
    (TPU pods, SLURM, Open MPI, ...). A single process with nothing set does nothing.
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("EQXDIFF_COORDINATOR")
    if num_processes is None and env.get("EQXDIFF_NUM_PROCESSES"):
        num_processes = int(env["EQXDIFF_NUM_PROCESSES"])
    if process_id is None and env.get("EQXDIFF_PROCESS_ID"):
        process_id = int(env["EQXDIFF_PROCESS_ID"])
    given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        raise MeshError(f"initialize_distributed: got {', '.join(k for k, v in given.items() if v is not None)} "
                        f"but not {missing}; give all three (or set EQXDIFF_COORDINATOR, EQXDIFF_NUM_PROCESSES, "
                        "EQXDIFF_PROCESS_ID), or none to let JAX detect the cluster")
    if num_processes == 1:
        return
    if coordinator_address is None and not _cluster_detectable():
        logger.info("initialize_distributed: no coordinator and no cluster environment; single process")
        return
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, **kwargs)
    logger.info("initialize_distributed: process %d of %d", jax.process_index(), jax.process_count())


def _cluster_detectable() -> bool:
    markers = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
               "JAX_COORDINATOR_ADDRESS")
    return any(m in os.environ for m in markers)
