"""Multistep DPM-Solver++ and DPM-Solver (Lu et al. 2022), orders 1, 2 (``2M``) and 3, matching
``diffusers.DPMSolverMultistepScheduler`` with ``algorithm_type`` ``"dpmsolver++"``, ``"sde-dpmsolver++"`` (the
stochastic ``2M SDE``: its step takes ``key=``), ``"dpmsolver"`` or ``"sde-dpmsolver"`` (the noise-prediction
forms diffusers deprecates): on beta schedules, and on flow sigmas (``use_flow_sigmas`` with ``flow_shift``,
``prediction_type="flow_prediction"``: the DPM++ sampler Wan's folders may swap in, ``alpha = 1 - sigma``)."""

import dataclasses
import math
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._typing import Array, Float, Int, typechecked
from ..core import ConfigError
from ._base import (
    BOOLS,
    AbstractSchedulerState,
    check_num_steps,
    counters,
    custom_schedule,
    one_of_steps_or,
    resolve_begin_index,
    step_noise,
    to_device,
)
from ._beta import (
    PREDICTION_TYPES,
    SIGMA_SPACINGS,
    VARIANCE_TYPES,
    AbstractLearnedVarianceScheduler,
    SigmaSpacingConfig,
    check_train_indices,
    sigma_to_t,
    threshold_sample,
    train_sigmas,
)
from ._sigmas import SHIFT_TYPES, respace

UNIPC_SOLVER_TYPES = ("logrho", "bh1", "bh2")


@dataclasses.dataclass(frozen=True)
class DPMSolverConfig(SigmaSpacingConfig):
    SUPPORTED_VALUES: ClassVar = {
        **SigmaSpacingConfig.SUPPORTED_VALUES,
        "algorithm_type": ("dpmsolver++", "sde-dpmsolver++", "dpmsolver", "sde-dpmsolver"),
        "solver_order": (1, 2, 3),
        "solver_type": ("midpoint", "heun"), "lower_order_final": BOOLS, "euler_at_final": BOOLS,
        "use_lu_lambdas": BOOLS, "use_flow_sigmas": BOOLS, "use_dynamic_shifting": BOOLS,
        "time_shift_type": SHIFT_TYPES,
        "prediction_type": (*PREDICTION_TYPES, "flow_prediction"),
        "final_sigmas_type": ("zero", "sigma_min"), "variance_type": (*VARIANCE_TYPES, "fixed_large_log"),
        "thresholding": BOOLS, "rescale_betas_zero_snr": BOOLS}

    SCHEDULE_ONLY: ClassVar = SigmaSpacingConfig.SCHEDULE_ONLY | {"lambda_min_clipped", "flow_shift",
                                                                  "use_dynamic_shifting", "time_shift_type"}

    timestep_spacing: str = "linspace"
    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    use_lu_lambdas: bool = False
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0
    use_dynamic_shifting: bool = False  # init(mu=...) then sets the flow shift to exp(mu), as diffusers
    time_shift_type: str = "exponential"  # (the only one diffusers' DPM-Solver takes mu with)
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -math.inf
    variance_type: str | None = None
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    rescale_betas_zero_snr: bool = False

    def __post_init__(self):
        if self.solver_type in UNIPC_SOLVER_TYPES:  # diffusers maps a UniPC config's (Wan's bh2) to midpoint
            object.__setattr__(self, "solver_type", "midpoint")
        super().__post_init__()
        # diffusers' flow sigmas pair only with flow predictions (and its Karras / exponential spacing would replace
        # them by the beta schedule's sigmas, above 1: every step NaN)
        self.check(self.use_flow_sigmas or self.prediction_type != "flow_prediction", "prediction_type",
                   "needs use_flow_sigmas=True (diffusers would read the beta schedule's sigmas, up to ~15, as flow "
                   "ones in x0 = x - sigma * v: no model predicts that)")
        if self.noise_form:  # DPM-Solver (not ++) integrates the noise prediction; diffusers' limits on it
            self.check(self.final_sigmas_type != "zero", "final_sigmas_type", f"is refused by diffusers with "
                       f"algorithm_type={self.algorithm_type!r} (its last step would divide by sigma 0): use "
                       "'sigma_min'")
            self.check(self.prediction_type != "flow_prediction", "prediction_type", "is refused by diffusers with "
                       f"algorithm_type={self.algorithm_type!r}")
            self.check(not (self.sde and self.solver_order == 3), "solver_order", "with algorithm_type="
                       "'sde-dpmsolver' has no update in diffusers (UnboundLocalError): use 2, or 'sde-dpmsolver++'")
        spacing = [k for k in (*SIGMA_SPACINGS, "use_lu_lambdas") if getattr(self, k)]
        if self.use_flow_sigmas and spacing:
            self.check(False, spacing[0], "cannot be combined with use_flow_sigmas=True (diffusers then steps the "
                       "beta schedule's sigmas as flow sigmas: NaN)")

    @property
    def sde(self) -> bool:
        """``"sde-dpmsolver++"`` (DPM++ 2M SDE) or ``"sde-dpmsolver"``: a stochastic solver, noise added each step."""
        return self.algorithm_type.startswith("sde-")

    @property
    def noise_form(self) -> bool:
        """``"dpmsolver"`` / ``"sde-dpmsolver"``: the history holds noise predictions, not data predictions."""
        return not self.algorithm_type.endswith("++")

    @property
    def spacing(self) -> str | None:
        """The respacing of the sigmas, in diffusers' order of precedence: Karras, then Lu's evenly spaced log
        sigmas (``use_lu_lambdas``, which diffusers lets any other spacing be set with), exponential, beta."""
        if self.use_lu_lambdas and not self.use_karras_sigmas:
            return "lu"
        return self.sigma_spacing


