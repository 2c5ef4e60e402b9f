"""UniPC (Zhao et al. 2023): a multistep predictor (UniP) and corrector (UniC) of orders 1-3, matching
``diffusers.UniPCMultistepScheduler``, on beta schedules (epsilon / v / sample prediction) and on flow sigmas
(``use_flow_sigmas`` with ``flow_shift`` or dynamic ``mu``, ``prediction_type="flow_prediction"``: Wan's config).

Each step first corrects the sample the previous step predicted, using the model output at it (unless that step
is in ``disable_corrector``), then predicts the next sample from the last ``order`` data (or noise) predictions.
The order is warmed up from 1 and, with ``lower_order_final``, lowered over the last steps. Each update is a
weighted sum of the sample and the model outputs whose weights (per step and order) ``init`` computes on the host
in float64, so the whole loop stays one jitted ``fori_loop`` and the weights keep the digits float32 would lose.

One difference from diffusers is kept on purpose: with ``solver_type="bh1"``, an order-1 update into sigma 0 (the
last step of a ``final_sigmas_type="zero"`` schedule) is NaN in diffusers, whose ``alpha_t * B_h * pred_res`` is
``-inf * 0``; here the empty residual term is left out, so that step lands on the data prediction as with ``bh2``.
"""

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._typing import Array, Bool, Float, Int, typechecked
from ..core import ConfigError
from ._base import (
    BOOLS,
    AbstractSigmaState,
    check_num_steps,
    counters,
    custom_schedule,
    resolve_begin_index,
    to_device,
)
from ._beta import (
    PREDICTION_TYPES,
    AbstractBetaScheduler,
    BetaScheduleConfig,
    check_train_indices,
    sigma_to_t,
    threshold_sample,
    train_sigmas,
)
from ._sigmas import SHIFT_TYPES, respace, shift_flow_sigmas

SPACINGS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")
# diffusers maps DPM-Solver's solver types to bh2 (a DPM-Solver config swapped to UniPC carries "midpoint").
DPM_SOLVER_TYPES = ("midpoint", "heun", "logrho")


@dataclasses.dataclass(frozen=True)
class UniPCConfig(BetaScheduleConfig):
    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {
        **BetaScheduleConfig.SUPPORTED_VALUES, "prediction_type": (*PREDICTION_TYPES, "flow_prediction"),
        "solver_order": (1, 2, 3), "solver_type": ("bh1", "bh2", *DPM_SOLVER_TYPES), "thresholding": BOOLS,
        "predict_x0": BOOLS, "lower_order_final": BOOLS, "solver_p": (None,), "use_karras_sigmas": BOOLS,
        "use_exponential_sigmas": BOOLS, "use_beta_sigmas": BOOLS, "use_flow_sigmas": BOOLS,
        "final_sigmas_type": ("zero", "sigma_min"), "rescale_betas_zero_snr": BOOLS, "use_dynamic_shifting": BOOLS,
        "time_shift_type": SHIFT_TYPES}

    SCHEDULE_ONLY: ClassVar[frozenset[str]] = BetaScheduleConfig.SCHEDULE_ONLY | {
        *SPACINGS, "flow_shift", "use_dynamic_shifting", "time_shift_type", "sigma_min", "sigma_max",
        "shift_terminal", "final_sigmas_type", "disable_corrector", "solver_type"}

    solver_order: int = 2
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    predict_x0: bool = True
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()
    solver_p: None = None
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    use_flow_sigmas: bool = False
    flow_shift: float = 1.0
    timestep_spacing: str = "linspace"
    final_sigmas_type: str = "zero"
    rescale_betas_zero_snr: bool = False
    use_dynamic_shifting: bool = False
    time_shift_type: str = "exponential"
    sigma_min: float | None = None
    sigma_max: float | None = None
    shift_terminal: float | None = None

    def __post_init__(self):
        if self.solver_type in DPM_SOLVER_TYPES:
            object.__setattr__(self, "solver_type", "bh2")
        super().__post_init__()
        spacing = [k for k in SPACINGS if getattr(self, k)]
        self.check(len(spacing) <= 1, spacing[0] if spacing else "use_karras_sigmas",
                   f"cannot be combined with {'=True, '.join(spacing[1:])}=True (pick one spacing)")
        if self.use_flow_sigmas and spacing and spacing[0] != "use_karras_sigmas":
            # diffusers converts only Karras sigmas to flow sigmas: these stay the beta schedule's (up to ~157), and
            # 1 - sigma < 0 makes every step NaN
            self.check(False, spacing[0], "cannot be combined with use_flow_sigmas=True (only use_karras_sigmas "
                       "respaces flow sigmas; these exceed 1 and every step is NaN, in diffusers too)")
        if self.shift_terminal is not None:
            self.check(self.use_flow_sigmas, "shift_terminal", "needs use_flow_sigmas=True")
        if self.prediction_type == "flow_prediction":
            self.check(self.predict_x0, "prediction_type", "needs predict_x0=True")


