"""DDIM (Song et al. 2020), matching ``diffusers.DDIMScheduler``."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float
from ._base import BOOLS, check_num_steps, counters, is_zero, resolve_begin_index, step_noise, to_device
from ._beta import (
    AbstractBetaScheduler,
    AlphaProdState,
    ClipSampleConfig,
    check_train_indices,
    check_zero_snr_start,
    clip_or_threshold,
    spaced_timesteps,
    x0_and_eps,
)


@dataclasses.dataclass(frozen=True)
class DDIMConfig(ClipSampleConfig):
    SUPPORTED_VALUES: ClassVar = {**ClipSampleConfig.SUPPORTED_VALUES, "set_alpha_to_one": BOOLS}

    SCHEDULE_ONLY: ClassVar = ClipSampleConfig.SCHEDULE_ONLY | {"set_alpha_to_one"}

    set_alpha_to_one: bool = True


DDIMState = AlphaProdState  # the same state as DDPM's


class DDIMScheduler(AbstractBetaScheduler):
    """DDIM. ``eta`` (0: deterministic DDIM, 1: DDPM-like) and ``use_clipped_model_output`` are the arguments
    diffusers takes in ``step``; here they are fields so that every scheduler's ``step`` looks the same. ``eta``
    may be an array (a traced value: the pipelines pass one, so a new ``eta`` compiles nothing); a Python ``0``
    skips the noise draw, any other value adds ``eta``-scaled noise (none at all when the array holds 0)."""

    CONFIG: ClassVar[type[DDIMConfig]] = DDIMConfig
    config: DDIMConfig = eqx.field(static=True, default=DDIMConfig())
    eta: float | Float[Array, ""] = 0.0
    use_clipped_model_output: bool = eqx.field(static=True, default=False)

    def _init(self, num_inference_steps: int, *, sample_shape, strength, begin_index) -> DDIMState:
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
        check_zero_snr_start("DDIMScheduler", cfg, timesteps[begin:], acp)
        return DDIMState(timesteps=to_device(timesteps, np.int32), alpha_prod=to_device(acp[timesteps]),
                         alpha_prod_prev=to_device(alpha_prev, np.float32), **counters(len(timesteps), begin))

    def update(self, state: DDIMState, out, x, *, key=None, noise=None):
        cfg = self.config
        a_t, a_prev = state.alpha_prod[state.step_index], state.alpha_prod_prev[state.step_index]
        b_t = 1 - a_t
        x0, eps = x0_and_eps(cfg.prediction_type, out, x, a_t)
        x0 = clip_or_threshold(cfg, x0)
        variance = ((1 - a_prev) / b_t) * (1 - a_t / a_prev)
        std = self.eta * jnp.sqrt(variance)
        if self.use_clipped_model_output:
            eps = (x - jnp.sqrt(a_t) * x0) / jnp.sqrt(b_t)
        prev = jnp.sqrt(a_prev) * x0 + jnp.sqrt(1 - a_prev - std * std) * eps
        if not is_zero(self.eta):
            prev = prev + std * step_noise("DDIMScheduler", x.shape, x.dtype, key, noise)
        return prev, state
