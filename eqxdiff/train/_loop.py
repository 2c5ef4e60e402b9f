"""The training loop: placement on a device mesh, the jitted step, metrics, checkpoints, profiler traces, samples."""

import time
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ..data import to_global_batch
from ..parallel import DEFAULT_RULES, AxisRules, MeshConfig, batch_shards, make_mesh, param_shardings, shard_params
from ._data import DataError, check_batch
from ._family import TrainModel
from ._interrupt import TrainingInterrupted, stop_on_signals
from ._metrics import MetricsLogger, step_flops
from ._step import TrainState, train_step


def data_parallel_mesh(devices: Sequence | None = None) -> jax.sharding.Mesh:
    """The ``data, fsdp, context, tensor`` mesh of ``MeshConfig()``: pure data parallelism over ``devices``
    (default: all of them)."""
    return make_mesh(MeshConfig(), devices)


def state_shardings(state: TrainState, mesh: jax.sharding.Mesh, rules: AxisRules = DEFAULT_RULES) -> TrainState:
    """A :class:`TrainState` of ``NamedSharding`` s: the trainable ``params`` and their EMA by the logical-axis
    ``rules`` (:func:`eqxdiff.parallel.param_shardings`), every optimizer-state subtree shaped like the params
    (Adam's moments, accumulated gradients) like them, and everything else (counters, the step, the key)
    replicated."""
    params = param_shardings(state.params, mesh, rules)
    treedef = jax.tree.structure(state.params)
    replicated = NamedSharding(mesh, PartitionSpec())

    def like_params(x) -> bool:
        return jax.tree.structure(x) == treedef

    opt_state = jax.tree.map(lambda x: params if like_params(x) else replicated, state.opt_state,
                             is_leaf=like_params)
    return TrainState(params, opt_state, None if state.ema is None else params, replicated, replicated)


def shard_state(state: TrainState, frozen, mesh: jax.sharding.Mesh, rules: AxisRules = DEFAULT_RULES):
    """``(state, frozen, shardings)``: the state placed on :func:`state_shardings`, the frozen half of the model on
    its rule shardings (:func:`eqxdiff.parallel.shard_params`), and the state's shardings (which
    :func:`eqxdiff.train.train_step` keeps its output on)."""
    shardings = state_shardings(state, mesh, rules)
    return jax.device_put(state, shardings), shard_params(frozen, mesh, rules), shardings


def shard_batch(batch: dict, mesh: jax.sharding.Mesh | None, rules: AxisRules = DEFAULT_RULES) -> dict:
    """The batch as device arrays; with a mesh, one global array per key split over the rules' batch axes
    (:func:`eqxdiff.data.to_global_batch`, so on several hosts each passes its own rows)."""
    if mesh is None:
        return {k: jax.numpy.asarray(v) for k, v in batch.items()}
    n = batch_shards(mesh, rules)
    b = len(next(iter(batch.values()))) * jax.process_count()
    if b % n:
        raise DataError(f"batch size {b} must be a multiple of the {n} devices the mesh {dict(mesh.shape)} splits "
                        "a batch over (its data x fsdp axes)")
    return to_global_batch(batch, mesh, rules=rules)


def _check_finite(loss: float, step: int) -> None:
    """``FloatingPointError`` for a loss that is not finite, naming its causes."""
    if not np.isfinite(loss):
        raise FloatingPointError(f"loss became {loss} at step {step}: the weights diverged or a loss term is not "
                                 "finite; lower the learning rate (or set a max_grad_norm), and check the data and "
                                 "the objective's settings")


