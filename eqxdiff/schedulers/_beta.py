"""The beta-schedule (DDPM-process) part of the schedulers: the config keys of diffusers' discrete-time schedulers,
betas and ``alphas_cumprod``, timestep spacing, prediction-type conversion, and the scheduler base whose
``add_noise`` / ``get_velocity`` are the DDPM forward process; what DDIM and DDPM share (their clipping /
thresholding config keys and their state); and the sigma-respacing config keys of Euler, LMS and DPM-Solver.

Host-side work (betas, ``alphas_cumprod``, timesteps, sigmas) runs in NumPy and reproduces diffusers' float32
values (``torch.cumprod`` accumulates in float64 on the CPU, so ours does), except the zero-SNR rescale, which
is computed in float64 (see ``_rescale_zero_terminal_snr``). Per-step arithmetic runs in ``jnp`` float32 inside
``update``, in diffusers' order of operations.
"""

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, Shaped, typechecked
from ..core import ConfigError
from ._base import BOOLS, AbstractScheduler, AbstractSchedulerState, SchedulerConfig, per_sample

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
TIMESTEP_SPACINGS = ("leading", "linspace", "trailing")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
# None is what other schedulers' configs carry (DPM-Solver writes variance_type=None); diffusers' DDPM then
# takes none of _get_variance's branches, which leaves the clamped fixed_small variance. ("fixed_large_log" is
# refused: diffusers' DDPM takes the square root of its log variance, NaN.)
VARIANCE_TYPES = ("fixed_small", "fixed_small_log", "fixed_large", "learned", "learned_range", None)


@dataclasses.dataclass(frozen=True)
class BetaScheduleConfig(SchedulerConfig):
    """Keys shared by diffusers' discrete-time (DDPM-process) schedulers (``scheduler_config.json``).

    Subclasses add their own keys and may change a default (diffusers' defaults differ per class, e.g.
    ``timestep_spacing`` is ``"leading"`` for DDIM and ``"linspace"`` for Euler).
    """

    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {
        "beta_schedule": BETA_SCHEDULES,
        "timestep_spacing": TIMESTEP_SPACINGS,
        "prediction_type": PREDICTION_TYPES,
    }

    SCHEDULE_ONLY: ClassVar[frozenset[str]] = frozenset({"timestep_spacing", "steps_offset"})

    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str = "epsilon"
    timestep_spacing: str = "leading"
    steps_offset: int = 0

    def __post_init__(self):
        if self.trained_betas is not None:  # a list or array from Python: keep the config hashable
            object.__setattr__(self, "trained_betas", tuple(float(b) for b in np.ravel(self.trained_betas)))
        super().__post_init__()
        self.check(self.steps_offset >= 0, "steps_offset", "must be >= 0")
        if self.trained_betas is not None:
            self.check(len(self.trained_betas) == self.num_train_timesteps, "trained_betas",
                       f"must have num_train_timesteps={self.num_train_timesteps} entries")


@dataclasses.dataclass(frozen=True)
class ClipSampleConfig(BetaScheduleConfig):
    """Keys of DDIM and DDPM beyond :class:`BetaScheduleConfig`: clipping (``clip_sample``) or Imagen's dynamic
    thresholding (``thresholding``) of the predicted clean sample, and the zero-terminal-SNR rescale."""

    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {
        **BetaScheduleConfig.SUPPORTED_VALUES, "clip_sample": BOOLS, "thresholding": BOOLS,
        "rescale_betas_zero_snr": BOOLS}

    clip_sample: bool = True
    clip_sample_range: float = 1.0
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    rescale_betas_zero_snr: bool = False


