"""What every scheduler has, whatever its noise process: the config base, the state base, and the scheduler base
class whose ``init`` and ``step`` are templates.

``init(num_inference_steps, *, sample_shape, strength, begin_index, **schedule)`` checks the diffusers
``set_timesteps`` keywords (``timesteps=``, ``sigmas=``, ``mu=`` ...) against the ones the scheduler takes
(:attr:`AbstractScheduler.SCHEDULE_KEYWORDS`) and hands them to the subclass's ``_init``. ``step`` does the
first and last lines every scheduler shares (float32 in, the state's step index, the index advanced, the sample's
dtype out) around the subclass's :meth:`AbstractScheduler.update`.
"""

import abc
import dataclasses
import functools
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, Shaped, typechecked
from ..core import ModelConfig

BOOLS = (False, True)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(ModelConfig):
    """The key every diffusers scheduler config has (``num_train_timesteps``), and the source dict.

    Subclasses add their own keys and may change a default (diffusers' defaults differ per class).
    """

    # Fields that only shape the schedule: ``init`` reads them on the host, ``step`` never does (see
    # ``AbstractScheduler.stepper``). A subclass adds its own; leaving one out only costs a recompile.
    SCHEDULE_ONLY: ClassVar[frozenset[str]] = frozenset()

    num_train_timesteps: int = 1000
    # The checkpoint dict this config was read from (not part of equality): which keys it set, and keys that
    # other schedulers use (``clip_sample`` in a PNDM config) which ``to_dict`` carries on, as diffusers does.
    source: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]):
        config = super().from_dict(raw)
        object.__setattr__(config, "source", {k: v for k, v in raw.items() if k[:1] != "_"})
        return config

    def to_dict(self) -> dict[str, Any]:
        """The config keys, the source's keys for other schedulers, and (like diffusers' ``.config``)
        ``_use_default_values``: the keys the source did not set, so that swapping schedulers from this dict
        follows diffusers' ``from_config``."""
        fields = {k: v for k, v in super().to_dict().items() if k != "source"}
        if self.source is None:
            return fields
        return {**self.source, **fields, "_use_default_values": sorted(k for k in fields if k not in self.source)}

    def __post_init__(self):
        super().__post_init__()
        self.check(self.num_train_timesteps >= 2, "num_train_timesteps", "must be at least 2")


# ----------------------------------------------------------------------------------------------------------------
# Host-side checks


def check_num_steps(config: SchedulerConfig, num_inference_steps: int) -> None:
    if not isinstance(num_inference_steps, (int, np.integer)) or isinstance(num_inference_steps, bool):
        raise TypeError(f"num_inference_steps must be a Python int, got {num_inference_steps!r}")
    if not 1 <= num_inference_steps <= config.num_train_timesteps:
        raise ValueError(f"num_inference_steps={num_inference_steps} must be in "
                         f"[1, num_train_timesteps={config.num_train_timesteps}]")


def one_of_steps_or(name: str, num_inference_steps: int | None, **given) -> None:
    """diffusers' rule for ``set_timesteps``: the number of steps or a custom schedule (``given``), not both."""
    passed = [k for k, v in given.items() if v is not None]
    if num_inference_steps is None and not passed:
        raise ValueError(f"{name}.init needs num_inference_steps (or one of " +
                         ", ".join(f"{k}=" for k in given) + ")")
    if num_inference_steps is not None and passed:
        raise ValueError(f"{name}.init: pass num_inference_steps or {passed[0]}=, not both (the custom schedule "
                         "sets the number of steps)")


def custom_schedule(name: str, key: str, values: Sequence[float] | np.ndarray, dtype) -> np.ndarray:
    """A user's ``timesteps=`` / ``sigmas=`` as a non-empty 1-D array."""
    out = np.asarray(values, dtype)
    if out.ndim != 1 or out.size == 0:
        raise ValueError(f"{name}.init: {key}= must be a non-empty 1-D sequence, got shape {out.shape}")
    check_descending(name, key, out)
    return out


def check_descending(name: str, key: str, values: np.ndarray) -> None:
    """A custom schedule runs from the noisiest step down: ascending or repeated entries would step backwards (or
    by nothing) and draw garbage, so they are refused, naming the first offending pair."""
    rising = np.flatnonzero(np.diff(values) >= 0)
    if rising.size:
        i = int(rising[0])
        shown = values.tolist() if values.size <= 8 else f"[{values[0]:g}, ..., {values[-1]:g}] ({values.size} values)"
        raise ValueError(f"{name}.init: {key}={shown} must be strictly descending (the noisiest step first): "
                         f"{values[i]:g} at position {i} is followed by {values[i + 1]:g}")


