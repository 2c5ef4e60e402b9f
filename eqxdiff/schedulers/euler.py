"""Euler and Euler-ancestral samplers in the sigma parameterisation (Karras et al. 2022), matching
``diffusers.EulerDiscreteScheduler`` and ``diffusers.EulerAncestralDiscreteScheduler``."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, typechecked
from ._base import (
    BOOLS,
    AbstractSigmaState,
    SigmaState,
    check_num_steps,
    counters,
    custom_schedule,
    one_of_steps_or,
    per_sample,
    resolve_begin_index,
    step_noise,
    to_device,
)
from ._beta import (
    AbstractBetaScheduler,
    BetaScheduleConfig,
    SigmaSpacingConfig,
    sigma_to_t,
    spaced_timesteps,
    train_sigmas,
    x0_from_sigma,
)
from ._sigmas import respace


@dataclasses.dataclass(frozen=True)
class EulerAncestralConfig(BetaScheduleConfig):
    SUPPORTED_VALUES: ClassVar = {**BetaScheduleConfig.SUPPORTED_VALUES, "prediction_type": ("epsilon", "v_prediction"),
                                  "rescale_betas_zero_snr": BOOLS}

    timestep_spacing: str = "linspace"
    rescale_betas_zero_snr: bool = False


@dataclasses.dataclass(frozen=True)
class EulerConfig(SigmaSpacingConfig):
    SUPPORTED_VALUES: ClassVar = {
        **SigmaSpacingConfig.SUPPORTED_VALUES, "interpolation_type": ("linear", "log_linear"),
        "timestep_type": ("discrete", "continuous"), "final_sigmas_type": ("zero", "sigma_min"),
        "rescale_betas_zero_snr": BOOLS}

    SCHEDULE_ONLY: ClassVar = SigmaSpacingConfig.SCHEDULE_ONLY | {"sigma_min", "sigma_max", "timestep_type",
                                                                  "final_sigmas_type"}

    timestep_spacing: str = "linspace"
    interpolation_type: str = "linear"
    sigma_min: float | None = None
    sigma_max: float | None = None
    timestep_type: str = "discrete"
    final_sigmas_type: str = "zero"
    rescale_betas_zero_snr: bool = False


def euler_timesteps_and_sigmas(scheduler, num_inference_steps: int):
    """Float timesteps, float64 sigmas (without the final entry) and log training sigmas, as Euler-type
    ``set_timesteps`` computes them."""
    cfg = scheduler.config
    check_num_steps(cfg, num_inference_steps)
    if cfg.timestep_spacing == "linspace":
        timesteps = np.linspace(0, cfg.num_train_timesteps - 1, num_inference_steps, dtype=np.float32)[::-1].copy()
    else:
        timesteps = spaced_timesteps(cfg, num_inference_steps).astype(np.float32)
    sigmas = train_sigmas(scheduler.alphas_cumprod)
    return timesteps, np.interp(timesteps, np.arange(0, len(sigmas)), sigmas), np.log(sigmas)


class AbstractSigmaScheduler(AbstractBetaScheduler):
    """Shared by Euler, Euler ancestral and LMS: sigma-space input scaling and ``init_noise_sigma``."""

    TERMINAL_FLOOR: ClassVar[bool] = True

    def init_noise_sigma(self, state: AbstractSigmaState) -> Float[Array, ""]:
        max_sigma = jnp.max(state.sigmas)
        if self.config.timestep_spacing in ("linspace", "trailing"):
            return max_sigma
        return jnp.sqrt(max_sigma * max_sigma + 1)

    @typechecked
    def scale_model_input(self, state: AbstractSigmaState, sample: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        sigma = state.sigmas[state.step_index]
        return (sample / jnp.sqrt(sigma * sigma + 1)).astype(sample.dtype)

    @typechecked
    def add_noise(self, original: Float[Array, "batch *dims"], noise: Float[Array, "batch *dims"],
                  timesteps: Float[Array, "*b"] | Int[Array, "*b"]) -> Float[Array, "batch *dims"]:
        """``original + sigma(t) * noise``, ``sigma`` linearly interpolated between training timesteps.

        At integer ``t`` this is diffusers' Euler-type ``add_noise`` on the training schedule; at a timestep of a
        non-Karras schedule it is that step's sigma. For img2img with Karras / exponential sigmas use
        :meth:`add_noise_at_step` (diffusers' ``add_noise`` after ``set_begin_index``)."""
        sigmas = jnp.asarray(train_sigmas(self.alphas_cumprod))
        t = timesteps.astype(jnp.float32)
        sigma = jnp.interp(t, jnp.arange(sigmas.shape[0], dtype=jnp.float32), sigmas)
        return (original + noise * per_sample(sigma, original)).astype(original.dtype)

    @typechecked
    def add_noise_at_step(self, state: AbstractSigmaState, original: Float[Array, "*dims"],
                          noise: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        """``original + sigmas[step] * noise``: diffusers' ``add_noise`` after ``set_begin_index`` (img2img)."""
        return (original + noise * state.sigmas[state.step_index]).astype(original.dtype)


class EulerDiscreteScheduler(AbstractSigmaScheduler):
    """Euler's method on the probability-flow ODE (k-diffusion's ``sample_euler`` without churn)."""

    CONFIG: ClassVar[type[EulerConfig]] = EulerConfig
    config: EulerConfig = eqx.field(static=True, default=EulerConfig())
    SCHEDULE_KEYWORDS: ClassVar[tuple[str, ...]] = ("timesteps", "sigmas")

    def _init(self, num_inference_steps: int | None, *, sample_shape, strength, begin_index, timesteps=None,
              sigmas=None) -> SigmaState:
        cfg = self.config
        if timesteps is not None and sigmas is not None:
            raise ValueError("EulerDiscreteScheduler.init: pass timesteps= or sigmas=, not both")
        one_of_steps_or("EulerDiscreteScheduler", num_inference_steps, timesteps=timesteps, sigmas=sigmas)
        if sigmas is not None:
            timesteps, sigmas = self._custom_sigmas(sigmas)
        else:
            if timesteps is None:
                timesteps, sigmas, log_sigmas = euler_timesteps_and_sigmas(self, num_inference_steps)
            else:
                timesteps, sigmas, log_sigmas = self._custom_timesteps(timesteps)
            if cfg.interpolation_type == "log_linear":  # the timesteps stay; n + 1 levels evenly spaced in log
                # sigma over the training schedule, the last at its smallest (so the step list's last level, below,
                # is one more than the steps reach, as in diffusers)
                sigmas = np.exp(np.linspace(log_sigmas[-1].item(), log_sigmas[0].item(),
                                            (num_inference_steps or len(timesteps)) + 1))
            if cfg.sigma_spacing:
                # num_inference_steps levels, as diffusers: not len(timesteps), which 'trailing' spacing makes one
                # longer for some step counts (NumPy's arange overshoots to -1)
                sigmas = respace(cfg.sigma_spacing, sigmas, num_inference_steps, cfg.sigma_min, cfg.sigma_max)
                timesteps = sigma_to_t(sigmas, log_sigmas)
            acp0 = self.alphas_cumprod[0]
            last = np.sqrt((np.float32(1) - acp0) / acp0) if cfg.final_sigmas_type == "sigma_min" else 0.0
            sigmas = np.concatenate([sigmas, [last]])
        sigmas = sigmas.astype(np.float32)
        if cfg.timestep_type == "continuous" and cfg.prediction_type == "v_prediction":
            timesteps = np.float32(0.25) * np.log(sigmas[:-1])
        n = len(timesteps)
        sigmas = sigmas[:n + 1]  # (log_linear: the levels the steps go to)
        begin = resolve_begin_index(n, n, self.order, strength, begin_index)
        return SigmaState(timesteps=to_device(timesteps, np.float32), sigmas=to_device(sigmas),
                          **counters(n, begin))

    def _custom_sigmas(self, sigmas):
        """diffusers' ``set_timesteps(sigmas=...)``: ``n + 1`` levels (the last is where the last step goes), the
        timesteps interpolated from them."""
        sigmas = custom_schedule("EulerDiscreteScheduler", "sigmas", sigmas, np.float32)
        if len(sigmas) < 2:
            raise ValueError("EulerDiscreteScheduler.init: sigmas= lists n + 1 levels (the last one is where the "
                             f"last step goes), got {len(sigmas)}")
        return sigma_to_t(sigmas[:-1], np.log(train_sigmas(self.alphas_cumprod))), sigmas

    def _custom_timesteps(self, timesteps):
        """diffusers' ``set_timesteps(timesteps=...)``: the sigmas interpolated at the given timesteps."""
        cfg = self.config
        if cfg.sigma_spacing:
            raise ValueError(f"EulerDiscreteScheduler.init: timesteps= cannot be used with "
                             f"use_{cfg.sigma_spacing}_sigmas=True")
        if cfg.timestep_type == "continuous" and cfg.prediction_type == "v_prediction":
            raise ValueError("EulerDiscreteScheduler.init: timesteps= cannot be used with timestep_type='continuous' "
                             "and prediction_type='v_prediction'")
        timesteps = custom_schedule("EulerDiscreteScheduler", "timesteps", timesteps, np.float32)
        train = train_sigmas(self.alphas_cumprod)
        return timesteps, np.interp(timesteps, np.arange(0, len(train)), train), np.log(train)

    def update(self, state: SigmaState, out, x, *, key=None, noise=None):
        sigma = state.sigmas[state.step_index]
        x0 = x0_from_sigma(self.config.prediction_type, out, x, sigma)
        derivative = (x - x0) / sigma
        return x + derivative * (state.sigmas[state.step_index + 1] - sigma), state


class EulerAncestralDiscreteScheduler(AbstractSigmaScheduler):
    """Euler ancestral (k-diffusion's ``sample_euler_ancestral``): an Euler step to ``sigma_down`` plus fresh noise
    of size ``sigma_up``. ``step`` needs ``key=`` (or ``noise=``)."""

    CONFIG: ClassVar[type[EulerAncestralConfig]] = EulerAncestralConfig
    config: EulerAncestralConfig = eqx.field(static=True, default=EulerAncestralConfig())

    def _init(self, num_inference_steps: int, *, sample_shape, strength, begin_index) -> SigmaState:
        timesteps, sigmas, _ = euler_timesteps_and_sigmas(self, num_inference_steps)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        begin = resolve_begin_index(num_inference_steps, len(timesteps), self.order, strength, begin_index)
        return SigmaState(timesteps=to_device(timesteps, np.float32), sigmas=to_device(sigmas),
                          **counters(len(timesteps), begin))

    def update(self, state: SigmaState, out, x, *, key=None, noise=None):
        sigma_from, sigma_to = state.sigmas[state.step_index], state.sigmas[state.step_index + 1]
        x0 = x0_from_sigma(self.config.prediction_type, out, x, sigma_from)
        sigma_up = jnp.sqrt(sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2)
        # sigma_to**2 - sigma_up**2 is sigma_to**4 / sigma_from**2 in exact arithmetic (diffusers' form): when
        # sigma_to << sigma_from it cancels to an ulp or two of sigma_to**2, which XLA's rounding can make negative (a
        # NaN sample); this form has no cancellation and is closer to diffusers' float64 run than its float32 one.
        sigma_down = sigma_to * (sigma_to / sigma_from)
        derivative = (x - x0) / sigma_from
        prev = x + derivative * (sigma_down - sigma_from)
        return prev + step_noise("EulerAncestralDiscreteScheduler", x.shape, x.dtype, key, noise) * sigma_up, state
