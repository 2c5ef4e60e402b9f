"""Train-state checkpoints with orbax: saved asynchronously every N steps, the last K kept, resumed exactly.

A checkpoint holds every array of the :class:`TrainState` (trainable params, optimizer state, EMA, step, PRNG key)
as a flat list in the state's own leaf order, the state's layout (each array's path, shape and dtype), the data
iterator's state and the run's settings as JSON, all written together (orbax writes a step's folder under a temporary
name and renames it when complete), so a resumed run compares its settings with the ones the state was trained with
(:func:`saved_settings`), never with a ``config.json`` another run may have rewritten. The frozen half of the model
is not saved: it is rebuilt the same way (or, from scratch, reloaded from the autoencoder stage's folder). A state
whose layout differs from the checkpoint's is refused before anything is restored, with the list of what differs.
"""

import json
from pathlib import Path

import jax
import numpy as np

SETTINGS = "settings"  # the checkpoint item holding the run's settings (eqxdiff.train.run_settings)


class CheckpointMismatchError(ValueError):
    """The checkpoint was written by a run whose model or optimizer differs from this one's."""


def mismatch_message(where: str, differences: list[str], settings: str = "") -> str:
    """The message of a refused resume: what differs (settings first, if known, then arrays) and what to do."""
    lines = [f"{where} was written by a different model or optimizer configuration; nothing was restored."]
    if settings:
        lines.append(f"Settings that differ from that run's config.json: {settings}")
    lines += ["Arrays that differ:", *(f"  {d}" for d in differences)]
    lines.append("Resume with that run's settings, use another output_dir, or pass resume=False to start over.")
    return "\n".join(lines)


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _to_saveable(state) -> dict:
    leaves = jax.tree.leaves(state)
    return {f"{i:05d}": jax.random.key_data(x) if _is_key(x) else x for i, x in enumerate(leaves)}


def layout(state) -> list[list]:
    """``[path, shape, dtype]`` of every array of ``state``, in leaf order (what a checkpoint must match)."""
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        like = jax.random.key_data(x) if _is_key(x) else x
        out.append([jax.tree_util.keystr(path), list(np.shape(like)), str(np.dtype(like.dtype))])
    return out


def layout_differences(saved: list, current: list, limit: int = 12) -> list[str]:
    """Readable lines saying how two :func:`layout` s differ (arrays only in one, or of another shape/dtype)."""
    old, new = {p: (s, d) for p, s, d in saved}, {p: (s, d) for p, s, d in current}
    lines = [f"{p}: in the checkpoint only ({old[p][0]} {old[p][1]})" for p in old if p not in new]
    lines += [f"{p}: in this run only ({new[p][0]} {new[p][1]})" for p in new if p not in old]
    lines += [f"{p}: {old[p][0]} {old[p][1]} in the checkpoint, {new[p][0]} {new[p][1]} in this run"
              for p in old if p in new and old[p] != new[p]]
    return lines[:limit] + ([f"... and {len(lines) - limit} more"] if len(lines) > limit else [])


def saved_steps(directory) -> list[int]:
    """The steps of the complete checkpoints in ``directory`` (orbax's step folders: one still being written has a
    temporary name), read without opening orbax."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and p.is_dir())


def saved_settings(directory, step: int) -> dict | None:
    """The run settings checkpoint ``step`` in ``directory`` was saved with (``Checkpointer(settings=...)``);
    ``None`` for a checkpoint saved without them (by eqxdiff before it stored them)."""
    file = Path(directory) / str(step) / SETTINGS / "metadata"  # where orbax's JsonSave writes an item
    return json.loads(file.read_text()) if file.is_file() else None


class Checkpointer:
    """``orbax.checkpoint.CheckpointManager`` around a train state and a data iterator with
    ``get_state``/``set_state``. ``every``: save when ``step % every == 0`` (0: only when :meth:`save` is called,
    e.g. on Ctrl-C or at the end of the run); ``keep``: how many to keep; ``settings``: a JSON dict saved with each
    checkpoint (the run's settings: :func:`saved_settings`)."""

    def __init__(self, directory, *, every: int, keep: int = 3, async_save: bool = True,
                 settings: dict | None = None):
        import orbax.checkpoint as ocp

        if every < 0 or keep < 1:
            raise ValueError(f"checkpoint every={every} must be >= 0 and keep={keep} >= 1")
        self.directory = Path(directory).absolute()
        self.every = every
        self.settings = settings
        self._ocp = ocp
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                 enable_async_checkpointing=async_save))

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, data_iterator=None) -> None:
        """Start saving ``state`` (and the iterator's position) as ``step``; returns before the write finishes."""
        ocp = self._ocp
        data = data_iterator.get_state() if data_iterator is not None else {}
        items = {"state": ocp.args.StandardSave(_to_saveable(state)), "data": ocp.args.JsonSave(data),
                 "layout": ocp.args.JsonSave(layout(state))}
        if self.settings is not None:
            items[SETTINGS] = ocp.args.JsonSave(self.settings)
        if not self.manager.save(step, args=ocp.args.Composite(**items)):
            raise RuntimeError(f"orbax did not save checkpoint {step} in {self.directory} (it holds steps "
                               f"{self.all_steps()}: it saves only steps past the latest)")

    def clear(self) -> list[int]:
        """Delete every checkpoint in the folder (a run that starts over); returns their steps."""
        self.manager.wait_until_finished()
        steps = self.all_steps()
        for step in steps:
            self.manager.delete(step)
        return steps

    def check_layout(self, state, step: int | None = None) -> None:
        """Raise :class:`CheckpointMismatchError` listing the differences if checkpoint ``step`` (default: the
        latest) holds a state laid out unlike ``state``. Checkpoints written before layouts were saved pass."""
        ocp = self._ocp
        step = self.latest_step() if step is None else step
        if step is None or not (self.directory / str(step) / "layout").exists():
            return
        saved = self.manager.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))["layout"]
        lines = layout_differences(saved, layout(state))
        if lines:
            error = CheckpointMismatchError(mismatch_message(f"checkpoint {step} in {self.directory}", lines))
            error.where, error.differences = f"checkpoint {step} in {self.directory}", lines
            raise error

    def restore(self, state, data_iterator=None, *, step: int | None = None):
        """``state``'s structure filled from checkpoint ``step`` (default: the latest); sets the iterator's
        position. Arrays land with the sharding of ``state``'s leaves, and stay uncommitted where those are (a
        committed array is a different jit signature: the train step would compile a second time on resume)."""
        ocp = self._ocp
        self.manager.wait_until_finished()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        self.check_layout(state, step)
        leaves, treedef = jax.tree.flatten(state)
        target = {}
        for i, x in enumerate(leaves):
            like = jax.random.key_data(x) if _is_key(x) else x
            target[f"{i:05d}"] = jax.ShapeDtypeStruct(like.shape, like.dtype, sharding=getattr(like, "sharding", None))
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                                 data=ocp.args.JsonRestore()))
        saved = out["state"]
        if len(saved) != len(leaves):
            raise CheckpointMismatchError(f"checkpoint {step} in {self.directory} has {len(saved)} arrays; this run's state has "
                             f"{len(leaves)}: it was written by a different model or optimizer configuration")
        restored = []
        for i, x in enumerate(leaves):
            value = saved[f"{i:05d}"]
            if tuple(np.shape(value)) != tuple(np.shape(jax.random.key_data(x) if _is_key(x) else x)):
                raise CheckpointMismatchError(f"checkpoint {step}: array {i} has shape {np.shape(value)}, the state expects "
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
