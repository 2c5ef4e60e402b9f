"""The training loop: data-parallel placement, the jitted step, metrics, checkpoints, profiler traces, samples."""

import time
from collections.abc import Callable, Iterator, Sequence

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ._data import DataError, check_batch
from ._metrics import MetricsLogger, step_flops
from ._step import train_step


def data_parallel_mesh(devices: Sequence | None = None) -> jax.sharding.Mesh:
    """A 1-D ``("data",)`` mesh over ``devices`` (default: all of them)."""
    devices = list(jax.devices() if devices is None else devices)
    return jax.sharding.Mesh(np.asarray(devices), ("data",))


def place(tree, mesh: jax.sharding.Mesh | None, spec: PartitionSpec):
    """Put every array leaf of ``tree`` on ``mesh`` with ``spec`` (no-op without a mesh)."""
    if mesh is None:
        return tree
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.device_put(x, sharding) if eqx.is_array(x) else x, tree)


def shard_batch(batch: dict, mesh: jax.sharding.Mesh | None) -> dict:
    """The batch as device arrays, split along its first axis over the mesh's ``data`` axis."""
    if mesh is None:
        return {k: jax.numpy.asarray(v) for k, v in batch.items()}
    n = mesh.shape["data"]
    b = len(next(iter(batch.values())))
    if b % n:
        raise DataError(f"batch size {b} must be a multiple of the {n} devices of the data-parallel mesh")
    return {k: jax.device_put(np.asarray(v), NamedSharding(mesh, PartitionSpec("data"))) for k, v in batch.items()}


def fit(state, frozen, batches: Iterator[dict], *, steps: int, scheduler, objective, optimizer,
        ema_decay: float = 0.9999, mesh: jax.sharding.Mesh | None = None, logger: MetricsLogger | None = None,
        log_every: int = 10, checkpointer=None, profile_steps: Sequence[int] = (), profile_dir=None,
        sample_every: int = 0, sample_fn: Callable | None = None, on_step: Callable | None = None):
    """Train until ``state.step == steps``; returns ``(state, losses)`` (the loss of every step run here).

    The first batch is checked before anything is compiled (:func:`eqxdiff.train.check_batch`). With ``mesh`` the
    state is replicated and each batch is sharded over the ``data`` axis. ``checkpointer`` (a
    :class:`eqxdiff.train.Checkpointer`) saves every ``checkpointer.every`` steps along with ``batches``'s
    position; ``profile_steps`` writes a JAX profiler trace of those steps to ``profile_dir``; ``sample_fn(state)``
    returns uint8 images logged every ``sample_every`` steps.
    """
    start = int(state.step)
    if start >= steps:
        return state, []
    first = next(batches)
    check_batch(first, where="the first training batch")
    state = place(state, mesh, PartitionSpec())
    frozen = place(frozen, mesh, PartitionSpec())
    kwargs = dict(scheduler=scheduler, objective=objective, optimizer=optimizer, ema_decay=ema_decay)
    batch = shard_batch(first, mesh)
    if logger is not None:  # compile ahead of time once, to read the FLOPs of a step, and run that program
        step_fn = train_step.lower(state, frozen, batch, **kwargs).compile()
        flops = step_flops(step_fn)
    else:  # the jit cache: runs sharing the same shapes and settings compile once
        step_fn, flops = train_step, None
    devices = 1 if mesh is None else mesh.size
    losses, pending, tracing = [], [], False
    t_last, n_last = time.perf_counter(), start
    for step in range(start, steps):
        if step in profile_steps and profile_dir is not None and not tracing:
            jax.profiler.start_trace(str(profile_dir))
            tracing = True
        state, metrics = step_fn(state, frozen, batch, **kwargs)
        pending.append(metrics)
        done = step + 1
        if tracing and done not in profile_steps:
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
            tracing = False
        if done % log_every == 0 or done == steps or (checkpointer is not None and checkpointer.due(done)):
            fetched = jax.device_get(pending)
            losses.extend(float(m["loss"]) for m in fetched)
            pending = []
            now = time.perf_counter()
            dt = (now - t_last) / max(done - n_last, 1)
            row = {**fetched[-1], "step_time": dt,
                   "samples_per_second": len(first[next(iter(first))]) / dt,
                   "tflops_per_device": None if flops is None else flops / dt / 1e12}
            if not np.isfinite(row["loss"]):
                raise FloatingPointError(f"loss became {row['loss']} at step {done}; lower the learning rate")
            if logger is not None:
                logger.log(done, row)
            t_last, n_last = now, done
        if checkpointer is not None and checkpointer.due(done):
            checkpointer.save(done, state, batches)
        if sample_fn is not None and sample_every and done % sample_every == 0 and logger is not None:
            logger.images(done, "samples", sample_fn(state))
            t_last = time.perf_counter()
        if on_step is not None:
            on_step(done, state)
        if done < steps:
            batch = shard_batch(next(batches), mesh)
    if tracing:
        jax.profiler.stop_trace()
    if checkpointer is not None:
        checkpointer.wait()
    return state, losses
