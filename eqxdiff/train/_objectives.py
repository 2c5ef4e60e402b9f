"""Training objectives as pure functions: timestep sampling (with diffusers' timestep bias), noise offset,
epsilon / v-prediction / sample targets, Min-SNR-gamma weights, the diffusion MSE, and rectified-flow matching on
a flow-matching scheduler's training schedule (SD3's density and loss weightings, as diffusers' training scripts).

Every function takes arrays and a PRNG key and is jittable; :class:`Objective` holds the static settings.
:func:`diffusion_loss` takes either kind of scheduler: a DDPM-process one (epsilon / v / sample targets) or
:class:`~eqxdiff.schedulers.FlowMatchEulerDiscreteScheduler` (the velocity target).
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ..schedulers import FlowMatchEulerDiscreteScheduler
from ._checks import check_choice

PREDICTION_TYPES = ("epsilon", "v_prediction", "sample", "flow_prediction")
BIAS_STRATEGIES = ("none", "earlier", "later", "range")
# diffusers' --weighting_scheme: logit_normal and mode shape the timestep density, sigma_sqrt and cosmap weight
# the loss (their timesteps are uniform), none and uniform do neither.
WEIGHTING_SCHEMES = ("none", "uniform", "logit_normal", "mode", "sigma_sqrt", "cosmap")


@dataclasses.dataclass(frozen=True)
class TimestepBias:
    """diffusers' ``--timestep_bias_*`` options: multiply the sampling weight of some timesteps.

    ``earlier``/``later`` bias the first/last ``portion`` of the timesteps, ``range`` biases ``[begin, end)``.
    """

    strategy: str = "none"
    """``none``, ``earlier``, ``later`` or ``range``: which timesteps to sample more (or less) often."""
    multiplier: float = 1.0
    """Sampling weight of the biased timesteps relative to the others (< 1 samples them less)."""
    portion: float = 0.25
    """``earlier`` / ``later``: the fraction of the timesteps biased."""
    begin: int = 0
    """``range``: the first biased timestep."""
    end: int = 1000
    """``range``: one past the last biased timestep."""

    def __post_init__(self):
        check_choice("timestep bias strategy", self.strategy, BIAS_STRATEGIES)
        if not 0 <= self.multiplier < math.inf:
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
    scheduler config's (``flow_prediction``, the velocity, on a flow-matching scheduler); ``snr_gamma`` turns on
    Min-SNR weighting (5.0 is the paper's value); ``caption_dropout`` is the probability of training a sample on the
    empty prompt (for classifier-free guidance). Flow matching reads ``weighting_scheme`` (diffusers'
    ``--weighting_scheme``) with ``logit_mean`` / ``logit_std`` (``logit_normal``) and ``mode_scale`` (``mode``)."""

    prediction_type: str | None = None
    """What the model predicts: ``epsilon``, ``v_prediction`` or ``sample`` (None: the scheduler config's)."""
    snr_gamma: float | None = None
    """Min-SNR loss weighting with this gamma (5.0 is the paper's); None: plain MSE."""
    noise_offset: float = 0.0
    """Offset noise: add this times a per-sample, per-channel Gaussian constant to the noise (0: off)."""
    caption_dropout: float = 0.0
    """Probability of training a sample on the empty prompt (for classifier-free guidance)."""
    timestep_bias: TimestepBias = TimestepBias()
    """Sample some timesteps more often (diffusers' ``--timestep_bias_*``)."""
    weighting_scheme: str = "none"
    """Flow matching: how timesteps are drawn and weighted (none, uniform, logit_normal, mode, sigma_sqrt,
    cosmap)."""
    logit_mean: float = 0.0
    """Flow matching, ``logit_normal``: the mean of the normal behind the logit."""
    logit_std: float = 1.0
    """Flow matching, ``logit_normal``: its standard deviation."""
    mode_scale: float = 1.29
    """Flow matching, ``mode``: the scale of the mode-seeking density."""

    def __post_init__(self):
        check_choice("weighting_scheme", self.weighting_scheme, WEIGHTING_SCHEMES)
        if not 0 < self.logit_std < math.inf:
            raise ValueError(f"logit_std={self.logit_std} must be > 0")
        if not math.isfinite(self.logit_mean) or not math.isfinite(self.mode_scale):
            raise ValueError(f"logit_mean={self.logit_mean} and mode_scale={self.mode_scale} must be finite")
        if self.prediction_type is not None:
            check_choice("prediction_type", self.prediction_type, PREDICTION_TYPES)
        if self.snr_gamma is not None and not 0 < self.snr_gamma < math.inf:
            raise ValueError(f"snr_gamma={self.snr_gamma} must be positive (or None to turn Min-SNR off)")
        if not 0.0 <= self.caption_dropout < 1.0:
            raise ValueError(f"caption_dropout={self.caption_dropout} must be in [0, 1)")
        if not 0 <= self.noise_offset < math.inf:
            raise ValueError(f"noise_offset={self.noise_offset} must be >= 0")


