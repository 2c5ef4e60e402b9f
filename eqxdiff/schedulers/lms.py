"""Linear multistep (k-diffusion's ``sample_lms``, order 4), matching ``diffusers.LMSDiscreteScheduler``.

diffusers integrates each Lagrange basis polynomial with ``scipy.integrate.quad``; the integrand is a polynomial of
degree < 4, so ``init`` integrates it exactly in closed form (float64) instead.
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from numpy.polynomial import Polynomial

from .._typing import Array, Float, Int
from ._base import AbstractSigmaState, counters, resolve_begin_index, to_device
from ._beta import SigmaSpacingConfig, sigma_to_t, x0_from_sigma
from ._sigmas import respace
from .euler import AbstractSigmaScheduler, euler_timesteps_and_sigmas

LMS_ORDER = 4


@dataclasses.dataclass(frozen=True)
class LMSConfig(SigmaSpacingConfig):
    timestep_spacing: str = "linspace"


class LMSState(AbstractSigmaState):
    """``coeffs[i, j]`` weighs the ``j``-th newest derivative at step ``i``; ``derivatives`` is newest first."""

    timesteps: Float[Array, " steps"]
    sigmas: Float[Array, " steps_plus_one"]
    coeffs: Float[Array, "steps 4"]
    derivatives: Float[Array, "4 *dims"]
    step_index: Int[Array, ""]
    begin_index: Int[Array, ""]
    num_timesteps: Int[Array, ""]


def lms_coefficients(sigmas: np.ndarray, num_steps: int) -> np.ndarray:
    """``coeffs[i, j] = integral from sigmas[i] to sigmas[i+1] of the j-th Lagrange basis polynomial`` on the
    nodes ``sigmas[i], sigmas[i-1], ...`` (order ``min(i + 1, 4)``)."""
    s = sigmas.astype(np.float64)
    coeffs = np.zeros((num_steps, LMS_ORDER), np.float64)
    for i in range(num_steps):
        order = min(i + 1, LMS_ORDER)
        for j in range(order):
            basis = Polynomial([1.0])
            for k in range(order):
                if k != j:
                    basis = basis * Polynomial([-s[i - k], 1.0]) / (s[i - j] - s[i - k])
            antiderivative = basis.integ()
            coeffs[i, j] = antiderivative(s[i + 1]) - antiderivative(s[i])
    return coeffs.astype(np.float32)


class LMSDiscreteScheduler(AbstractSigmaScheduler):
    CONFIG: ClassVar[type[LMSConfig]] = LMSConfig
    config: LMSConfig = eqx.field(static=True, default=LMSConfig())
    TERMINAL_FLOOR: ClassVar[bool] = False

    def _init(self, num_inference_steps: int, *, sample_shape, strength, begin_index) -> LMSState:
        cfg = self.config
        if sample_shape is None:
            raise ValueError("LMSDiscreteScheduler.init needs sample_shape= (the latents' shape) for its history")
        timesteps, sigmas, log_sigmas = euler_timesteps_and_sigmas(self, num_inference_steps)
        if cfg.sigma_spacing:
            sigmas = respace(cfg.sigma_spacing, sigmas, num_inference_steps)
            timesteps = sigma_to_t(sigmas, log_sigmas)
        sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32)
        begin = resolve_begin_index(num_inference_steps, len(timesteps), self.order, strength, begin_index)
        # (one per timestep: 'trailing' spacing gives one more than num_inference_steps for some step counts)
        return LMSState(timesteps=to_device(timesteps, np.float32), sigmas=to_device(sigmas),
                        **counters(len(timesteps), begin),
                        coeffs=to_device(lms_coefficients(sigmas, len(timesteps))),
                        derivatives=jnp.zeros((LMS_ORDER, *sample_shape), jnp.float32))

    def update(self, state: LMSState, out, x, *, key=None, noise=None):
        sigma = state.sigmas[state.step_index]
        x0 = x0_from_sigma(self.config.prediction_type, out, x, sigma)
        derivatives = jnp.concatenate([((x - x0) / sigma)[None], state.derivatives[:-1]])
        coeffs = state.coeffs[state.step_index]
        # Summed newest first like diffusers; after a (re)start the missing derivatives are zeros.
        update = coeffs[0] * derivatives[0]
        for j in range(1, LMS_ORDER):
            update = update + coeffs[j] * derivatives[j]
        prev = x + update
        return prev, dataclasses.replace(state, derivatives=derivatives)