@dataclasses.dataclass(frozen=True)
class SigmaSpacingConfig(BetaScheduleConfig):
    """Keys of Euler, LMS and DPM-Solver beyond :class:`BetaScheduleConfig`: noise levels spaced as Karras et al.
    (``use_karras_sigmas``), exponentially (``use_exponential_sigmas``) or as a Beta distribution's quantiles
    (``use_beta_sigmas``) instead of those of the spaced timesteps; at most one (diffusers refuses more)."""

    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {
        **BetaScheduleConfig.SUPPORTED_VALUES, "use_karras_sigmas": BOOLS, "use_exponential_sigmas": BOOLS,
        "use_beta_sigmas": BOOLS}

    SCHEDULE_ONLY: ClassVar[frozenset[str]] = BetaScheduleConfig.SCHEDULE_ONLY | {
        "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"}

    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    def __post_init__(self):
        super().__post_init__()
        keys = [k for k in SIGMA_SPACINGS if getattr(self, k)]
        self.check(len(keys) <= 1, keys[0] if keys else "use_karras_sigmas",
                   f"cannot be combined with {'=True, '.join(keys[1:])}=True: set one of {list(SIGMA_SPACINGS)}")

    @property
    def sigma_spacing(self) -> str | None:
        """``"karras"``, ``"exponential"``, ``"beta"`` (the ``kind`` of ``_sigmas.respace``) or ``None``."""
        return next((SIGMA_SPACINGS[k] for k in SIGMA_SPACINGS if getattr(self, k)), None)


SIGMA_SPACINGS = {"use_karras_sigmas": "karras", "use_exponential_sigmas": "exponential", "use_beta_sigmas": "beta"}


# ----------------------------------------------------------------------------------------------------------------
# Noise schedule (host, NumPy)


def _betas_for_alpha_bar(n: int, max_beta: float = 0.999) -> np.ndarray:
    """The ``squaredcos_cap_v2`` (Glide cosine) betas, computed in Python floats like diffusers."""

    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return np.array([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)], np.float32)


