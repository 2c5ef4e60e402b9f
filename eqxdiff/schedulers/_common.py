"""What every scheduler shares: the config base, the noise schedule, timestep spacing, prediction-type
conversion, the state base class and the scheduler base class with ``add_noise`` / ``get_velocity``; what DDIM
and DDPM share (their clipping/thresholding config keys and their state); and the sigma-respacing config keys of
Euler, LMS and DPM-Solver.

Host-side work (betas, ``alphas_cumprod``, timesteps, sigmas) runs in NumPy and reproduces diffusers' float32
values (``torch.cumprod`` accumulates in float64 on the CPU, so ours does), except the zero-SNR rescale, which
is computed in float64 (see ``_rescale_zero_terminal_snr``). Per-step arithmetic runs in ``jnp`` float32 inside
``step``, in diffusers' order of operations.
"""

import abc
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, Shaped, typechecked
from ..core import ModelConfig

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
TIMESTEP_SPACINGS = ("leading", "linspace", "trailing")
PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
BOOLS = (False, True)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(ModelConfig):
    """Keys shared by diffusers' discrete-time schedulers (``scheduler_config.json``).

    Subclasses add their own keys and may change a default (diffusers' defaults differ per class, e.g.
    ``timestep_spacing`` is ``"leading"`` for DDIM and ``"linspace"`` for Euler).
    """

    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {
        "beta_schedule": BETA_SCHEDULES,
        "timestep_spacing": TIMESTEP_SPACINGS,
        "prediction_type": PREDICTION_TYPES,
    }

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str = "epsilon"
    timestep_spacing: str = "leading"
    steps_offset: int = 0
    # The checkpoint dict this config was read from (not part of equality): which keys it set, and keys that
    # other schedulers use (``clip_sample`` in a PNDM config) which ``to_dict`` carries on, as diffusers does.
    source: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]):
        config = super().from_dict(raw)
        object.__setattr__(config, "source", {k: v for k, v in raw.items() if k[:1] != "_"})
        return config

    def to_dict(self) -> dict[str, Any]:
        """The config keys, the source's keys for other schedulers, and (like diffusers' ``.config``)
        ``_use_default_values``: the keys the source did not set, so that swapping schedulers from this dict
        follows diffusers' ``from_config``."""
        fields = {k: v for k, v in super().to_dict().items() if k != "source"}
        if self.source is None:
            return fields
        return {**self.source, **fields, "_use_default_values": sorted(k for k in fields if k not in self.source)}

    def __post_init__(self):
        if self.trained_betas is not None:  # a list or array from Python: keep the config hashable
            object.__setattr__(self, "trained_betas", tuple(float(b) for b in np.ravel(self.trained_betas)))
        super().__post_init__()
        self.check(self.num_train_timesteps >= 2, "num_train_timesteps", "must be at least 2")
        self.check(self.steps_offset >= 0, "steps_offset", "must be >= 0")
        if self.trained_betas is not None:
            self.check(len(self.trained_betas) == self.num_train_timesteps, "trained_betas",
                       f"must have num_train_timesteps={self.num_train_timesteps} entries")


@dataclasses.dataclass(frozen=True)
class ClipSampleConfig(SchedulerConfig):
    """Keys of DDIM and DDPM beyond :class:`SchedulerConfig`: clipping (``clip_sample``) or Imagen's dynamic
    thresholding (``thresholding``) of the predicted clean sample, and the zero-terminal-SNR rescale."""

    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {
        **SchedulerConfig.SUPPORTED_VALUES, "clip_sample": BOOLS, "thresholding": BOOLS,
        "rescale_betas_zero_snr": BOOLS}

    clip_sample: bool = True
    clip_sample_range: float = 1.0
    thresholding: bool = False
    dynamic_thresholding_ratio: float = 0.995
    sample_max_value: float = 1.0
    rescale_betas_zero_snr: bool = False


@dataclasses.dataclass(frozen=True)
class SigmaSpacingConfig(SchedulerConfig):
    """Keys of Euler, LMS and DPM-Solver beyond :class:`SchedulerConfig`: noise levels spaced as Karras et al.
    (``use_karras_sigmas``) or exponentially (``use_exponential_sigmas``) instead of those of the spaced timesteps;
    beta-distributed sigmas are not supported."""

    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {
        **SchedulerConfig.SUPPORTED_VALUES, "use_karras_sigmas": BOOLS, "use_exponential_sigmas": BOOLS,
        "use_beta_sigmas": (False,)}

    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.check(not (self.use_karras_sigmas and self.use_exponential_sigmas), "use_karras_sigmas",
                   "cannot be combined with use_exponential_sigmas=True")


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


