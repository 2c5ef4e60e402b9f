"""Training objectives as pure functions: timestep sampling (with diffusers' timestep bias), noise offset,
epsilon / v-prediction / sample targets, Min-SNR-gamma weights, the diffusion MSE, and rectified-flow matching.

Every function takes arrays and a PRNG key and is jittable; :class:`Objective` holds the static settings.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample")
BIAS_STRATEGIES = ("none", "earlier", "later", "range")


@dataclasses.dataclass(frozen=True)
class TimestepBias:
    """diffusers' ``--timestep_bias_*`` options: multiply the sampling weight of some timesteps.

    ``earlier``/``later`` bias the first/last ``portion`` of the timesteps, ``range`` biases ``[begin, end)``.
    """

    strategy: str = "none"
    multiplier: float = 1.0
    portion: float = 0.25
    begin: int = 0
    end: int = 1000

    def __post_init__(self):
        if self.strategy not in BIAS_STRATEGIES:
            raise ValueError(f"timestep bias strategy={self.strategy!r}; choose one of {list(BIAS_STRATEGIES)}")
        if self.multiplier < 0:
            raise ValueError(f"timestep bias multiplier={self.multiplier} must be >= 0")
        if not 0.0 < self.portion <= 1.0:
            raise ValueError(f"timestep bias portion={self.portion} must be in (0, 1]")
        if self.strategy == "range" and not 0 <= self.begin < self.end:
            raise ValueError(f"timestep bias range [begin={self.begin}, end={self.end}) is empty or negative")

    def weights(self, num_timesteps: int) -> np.ndarray:
        """Normalised sampling weights over ``num_timesteps`` (diffusers' ``generate_timestep_weights``)."""
        w = np.ones(num_timesteps, np.float64)
        n = int(self.portion * num_timesteps)
        if self.strategy == "later":
            w[num_timesteps - n:] *= self.multiplier
        elif self.strategy == "earlier":
            w[:n] *= self.multiplier
        elif self.strategy == "range":
            if self.end > num_timesteps:
                raise ValueError(f"timestep bias range end={self.end} exceeds num_train_timesteps={num_timesteps}")
            w[self.begin:self.end] *= self.multiplier
        if w.sum() <= 0:
            raise ValueError("timestep bias gives every timestep zero weight; raise multiplier above 0")
        return w / w.sum()


@dataclasses.dataclass(frozen=True)
class Objective:
    """Static settings of the denoising loss. ``prediction_type`` (what the model predicts) defaults to the
    scheduler config's; ``snr_gamma`` turns on Min-SNR weighting (5.0 is the paper's value); ``caption_dropout``
    is the probability of training a sample on the empty prompt (for classifier-free guidance)."""

    prediction_type: str | None = None
    snr_gamma: float | None = None
    noise_offset: float = 0.0
    caption_dropout: float = 0.0
    timestep_bias: TimestepBias = TimestepBias()

    def __post_init__(self):
        if self.prediction_type is not None and self.prediction_type not in PREDICTION_TYPES:
            raise ValueError(f"prediction_type={self.prediction_type!r}; choose one of {list(PREDICTION_TYPES)}")
        if self.snr_gamma is not None and self.snr_gamma <= 0:
            raise ValueError(f"snr_gamma={self.snr_gamma} must be positive (or None to turn Min-SNR off)")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"caption_dropout={self.caption_dropout} must be in [0, 1)")
        if self.noise_offset < 0:
            raise ValueError(f"noise_offset={self.noise_offset} must be >= 0")


def sample_timesteps(key: PRNGKeyArray, batch: int, num_timesteps: int,
                     bias: TimestepBias = TimestepBias()) -> Int[Array, " batch"]:
    """Integer training timesteps: uniform, or drawn from :meth:`TimestepBias.weights`."""
    if bias.strategy == "none" or bias.multiplier == 1.0:
        return jax.random.randint(key, (batch,), 0, num_timesteps, dtype=jnp.int32)
    logits = jnp.log(jnp.asarray(bias.weights(num_timesteps), jnp.float32))
    return jax.random.categorical(key, logits, shape=(batch,)).astype(jnp.int32)


@typechecked
def offset_noise(key: PRNGKeyArray, latents: Float[Array, "batch height width channels"],
                 noise_offset: float) -> Float[Array, "batch height width channels"]:
    """Gaussian noise plus ``noise_offset`` times a per-sample, per-channel constant (Guttenberg's offset noise)."""
    k_noise, k_off = jax.random.split(key)
    noise = jax.random.normal(k_noise, latents.shape, latents.dtype)
    if noise_offset:
        b, _, _, c = latents.shape
        noise = noise + noise_offset * jax.random.normal(k_off, (b, 1, 1, c), latents.dtype)
    return noise


