"""DDPM (Ho et al. 2020) ancestral sampling, matching ``diffusers.DDPMScheduler``; the training-side
``add_noise`` / ``get_velocity`` live on the beta-schedule base class."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from ._base import (
    check_num_steps,
    counters,
    custom_schedule,
    one_of_steps_or,
    resolve_begin_index,
    step_noise,
    to_device,
)
from ._beta import (
    VARIANCE_TYPES,
    AbstractLearnedVarianceScheduler,
    AlphaProdState,
    ClipSampleConfig,
    check_train_indices,
    check_zero_snr_start,
    clip_or_threshold,
    spaced_timesteps,
    x0_and_eps,
)


@dataclasses.dataclass(frozen=True)
class DDPMConfig(ClipSampleConfig):
    SUPPORTED_VALUES: ClassVar = {**ClipSampleConfig.SUPPORTED_VALUES, "variance_type": VARIANCE_TYPES}

    variance_type: str | None = "fixed_small"

    def __post_init__(self):
        self.check(self.variance_type != "fixed_large_log", "variance_type", "gives NaN in diffusers' DDPMScheduler "
                   "(it adds sqrt(log(beta_t)) * noise, the square root of a negative number, at every step but the "
                   "last); use 'fixed_large' (variance beta_t) or 'fixed_small'")
        super().__post_init__()


DDPMState = AlphaProdState  # the same state as DDIM's


class DDPMScheduler(AbstractLearnedVarianceScheduler):
    """DDPM. With ``variance_type`` ``"learned"`` / ``"learned_range"`` the model output carries the predicted
    variance in the second half of its channels (the last axis). ``init(timesteps=[...])`` takes a custom
    descending schedule (each step goes to the next listed timestep, the last to the clean sample)."""

    CONFIG: ClassVar[type[DDPMConfig]] = DDPMConfig
    config: DDPMConfig = eqx.field(static=True, default=DDPMConfig())
    SCHEDULE_KEYWORDS: ClassVar[tuple[str, ...]] = ("timesteps",)

    def _init(self, num_inference_steps: int | None, *, sample_shape, strength, begin_index,
              timesteps=None) -> DDPMState:
        cfg = self.config
        if timesteps is not None:
            one_of_steps_or("DDPMScheduler", num_inference_steps, timesteps=timesteps)
            timesteps = custom_schedule("DDPMScheduler", "timesteps", timesteps, np.int64)
            num_inference_steps = len(timesteps)
        else:
            num_inference_steps = cfg.num_train_timesteps if num_inference_steps is None else num_inference_steps
            check_num_steps(cfg, num_inference_steps)
            timesteps = spaced_timesteps(cfg, num_inference_steps).astype(np.int64)
        check_train_indices("timesteps", timesteps, cfg)
        acp = self.alphas_cumprod
        # The previous timestep is the next entry of the schedule; past the last one alpha_prod is 1.
        alpha_prev = np.concatenate([acp[timesteps[1:]], np.ones(1, np.float32)])
        begin = resolve_begin_index(num_inference_steps, len(timesteps), self.order, strength, begin_index)
        check_zero_snr_start("DDPMScheduler", cfg, timesteps[begin:], acp)
        return DDPMState(timesteps=to_device(timesteps, np.int32), alpha_prod=to_device(acp[timesteps]),
                         alpha_prod_prev=to_device(alpha_prev), **counters(len(timesteps), begin))

    def update(self, state: DDPMState, out, x, *, key=None, noise=None):
        cfg = self.config
        predicted_variance = None
        learned = cfg.variance_type in ("learned", "learned_range")
        if learned and out.shape[-1] == 2 * x.shape[-1]:
            out, predicted_variance = out[..., :x.shape[-1]], out[..., x.shape[-1]:]
        elif learned:
            raise ValueError(f"variance_type={cfg.variance_type!r} needs a model output with twice the sample's "
                             f"channels (last axis); got {out.shape} for a sample of shape {x.shape}")
        if out.shape != x.shape:
            raise ValueError(f"model_output shape {out.shape} must equal the sample shape {x.shape}")

        t = state.timesteps[state.step_index]
        a_t, a_prev = state.alpha_prod[state.step_index], state.alpha_prod_prev[state.step_index]
        b_t, b_prev = 1 - a_t, 1 - a_prev
        cur_alpha = a_t / a_prev
        cur_beta = 1 - cur_alpha
        x0, _ = x0_and_eps(cfg.prediction_type, out, x, a_t)
        x0 = clip_or_threshold(cfg, x0)
        x0_coeff = (jnp.sqrt(a_prev) * cur_beta) / b_t
        x_coeff = jnp.sqrt(cur_alpha) * b_prev / b_t
        prev = x0_coeff * x0 + x_coeff * x

        variance = jnp.maximum((1 - a_prev) / (1 - a_t) * cur_beta, 1e-20)
        if cfg.variance_type in ("fixed_small", None):
            std = jnp.sqrt(variance)
        elif cfg.variance_type == "fixed_small_log":
            std = jnp.exp(0.5 * jnp.log(variance))
        elif cfg.variance_type == "fixed_large":
            std = jnp.sqrt(cur_beta)
        elif cfg.variance_type == "learned":
            std = jnp.sqrt(predicted_variance)
        else:  # learned_range
            frac = (predicted_variance + 1) / 2
            std = jnp.exp(0.5 * (frac * jnp.log(cur_beta) + (1 - frac) * jnp.log(variance)))
        eps = step_noise("DDPMScheduler", x.shape, x.dtype, key, noise)
        return prev + jnp.where(t > 0, std * eps, 0.0), state