def betas(config: SchedulerConfig) -> np.ndarray:
    """The training betas (float32), as the diffusers scheduler builds them."""
    n = config.num_train_timesteps
    if config.trained_betas is not None:
        out = np.asarray(config.trained_betas, np.float32)
    elif config.beta_schedule == "linear":
        out = np.linspace(config.beta_start, config.beta_end, n).astype(np.float32)
    elif config.beta_schedule == "scaled_linear":
        out = np.linspace(config.beta_start**0.5, config.beta_end**0.5, n).astype(np.float32) ** 2
    else:
        out = _betas_for_alpha_bar(n)
    if getattr(config, "rescale_betas_zero_snr", False):
        out = _rescale_zero_terminal_snr(out)
    return out


@functools.lru_cache(maxsize=64)
def _alphas_cumprod_cached(config: SchedulerConfig, terminal_floor: bool) -> np.ndarray:
    acp = _cumprod(np.float32(1.0) - betas(config))
    if terminal_floor and getattr(config, "rescale_betas_zero_snr", False):
        # Sigma-parameterised schedulers keep sigma_max finite: diffusers sets the last value to 2**-24.
        acp[-1] = 2.0**-24
    acp.setflags(write=False)
    return acp


def alphas_cumprod(config: SchedulerConfig, *, terminal_floor: bool = False) -> np.ndarray:
    """``cumprod(1 - betas)`` in float32 (read-only, cached per config)."""
    return _alphas_cumprod_cached(config, terminal_floor)


def train_sigmas(acp: np.ndarray) -> np.ndarray:
    """``sqrt((1 - acp) / acp)`` at every training timestep, float32 like diffusers."""
    return np.sqrt((np.float32(1.0) - acp) / acp)