def snr(alphas_cumprod, timesteps: Int[Array, " batch"]) -> Float[Array, " batch"]:
    """Signal-to-noise ratio ``acp / (1 - acp)`` at integer ``timesteps`` (diffusers' ``compute_snr``)."""
    acp = jnp.asarray(alphas_cumprod, jnp.float32)[timesteps]
    return acp / (1.0 - acp)


def min_snr_weights(snr_values: Float[Array, " batch"], gamma: float, prediction_type: str) -> Float[Array, " batch"]:
    """Min-SNR-gamma loss weights (Hang et al. 2023) as diffusers' scripts compute them: ``min(snr, gamma)``
    divided by ``snr`` for epsilon, by ``snr + 1`` for v-prediction, and by 1 for sample prediction."""
    clipped = jnp.minimum(snr_values, gamma)
    if prediction_type == "epsilon":
        return clipped / snr_values
    if prediction_type == "v_prediction":
        return clipped / (snr_values + 1.0)
    return clipped


def target(scheduler, prediction_type: str, latents, noise, timesteps):
    """What the model should output: the noise, the velocity (``scheduler.get_velocity``) or the clean latents."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    return latents


def weighted_mse(prediction, goal, weights: Float[Array, " batch"] | None = None) -> Float[Array, ""]:
    """Mean over elements of each sample's squared error, then (optionally weighted) mean over the batch."""
    per_sample = jnp.mean(jnp.square(prediction.astype(jnp.float32) - goal.astype(jnp.float32)),
                          axis=tuple(range(1, prediction.ndim)))
    return jnp.mean(per_sample if weights is None else per_sample * weights)


def diffusion_loss(denoiser: Callable, scheduler, objective: Objective, latents: Float[Array, "batch h w c"],
                   context, key: PRNGKeyArray) -> Float[Array, ""]:
    """The denoising loss of ``denoiser(noisy_latents, timesteps, context)`` at random timesteps and noise."""
    k_t, k_noise = jax.random.split(key)
    n = scheduler.config.num_train_timesteps
    timesteps = sample_timesteps(k_t, latents.shape[0], n, objective.timestep_bias)
    noise = offset_noise(k_noise, latents, objective.noise_offset)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    prediction = denoiser(noisy, timesteps, context)
    kind = objective.prediction_type or scheduler.config.prediction_type
    goal = target(scheduler, kind, latents, noise, timesteps)
    weights = None
    if objective.snr_gamma is not None:
        weights = min_snr_weights(snr(scheduler.alphas_cumprod, timesteps), objective.snr_gamma, kind)
    return weighted_mse(prediction, goal, weights)


# ----------------------------------------------------------------------------------------------------------------
# Rectified flow (SD3, Flux, Wan): x_s = (1 - s) x0 + s noise, the model predicts the velocity noise - x0.


def flow_sigmas(key: PRNGKeyArray, batch: int, *, weighting: str = "logit_normal", logit_mean: float = 0.0,
                logit_std: float = 1.0, shift: float = 1.0) -> Float[Array, " batch"]:
    """Noise levels ``s`` in (0, 1): ``uniform`` or ``logit_normal`` (SD3's default), then time-shifted as SD3/Flux
    do: ``shift * s / (1 + (shift - 1) * s)``."""
    if weighting == "uniform":
        s = jax.random.uniform(key, (batch,), minval=1e-5, maxval=1.0 - 1e-5)
    elif weighting == "logit_normal":
        s = jax.nn.sigmoid(logit_mean + logit_std * jax.random.normal(key, (batch,)))
    else:
        raise ValueError(f"flow weighting={weighting!r}; choose 'uniform' or 'logit_normal'")
    return shift * s / (1.0 + (shift - 1.0) * s)


def flow_matching_pair(x0, noise, sigmas: Float[Array, " batch"]):
    """``(x_s, velocity)`` for rectified flow: ``x_s = (1 - s) x0 + s noise`` and the target ``noise - x0``."""
    s = sigmas.reshape((-1,) + (1,) * (x0.ndim - 1)).astype(x0.dtype)
    return (1.0 - s) * x0 + s * noise, noise - x0


def flow_matching_loss(velocity_model: Callable, x0, context, key: PRNGKeyArray, *, weighting: str = "logit_normal",
                       logit_mean: float = 0.0, logit_std: float = 1.0, shift: float = 1.0,
                       num_train_timesteps: int = 1000) -> Float[Array, ""]:
    """MSE between ``velocity_model(x_s, s * num_train_timesteps, context)`` and ``noise - x0``."""
    k_s, k_noise = jax.random.split(key)
    sigmas = flow_sigmas(k_s, x0.shape[0], weighting=weighting, logit_mean=logit_mean, logit_std=logit_std,
                         shift=shift)
    noise = jax.random.normal(k_noise, x0.shape, x0.dtype)
    x_s, velocity = flow_matching_pair(x0, noise, sigmas)
    return weighted_mse(velocity_model(x_s, sigmas * num_train_timesteps, context), velocity)