def sample_timesteps(key: PRNGKeyArray, batch: int, num_timesteps: int,
                     bias: TimestepBias = TimestepBias()) -> Int[Array, " batch"]:
    """Integer training timesteps: uniform, or drawn from :meth:`TimestepBias.weights`."""
    if bias.strategy == "none" or bias.multiplier == 1.0:
        return jax.random.randint(key, (batch,), 0, num_timesteps, dtype=jnp.int32)
    logits = jnp.log(jnp.asarray(bias.weights(num_timesteps), jnp.float32))
    return jax.random.categorical(key, logits, shape=(batch,)).astype(jnp.int32)


@typechecked
def offset_noise(key: PRNGKeyArray, latents: Float[Array, "batch *dims channels"],
                 noise_offset: float) -> Float[Array, "batch *dims channels"]:
    """Gaussian noise plus ``noise_offset`` times a per-sample, per-channel constant (Guttenberg's offset noise;
    diffusers' ``noise_offset * randn(b, c, 1, 1)``), the same over space and, for video latents ``[b, f, h, w,
    c]``, over frames."""
    k_noise, k_off = jax.random.split(key)
    noise = jax.random.normal(k_noise, latents.shape, latents.dtype)
    if noise_offset:
        per = (latents.shape[0],) + (1,) * (latents.ndim - 2) + (latents.shape[-1],)
        noise = noise + noise_offset * jax.random.normal(k_off, per, latents.dtype)
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


def check_min_snr(scheduler, prediction_type: str) -> None:
    """``ValueError`` where Min-SNR weighting is undefined: epsilon prediction divides ``min(snr, gamma)`` by the SNR,
    which is 0 at the last timestep of a zero-terminal-SNR schedule (``rescale_betas_zero_snr``), so a batch that
    draws it would give a NaN loss."""
    if prediction_type == "epsilon" and float(np.min(np.asarray(scheduler.alphas_cumprod))) <= 0.0:
        raise ValueError("snr_gamma (Min-SNR weighting) with prediction_type='epsilon' divides by the SNR, which is 0 "
                         "at the last timestep of this zero-terminal-SNR noise schedule (rescale_betas_zero_snr=True): "
                         "the loss would be NaN there, whatever the learning rate; train prediction_type="
                         "'v_prediction' (as zero-terminal-SNR models do) or set snr_gamma=None")


def target(scheduler, prediction_type: str, latents, noise, timesteps):
    """What the model should output: the noise, the velocity (``scheduler.get_velocity``) or the clean latents."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return scheduler.get_velocity(latents, noise, timesteps)
    return latents


def weighted_mse(prediction, goal, weights: Float[Array, " batch"] | None = None, mask=None) -> Float[Array, ""]:
    """Mean over elements of each sample's squared error (with ``mask``, broadcastable to the prediction: over the
    elements where it is nonzero), then (optionally weighted) mean over the batch."""
    square = jnp.square(prediction.astype(jnp.float32) - goal.astype(jnp.float32))
    axes = tuple(range(1, prediction.ndim))
    if mask is None:
        per_sample = jnp.mean(square, axis=axes)
    else:
        counted = jnp.broadcast_to(mask, square.shape).astype(jnp.float32)
        per_sample = jnp.sum(square * counted, axis=axes) / jnp.maximum(jnp.sum(counted, axis=axes), 1.0)
    return jnp.mean(per_sample if weights is None else per_sample * weights)


def model_inputs(inputs: Callable | None, x0, noisy, timesteps):
    """``(model input, timesteps, loss mask)``: ``inputs(x0, noisy, timesteps)`` (a bundle's
    :meth:`~eqxdiff.train.TrainModel.training_inputs`: some samples conditioned on part of their clean latents), or
    the noisy latents and timesteps as they are, every element counted (``inputs=None``)."""
    return (noisy, timesteps, None) if inputs is None else inputs(x0, noisy, timesteps)


def _times(weights, sample_weights):
    """The objective's per-sample ``weights`` (or ``None``: ones) times ``sample_weights`` (or ``None``)."""
    if sample_weights is None:
        return weights
    return sample_weights if weights is None else weights * sample_weights