def resolve_begin_index(num_inference_steps: int, num_timesteps: int, order: int,
                        strength: float | None, begin_index: int | None, *, whole_steps: bool = True) -> int:
    """The index into ``timesteps`` where sampling starts.

    ``strength`` follows diffusers' img2img pipelines: ``t_start = N - min(int(N * strength), N)`` (Stable
    Diffusion's, Wan's) or, with ``whole_steps=False``, ``int(N - min(N * strength, N))`` (Flux's, SD3's), and the
    scheduler starts at ``t_start * order``. ``begin_index`` sets the index directly (``set_begin_index``).
    """
    if strength is not None and begin_index is not None:
        raise ValueError("pass strength= or begin_index=, not both")
    if strength is not None:
        check_strength(strength)
        if not whole_steps:
            return int(max(num_inference_steps - min(num_inference_steps * strength, num_inference_steps), 0)) * order
        init_timestep = min(int(num_inference_steps * strength), num_inference_steps)
        return max(num_inference_steps - init_timestep, 0) * order
    if begin_index is None:
        return 0
    if not 0 <= begin_index <= num_timesteps:
        raise ValueError(f"begin_index={begin_index} must be in [0, {num_timesteps}] (the number of timesteps)")
    return int(begin_index)


def check_strength(strength: float) -> None:
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength={strength} must be in [0, 1]")


# ----------------------------------------------------------------------------------------------------------------
# Per-step helpers (jnp, float32)


def per_sample(coef: Array, like: Array) -> Array:
    """``coef`` with one value per batch entry (or a scalar), reshaped to broadcast against ``like``."""
    return jnp.reshape(coef, (-1,) + (1,) * (like.ndim - 1))