def _rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Algorithm 1 of "Common Diffusion Noise Schedules and Sample Steps are Flawed" (diffusers'
    ``rescale_zero_terminal_snr``), in float64: it subtracts nearly equal square roots near the end, where
    float32 rounding (diffusers computes in float32) moves the last few ``alphas_cumprod`` by up to ~4e-5."""
    alphas_bar_sqrt = np.sqrt(np.cumprod(1.0 - betas.astype(np.float64)))
    first, last = alphas_bar_sqrt[0], alphas_bar_sqrt[-1]
    alphas_bar_sqrt = (alphas_bar_sqrt - last) * (first / (first - last))
    alphas_bar = alphas_bar_sqrt**2
    alphas = np.concatenate([alphas_bar[:1], alphas_bar[1:] / alphas_bar[:-1]])
    return (1.0 - alphas).astype(np.float32)


def _cumprod(x: np.ndarray) -> np.ndarray:
    # torch's CPU cumprod accumulates float32 in float64; this reproduces its values exactly.
    return np.cumprod(x.astype(np.float64)).astype(np.float32)


def linspace32(start: float, end: float, n: int) -> np.ndarray:
    """``torch.linspace(start, end, n, dtype=torch.float32)`` as PyTorch's CPU kernel computes it: the float32 step
    ``(end - start) / (n - 1)``, the first half ``start + step * i`` and the rest ``end - step * (n - 1 - i)``, each
    rounded once (a fused multiply-add; in float64 here, the product being exact). NumPy's float64 linspace cast to
    float32 differs from it by an ulp in about a third of the values, which can move a timestep diffusers truncates
    from sigmas (999 against 998 under exponential or beta sigma spacing). Checked equal to torch 2.13 on 7.4 million
    values (random ends and lengths)."""
    s, e = np.float32(start), np.float32(end)
    if n == 1:
        return np.array([s], np.float32)
    step = np.float64(np.float32(e - s) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    return np.where(i < n // 2, step * i + np.float64(s), np.float64(e) - step * (n - 1 - i)).astype(np.float32)


def betas(config: BetaScheduleConfig) -> np.ndarray:
    """The training betas (float32), as the diffusers scheduler builds them (torch's float32 linspace)."""
    n = config.num_train_timesteps
    if config.trained_betas is not None:
        out = np.asarray(config.trained_betas, np.float32)
    elif config.beta_schedule == "linear":
        out = linspace32(config.beta_start, config.beta_end, n)
    elif config.beta_schedule == "scaled_linear":
        out = linspace32(config.beta_start**0.5, config.beta_end**0.5, n) ** 2
    else:
        out = _betas_for_alpha_bar(n)
    if getattr(config, "rescale_betas_zero_snr", False):
        out = _rescale_zero_terminal_snr(out)
    return out


@functools.lru_cache(maxsize=64)
def _alphas_cumprod_cached(config: BetaScheduleConfig, terminal_floor: bool) -> np.ndarray:
    acp = _cumprod(np.float32(1.0) - betas(config))
    if terminal_floor and getattr(config, "rescale_betas_zero_snr", False):
        # Sigma-parameterised schedulers keep sigma_max finite: diffusers sets the last value to 2**-24.
        acp[-1] = 2.0**-24
    acp.setflags(write=False)
    return acp


def alphas_cumprod(config: BetaScheduleConfig, *, terminal_floor: bool = False) -> np.ndarray:
    """``cumprod(1 - betas)`` in float32 (read-only, cached per config)."""
    return _alphas_cumprod_cached(config, terminal_floor)


def train_sigmas(acp: np.ndarray) -> np.ndarray:
    """``sqrt((1 - acp) / acp)`` at every training timestep, float32 like diffusers."""
    return np.sqrt((np.float32(1.0) - acp) / acp)


def spaced_timesteps(config: BetaScheduleConfig, num_inference_steps: int) -> np.ndarray:
    """Descending timesteps (float64, integral values) for ``leading`` / ``linspace`` / ``trailing`` spacing.

    ``linspace`` is rounded here; Euler-type schedulers that keep fractional values call ``np.linspace`` directly.
    """
    n, t = num_inference_steps, config.num_train_timesteps
    if config.timestep_spacing == "linspace":
        return np.linspace(0, t - 1, n).round()[::-1].copy()
    if config.timestep_spacing == "leading":
        return (np.arange(0, n) * (t // n)).round()[::-1] + config.steps_offset
    return np.round(np.arange(t, 0, -t / n)) - 1


def sigma_to_t(sigma: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """The fractional training timestep whose (log-interpolated) sigma is ``sigma``, as diffusers computes it."""
    sigma = np.asarray(sigma)
    log_sigma = np.log(np.maximum(sigma, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]
    low_idx = np.cumsum((dists >= 0), axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)
    high_idx = low_idx + 1
    low, high = log_sigmas[low_idx], log_sigmas[high_idx]
    w = np.clip((low - log_sigma) / (low - high), 0, 1)
    return ((1 - w) * low_idx + w * high_idx).reshape(sigma.shape)


def check_train_indices(name: str, indices: np.ndarray, config: BetaScheduleConfig, *,
                        sigma_clamped: bool = False) -> None:
    """Refuse training-timestep indices outside ``[0, num_train_timesteps)``.

    'trailing' spacing ends at -1 for some step counts (61, 103, 121, ... of 1000: ``np.arange(1000, 0, -1000 / n)``
    overshoots by one entry), and diffusers then runs one extra last step at timestep -1. Schedulers that interpolate
    their sigmas at the timesteps (``sigma_clamped``: DPM-Solver, UniPC; Euler-type ones do too and never call this)
    clamp it to the sigma of timestep 0, a sane last step that they run as diffusers does. DDIM, DDPM and PNDM would
    read ``alphas_cumprod[-1]`` there, the noisiest value, for a sample that is already clean: that step (a diffusers
    bug) spoils the result, so it is refused with that reason."""
    big_n = config.num_train_timesteps
    overshoot = config.timestep_spacing == "trailing" and indices.size and int(indices.ravel()[-1]) == -1
    if sigma_clamped and overshoot:
        indices = indices.ravel()[:-1]
    if indices.size and (indices.min() < 0 or indices.max() >= big_n):
        outside = sorted({int(t) for t in indices.ravel() if not 0 <= t < big_n})
        fix = "lower steps_offset or change timestep_spacing"
        if outside == [-1] and overshoot:
            fix = ("timestep_spacing='trailing' overshoots to -1 at this number of steps (NumPy's arange), where "
                   "diffusers runs an extra last step that reads alphas_cumprod[-1], the noisiest value, on the "
                   "already denoised sample and spoils it: use one step more or fewer, or 'linspace'")
        raise ValueError(f"{name} {outside} fall outside [0, num_train_timesteps={big_n}): {fix}")


def check_zero_snr_start(name: str, config: ClipSampleConfig, timesteps: np.ndarray, acp: np.ndarray, *,
                         clips: bool | None = None) -> None:
    """Refuse a schedule that would step from a timestep of zero SNR (``alphas_cumprod == 0``: the last one under
    ``rescale_betas_zero_snr``) with an epsilon model: its predicted clean sample is ``x / 0``, and unless a clip
    bounds it (``clips``; default: ``clip_sample`` without ``thresholding``, as :func:`clip_or_threshold` clips)
    diffusers' result is NaN, so is ours."""
    configurable = clips is None  # then clip_sample is also a fix
    if configurable:
        clips = config.clip_sample and not config.thresholding
    if config.prediction_type != "epsilon" or clips or not timesteps.size or not np.any(acp[timesteps] == 0):
        return
    t = int(timesteps[np.flatnonzero(acp[timesteps] == 0)[0]])
    raise ConfigError(f"{name}: rescale_betas_zero_snr=True with prediction_type='epsilon' steps from timestep {t}, "
                      "where alphas_cumprod is 0 and an epsilon model's clean-sample estimate is x / 0 (NaN, in "
                      "diffusers too): use prediction_type='v_prediction' (what zero-SNR models are trained for), "
                      "or a schedule that starts below it (timestep_spacing='leading', strength < 1)"
                      + (", or clip_sample=True with thresholding=False" if configurable else ""))


# ----------------------------------------------------------------------------------------------------------------
# Per-step helpers (jnp, float32)


def x0_and_eps(prediction_type: str, model_output, sample, alpha_prod_t):
    """The predicted clean sample and noise from a model output at ``alpha_prod_t`` (DDPM parameterisation)."""
    beta_prod_t = 1 - alpha_prod_t
    if prediction_type == "epsilon":
        x0 = (sample - jnp.sqrt(beta_prod_t) * model_output) / jnp.sqrt(alpha_prod_t)
        return x0, model_output
    if prediction_type == "sample":
        return model_output, (sample - jnp.sqrt(alpha_prod_t) * model_output) / jnp.sqrt(beta_prod_t)
    x0 = jnp.sqrt(alpha_prod_t) * sample - jnp.sqrt(beta_prod_t) * model_output
    eps = jnp.sqrt(alpha_prod_t) * model_output + jnp.sqrt(beta_prod_t) * sample
    return x0, eps


def x0_from_sigma(prediction_type: str, model_output, sample, sigma):
    """The predicted clean sample in the sigma (Karras / k-diffusion) parameterisation used by Euler and LMS."""
    if prediction_type == "epsilon":
        return sample - sigma * model_output
    if prediction_type == "v_prediction":
        return model_output * (-sigma / jnp.sqrt(sigma * sigma + 1)) + sample / (sigma * sigma + 1)
    return model_output


def threshold_sample(x0, ratio: float, max_value: float):
    """Imagen's dynamic thresholding: per batch entry, clip to the ``ratio`` quantile of ``|x0|`` (>= 1)."""
    flat = x0.reshape(x0.shape[0], -1)
    s = jnp.quantile(jnp.abs(flat), ratio, axis=1, method="linear")
    s = jnp.clip(s, 1, max_value)[:, None]
    return (jnp.clip(flat, -s, s) / s).reshape(x0.shape)


def clip_or_threshold(config: ClipSampleConfig, x0):
    """DDIM/DDPM: dynamic thresholding or plain clipping of the predicted clean sample, as configured."""
    if config.thresholding:
        return threshold_sample(x0, config.dynamic_thresholding_ratio, config.sample_max_value)
    if config.clip_sample:
        return jnp.clip(x0, -config.clip_sample_range, config.clip_sample_range)
    return x0


# ----------------------------------------------------------------------------------------------------------------
# State and scheduler bases


class AlphaProdState(AbstractSchedulerState):
    """The state of DDIM and DDPM (``DDIMState`` and ``DDPMState`` are this class): per step, the timestep, its
    ``alphas_cumprod`` value and that of the timestep the step goes to."""

    timesteps: Int[Array, " steps"]
    alpha_prod: Float[Array, " steps"]
    alpha_prod_prev: Float[Array, " steps"]
    step_index: Int[Array, ""]
    begin_index: Int[Array, ""]
    num_timesteps: Int[Array, ""]


class AbstractBetaScheduler(AbstractScheduler):
    """A scheduler of the DDPM process: its config is a :class:`BetaScheduleConfig`, ``alphas_cumprod`` comes from
    the betas, and ``add_noise`` / ``get_velocity`` / ``add_noise_at_step`` are the DDPM forward process."""

    CONFIG: ClassVar[type[BetaScheduleConfig]]
    config: eqx.AbstractVar[BetaScheduleConfig]
    # Sigma-parameterised schedulers floor the last alphas_cumprod at 2**-24 under zero-SNR rescaling.
    TERMINAL_FLOOR: ClassVar[bool] = False

    @property
    def alphas_cumprod(self) -> np.ndarray:
        return alphas_cumprod(self.config, terminal_floor=self.TERMINAL_FLOOR)

    @typechecked
    def add_noise(self, original: Float[Array, "batch *dims"], noise: Float[Array, "batch *dims"],
                  timesteps: Shaped[Array, "*b"]) -> Float[Array, "batch *dims"]:
        """The forward process at integer training ``timesteps`` (one per batch entry, or a scalar):
        ``sqrt(acp[t]) * original + sqrt(1 - acp[t]) * noise``."""
        acp = jnp.asarray(self.alphas_cumprod)[timesteps.astype(jnp.int32)]
        a = per_sample(jnp.sqrt(acp), original)
        s = per_sample(jnp.sqrt(1 - acp), original)
        return (a * original + s * noise).astype(original.dtype)

    @typechecked
    def get_velocity(self, sample: Float[Array, "batch *dims"], noise: Float[Array, "batch *dims"],
                     timesteps: Shaped[Array, "*b"]) -> Float[Array, "batch *dims"]:
        """The v-prediction target ``sqrt(acp[t]) * noise - sqrt(1 - acp[t]) * sample`` at training ``timesteps``."""
        acp = jnp.asarray(self.alphas_cumprod)[timesteps.astype(jnp.int32)]
        a = per_sample(jnp.sqrt(acp), sample)
        s = per_sample(jnp.sqrt(1 - acp), sample)
        return (a * noise - s * sample).astype(sample.dtype)

    @typechecked
    def add_noise_at_step(self, state: AbstractSchedulerState, original: Float[Array, "*dims"],
                          noise: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        """Noise a clean ``original`` to the level of the state's current step (img2img: the start step), as
        diffusers' pipelines do with ``add_noise(original, noise, timesteps[t_start * order])``."""
        acp = jnp.asarray(self.alphas_cumprod)[self.current_timestep(state)]
        return (jnp.sqrt(acp) * original + jnp.sqrt(1 - acp) * noise).astype(original.dtype)


class AbstractLearnedVarianceScheduler(AbstractBetaScheduler):
    """A beta scheduler whose model may also predict its variance: :meth:`step` takes a model output with twice the
    sample's channels (the variance in the second half, which ``update`` reads or drops)."""

    @typechecked
    def step(self, state: AbstractSchedulerState, model_output: Float[Array, "..."], sample: Float[Array, "*dims"],
             *, key: PRNGKeyArray | None = None,
             noise: Float[Array, "*dims"] | None = None) -> tuple[Float[Array, "*dims"], AbstractSchedulerState]:
        """As :meth:`AbstractScheduler.step`; a learned-variance model output has twice the sample's channels."""
        return self._step(state, model_output, sample, key, noise)
