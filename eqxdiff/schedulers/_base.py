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
    return out


def check_descending(name: str, key: str, values: np.ndarray) -> None:
    if np.any(np.diff(values) >= 0):
        raise ValueError(f"{name}.init: {key}={values.tolist()} must be strictly descending")


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
# State and scheduler bases


class AbstractSchedulerState(eqx.Module):
    """A scheduler's state: arrays only (plus the static ``begin_index``), threaded through ``step``.

    ``step_index`` is the index of the current timestep into ``timesteps``; it starts at ``begin_index`` and
    grows by one per ``step``, so a ``lax.fori_loop`` body never needs its loop index.
    """

    timesteps: eqx.AbstractVar[Shaped[Array, " steps"]]
    step_index: eqx.AbstractVar[Int[Array, ""]]
    begin_index: eqx.AbstractVar[int]


class AbstractSigmaState(AbstractSchedulerState):
    """State of a scheduler that steps between noise levels: ``sigmas`` has one more entry than ``timesteps``
    (the level the last step goes to)."""

    sigmas: eqx.AbstractVar[Float[Array, " steps_plus_one"]]


class SigmaState(AbstractSigmaState):
    """State of Euler, Euler ancestral and flow-matching Euler: float timesteps and the noise levels."""

    timesteps: Float[Array, " steps"]
    sigmas: Float[Array, " steps_plus_one"]
    step_index: Int[Array, ""]
    begin_index: int = eqx.field(static=True)


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
             strength: float | None = None, begin_index: int | None = None, **schedule) -> AbstractSchedulerState:
        """The state for ``num_inference_steps`` steps.

        ``sample_shape`` sizes multistep history buffers; ``strength`` (img2img, as diffusers' pipelines) or
        ``begin_index`` start part-way. ``schedule`` takes the keywords of the diffusers scheduler's
        ``set_timesteps`` (``timesteps=``, ``sigmas=``, ``mu=`` ...; see ``SCHEDULE_KEYWORDS``).
        """
        name = type(self).__name__
        unknown = sorted(k for k, v in schedule.items() if k not in self.SCHEDULE_KEYWORDS and v is not None)
        if unknown:
            takes = (f"it takes {', '.join(k + '=' for k in self.SCHEDULE_KEYWORDS)}" if self.SCHEDULE_KEYWORDS
                     else "it takes only the number of steps")
            raise ValueError(f"{name}.init does not take {', '.join(k + '=' for k in unknown)} (diffusers' "
                             f"{name}.set_timesteps has no such argument); {takes}")
        schedule = {k: v for k, v in schedule.items() if k in self.SCHEDULE_KEYWORDS}
        return self._init(num_inference_steps, sample_shape=sample_shape, strength=strength,
                          begin_index=begin_index, **schedule)

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

    def remaining_steps(self, state: AbstractSchedulerState) -> int:
        """How many ``step`` calls are left from the state's start: a Python int (a static loop length) when
        called on the state ``init`` returned."""
        return int(state.timesteps.shape[0]) - state.begin_index

    def timesteps_to_run(self, state: AbstractSchedulerState) -> Shaped[Array, " run"]:
        """The timesteps from ``begin_index`` on (all of them unless ``init`` was given ``strength``)."""
        return state.timesteps[state.begin_index:]

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