class DPMSolverState(AbstractSchedulerState):
    """``model_outputs`` holds the last ``solver_order`` data predictions, oldest first; ``lower_order_nums``
    counts the steps taken since ``begin_index`` (capped at ``solver_order``)."""

    timesteps: Int[Array, " steps"]
    sigmas: Float[Array, " steps_plus_one"]
    model_outputs: Float[Array, "order *dims"]
    lower_order_nums: Int[Array, ""]
    step_index: Int[Array, ""]
    begin_index: Int[Array, ""]
    num_timesteps: Int[Array, ""]


def _alpha_sigma(sigma, flow: bool = False, xp=jnp):
    """``(alpha_t, sigma_t)`` of a sigma: the variance-preserving pair, or flow matching's ``(1 - sigma, sigma)``."""
    if flow:
        return 1 - sigma, sigma
    alpha_t = 1 / xp.sqrt(sigma * sigma + 1)
    return alpha_t, sigma * alpha_t


def _lambda(alpha, sigma):
    return jnp.log(alpha) - jnp.log(sigma)


class DPMSolverMultistepScheduler(AbstractLearnedVarianceScheduler):
    CONFIG: ClassVar[type[DPMSolverConfig]] = DPMSolverConfig
    config: DPMSolverConfig = eqx.field(static=True, default=DPMSolverConfig())
    TERMINAL_FLOOR: ClassVar[bool] = True
    SCHEDULE_KEYWORDS: ClassVar[tuple[str, ...]] = ("timesteps", "mu")

    def _timesteps(self, num_inference_steps: int) -> np.ndarray:
        cfg = self.config
        n, t = num_inference_steps, cfg.num_train_timesteps
        acp = self.alphas_cumprod
        lambdas = np.log(np.sqrt(acp)) - np.log(np.sqrt(np.float32(1) - acp))
        last = t - int(np.searchsorted(lambdas[::-1], cfg.lambda_min_clipped, side="left"))
        if cfg.timestep_spacing == "linspace":
            return np.linspace(0, last - 1, n + 1).round()[::-1][:-1].astype(np.int64)
        if cfg.timestep_spacing == "leading":
            ratio = last // (n + 1)
            return (np.arange(0, n + 1) * ratio).round()[::-1][:-1].astype(np.int64) + cfg.steps_offset
        return np.arange(last, 0, -t / n).round().astype(np.int64) - 1

    def _init(self, num_inference_steps: int | None, *, sample_shape, strength, begin_index, timesteps=None,
              mu=None) -> DPMSolverState:
        cfg = self.config
        flow_shift = cfg.flow_shift
        if mu is not None:  # diffusers: flow_shift = exp(mu) (the exponential time shift of the flow sigmas)
            if not (cfg.use_dynamic_shifting and cfg.time_shift_type == "exponential"):
                raise ValueError("DPMSolverMultistepScheduler.init: mu= needs use_dynamic_shifting=True and "
                                 f"time_shift_type='exponential' (got use_dynamic_shifting={cfg.use_dynamic_shifting}"
                                 f", time_shift_type={cfg.time_shift_type!r})")
            flow_shift = math.exp(mu)
        if sample_shape is None:
            raise ValueError("DPMSolverMultistepScheduler.init needs sample_shape= (the latents' shape) for its "
                             "history buffer")
        one_of_steps_or("DPMSolverMultistepScheduler", num_inference_steps, timesteps=timesteps)
        if timesteps is not None:
            spacing = [k for k in (*SIGMA_SPACINGS, "use_lu_lambdas", "use_flow_sigmas") if getattr(cfg, k)]
            if spacing:  # (diffusers replaces given timesteps by the respaced or flow schedule's)
                raise ValueError(f"DPMSolverMultistepScheduler.init: timesteps= cannot be used with {spacing[0]}=True")
            timesteps = custom_schedule("DPMSolverMultistepScheduler", "timesteps", timesteps, np.int64)
            num_inference_steps = len(timesteps)
        else:
            check_num_steps(cfg, num_inference_steps)
            timesteps = self._timesteps(num_inference_steps)
        acp = self.alphas_cumprod
        sigmas = train_sigmas(acp)
        log_sigmas = np.log(sigmas)
        spacing = cfg.spacing
        if spacing == "lu":  # diffusers' _convert_to_lu: log sigmas (float32) evenly spaced, from the largest
            low, high = log_sigmas[0].item(), log_sigmas[-1].item()
            sigmas = np.exp(high + np.linspace(0, 1, num_inference_steps) * (low - high))
        elif spacing:
            sigmas = respace(spacing, sigmas[::-1], num_inference_steps)
        if spacing:
            timesteps = sigma_to_t(sigmas, log_sigmas)
            if spacing in ("karras", "lu") and cfg.beta_schedule != "squaredcos_cap_v2":
                timesteps = timesteps.round()
            timesteps = timesteps.astype(np.int64)  # torch's .to(int64) truncates
        elif cfg.use_flow_sigmas:  # diffusers: 1 - linspace(1, 1/T, n+1), shifted, from the top, without the 0
            flow = 1.0 - np.linspace(1, 1 / cfg.num_train_timesteps, num_inference_steps + 1)
            sigmas = np.flip(flow_shift * flow / (1 + (flow_shift - 1) * flow))[:-1].copy()
            timesteps = (sigmas * cfg.num_train_timesteps).astype(np.int64)  # torch's .to(int64) truncates
        else:
            sigmas = np.interp(timesteps, np.arange(0, len(sigmas)), sigmas)
        check_train_indices("timesteps", timesteps, cfg, sigma_clamped=True)
        last = np.sqrt((np.float32(1) - acp[0]) / acp[0]) if cfg.final_sigmas_type == "sigma_min" else 0.0
        sigmas = np.concatenate([sigmas, [last]]).astype(np.float32)
        begin = resolve_begin_index(num_inference_steps, len(timesteps), self.order, strength, begin_index)
        self._check_defined(sigmas, begin)
        return DPMSolverState(timesteps=to_device(timesteps, np.int32), sigmas=to_device(sigmas),
                              model_outputs=jnp.zeros((cfg.solver_order, *sample_shape), jnp.float32),
                              lower_order_nums=jnp.zeros((), jnp.int32), **counters(len(timesteps), begin))

    def _check_defined(self, sigmas: np.ndarray, begin: int) -> None:
        """Refuse a schedule whose second- or third-order update divides by a zero step (float64 on the float32 sigmas):
        repeated timesteps make ``h_0 = 0`` (and ``1 / r0 = h / h_0`` infinite), and heun's ``(e^-h - 1) / h`` is
        ``0 / 0`` at ``h = 0``. diffusers' sample is NaN or inf from that step on; so was ours."""
        cfg, n = self.config, len(sigmas) - 1
        if cfg.solver_order == 1:
            return
        s = sigmas.astype(np.float64)
        with np.errstate(all="ignore"):
            alpha, sig = _alpha_sigma(s, cfg.use_flow_sigmas, xp=np)
            lam = np.log(alpha) - np.log(sig)
            final_first = cfg.euler_at_final or (cfg.lower_order_final and n < 15) or cfg.final_sigmas_type == "zero"
            for i in range(begin + 1, n - 1 if final_first else n):
                h, h_0 = lam[i + 1] - lam[i], lam[i] - lam[i - 1]
                k = 2.0 if cfg.sde else 1.0  # (the SDE solver's weights are the ODE one's at 2h, over 2h)
                phi = np.expm1(k * h if cfg.noise_form else -k * h)
                weight = -0.5 * phi if cfg.solver_type == "midpoint" else phi / (k * h) + 1.0
                defined = np.isfinite(weight * (h / h_0))
                if cfg.solver_order == 3 and i >= begin + 2:  # (also 1 / r1 and the heun-type weights)
                    h_1 = lam[i - 1] - lam[i - 2]
                    defined &= np.isfinite(h / h_1) and np.isfinite(h / (h_0 + h_1)) and np.isfinite(phi / (k * h))
                if not defined:
                    raise ConfigError(
                        f"DPMSolverMultistepScheduler: the multistep update of step {i} of {n} (sigmas "
                        f"{s[i - 1]:g}, {s[i]:g} -> {s[i + 1]:g}) divides by a zero step (a repeated sigma; diffusers' "
                        "sample is NaN or inf from there): use fewer steps (1000 'linspace' steps repeat a timestep),"
                        " another timestep_spacing, euler_at_final=True (at the last step) or solver_order=1")

    def _data_prediction(self, state: DPMSolverState, out, x):
        cfg = self.config
        if cfg.prediction_type == "sample":
            x0 = out
        else:
            alpha_t, sigma_t = self._alpha_sigma(state.sigmas[state.step_index])
            if cfg.prediction_type == "epsilon":
                x0 = (x - sigma_t * out) / alpha_t
            elif cfg.prediction_type == "flow_prediction":  # (only with flow sigmas, where sigma_t is the sigma)
                x0 = x - sigma_t * out
            else:
                x0 = alpha_t * x - sigma_t * out
        if cfg.thresholding:
            x0 = threshold_sample(x0, cfg.dynamic_thresholding_ratio, cfg.sample_max_value)
        return x0

    def _noise_prediction(self, state: DPMSolverState, out, x):
        """The noise ``"dpmsolver"`` / ``"sde-dpmsolver"`` integrate, as diffusers' ``convert_model_output``."""
        cfg = self.config
        alpha_t, sigma_t = self._alpha_sigma(state.sigmas[state.step_index])
        if cfg.prediction_type == "epsilon":
            eps = out
        elif cfg.prediction_type == "sample":
            eps = (x - alpha_t * out) / sigma_t
        else:
            eps = alpha_t * out + sigma_t * x
        if cfg.thresholding:
            x0 = threshold_sample((x - sigma_t * eps) / alpha_t, cfg.dynamic_thresholding_ratio, cfg.sample_max_value)
            eps = (x - alpha_t * x0) / sigma_t
        return eps

    def _alpha_sigma(self, sigma):
        return _alpha_sigma(sigma, self.config.use_flow_sigmas)

    def _first_order(self, state: DPMSolverState, m, x):
        i = state.step_index
        alpha_t, sigma_t = self._alpha_sigma(state.sigmas[i + 1])
        alpha_s, sigma_s = self._alpha_sigma(state.sigmas[i])
        h = _lambda(alpha_t, sigma_t) - _lambda(alpha_s, sigma_s)
        if self.config.noise_form:  # (the noise term is added by update)
            return (alpha_t / alpha_s) * x - (2.0 if self.config.sde else 1.0) * (sigma_t * (jnp.exp(h) - 1.0)) * m[-1]
        if self.config.sde:
            return (sigma_t / sigma_s * jnp.exp(-h)) * x + (alpha_t * (1 - jnp.exp(-2.0 * h))) * m[-1]
        return (sigma_t / sigma_s) * x - (alpha_t * (jnp.exp(-h) - 1.0)) * m[-1]

    def _second_order(self, state: DPMSolverState, m, x):
        i = state.step_index
        alpha_t, sigma_t = self._alpha_sigma(state.sigmas[i + 1])
        alpha_s0, sigma_s0 = self._alpha_sigma(state.sigmas[i])
        alpha_s1, sigma_s1 = self._alpha_sigma(state.sigmas[jnp.maximum(i - 1, 0)])
        lambda_t, lambda_s0 = _lambda(alpha_t, sigma_t), _lambda(alpha_s0, sigma_s0)
        lambda_s1 = _lambda(alpha_s1, sigma_s1)
        m0, m1 = m[-1], m[-2]
        h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
        r0 = h_0 / h
        d0, d1 = m0, (1.0 / r0) * (m0 - m1)
        if self.config.noise_form:
            k = 2.0 if self.config.sde else 1.0
            first = (alpha_t / alpha_s0) * x - k * (sigma_t * (jnp.exp(h) - 1.0)) * d0
            if self.config.solver_type == "midpoint":
                return first - (0.5 * k) * (sigma_t * (jnp.exp(h) - 1.0)) * d1
            return first - k * (sigma_t * ((jnp.exp(h) - 1.0) / h - 1.0)) * d1
        if self.config.sde:
            first = (sigma_t / sigma_s0 * jnp.exp(-h)) * x + (alpha_t * (1 - jnp.exp(-2.0 * h))) * d0
            if self.config.solver_type == "midpoint":
                return first + 0.5 * (alpha_t * (1 - jnp.exp(-2.0 * h))) * d1
            return first + (alpha_t * ((1.0 - jnp.exp(-2.0 * h)) / (-2.0 * h) + 1.0)) * d1
        first = (sigma_t / sigma_s0) * x - (alpha_t * (jnp.exp(-h) - 1.0)) * d0
        if self.config.solver_type == "midpoint":
            return first - 0.5 * (alpha_t * (jnp.exp(-h) - 1.0)) * d1
        return first + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1

    def _third_order(self, state: DPMSolverState, m, x):
        i = state.step_index
        alpha_t, sigma_t = self._alpha_sigma(state.sigmas[i + 1])
        lambda_t = _lambda(alpha_t, sigma_t)
        alpha_s0, sigma_s0 = self._alpha_sigma(state.sigmas[i])
        lambda_s0 = _lambda(alpha_s0, sigma_s0)
        lambda_s1 = _lambda(*self._alpha_sigma(state.sigmas[jnp.maximum(i - 1, 0)]))
        lambda_s2 = _lambda(*self._alpha_sigma(state.sigmas[jnp.maximum(i - 2, 0)]))
        m0, m1, m2 = m[-1], m[-2], m[-3]
        h, h_0, h_1 = lambda_t - lambda_s0, lambda_s0 - lambda_s1, lambda_s1 - lambda_s2
        r0, r1 = h_0 / h, h_1 / h
        d1_0, d1_1 = (1.0 / r0) * (m0 - m1), (1.0 / r1) * (m1 - m2)
        d1 = d1_0 + (r0 / (r0 + r1)) * (d1_0 - d1_1)
        d2 = (1.0 / (r0 + r1)) * (d1_0 - d1_1)
        if self.config.noise_form:  # ("dpmsolver": diffusers has no third-order "sde-dpmsolver")
            e = jnp.exp(h)
            return ((alpha_t / alpha_s0) * x - (sigma_t * (e - 1.0)) * m0 - (sigma_t * ((e - 1.0) / h - 1.0)) * d1
                    - (sigma_t * ((e - 1.0 - h) / h**2 - 0.5)) * d2)
        if self.config.sde:
            e = jnp.exp(-2.0 * h)
            return ((sigma_t / sigma_s0 * jnp.exp(-h)) * x + (alpha_t * (1.0 - e)) * m0
                    + (alpha_t * ((1.0 - e) / (-2.0 * h) + 1.0)) * d1
                    + (alpha_t * ((1.0 - e - 2.0 * h) / (2.0 * h) ** 2 - 0.5)) * d2)
        e = jnp.exp(-h)
        return ((sigma_t / sigma_s0) * x - (alpha_t * (e - 1.0)) * m0 + (alpha_t * ((e - 1.0) / h + 1.0)) * d1
                - (alpha_t * ((e - 1.0 + h) / h**2 - 0.5)) * d2)

    def update(self, state: DPMSolverState, out, x, *, key=None, noise=None):
        cfg = self.config
        learned = cfg.variance_type in ("learned", "learned_range")  # diffusers ignores the fixed_* types
        if learned and cfg.prediction_type == "epsilon" and out.shape[-1] == 2 * x.shape[-1]:
            out = out[..., :x.shape[-1]]  # drop the predicted variance (the channels' second half)
        if out.shape != x.shape:
            raise ValueError(f"model_output shape {out.shape} must equal the sample shape {x.shape}")
        n = state.num_timesteps
        i = state.step_index
        final_first_order = cfg.euler_at_final | (cfg.lower_order_final & (n < 15)) | (cfg.final_sigmas_type == "zero")
        lower_final = (i == n - 1) & final_first_order
        pred = self._noise_prediction(state, out, x) if cfg.noise_form else self._data_prediction(state, out, x)
        m = jnp.concatenate([state.model_outputs[1:], pred[None]])
        if cfg.solver_order == 1:
            prev = self._first_order(state, m, x)
        else:
            use_first = (state.lower_order_nums < 1) | lower_final
            # third order: from the third step, but the second-to-last of a short run (lower_order_second)
            use_second = (cfg.solver_order == 2) | (state.lower_order_nums < 2) | (
                (i == n - 2) & cfg.lower_order_final & (n < 15))
            prev = lax.switch(jnp.where(use_first, 0, jnp.where(use_second, 1, 2)),
                              [self._first_order, self._second_order, self._third_order][:cfg.solver_order],
                              state, m, x)
        if cfg.sde:  # sigma_t * sqrt(1 - e^(-2h)) (sde-dpmsolver: sqrt(e^2h - 1)) * noise, drawn every step
            alpha_t, sigma_t = self._alpha_sigma(state.sigmas[i + 1])
            alpha_s, sigma_s = self._alpha_sigma(state.sigmas[i])
            h = _lambda(alpha_t, sigma_t) - _lambda(alpha_s, sigma_s)
            scale = jnp.sqrt(jnp.exp(2 * h) - 1.0) if cfg.noise_form else jnp.sqrt(1.0 - jnp.exp(-2 * h))
            prev = prev + sigma_t * scale * step_noise(
                "DPMSolverMultistepScheduler", x.shape, x.dtype, key, noise)
        new = dataclasses.replace(state, model_outputs=m,
                                  lower_order_nums=jnp.minimum(state.lower_order_nums + 1, cfg.solver_order))
        return prev, new

    @typechecked
    def add_noise_at_step(self, state: DPMSolverState, original: Float[Array, "*dims"],
                          noise: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        """``alpha_t * original + sigma_t * noise`` at ``sigmas[step]`` (diffusers after ``set_begin_index``; flow
        sigmas: ``(1 - sigma) * original + sigma * noise``)."""
        alpha_t, sigma_t = self._alpha_sigma(state.sigmas[state.step_index])
        return (alpha_t * original + sigma_t * noise).astype(original.dtype)
