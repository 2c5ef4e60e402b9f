"""Consistency-model samplers on the DDPM process: LCM (Luo et al. 2023), matching ``diffusers.LCMScheduler``, and
TCD (Zheng et al. 2024), matching ``diffusers.TCDScheduler``.

Both run on a sub-schedule of the distillation schedule (``original_inference_steps`` evenly spaced training
timesteps, ``k * i - 1``) or on custom ``timesteps=`` such as ``[999, 759, 499, 259]``. Per step, LCM predicts the
clean sample through the consistency boundary condition (``c_skip``, ``c_out`` from ``timestep_scaling``) and
re-noises it to the next timestep with fresh noise; TCD moves to an intermediate timestep ``s = floor((1 - eta)
* t_prev)`` and re-noises from there with strength ``eta`` (the paper's gamma). Neither adds noise at the last
step of the schedule. Every per-step constant is computed on the host at ``init``.
"""

import abc
import dataclasses
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Bool, Float, Int
from ._base import (
    AbstractSchedulerState,
    counters,
    custom_schedule,
    is_zero,
    one_of_steps_or,
    resolve_begin_index,
    step_noise,
    to_device,
)
from ._beta import AbstractBetaScheduler, ClipSampleConfig, check_zero_snr_start, clip_or_threshold, x0_and_eps


@dataclasses.dataclass(frozen=True)
class LCMConfig(ClipSampleConfig):
    """``LCMScheduler``'s and ``TCDScheduler``'s keys (the same ones, with the same defaults)."""

    SCHEDULE_ONLY: ClassVar = ClipSampleConfig.SCHEDULE_ONLY | {"original_inference_steps", "timestep_scaling",
                                                                "set_alpha_to_one"}

    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    original_inference_steps: int = 50
    clip_sample: bool = False
    set_alpha_to_one: bool = True
    timestep_scaling: float = 10.0

    def __post_init__(self):
        super().__post_init__()
        self.check(1 <= self.original_inference_steps <= self.num_train_timesteps, "original_inference_steps",
                   f"must be in [1, num_train_timesteps={self.num_train_timesteps}]")


TCDConfig = LCMConfig


class LCMState(AbstractSchedulerState):
    """Per step: the timestep, ``alphas_cumprod`` there and at the next timestep, the consistency scalings
    ``c_skip`` / ``c_out`` (LCM) or the intermediate timestep's ``alphas_cumprod`` (TCD), and whether the step
    re-noises (all but the schedule's last)."""

    timesteps: Int[Array, " steps"]
    alpha_prod: Float[Array, " steps"]
    alpha_prod_prev: Float[Array, " steps"]
    aux: Float[Array, "steps 2"]
    renoise: Bool[Array, " steps"]
    step_index: Int[Array, ""]
    begin_index: Int[Array, ""]
    num_timesteps: Int[Array, ""]


TCDState = LCMState


