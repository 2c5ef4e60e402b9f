"""PNDM (Liu et al. 2022), matching ``diffusers.PNDMScheduler``: PLMS (``skip_prk_steps=True``, what Stable
Diffusion uses) and the Runge-Kutta warm-up (``skip_prk_steps=False``)."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._typing import Array, Float, Int
from ._base import BOOLS, AbstractSchedulerState, check_num_steps, counters, resolve_begin_index, to_device
from ._beta import AbstractBetaScheduler, BetaScheduleConfig, check_train_indices, spaced_timesteps

PNDM_ORDER = 4


@dataclasses.dataclass(frozen=True)
class PNDMConfig(BetaScheduleConfig):
    SUPPORTED_VALUES: ClassVar = {**BetaScheduleConfig.SUPPORTED_VALUES, "prediction_type": ("epsilon", "v_prediction"),
                                  "skip_prk_steps": BOOLS, "set_alpha_to_one": BOOLS}

    SCHEDULE_ONLY: ClassVar = BetaScheduleConfig.SCHEDULE_ONLY | {"set_alpha_to_one"}

    skip_prk_steps: bool = False
    set_alpha_to_one: bool = False


class PNDMState(AbstractSchedulerState):
    """``alpha_prod`` / ``alpha_prod_prev`` hold, per step, the two ``alphas_cumprod`` values the update uses
    (diffusers' PLMS shifts them on its second step; PRK reads them from its sub-step table). ``ets`` keeps the
    last four model outputs, oldest first; ``num_ets`` how many are valid."""

    timesteps: Int[Array, " steps"]
    alpha_prod: Float[Array, " steps"]
    alpha_prod_prev: Float[Array, " steps"]
    ets: Float[Array, "4 *dims"]
    num_ets: Int[Array, ""]
    cur_sample: Float[Array, "*dims"]
    cur_model_output: Float[Array, "*dims"]
    step_index: Int[Array, ""]
    begin_index: Int[Array, ""]
    num_timesteps: Int[Array, ""]
    num_prk: Int[Array, ""]


def _plms_combination(ets, model_output, index):
    """diffusers' PLMS linear multistep combinations, newest entry last; index 4 is the second warm-up step."""
    branches = [
        lambda: ets[-1],
        lambda: (3 * ets[-1] - ets[-2]) / 2,
        lambda: (23 * ets[-1] - 16 * ets[-2] + 5 * ets[-3]) / 12,
        lambda: (1 / 24) * (55 * ets[-1] - 59 * ets[-2] + 37 * ets[-3] - 9 * ets[-4]),
        lambda: (model_output + ets[-1]) / 2,
    ]
    return lax.switch(index, branches)


class PNDMScheduler(AbstractBetaScheduler):
    CONFIG: ClassVar[type[PNDMConfig]] = PNDMConfig
    config: PNDMConfig = eqx.field(static=True, default=PNDMConfig())

    def _schedule(self, num_inference_steps: int):
        """(all timesteps, the PRK warm-up part) exactly as diffusers' ``set_timesteps`` lays them out."""
        cfg = self.config
        ascending = spaced_timesteps(cfg, num_inference_steps)[::-1].astype(np.int64)
        if cfg.skip_prk_steps:
            plms = np.concatenate([ascending[:-1], ascending[-2:-1], ascending[-1:]])[::-1]
            return plms.astype(np.int64), np.zeros(0, np.int64)
        half = cfg.num_train_timesteps // num_inference_steps // 2
        prk = np.array(ascending[-PNDM_ORDER:]).repeat(2) + np.tile(np.array([0, half]), PNDM_ORDER)
        prk = prk[:-1].repeat(2)[1:-1][::-1]
        plms = ascending[:-3][::-1]
        return np.concatenate([prk, plms]).astype(np.int64), prk

    def _init(self, num_inference_steps: int, *, sample_shape, strength, begin_index) -> PNDMState:
        cfg = self.config
        check_num_steps(cfg, num_inference_steps)
        if sample_shape is None:
            raise ValueError("PNDMScheduler.init needs sample_shape= (the latents' shape) for its history buffers")
        if not cfg.skip_prk_steps and num_inference_steps < PNDM_ORDER:
            raise ValueError(f"PNDM with skip_prk_steps=False needs num_inference_steps >= {PNDM_ORDER}, "
                             f"got {num_inference_steps}")
        timesteps, prk = self._schedule(num_inference_steps)
        begin = resolve_begin_index(num_inference_steps, len(timesteps), self.order, strength, begin_index)
        ratio = cfg.num_train_timesteps // num_inference_steps
        # diffusers' step counter restarts at 0 wherever sampling begins; the per-step alphas follow it.
        t_now, t_prev = [], []
        for i, t in enumerate(timesteps):
            counter = max(i - begin, 0)
            if counter < len(prk):
                t_now.append(prk[counter // 4 * 4])
                t_prev.append(t - (0 if counter % 2 else ratio // 2))
            elif counter == 1:
                t_now.append(t + ratio)
                t_prev.append(t)
            else:
                t_now.append(t)
                t_prev.append(t - ratio)
        t_now, t_prev = np.array(t_now, np.int64), np.array(t_prev, np.int64)
        check_train_indices("timesteps", t_now, cfg)
        acp = self.alphas_cumprod
        final = np.float32(1.0) if cfg.set_alpha_to_one else acp[0]
        alpha_prev = np.where(t_prev >= 0, acp[np.clip(t_prev, 0, None)], final)
        zeros = jnp.zeros(tuple(sample_shape), jnp.float32)
        return PNDMState(timesteps=to_device(timesteps, np.int32), alpha_prod=to_device(acp[t_now]),
                         alpha_prod_prev=to_device(alpha_prev, np.float32),
                         ets=jnp.zeros((PNDM_ORDER, *sample_shape), jnp.float32),
                         num_ets=jnp.zeros((), jnp.int32), cur_sample=zeros, cur_model_output=zeros,
                         num_prk=to_device(len(prk), np.int32), **counters(len(timesteps), begin))

    def _plms(self, state: PNDMState, out, x):
        counter = state.step_index - state.begin_index
        append = counter != 1
        ets = jnp.where(append, jnp.concatenate([state.ets[1:], out[None]]), state.ets)
        num_ets = jnp.where(append, jnp.minimum(state.num_ets + 1, PNDM_ORDER), state.num_ets)
        first = (counter == 0) & (num_ets == 1)
        second = (counter == 1) & (num_ets == 1)
        combined = _plms_combination(ets, out, jnp.where(second, 4, num_ets - 1))
        base = jnp.where(second, state.cur_sample, x)
        cur_sample = jnp.where(first, x, state.cur_sample)
        return combined, base, dataclasses.replace(state, ets=ets, num_ets=num_ets, cur_sample=cur_sample)

    def _prk(self, state: PNDMState, out, x):
        phase = (state.step_index - state.begin_index) % 4
        starts = phase == 0
        cmo = jnp.where(starts, 0.0, state.cur_model_output)
        combined = jnp.where(phase == 3, cmo + 1 / 6 * out, out)
        cmo = jnp.where(starts, cmo + 1 / 6 * out, jnp.where(phase == 3, 0.0, cmo + 1 / 3 * out))
        ets = jnp.where(starts, jnp.concatenate([state.ets[1:], out[None]]), state.ets)
        num_ets = jnp.where(starts, jnp.minimum(state.num_ets + 1, PNDM_ORDER), state.num_ets)
        cur_sample = jnp.where(starts, x, state.cur_sample)
        new = dataclasses.replace(state, ets=ets, num_ets=num_ets, cur_sample=cur_sample, cur_model_output=cmo)
        return combined, cur_sample, new

    def update(self, state: PNDMState, out, x, *, key=None, noise=None):
        if not self.config.skip_prk_steps:
            is_prk = state.step_index - state.begin_index < state.num_prk
            combined, base, state = lax.cond(is_prk, self._prk, self._plms, state, out, x)
        else:
            combined, base, state = self._plms(state, out, x)
        a_t, a_prev = state.alpha_prod[state.step_index], state.alpha_prod_prev[state.step_index]
        b_t, b_prev = 1 - a_t, 1 - a_prev
        if self.config.prediction_type == "v_prediction":
            combined = jnp.sqrt(a_t) * combined + jnp.sqrt(b_t) * base
        denom = a_t * jnp.sqrt(b_prev) + jnp.sqrt(a_t * b_t * a_prev)
        prev = jnp.sqrt(a_prev / a_t) * base - (a_prev - a_t) * combined / denom
        return prev, state
