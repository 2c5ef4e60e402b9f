"""Train-state checkpoints with orbax: saved asynchronously every N steps, the last K kept, resumed exactly.

A checkpoint holds every array of the :class:`TrainState` (trainable params, optimizer state, EMA, step, PRNG key)
as a flat list in the state's own leaf order, plus the data iterator's state as JSON. The frozen half of the model
is not saved: it is rebuilt the same way (or, from scratch, reloaded from the autoencoder stage's folder).
"""

from pathlib import Path

import jax
import numpy as np


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_saveable(state) -> dict:
    leaves = jax.tree.leaves(state)
    return {f"{i:05d}": jax.random.key_data(x) if _is_key(x) else x for i, x in enumerate(leaves)}


class Checkpointer:
    """``orbax.checkpoint.CheckpointManager`` around a train state and a data iterator with
    ``get_state``/``set_state``. ``every``: save when ``step % every == 0``; ``keep``: how many to keep."""

    def __init__(self, directory, *, every: int, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp

        if every < 1 or keep < 1:
            raise ValueError(f"checkpoint every={every} and keep={keep} must be >= 1")
        self.directory = Path(directory).absolute()
        self.every = every
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                 enable_async_checkpointing=async_save))

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_iterator=None) -> None:
        """Start saving ``state`` (and the iterator's position) as ``step``; returns before the write finishes."""
        ocp = self._ocp
        data = data_iterator.get_state() if data_iterator is not None else {}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_to_saveable(state)),
                                                        data=ocp.args.JsonSave(data)))

    def restore(self, state, data_iterator=None, *, step: int | None = None):
        """``state``'s structure filled from checkpoint ``step`` (default: the latest); sets the iterator's
        position. Arrays land with the sharding of ``state``'s leaves, and stay uncommitted where those are (a
        committed array is a different jit signature: the train step would compile a second time on resume)."""
        ocp = self._ocp
        self.manager.wait_until_finished()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        leaves, treedef = jax.tree.flatten(state)
        target = {}
        for i, x in enumerate(leaves):
            like = jax.random.key_data(x) if _is_key(x) else x
            target[f"{i:05d}"] = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=getattr(like, "sharding", None))
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                 data=ocp.args.JsonRestore()))
        saved = out["state"]
        if len(saved) != len(leaves):
            raise ValueError(f"checkpoint {step} in {self.directory} has {len(saved)} arrays; this run's state has "
                             f"{len(leaves)}: it was written by a different model or optimizer configuration")
        restored = []
        for i, x in enumerate(leaves):
            value = saved[f"{i:05d}"]
            if tuple(np.shape(value)) != tuple(np.shape(jax.random.key_data(x) if _is_key(x) else x)):
                raise ValueError(f"checkpoint {step}: array {i} has shape {np.shape(value)}, the state expects "
                                 f"{np.shape(x)}: a different model configuration")
            if not getattr(x, "committed", True):  # keep the signature the jitted step was compiled for
                value = jax.device_put(np.asarray(value))
            restored.append(jax.random.wrap_key_data(value, impl=jax.random.key_impl(x)) if _is_key(x) else value)
        if data_iterator is not None and out["data"]:
            data_iterator.set_state(out["data"])
        return jax.tree.unflatten(treedef, restored)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
