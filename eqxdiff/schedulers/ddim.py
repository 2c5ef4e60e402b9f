"""DDIM (Song et al. 2020), matching ``diffusers.DDIMScheduler``."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ._common import (
    BOOLS,
    AbstractScheduler,
    AbstractSchedulerState,
    SchedulerConfig,
    check_num_steps,
    check_train_indices,
    resolve_begin_index,
    spaced_timesteps,
    step_noise,
    threshold_sample,
    x0_and_eps,
)


@dataclasses.dataclass(frozen=True)
class DDIMConfig(SchedulerConfig):
    SUPPORTED_VALUES: ClassVar = {**SchedulerConfig.SUPPORTED_VALUES, "clip_sample": BOOLS,
                                  "set_alpha_to_one": BOOLS, "thresholding": BOOLS,
                                  "rescale_betas_zero_snr": BOOLS}

    clip_sample: bool = True
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    rescale_betas_zero_snr: bool = False


class DDIMState(AbstractSchedulerState):
    timesteps: Int[Array, " steps"]
    alpha_prod: Float[Array, " steps"]
    alpha_prod_prev: Float[Array, " steps"]
    step_index: Int[Array, ""]
    begin_index: int = eqx.field(static=True)


def clip_or_threshold(config, x0):
    """DDIM/DDPM: dynamic thresholding or plain clipping of the predicted clean sample, as configured."""
    if config.thresholding:
        return threshold_sample(x0, config.dynamic_thresholding_ratio, config.sample_max_value)
    if config.clip_sample:
        return jnp.clip(x0, -config.clip_sample_range, config.clip_sample_range)
    return x0


class DDIMScheduler(AbstractScheduler):
    """DDIM. ``eta`` (0: deterministic DDIM, 1: DDPM-like) and ``use_clipped_model_output`` are the arguments
    diffusers takes in ``step``; here they are static fields so that every scheduler's ``step`` looks the same."""

    CONFIG: ClassVar[type[DDIMConfig]] = DDIMConfig
    config: DDIMConfig = eqx.field(static=True, default=DDIMConfig())
    eta: float = eqx.field(static=True, default=0.0)
    use_clipped_model_output: bool = eqx.field(static=True, default=False)

    def init(self, num_inference_steps: int, *, sample_shape: tuple[int, ...] | None = None,
             strength: float | None = None, begin_index: int | None = None) -> DDIMState:
        cfg = self.config
        check_num_steps(cfg, num_inference_steps)
        timesteps = spaced_timesteps(cfg, num_inference_steps).astype(np.int64)
        check_train_indices("timesteps", timesteps, cfg)
        acp = self.alphas_cumprod
        final = np.float32(1.0) if cfg.set_alpha_to_one else acp[0]
        # diffusers steps back by num_train_timesteps // N whatever the spacing.
        prev = timesteps - cfg.num_train_timesteps // num_inference_steps
        alpha_prev = np.where(prev >= 0, acp[np.clip(prev, 0, None)], final)
        begin = resolve_begin_index(num_inference_steps, len(timesteps), self.order, strength, begin_index)
        return DDIMState(timesteps=jnp.asarray(timesteps, jnp.int32), alpha_prod=jnp.asarray(acp[timesteps]),
                         alpha_prod_prev=jnp.asarray(alpha_prev, jnp.float32),
                         step_index=jnp.asarray(begin, jnp.int32), begin_index=begin)

    @typechecked
    def step(self, state: DDIMState, model_output: Float[Array, "*dims"], sample: Float[Array, "*dims"], *,
             key: PRNGKeyArray | None = None,
             noise: Float[Array, "*dims"] | None = None) -> tuple[Float[Array, "*dims"], DDIMState]:
        cfg = self.config
        x, out = sample.astype(jnp.float32), model_output.astype(jnp.float32)
        a_t, a_prev = state.alpha_prod[state.step_index], state.alpha_prod_prev[state.step_index]
        b_t = 1 - a_t
        x0, eps = x0_and_eps(cfg.prediction_type, out, x, a_t)
        x0 = clip_or_threshold(cfg, x0)
        variance = ((1 - a_prev) / b_t) * (1 - a_t / a_prev)
        std = self.eta * jnp.sqrt(variance)
        if self.use_clipped_model_output:
            eps = (x - jnp.sqrt(a_t) * x0) / jnp.sqrt(b_t)
        prev = jnp.sqrt(a_prev) * x0 + jnp.sqrt(1 - a_prev - std * std) * eps
        if self.eta > 0:
            prev = prev + std * step_noise("DDIMScheduler", x.shape, x.dtype, key, noise)
        return prev.astype(sample.dtype), dataclasses.replace(state, step_index=state.step_index + 1)