def check_objective(objective: Objective, scheduler) -> None:
    """``ValueError`` for ``objective`` settings of another noise process than ``scheduler``'s (the DDPM process, or
    rectified flow: a ``FlowMatchEulerDiscreteScheduler``), naming them and what this one takes; checked by the
    losses and, before anything loads, by :func:`eqxdiff.train.run` on the folder's scheduler config."""
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        ddpm = [f"snr_gamma={objective.snr_gamma}"] if objective.snr_gamma is not None else []
        if objective.timestep_bias.strategy != "none":
            ddpm.append(f"timestep_bias={objective.timestep_bias.strategy!r}")
        if ddpm:
            raise ValueError(f"{' and '.join(ddpm)}: snr_gamma and timestep_bias weight the DDPM process, but the "
                             "model trains by flow matching, which takes weighting_scheme (one of "
                             f"{list(WEIGHTING_SCHEMES)}): leave them out")
        if objective.prediction_type not in (None, "flow_prediction"):
            raise ValueError(f"prediction_type={objective.prediction_type!r} is a DDPM target; the model trains by "
                             "flow matching, which predicts the velocity: set prediction_type='flow_prediction' or "
                             "leave it out")
        return
    flow = [f"weighting_scheme={objective.weighting_scheme!r}"] if objective.weighting_scheme != "none" else []
    if objective.prediction_type == "flow_prediction":
        flow.append("prediction_type='flow_prediction'")
    if flow:
        raise ValueError(f"{type(scheduler).__name__} trains on the DDPM process, where {' and '.join(flow)} (flow "
                         "matching's) does not apply: leave it out (the DDPM process takes snr_gamma and "
                         "timestep_bias)")
    kind = objective.prediction_type or scheduler.config.prediction_type
    if objective.snr_gamma is not None:
        check_min_snr(scheduler, kind)


def diffusion_loss(denoiser: Callable, scheduler, objective: Objective, latents: Float[Array, "batch *dims"],
                   context, key: PRNGKeyArray, sample_weights: Float[Array, " batch"] | None = None,
                   inputs: Callable | None = None) -> Float[Array, ""]:
    """The denoising loss of ``denoiser(noisy_latents, timesteps, context)`` at random timesteps and noise (on a
    flow-matching scheduler: :func:`flow_matching_loss`); ``sample_weights`` multiply each sample's loss before
    the batch mean (prior preservation's class images: ``prior_loss_weight``); ``inputs``: what the denoiser is
    called with and which elements the loss counts (:func:`model_inputs`)."""
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return flow_matching_loss(denoiser, scheduler, objective, latents, context, key, sample_weights, inputs)
    check_objective(objective, scheduler)
    k_t, k_noise = jax.random.split(key)
    n = scheduler.config.num_train_timesteps
    timesteps = sample_timesteps(k_t, latents.shape[0], n, objective.timestep_bias)
    noise = offset_noise(k_noise, latents, objective.noise_offset)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    x, t, mask = model_inputs(inputs, latents, noisy, timesteps)
    prediction = denoiser(x, t, context)
    kind = objective.prediction_type or scheduler.config.prediction_type
    goal = target(scheduler, kind, latents, noise, timesteps)
    weights = None
    if objective.snr_gamma is not None:
        check_min_snr(scheduler, kind)
        weights = min_snr_weights(snr(scheduler.alphas_cumprod, timesteps), objective.snr_gamma, kind)
    return weighted_mse(prediction, goal, _times(weights, sample_weights), mask)


# ----------------------------------------------------------------------------------------------------------------
# Rectified flow (SD3, Flux, Wan, LTX): x_s = (1 - s) x0 + s noise, the model predicts the velocity noise - x0.
# The noise levels come from the flow-matching scheduler's training schedule, as diffusers' training scripts take
# them: u from compute_density_for_timestep_sampling, indices = (u * num_train_timesteps).long(),
# timesteps = scheduler.timesteps[indices] and sigmas = scheduler.sigmas at those timesteps (shifted when the
# scheduler's config has a static shift).