class _ConsistencyScheduler(AbstractBetaScheduler):
    """The schedule LCM and TCD share (diffusers' ``set_timesteps``, without its ``strength``: ``init(strength=)``
    starts part-way as in the Stable Diffusion img2img pipelines, like every other scheduler)."""

    config: eqx.AbstractVar[LCMConfig]
    SCHEDULE_KEYWORDS: ClassVar[tuple[str, ...]] = ("timesteps", "original_inference_steps")

    def _origin_timesteps(self, original_inference_steps: int | None) -> np.ndarray:
        cfg = self.config
        steps = cfg.original_inference_steps if original_inference_steps is None else original_inference_steps
        if not 1 <= steps <= cfg.num_train_timesteps:
            raise ValueError(f"{type(self).__name__}.init: original_inference_steps={steps} must be in "
                             f"[1, num_train_timesteps={cfg.num_train_timesteps}]")
        return np.arange(1, steps + 1) * (cfg.num_train_timesteps // steps) - 1

    def _schedule(self, num_inference_steps, timesteps, original_inference_steps) -> np.ndarray:
        cfg, name = self.config, type(self).__name__
        one_of_steps_or(name, num_inference_steps, timesteps=timesteps)
        origin = self._origin_timesteps(original_inference_steps)
        if timesteps is not None:
            timesteps = custom_schedule(name, "timesteps", timesteps, np.int64)
            if timesteps[0] >= cfg.num_train_timesteps or timesteps[-1] < 0:
                raise ValueError(f"{name}.init: timesteps={timesteps.tolist()} must lie in [0, "
                                 f"num_train_timesteps={cfg.num_train_timesteps})")
            return timesteps
        if isinstance(num_inference_steps, bool) or not isinstance(num_inference_steps, (int, np.integer)):
            raise TypeError(f"num_inference_steps must be a Python int, got {num_inference_steps!r}")
        if not 1 <= num_inference_steps <= len(origin):
            raise ValueError(f"{name}.init: num_inference_steps={num_inference_steps} must be in [1, {len(origin)}] "
                             "(a subset of the original_inference_steps schedule)")
        indices = np.floor(np.linspace(0, len(origin), num=num_inference_steps, endpoint=False)).astype(np.int64)
        return origin[::-1][indices]

    def _init(self, num_inference_steps: int | None, *, sample_shape, strength, begin_index, timesteps=None,
              original_inference_steps=None) -> LCMState:
        timesteps = self._schedule(num_inference_steps, timesteps, original_inference_steps)
        n = len(timesteps)
        acp = self.alphas_cumprod
        nxt = np.concatenate([timesteps[1:], [self._after_last(timesteps[-1])]])
        alpha_prev, aux = self._per_step(timesteps, nxt, acp)
        begin = resolve_begin_index(n, n, self.order, strength, begin_index)
        check_zero_snr_start(type(self).__name__, self.config, timesteps[begin:], acp, clips=self._clips())
        return LCMState(timesteps=to_device(timesteps, np.int32), alpha_prod=to_device(acp[timesteps]),
                        alpha_prod_prev=to_device(alpha_prev, np.float32), aux=to_device(aux, np.float32),
                        renoise=to_device(np.arange(n) != n - 1), **counters(n, begin))

    @abc.abstractmethod
    def _after_last(self, last: int) -> int:
        """The "previous timestep" diffusers uses at the last step."""

    @abc.abstractmethod
    def _per_step(self, timesteps: np.ndarray, nxt: np.ndarray, acp: np.ndarray):
        """``(alphas_cumprod at the step's target, aux[steps, 2])`` on the host."""

    def _clips(self) -> bool | None:
        """Whether the step bounds its clean-sample estimate (``None``: as its config says, LCM's case)."""
        return None

    def _final_alpha(self, acp: np.ndarray) -> np.float32:
        return np.float32(1.0) if self.config.set_alpha_to_one else acp[0]


class LCMScheduler(_ConsistencyScheduler):
    """Latent Consistency Model multistep sampling. ``step`` needs ``key=`` (or ``noise=``) for the re-noising."""

    CONFIG: ClassVar[type[LCMConfig]] = LCMConfig
    config: LCMConfig = eqx.field(static=True, default=LCMConfig())

    def _after_last(self, last: int) -> int:
        return last

    def _per_step(self, timesteps, nxt, acp):
        # c_skip and c_out in float32, from the timestep times timestep_scaling (sigma_data = 0.5), as torch does.
        scaled = timesteps.astype(np.float32) * np.float32(self.config.timestep_scaling)
        sd2 = np.float32(0.25)
        c_skip = sd2 / (scaled**2 + sd2)
        c_out = scaled / np.sqrt(scaled**2 + sd2)
        alpha_prev = np.where(nxt >= 0, acp[np.clip(nxt, 0, None)], self._final_alpha(acp))
        return alpha_prev, np.stack([c_skip, c_out], axis=1)

    def update(self, state: LCMState, out, x, *, key=None, noise=None):
        i = state.step_index
        a_t, a_prev = state.alpha_prod[i], state.alpha_prod_prev[i]
        c_skip, c_out = state.aux[i, 0], state.aux[i, 1]
        x0, _ = x0_and_eps(self.config.prediction_type, out, x, a_t)
        x0 = clip_or_threshold(self.config, x0)
        denoised = c_out * x0 + c_skip * x
        fresh = step_noise("LCMScheduler", x.shape, x.dtype, key, noise)
        renoised = jnp.sqrt(a_prev) * denoised + jnp.sqrt(1 - a_prev) * fresh
        return jnp.where(state.renoise[i], renoised, denoised), state


class TCDScheduler(_ConsistencyScheduler):
    """Trajectory Consistency Distillation's strategic stochastic sampling. ``eta`` (the paper's gamma, diffusers'
    ``step(eta=)``, default 0.3) is a field as DDIM's is (a Python float or an array: the intermediate timesteps it
    picks are computed by ``init`` on the host, so a new value compiles nothing); unless it is a Python ``0``,
    ``step`` needs ``key=`` (or ``noise=``)."""

    CONFIG: ClassVar[type[LCMConfig]] = LCMConfig
    config: LCMConfig = eqx.field(static=True, default=LCMConfig())
    eta: float | Float[Array, ""] = 0.3

    def __check_init__(self):
        if not 0.0 <= self.eta <= 1.0:
            raise ValueError(f"TCDScheduler: eta={self.eta} must be in [0, 1]")

    def _origin_timesteps(self, original_inference_steps: int | None) -> np.ndarray:
        if original_inference_steps is None:
            return super()._origin_timesteps(None)
        # diffusers: an explicit original_inference_steps samples from every training timestep.
        return np.arange(0, self.config.num_train_timesteps)

    def _after_last(self, last: int) -> int:
        return 0

    def _clips(self) -> bool:
        return False  # diffusers' TCD never clips (clip_sample and thresholding are inert there)

    def _per_step(self, timesteps, nxt, acp):
        # torch computes (1 - eta) * t_prev in float32 before the floor.
        s = np.floor(np.float32(1 - self.eta) * nxt.astype(np.float32)).astype(np.int64)
        alpha_prev = np.where(nxt >= 0, acp[np.clip(nxt, 0, None)], self._final_alpha(acp))
        return alpha_prev, np.stack([acp[s], np.zeros_like(acp[s])], axis=1)

    def update(self, state: TCDState, out, x, *, key=None, noise=None):
        i = state.step_index
        a_t, a_prev, a_s = state.alpha_prod[i], state.alpha_prod_prev[i], state.aux[i, 0]
        x0, eps = x0_and_eps(self.config.prediction_type, out, x, a_t)
        x_s = jnp.sqrt(a_s) * x0 + jnp.sqrt(1 - a_s) * eps
        if is_zero(self.eta):
            return x_s, state
        fresh = step_noise("TCDScheduler", x.shape, x.dtype, key, noise)
        renoised = jnp.sqrt(a_prev / a_s) * x_s + jnp.sqrt(1 - a_prev / a_s) * fresh
        return jnp.where(state.renoise[i] & (self.eta != 0), renoised, x_s), state