def step_noise(name: str, shape, dtype, key, noise):
    """The Gaussian noise a stochastic step adds: drawn from ``key``, or ``noise`` itself (for parity tests)."""
    if key is not None and noise is not None:
        raise ValueError(f"{name}.step: pass key= or noise=, not both")
    if noise is not None:
        if noise.shape != tuple(shape):
            raise ValueError(f"{name}.step: noise.shape={noise.shape} must equal the sample shape {tuple(shape)}")
        return noise.astype(jnp.float32)
    if key is None:
        raise ValueError(f"{name}.step adds noise: pass key= (a PRNG key) or noise= (an array)")
    return jax.random.normal(key, shape, jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# Counters and the fixed-length schedule

# Per-step arrays are padded to a multiple of this many steps (1024: every schedule of up to 1000 training
# timesteps, the common case, has one length); longer custom schedules take the next power of two.
SCHEDULE_BUCKET = 1024
_STEP_AXES = {"steps": 0, "steps_plus_one": 1}  # a per-step field's leading axis -> entries beyond the steps


def to_device(value, dtype=None) -> Array:
    """A host value as a device array, compiling nothing (``jnp.asarray`` of a NumPy array compiles a small copy
    program for each new shape: a new schedule length would compile one per per-step array)."""
    return jax.device_put(np.asarray(value, dtype))


def counters(num_timesteps: int, begin: int) -> dict[str, Array]:
    """The state's ``step_index`` / ``begin_index`` (both ``begin``) and ``num_timesteps``, as int32 arrays."""
    begin = to_device(begin, np.int32)
    return {"step_index": begin, "begin_index": begin, "num_timesteps": to_device(num_timesteps, np.int32)}


def is_zero(value) -> bool:
    """Whether ``value`` is a Python number equal to 0 (a static zero: a stochastic step may skip its draw); an
    array is never statically zero."""
    return isinstance(value, (int, float)) and value == 0


def schedule_length(num_steps: int) -> int:
    """The padded length of a schedule of ``num_steps`` steps: :data:`SCHEDULE_BUCKET`, doubled until it fits."""
    length = SCHEDULE_BUCKET
    while length < num_steps:
        length *= 2
    return length


@functools.cache
def _per_step_fields(cls: type) -> dict[str, int]:
    """``{field: extra}`` of a state class's per-step arrays (annotated ``" steps ..."``, or ``" steps_plus_one"``:
    one entry more than the steps)."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        dims = getattr(hint, "dims", ())
        first = getattr(dims[0], "name", None) if dims else None
        if first in _STEP_AXES:
            out[name] = _STEP_AXES[first]
    return out


def pad_schedule(state: "AbstractSchedulerState", length: int | None = None) -> "AbstractSchedulerState":
    """``state`` with its per-step arrays padded (repeating their last entry) to ``length`` steps, by default
    :func:`schedule_length` of their present length. Only ``num_timesteps`` says where the schedule ends, so the
    padded state steps exactly as the original; states of any schedule length up to the bucket (and any start)
    have the same shapes, hence one compiled loop. Works on traced states too (it reads shapes only)."""
    steps = int(state.timesteps.shape[0])
    length = schedule_length(steps) if length is None else length
    if length < steps:
        raise ValueError(f"pad_schedule: length={length} is shorter than the schedule's {steps} steps")
    if length == steps:
        return state
    changes = {}
    for name, extra in _per_step_fields(type(state)).items():
        value = getattr(state, name)
        pad = [(0, length + extra - value.shape[0])] + [(0, 0)] * (value.ndim - 1)
        if isinstance(value, jax.core.Tracer):
            changes[name] = jnp.pad(value, pad, mode="edge")
        else:  # on the host: no program is compiled for a new schedule length
            changes[name] = to_device(np.pad(np.asarray(value), pad, mode="edge"))
    return dataclasses.replace(state, **changes)


# ----------------------------------------------------------------------------------------------------------------
# State and scheduler bases


class AbstractSchedulerState(eqx.Module):
    """A scheduler's state: arrays only, threaded through ``step``.

    ``step_index`` is the index of the current timestep into ``timesteps``; it starts at ``begin_index`` and
    grows by one per ``step``, so a ``lax.fori_loop`` body never needs its loop index. ``num_timesteps`` is the
    schedule's length. All three are arrays, so that schedules of any length and start share one compiled loop
    once their per-step arrays are padded to a fixed length (:func:`pad_schedule`): the fields annotated with a
    leading ``steps`` (or ``steps_plus_one``) axis are the per-step ones.
    """

    timesteps: eqx.AbstractVar[Shaped[Array, " steps"]]
    step_index: eqx.AbstractVar[Int[Array, ""]]
    begin_index: eqx.AbstractVar[Int[Array, ""]]
    num_timesteps: eqx.AbstractVar[Int[Array, ""]]


class AbstractSigmaState(AbstractSchedulerState):
    """State of a scheduler that steps between noise levels: ``sigmas`` has one more entry than ``timesteps``
    (the level the last step goes to)."""

    sigmas: eqx.AbstractVar[Float[Array, " steps_plus_one"]]


class SigmaState(AbstractSigmaState):
    """State of Euler, Euler ancestral and flow-matching Euler: float timesteps and the noise levels."""

    timesteps: Float[Array, " steps"]
    sigmas: Float[Array, " steps_plus_one"]
    step_index: Int[Array, ""]
    begin_index: Int[Array, ""]
    num_timesteps: Int[Array, ""]


class AbstractScheduler(eqx.Module):
    """A stateless scheduler: a static config and pure functions of an explicit state.

    ``init`` runs on the host and builds the state; ``init_noise_sigma``, ``scale_model_input`` and ``step`` are
    pure and jittable. Subclasses implement ``_init`` and :meth:`update`.
    """

    CONFIG: ClassVar[type[SchedulerConfig]]
    config: eqx.AbstractVar[SchedulerConfig]
    order: ClassVar[int] = 1
    # The keywords of diffusers' ``set_timesteps`` this scheduler's ``init`` takes (beyond the number of steps).
    SCHEDULE_KEYWORDS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_config(cls, raw: Mapping, **overrides):
        """This scheduler from a ``scheduler_config.json`` dict, like diffusers' ``from_config``: unknown keys and
        keys diffusers recorded as defaulted (``_use_default_values``) are ignored."""
        defaulted = set(raw.get("_use_default_values", ()))
        raw = {k: v for k, v in raw.items() if k not in defaulted}
        return cls(cls.CONFIG.from_dict({**raw, **overrides}))

    def init(self, num_inference_steps: int | None = None, *, sample_shape: tuple[int, ...] | None = None,
             strength: float | None = None, begin_index: int | None = None, whole_steps: bool | None = None,
             **schedule) -> AbstractSchedulerState:
        """The state for ``num_inference_steps`` steps.

        ``sample_shape`` sizes multistep history buffers; ``strength`` (img2img, as diffusers' pipelines) or
        ``begin_index`` start part-way. ``whole_steps``: how ``strength`` rounds (:func:`resolve_begin_index`), which
        is the pipeline's rule in diffusers, not the scheduler's: ``True`` ``N - int(N * strength)`` steps skipped,
        ``False`` ``int(N - N * strength)``; ``None``: the rule of the pipelines this scheduler usually serves.
        ``schedule`` takes the keywords of the diffusers scheduler's ``set_timesteps`` (``timesteps=``, ``sigmas=``,
        ``mu=`` ...; see ``SCHEDULE_KEYWORDS``).
        """
        name = type(self).__name__
        unknown = sorted(k for k, v in schedule.items() if k not in self.SCHEDULE_KEYWORDS and v is not None)
        if unknown:
            takes = (f"it takes {', '.join(k + '=' for k in self.SCHEDULE_KEYWORDS)}" if self.SCHEDULE_KEYWORDS
                     else "it takes only the number of steps")
            raise ValueError(f"{name}.init does not take {', '.join(k + '=' for k in unknown)} (diffusers' "
                             f"{name}.set_timesteps has no such argument); {takes}")
        schedule = {k: v for k, v in schedule.items() if k in self.SCHEDULE_KEYWORDS}
        if strength is not None and whole_steps is not None:
            begin_index = self._strength_start(num_inference_steps, sample_shape, strength, begin_index, whole_steps,
                                               schedule)
            strength = None
        return self._init(num_inference_steps, sample_shape=sample_shape, strength=strength,
                          begin_index=begin_index, **schedule)

    def _strength_start(self, num_inference_steps, sample_shape, strength, begin_index, whole_steps, schedule) -> int:
        """The begin index ``strength`` gives under the rounding ``whole_steps``, ``N`` the number of steps asked for
        (or the custom schedule's length, as diffusers' ``retrieve_timesteps`` returns it)."""
        state = self._init(num_inference_steps, sample_shape=sample_shape, strength=None, begin_index=None, **schedule)
        custom = [len(v) for k, v in schedule.items() if k in ("timesteps", "sigmas") and v is not None]
        n = (num_inference_steps if num_inference_steps is not None else custom[0] if custom
             else int(state.num_timesteps))
        return resolve_begin_index(n, int(state.num_timesteps), self.order, strength, begin_index,
                                   whole_steps=whole_steps)

    @abc.abstractmethod
    def _init(self, num_inference_steps, *, sample_shape, strength, begin_index, **schedule):
        """Build the state (host side); ``schedule`` holds only keywords of ``SCHEDULE_KEYWORDS``."""

    @typechecked
    def step(self, state: AbstractSchedulerState, model_output: Float[Array, "*dims"], sample: Float[Array, "*dims"],
             *, key: PRNGKeyArray | None = None,
             noise: Float[Array, "*dims"] | None = None) -> tuple[Float[Array, "*dims"], AbstractSchedulerState]:
        """``(prev_sample, new_state)`` from the model output at ``current_timestep(state)``. Stochastic steps
        draw their noise from ``key``, or take it as ``noise`` (an array of the sample's shape)."""
        return self._step(state, model_output, sample, key, noise)

    def _step(self, state, model_output, sample, key, noise):
        x, out = sample.astype(jnp.float32), model_output.astype(jnp.float32)
        prev, state = self.update(state, out, x, key=key, noise=noise)
        return prev.astype(sample.dtype), dataclasses.replace(state, step_index=state.step_index + 1)

    @abc.abstractmethod
    def update(self, state, model_output, sample, *, key=None, noise=None):
        """``(prev_sample, state)`` in float32 at ``state.step_index``; :meth:`step` advances the index."""

    def current_timestep(self, state: AbstractSchedulerState) -> Shaped[Array, ""]:
        """The timestep to give the model at the current step."""
        return state.timesteps[state.step_index]

    def remaining_steps(self, state: AbstractSchedulerState) -> Int[Array, ""]:
        """How many ``step`` calls are left from the state's start (an int32 array: a traced loop length;
        ``int(...)`` of it on the host)."""
        return state.num_timesteps - state.begin_index

    def timesteps_to_run(self, state: AbstractSchedulerState) -> np.ndarray:
        """The timesteps from ``begin_index`` on (all of them unless ``init`` was given ``strength``), on the
        host (the state's arrays must be concrete)."""
        return np.asarray(state.timesteps)[int(state.begin_index):int(state.num_timesteps)]

    def stepper(self) -> "AbstractScheduler":
        """This scheduler as the denoising loop sees it: the config fields that only shape the schedule (read by
        ``init`` on the host, never by ``step``: the config class's ``SCHEDULE_ONLY``) set back to their defaults,
        so that schedulers differing only in them (a flow shift, Karras sigma bounds ...) share one compiled loop.
        Its ``step`` gives the same results as this scheduler's on this scheduler's states."""
        cfg = self.config
        defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.name in cfg.SCHEDULE_ONLY}
        if not defaults or all(getattr(cfg, k) == v for k, v in defaults.items()):
            return self
        return dataclasses.replace(self, config=dataclasses.replace(cfg, **defaults))

    def init_noise_sigma(self, state: AbstractSchedulerState) -> Float[Array, ""]:
        """The standard deviation of the initial noise."""
        return jnp.ones((), jnp.float32)

    @typechecked
    def scale_model_input(self, state: AbstractSchedulerState, sample: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        """The model's input at the current step (identity unless the scheduler works in sigma space)."""
        return sample

    @abc.abstractmethod
    def add_noise_at_step(self, state: AbstractSchedulerState, original, noise):
        """Noise a clean ``original`` to the level of the state's current step (img2img: the start step)."""