def spaced_timesteps(config: SchedulerConfig, num_inference_steps: int) -> np.ndarray:
    """Descending timesteps (float64, integral values) for ``leading`` / ``linspace`` / ``trailing`` spacing.

    ``linspace`` is rounded here; Euler-type schedulers that keep fractional values call ``np.linspace`` directly.
    """
    n, t = num_inference_steps, config.num_train_timesteps
    if config.timestep_spacing == "linspace":
        return np.linspace(0, t - 1, n).round()[::-1].copy()
    if config.timestep_spacing == "leading":
        return (np.arange(0, n) * (t // n)).round()[::-1] + config.steps_offset
    return np.round(np.arange(t, 0, -t / n)) - 1


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    """Karras et al. (2022) noise levels: ``n`` values from ``sigma_max`` down to ``sigma_min`` (float64)."""
    ramp = np.linspace(0, 1, n)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return (max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho


def exponential_sigmas(sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))


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


def check_num_steps(config: SchedulerConfig, num_inference_steps: int) -> None:
    if not isinstance(num_inference_steps, (int, np.integer)) or isinstance(num_inference_steps, bool):
        raise TypeError(f"num_inference_steps must be a Python int, got {num_inference_steps!r}")
    if not 1 <= num_inference_steps <= config.num_train_timesteps:
        raise ValueError(f"num_inference_steps={num_inference_steps} must be in "
                         f"[1, num_train_timesteps={config.num_train_timesteps}]")


def check_train_indices(name: str, indices: np.ndarray, config: SchedulerConfig) -> None:
    if indices.size and (indices.min() < 0 or indices.max() >= config.num_train_timesteps):
        raise ValueError(f"{name} {indices.tolist()} fall outside [0, num_train_timesteps="
                         f"{config.num_train_timesteps}); lower steps_offset or change timestep_spacing")


def resolve_begin_index(num_inference_steps: int, num_timesteps: int, order: int,
                        strength: float | None, begin_index: int | None) -> int:
    """The index into ``timesteps`` where sampling starts.

    ``strength`` follows diffusers' img2img pipelines: ``t_start = N - min(int(N * strength), N)`` and the
    scheduler starts at ``t_start * order``. ``begin_index`` sets the index directly (``set_begin_index``).
    """
    if strength is not None and begin_index is not None:
        raise ValueError("pass strength= or begin_index=, not both")
    if strength is not None:
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"strength={strength} must be in [0, 1]")
        init_timestep = min(int(num_inference_steps * strength), num_inference_steps)
        return max(num_inference_steps - init_timestep, 0) * order
    if begin_index is None:
        return 0
    if not 0 <= begin_index <= num_timesteps:
        raise ValueError(f"begin_index={begin_index} must be in [0, {num_timesteps}] (the number of timesteps)")
    return int(begin_index)


# ----------------------------------------------------------------------------------------------------------------
# Per-step helpers (jnp, float32)


def per_sample(coef: Array, like: Array) -> Array:
    """``coef`` with one value per batch entry (or a scalar), reshaped to broadcast against ``like``."""
    return jnp.reshape(coef, (-1,) + (1,) * (like.ndim - 1))


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


def step_noise(name: str, shape, dtype, key, noise):
    """The Gaussian noise a stochastic step adds: drawn from ``key``, or ``noise`` itself (for parity tests)."""
    if key is not None and noise is not None:
        raise ValueError(f"{name}.step: pass key= or noise=, not both")
    if noise is not None:
        if noise.shape != tuple(shape):
            raise ValueError(f"{name}.step: noise.shape={noise.shape} must equal the sample shape {tuple(shape)}")
        return noise.astype(jnp.float32)
    if key is None:
        raise ValueError(f"{name}.step adds noise: pass key= (a PRNG key) or noise= (an array)")
    return jax.random.normal(key, shape, jnp.float32)


# ----------------------------------------------------------------------------------------------------------------
# State and scheduler bases


class AbstractSchedulerState(eqx.Module):
    """A scheduler's state: arrays only (plus the static ``begin_index``), threaded through ``step``.

    ``step_index`` is the index of the current timestep into ``timesteps``; it starts at ``begin_index`` and
    grows by one per ``step``, so a ``lax.fori_loop`` body never needs its loop index.
    """

    timesteps: eqx.AbstractVar[Shaped[Array, " steps"]]
    step_index: eqx.AbstractVar[Int[Array, ""]]
    begin_index: eqx.AbstractVar[int]


class AlphaProdState(AbstractSchedulerState):
    """The state of DDIM and DDPM (``DDIMState`` and ``DDPMState`` are this class): per step, the timestep, its
    ``alphas_cumprod`` value and that of the timestep the step goes to."""

    timesteps: Int[Array, " steps"]
    alpha_prod: Float[Array, " steps"]
    alpha_prod_prev: Float[Array, " steps"]
    step_index: Int[Array, ""]
    begin_index: int = eqx.field(static=True)


class AbstractScheduler(eqx.Module):
    """A stateless scheduler: a static config and pure functions of an explicit state.

    ``init`` runs on the host and builds the state; ``init_noise_sigma``, ``scale_model_input``, ``step``,
    ``add_noise``, ``add_noise_at_step`` and ``get_velocity`` are pure and jittable.
    """

    CONFIG: ClassVar[type[SchedulerConfig]]
    config: eqx.AbstractVar[SchedulerConfig]
    order: ClassVar[int] = 1
    # Sigma-parameterised schedulers floor the last alphas_cumprod at 2**-24 under zero-SNR rescaling.
    TERMINAL_FLOOR: ClassVar[bool] = False

    @classmethod
    def from_config(cls, raw: Mapping, **overrides):
        """This scheduler from a ``scheduler_config.json`` dict, like diffusers' ``from_config``: unknown keys and
        keys diffusers recorded as defaulted (``_use_default_values``) are ignored."""
        defaulted = set(raw.get("_use_default_values", ()))
        raw = {k: v for k, v in raw.items() if k not in defaulted}
        return cls(cls.CONFIG.from_dict({**raw, **overrides}))

    @abc.abstractmethod
    def init(self, num_inference_steps: int, *, sample_shape: tuple[int, ...] | None = None,
             strength: float | None = None, begin_index: int | None = None) -> AbstractSchedulerState:
        """The state for ``num_inference_steps`` steps. ``sample_shape`` sizes multistep history buffers;
        ``strength`` (img2img, as diffusers' pipelines) or ``begin_index`` start part-way."""

    @abc.abstractmethod
    def step(self, state, model_output, sample, *, key=None, noise=None):
        """``(prev_sample, new_state)`` from the model output at ``current_timestep(state)``."""

    def current_timestep(self, state: AbstractSchedulerState) -> Shaped[Array, ""]:
        """The timestep to give the model at the current step."""
        return state.timesteps[state.step_index]

    def remaining_steps(self, state: AbstractSchedulerState) -> int:
        """How many ``step`` calls are left from the state's start: a Python int (a static loop length) when
        called on the state ``init`` returned."""
        return int(state.timesteps.shape[0]) - state.begin_index

    def timesteps_to_run(self, state: AbstractSchedulerState) -> Shaped[Array, " run"]:
        """The timesteps from ``begin_index`` on (all of them unless ``init`` was given ``strength``)."""
        return state.timesteps[state.begin_index:]

    @property
    def alphas_cumprod(self) -> np.ndarray:
        return alphas_cumprod(self.config, terminal_floor=self.TERMINAL_FLOOR)

    def init_noise_sigma(self, state: AbstractSchedulerState) -> Float[Array, ""]:
        """The standard deviation of the initial noise."""
        return jnp.ones((), jnp.float32)

    @typechecked
    def scale_model_input(self, state: AbstractSchedulerState, sample: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        """The model's input at the current step (identity unless the scheduler works in sigma space)."""
        return sample

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