class UniPCState(AbstractSigmaState):
    """``model_outputs``: the last ``solver_order`` converted model outputs, oldest first; ``last_sample``: the
    sample the last predictor started from (the corrector's base); ``this_order``: that predictor's order;
    ``lower_order_nums``: steps taken since ``begin_index`` (capped at ``solver_order``); ``corrector[i]``: whether
    step ``i`` may correct the previous prediction (not for ``i - 1`` in ``disable_corrector``); ``predictor_coeffs`` /
    ``corrector_coeffs``: per step and order, the weights of that update (float64 on the host, then float32)."""

    timesteps: Int[Array, " steps"]
    sigmas: Float[Array, " steps_plus_one"]
    corrector: Bool[Array, " steps"]
    predictor_coeffs: Float[Array, "steps order 4"]
    corrector_coeffs: Float[Array, "steps order 5"]
    model_outputs: Float[Array, "order *dims"]
    last_sample: Float[Array, "*dims"]
    this_order: Int[Array, ""]
    lower_order_nums: Int[Array, ""]
    step_index: Int[Array, ""]
    begin_index: Int[Array, ""]
    num_timesteps: Int[Array, ""]


class UniPCMultistepScheduler(AbstractBetaScheduler):
    CONFIG: ClassVar[type[UniPCConfig]] = UniPCConfig
    config: UniPCConfig = eqx.field(static=True, default=UniPCConfig())
    TERMINAL_FLOOR: ClassVar[bool] = True
    SCHEDULE_KEYWORDS: ClassVar[tuple[str, ...]] = ("sigmas", "mu")

    # -- host: the schedule ----------------------------------------------------------------------------------

    def _spaced_timesteps(self, n: int) -> np.ndarray:
        cfg, big_n = self.config, self.config.num_train_timesteps
        if cfg.timestep_spacing == "linspace":
            return np.linspace(0, big_n - 1, n + 1).round()[::-1][:-1].astype(np.int64)
        if cfg.timestep_spacing == "leading":
            ratio = big_n // (n + 1)
            return (np.arange(0, n + 1) * ratio).round()[::-1][:-1].astype(np.int64) + cfg.steps_offset
        return np.arange(big_n, 0, -big_n / n).round().astype(np.int64) - 1

    def _flow_sigmas(self, n: int, sigmas, mu) -> np.ndarray:
        cfg = self.config
        if sigmas is None:
            sigmas = np.linspace(1, 1 / cfg.num_train_timesteps, n + 1)[:-1]
        sigmas = shift_flow_sigmas(sigmas, dynamic=cfg.use_dynamic_shifting, shift_type=cfg.time_shift_type, mu=mu,
                                   shift=cfg.flow_shift, terminal=cfg.shift_terminal)
        sigmas = np.array(sigmas)
        if np.fabs(sigmas[0] - 1) < 1e-6:  # keep log(sigma) and log(1 - sigma) finite at the first step
            sigmas[0] -= 1e-6
        return sigmas

    def _init(self, num_inference_steps: int | None, *, sample_shape, strength, begin_index, sigmas=None,
              mu=None) -> UniPCState:
        cfg, name = self.config, "UniPCMultistepScheduler"
        if sample_shape is None:
            raise ValueError(f"{name}.init needs sample_shape= (the latents' shape) for its history buffers")
        if cfg.use_dynamic_shifting and mu is None:
            raise ValueError(f"{name}.init needs mu= with use_dynamic_shifting=True")
        if sigmas is not None:
            if not cfg.use_flow_sigmas:
                raise ValueError(f"{name}.init: sigmas= needs use_flow_sigmas=True (as diffusers)")
            spacing = [k for k in SPACINGS if getattr(cfg, k)]
            if spacing:  # diffusers flips the given (descending) sigmas before respacing: an ascending schedule
                raise ValueError(f"{name}.init: sigmas= cannot be used with {spacing[0]}=True (diffusers respaces "
                                 "between the given sigmas' ends reversed, from the smallest up); pass the respaced "
                                 f"sigmas themselves, or set {spacing[0]}=False")
            sigmas = custom_schedule(name, "sigmas", sigmas, np.float64)
            num_inference_steps = len(sigmas)
        elif num_inference_steps is None:
            raise ValueError(f"{name}.init needs num_inference_steps (or sigmas= with use_flow_sigmas=True)")
        check_num_steps(cfg, num_inference_steps)
        n, big_n = num_inference_steps, cfg.num_train_timesteps
        timesteps = self._spaced_timesteps(n)
        acp = self.alphas_cumprod
        spacing = [kind for key, kind in zip(SPACINGS, ("karras", "exponential", "beta")) if getattr(cfg, key)]
        if spacing:
            if sigmas is None:
                sigmas = train_sigmas(acp)
            log_sigmas = np.log(sigmas)
            sigmas = respace(spacing[0], np.flip(sigmas), n, cfg.sigma_min, cfg.sigma_max)
            if spacing[0] == "karras" and cfg.use_flow_sigmas:
                sigmas = sigmas / (sigmas + 1)
                timesteps = sigmas * big_n
            else:
                timesteps = sigma_to_t(sigmas, log_sigmas)
                if spacing[0] == "karras":
                    timesteps = timesteps.round()
            last = sigmas[-1]
        elif cfg.use_flow_sigmas:
            sigmas = self._flow_sigmas(n, sigmas, mu)
            timesteps = sigmas * big_n
            last = sigmas[-1]
        else:
            train = train_sigmas(acp)
            sigmas = np.interp(timesteps, np.arange(0, len(train)), train)
            last = train[0]
        last = last if cfg.final_sigmas_type == "sigma_min" else 0
        sigmas = np.concatenate([sigmas, [last]]).astype(np.float32)
        timesteps = np.asarray(timesteps).astype(np.int64)  # torch's .to(int64) truncates
        if not cfg.use_flow_sigmas:
            check_train_indices("timesteps", timesteps, cfg, sigma_clamped=True)
        steps = np.arange(len(timesteps))
        corrector = (steps > 0) & ~np.isin(steps - 1, np.asarray(cfg.disable_corrector, np.int64))
        begin = resolve_begin_index(n, len(timesteps), self.order, strength, begin_index)
        zeros = jnp.zeros(tuple(sample_shape), jnp.float32)
        predictor_coeffs, corrector_coeffs = self._coefficient_tables(sigmas)
        self._check_defined(sigmas, predictor_coeffs, corrector_coeffs, corrector, begin)
        return UniPCState(timesteps=to_device(timesteps, np.int32), sigmas=to_device(sigmas),
                          corrector=to_device(corrector), predictor_coeffs=to_device(predictor_coeffs, np.float32),
                          corrector_coeffs=to_device(corrector_coeffs, np.float32),
                          model_outputs=jnp.zeros((cfg.solver_order, *sample_shape)),
                          last_sample=zeros, this_order=jnp.zeros((), jnp.int32),
                          lower_order_nums=jnp.zeros((), jnp.int32), **counters(len(timesteps), begin))

    # -- device: the step ------------------------------------------------------------------------------------

    def _alpha_sigma(self, sigma):
        if self.config.use_flow_sigmas:
            return 1 - sigma, sigma
        alpha = 1 / jnp.sqrt(sigma * sigma + 1)
        return alpha, sigma * alpha

    # -- host: the per-step coefficients (float64) ----------------------------------------------------------

    def _coefficient_tables(self, sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(predictor[steps, order, 4], corrector[steps, order, 5])``: per step and order, the weights of the
        sample, of the newest model output ``m0``, of the differences ``m_k - m0`` (k = 1, 2) and (corrector) of
        ``model_t - m0`` (see :meth:`_combine`). Computed here in float64 from the float32 sigmas: the B(h) weights
        come from a recursion that cancels catastrophically in float32 (the order-3 one loses ~``1/h^2`` of its
        digits; diffusers' float32 run carries that error, and a less accurate ``expm1`` amplifies it further).
        Vectorised over the steps (one :meth:`_rows` per order): a Python loop over 999 steps took ~0.6 s."""
        s = sigmas.astype(np.float64)
        alpha, sig = (1 - s, s) if self.config.use_flow_sigmas else (1 / np.sqrt(s * s + 1), s / np.sqrt(s * s + 1))
        with np.errstate(all="ignore"):
            lam = np.log(alpha) - np.log(sig)
        order, n = self.config.solver_order, len(s) - 1
        pred, corr = np.zeros((n, order, 4)), np.zeros((n, order, 5))
        for p in range(1, order + 1):
            # The update of order p from sigma s0 to s0 + 1 needs p - 1 earlier outputs: s0 >= p - 1. Step s0
            # predicts with it; step s0 + 1 corrects with it.
            s0 = np.arange(p - 1, n)
            if s0.size:
                pred[s0, p - 1], corrector = self._rows(alpha, sig, lam, s0, p)
                corr[s0[:-1] + 1, p - 1] = corrector[:-1]
        return pred, corr

    def _check_defined(self, sigmas, predictor, corrector, corrects, begin: int) -> None:
        """Refuse a schedule with an update whose weights are not finite where ``step`` will use them (diffusers'
        sample is NaN or inf there, or its ``linalg.solve`` fails): an order >= 2 update into sigma 0 (``h = inf``)
        or between equal sigmas (``h = 0``: Karras / flow schedules ending at ``sigma_min``) without
        ``lower_order_final``, and every ``predict_x0=False`` update into sigma 0 (``0 * inf``)."""
        cfg, n = self.config, len(sigmas) - 1
        done, previous = 0, 0
        for i in range(begin, n):
            order = min(cfg.solver_order, n - i) if cfg.lower_order_final else cfg.solver_order
            order = min(order, done + 1)
            bad = None if np.isfinite(predictor[i, order - 1]).all() else (order, i, i + 1)
            if i > begin and corrects[i] and not np.isfinite(corrector[i, previous - 1]).all():
                bad = (previous, i - 1, i)
            if bad is not None:
                p, s0, t = bad
                fix = ("predict_x0=True or final_sigmas_type='sigma_min'" if not cfg.predict_x0 and sigmas[t] == 0
                       else "lower_order_final=True" if p > 1 and not cfg.lower_order_final and t == n
                       else "a schedule without repeated sigmas (fewer steps or another spacing: 1000 linspace "
                       "steps repeat a timestep)")
                raise ConfigError(f"UniPCMultistepScheduler: the order-{p} update from sigma {sigmas[s0]:g} to "
                                  f"{sigmas[t]:g} (step {s0} of {n}) is undefined (diffusers' sample is NaN or inf "
                                  f"there, or its solve fails); use {fix}")
            done, previous = min(done + 1, cfg.solver_order), order

    def _rows(self, alpha, sig, lam, s0: np.ndarray, order: int) -> tuple[np.ndarray, np.ndarray]:
        """diffusers' ``multistep_uni_p_bh_update`` and ``multistep_uni_c_bh_update`` of ``order`` from each sigma
        index in ``s0`` to the next, as the weights of :meth:`_combine`: ``(predictor[len(s0), 4],
        corrector[len(s0), 5])`` (float64, in diffusers' order of operations, per step what the former per-step
        loop computed bit for bit; infinities and NaN propagate as in diffusers)."""
        cfg, t = self.config, s0 + 1
        with np.errstate(all="ignore"):
            h = lam[t] - lam[s0]
            rks = np.stack([(lam[s0 - k] - lam[s0]) / h for k in range(1, order)] + [np.ones_like(h)], axis=-1)
            hh = -h if cfg.predict_x0 else h
            h_phi_1 = np.expm1(hh)
            h_phi_k = h_phi_1 / hh - 1
            b_h = hh if cfg.solver_type == "bh1" else np.expm1(hh)
            factorial, b = 1, []
            for i in range(1, order + 1):
                b.append(h_phi_k * factorial / b_h)
                factorial *= i + 1
                h_phi_k = h_phi_k / hh - 1 / factorial
            r, b = np.stack([rks ** (i - 1) for i in range(1, order + 1)], axis=-2), np.stack(b, axis=-1)
            half = np.full((len(s0), 1), 0.5)
            rhos_c = half if order == 1 else _solve(r, b)
            rhos_p = half[:, :0] if order == 1 else half if order == 2 else _solve(r[:, :-1, :-1], b[:, :-1])
            if cfg.predict_x0:
                cx, c0, scale = sig[t] / sig[s0], -alpha[t] * h_phi_1, alpha[t]
            else:
                cx, c0, scale = alpha[t] / alpha[s0], -sig[t] * h_phi_1, sig[t]
            pred, corr = np.zeros((len(s0), 4)), np.zeros((len(s0), 5))
            for rows, rhos in ((pred, rhos_p), (corr, rhos_c)):
                rows[:, 0], rows[:, 1] = cx, c0
                for k in range(order - 1):
                    rows[:, 2 + k] = -scale * b_h * rhos[:, k] / rks[:, k]
            corr[:, 4] = -scale * b_h * rhos_c[:, -1]
        return pred, corr

    # -- device: the step ------------------------------------------------------------------------------------

    def _convert(self, state: UniPCState, out, x):
        """The data prediction (``predict_x0``) or noise prediction the solver works on."""
        cfg = self.config
        sigma = state.sigmas[state.step_index]
        alpha_t, sigma_t = self._alpha_sigma(sigma)
        kind = cfg.prediction_type
        if cfg.predict_x0:
            if kind == "epsilon":
                x0 = (x - sigma_t * out) / alpha_t
            elif kind == "sample":
                x0 = out
            elif kind == "v_prediction":
                x0 = alpha_t * x - sigma_t * out
            else:  # flow_prediction: the raw sigma, whatever the sigma parameterisation
                x0 = x - sigma * out
            if cfg.thresholding:
                x0 = threshold_sample(x0, cfg.dynamic_thresholding_ratio, cfg.sample_max_value)
            return x0
        if kind == "epsilon":
            return out
        if kind == "sample":
            return (x - alpha_t * out) / sigma_t
        return alpha_t * out + sigma_t * x

    def _combine(self, row, m, x, model_t=None):
        """UniP (``model_t=None``) or UniC from the weights ``row`` of one step and order: ``row[0] * x + row[1] *
        m0 + row[2] * (m1 - m0) + row[3] * (m2 - m0) [+ row[4] * (model_t - m0)]``, ``m`` newest last (a lower order
        has zero weights for the older outputs)."""
        m0 = m[-1]
        out = row[0] * x + row[1] * m0
        for k in range(self.config.solver_order - 1):
            out = out + row[2 + k] * (m[-(k + 2)] - m0)
        return out if model_t is None else out + row[4] * (model_t - m0)

    def update(self, state: UniPCState, out, x, *, key=None, noise=None):
        cfg = self.config
        i = state.step_index
        converted = self._convert(state, out, x)

        def corrected(x):
            order = jnp.clip(state.this_order - 1, 0, cfg.solver_order - 1)
            return self._combine(state.corrector_coeffs[i, order], state.model_outputs, state.last_sample, converted)

        use_corrector = state.corrector[i] & (i > state.begin_index)
        x = lax.cond(use_corrector, corrected, lambda x: x, x)
        m = jnp.concatenate([state.model_outputs[1:], converted[None]])
        this_order = cfg.solver_order
        if cfg.lower_order_final:
            this_order = jnp.minimum(this_order, state.num_timesteps - i)
        this_order = jnp.minimum(this_order, state.lower_order_nums + 1)
        prev = self._combine(state.predictor_coeffs[i, this_order - 1], m, x)
        new = dataclasses.replace(state, model_outputs=m, last_sample=x, this_order=this_order,
                                  lower_order_nums=jnp.minimum(state.lower_order_nums + 1, cfg.solver_order))
        return prev, new

    @typechecked
    def add_noise_at_step(self, state: UniPCState, original: Float[Array, "*dims"],
                          noise: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        """``alpha_t * original + sigma_t * noise`` at ``sigmas[step]`` (diffusers after ``set_begin_index``); on
        flow sigmas ``(1 - sigma) * original + sigma * noise``."""
        alpha_t, sigma_t = self._alpha_sigma(state.sigmas[state.step_index])
        return (alpha_t * original + sigma_t * noise).astype(original.dtype)


def _solve(r: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``solve(r[j], b[j])`` for each ``j`` (LAPACK's ``gesv``, as one call per system gives), NaN where ``r[j]`` is
    singular (a repeated sigma, or the step into sigma 0: diffusers' result is NaN or an error). NumPy refuses a
    whole batch for one singular system, so a refused batch is split in halves until the singular ones are alone."""
    out = np.full(b.shape, np.nan)
    pending = [np.arange(len(b))]
    while pending:
        rows = pending.pop()
        try:
            out[rows] = np.linalg.solve(r[rows], b[rows][..., None])[..., 0]
        except np.linalg.LinAlgError:
            if len(rows) > 1:
                pending += [rows[: len(rows) // 2], rows[len(rows) // 2:]]
    return out