def flow_density(weighting_scheme: str, draws: Float[Array, " batch"], *, logit_mean: float = 0.0,
                 logit_std: float = 1.0, mode_scale: float = 1.29) -> Float[Array, " batch"]:
    """diffusers' ``compute_density_for_timestep_sampling`` given its random draws: ``draws`` are standard
    normal for ``logit_normal`` (``u = sigmoid(logit_mean + logit_std * draw)``) and uniform in [0, 1) otherwise
    (``mode``: ``1 - u - mode_scale * (cos(pi u / 2)^2 - 1 + u)``; the rest: ``u`` itself)."""
    if weighting_scheme == "logit_normal":
        return jax.nn.sigmoid(logit_mean + logit_std * draws)
    if weighting_scheme == "mode":
        return 1 - draws - mode_scale * (jnp.cos(math.pi * draws / 2) ** 2 - 1 + draws)
    return draws


def flow_timesteps(key: PRNGKeyArray, batch: int, scheduler: FlowMatchEulerDiscreteScheduler,
                   objective: Objective) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """``(timesteps, sigmas)`` for a batch: :func:`flow_density` of normal (``logit_normal``) or uniform draws,
    then :func:`flow_schedule_at` the scheduler's training schedule."""
    if objective.weighting_scheme == "logit_normal":
        draws = jax.random.normal(key, (batch,), jnp.float32)
    else:
        draws = jax.random.uniform(key, (batch,), jnp.float32)
    u = flow_density(objective.weighting_scheme, draws, logit_mean=objective.logit_mean,
                     logit_std=objective.logit_std, mode_scale=objective.mode_scale)
    return flow_schedule_at(scheduler, u)


def flow_schedule_at(scheduler: FlowMatchEulerDiscreteScheduler,
                     u: Float[Array, " batch"]) -> tuple[Float[Array, " batch"], Float[Array, " batch"]]:
    """The training schedule's ``(timesteps, sigmas)`` at ``indices = int(u * n)``, ``n`` its length
    (``num_train_timesteps``, or fewer where the scheduler keeps part of it: one expert's range); ``u`` in [0, 1], an
    index past the end, from ``u = 1``, clipped to the last."""
    timesteps, sigmas = scheduler.training_schedule()
    n = len(timesteps)
    indices = jnp.clip((u.astype(jnp.float32) * n).astype(jnp.int32), 0, n - 1)
    return jnp.asarray(timesteps)[indices], jnp.asarray(sigmas)[indices]


def flow_loss_weights(weighting_scheme: str, sigmas: Float[Array, " batch"]) -> Float[Array, " batch"]:
    """diffusers' ``compute_loss_weighting_for_sd3``: ``sigma^-2`` (``sigma_sqrt``), ``2 / (pi (1 - 2 sigma +
    2 sigma^2))`` (``cosmap``), else ones."""
    if weighting_scheme == "sigma_sqrt":
        return sigmas**-2.0
    if weighting_scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    return jnp.ones_like(sigmas)


def flow_matching_pair(x0, noise, sigmas: Float[Array, " batch"]):
    """``(x_s, velocity)`` for rectified flow: ``x_s = (1 - s) x0 + s noise`` and the target ``noise - x0``."""
    s = sigmas.reshape((-1,) + (1,) * (x0.ndim - 1)).astype(x0.dtype)
    return (1.0 - s) * x0 + s * noise, noise - x0


def flow_matching_loss(velocity_model: Callable, scheduler: FlowMatchEulerDiscreteScheduler, objective: Objective,
                       x0: Float[Array, "batch *dims"], context, key: PRNGKeyArray,
                       sample_weights: Float[Array, " batch"] | None = None,
                       inputs: Callable | None = None) -> Float[Array, ""]:
    """Weighted MSE between ``velocity_model(x_s, timesteps, context)`` and ``noise - x0`` at the scheduler's
    training timesteps drawn by :func:`flow_timesteps`, weighted by :func:`flow_loss_weights` (times
    ``sample_weights``, if given); ``inputs``: what the model is called with and which elements the loss counts
    (:func:`model_inputs`)."""
    check_objective(objective, scheduler)
    k_t, k_noise = jax.random.split(key)
    timesteps, sigmas = flow_timesteps(k_t, x0.shape[0], scheduler, objective)
    if objective.noise_offset:
        noise = offset_noise(k_noise, x0, objective.noise_offset)
    else:
        noise = jax.random.normal(k_noise, x0.shape, x0.dtype)
    x_s, velocity = flow_matching_pair(x0, noise, sigmas)
    x, t, mask = model_inputs(inputs, x0, x_s, timesteps)
    prediction = velocity_model(x, t, context)
    weights = flow_loss_weights(objective.weighting_scheme, sigmas)
    return weighted_mse(prediction, velocity, _times(weights, sample_weights), mask)