def fit(state, frozen, batches: Iterator[dict], *, steps: int, scheduler, objective, optimizer,
        ema_decay: float = 0.9999, mesh: jax.sharding.Mesh | None = None, rules: AxisRules = DEFAULT_RULES,
        logger: MetricsLogger | None = None, log_every: int = 10, checkpointer=None,
        profile_steps: Sequence[int] = (), profile_dir=None, sample_every: int = 0, sample_fn: Callable | None = None,
        on_step: Callable | None = None):
    """Train until ``state.step == steps``; returns ``(state, losses)`` (the loss of every step run here).

    The first batch is checked before anything is compiled (:func:`eqxdiff.train.check_batch`). With ``mesh``
    the state and the frozen half are placed by the logical-axis ``rules`` (:func:`shard_state`; replicated on a
    pure data-parallel mesh, split over ``fsdp``/``tensor`` otherwise), each batch is split over the data and fsdp
    axes, and the step keeps the state on those shardings. Give the model its :class:`eqxdiff.parallel.Plan`
    (``with_plan``) before :func:`init_state` for activation constraints and remat. ``checkpointer`` (a
    :class:`eqxdiff.train.Checkpointer`) saves every ``checkpointer.every`` steps and at ``steps`` along with
    ``batches``'s position; ``profile_steps`` writes a JAX profiler trace of those steps to ``profile_dir``;
    ``sample_fn(state)`` returns uint8 images (or videos) and their frame rate (``None`` for images), logged every
    ``sample_every`` steps.

    Ctrl-C (SIGINT) or SIGTERM stop the loop at the next step boundary: the state is saved with ``checkpointer``
    (if given) and :class:`eqxdiff.train.TrainingInterrupted` raised; a second Ctrl-C aborts at once.
    """
    start = int(state.step)
    if start >= steps:
        return state, []
    first = next(batches)
    check_batch(first, where="the first training batch", model=frozen if isinstance(frozen, TrainModel) else None)
    kwargs = dict(scheduler=scheduler, objective=objective, optimizer=optimizer, ema_decay=ema_decay)
    if mesh is not None:  # (only then: a keyword given is a different jit signature from one left out)
        state, frozen, kwargs["shardings"] = shard_state(state, frozen, mesh, rules)
    batch = shard_batch(first, mesh, rules)
    if logger is not None:  # lower and compile (through the jit cache: no second compile) to read the FLOPs
        step_fn = train_step.lower(state, frozen, batch, **kwargs).compile()
        flops = step_flops(step_fn)
    else:  # the jit cache: runs sharing the same shapes and settings compile once
        step_fn, flops = train_step, None
    losses, pending, tracing = [], [], False
    t_last, n_last = time.perf_counter(), start
    with stop_on_signals() as stop:  # Ctrl-C / SIGTERM: stop at the next step boundary
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
                fetched = _flush(pending, losses)
                pending = []
                now = time.perf_counter()
                dt = (now - t_last) / max(done - n_last, 1)
                row = {**fetched[-1], "step_time": dt,
                       "samples_per_second": len(first[next(iter(first))]) / dt,
                       "tflops_per_device": None if flops is None else flops / dt / 1e12}
                _check_finite(row["loss"], done)
                if logger is not None:
                    logger.log(done, row)
                t_last, n_last = now, done
            if checkpointer is not None and checkpointer.due(done):
                checkpointer.save(done, state, batches)
            if sample_fn is not None and sample_every and done % sample_every == 0 and logger is not None:
                logger.images(done, "samples", *sample_fn(state))
                t_last = time.perf_counter()
            if on_step is not None:
                on_step(done, state)
            if stop.requested is not None and done < steps:
                _flush(pending, losses)
                raise _interrupted(done, state, batches, checkpointer, tracing)
            if done < steps:
                batch = shard_batch(next(batches), mesh, rules)
    if tracing:
        jax.profiler.stop_trace()
    if checkpointer is not None:
        if checkpointer.latest_step() != steps:  # the finished state (not twice when the last step was due)
            checkpointer.save(steps, state, batches)
        checkpointer.wait()
    return state, losses


def _interrupted(done: int, state, batches, checkpointer, tracing: bool) -> TrainingInterrupted:
    """The error of a loop stopped by a signal after step ``done``, once the profiler trace is closed and the state
    saved with ``checkpointer`` (if given; not twice when the step's own checkpoint was just written)."""
    if tracing:
        jax.profiler.stop_trace()
    if checkpointer is not None:
        if checkpointer.latest_step() != done:
            checkpointer.save(done, state, batches)
        checkpointer.wait()
    return TrainingInterrupted(done, None if checkpointer is None else checkpointer.directory)


def _flush(pending: list, losses: list) -> list:
    """The pending metrics fetched to the host, their losses appended to ``losses``."""
    fetched = jax.device_get(pending)
    losses.extend(float(m["loss"]) for m in fetched)
    return fetched
