"""The one denoising loop every pipeline runs, and classifier-free guidance.

A family supplies a :class:`Denoiser`: an ``eqx.Module`` holding its model(s) whose ``__call__(x, t, cond, *,
step)`` returns the model output for latents ``x`` at timestep ``t`` (``cond`` is whatever arrays the family
conditions on: text embeddings, pooled embeddings, time ids, control images ...) and whose ``after_step`` may
change the latents after each scheduler step (inpainting's blend). :func:`denoise_loop` runs the scheduler's
remaining steps from a state as one jitted ``lax.fori_loop``, with or without guidance; :func:`plan_schedule` cuts
the timesteps for a call as diffusers' pipelines do (``strength``, ``denoising_start``, ``denoising_end``).
"""

import abc
import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._typing import Array, Float, Int, PRNGKeyArray
from ._progress import tick

GUIDANCE_MODES = ("batched", "separate")


@dataclasses.dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance settings (static: they decide the traced graph).

    ``scale > 1`` turns guidance on: ``uncond + scale * (cond - uncond)``, then optionally rescaled toward the
    conditional output's std (``rescale``, Lin et al. 2023). ``mode="batched"`` runs both halves in one call (the
    conditioning arrays hold ``[negative; positive]`` along the batch, as diffusers' UNet pipelines do);
    ``"separate"`` makes two calls with ``cond = (negative, positive)`` (Flux's true CFG, whose two halves may differ
    in shape)."""

    scale: float = 7.5
    rescale: float = 0.0
    mode: str = "batched"

    def __post_init__(self):
        if self.mode not in GUIDANCE_MODES:
            raise ValueError(f"Guidance: mode={self.mode!r}; choose one of {GUIDANCE_MODES}")

    @property
    def enabled(self) -> bool:
        return self.scale > 1.0


def rescale_noise_cfg(noise_cfg, noise_text, guidance_rescale: float):
    """Rescale guided noise toward the text-conditioned noise's std (Lin et al. 2023, sec. 3.4)."""
    axes = tuple(range(1, noise_cfg.ndim))
    std_text = jnp.std(noise_text, axis=axes, keepdims=True, ddof=1)
    std_cfg = jnp.std(noise_cfg, axis=axes, keepdims=True, ddof=1)
    rescaled = noise_cfg * (std_text / std_cfg)
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


def combine_guidance(uncond, cond, guidance: Guidance):
    """``uncond + scale * (cond - uncond)``, rescaled if ``guidance.rescale > 0``."""
    out = uncond + guidance.scale * (cond - uncond)
    if guidance.rescale > 0:
        out = rescale_noise_cfg(out, cond, guidance.rescale)
    return out


class Denoiser(eqx.Module):
    """A family's model call inside the loop. Subclasses hold their model(s) as fields and implement
    ``__call__``; :meth:`after_step` may change the latents after each scheduler step (inpainting's blending)."""

    @abc.abstractmethod
    def __call__(self, x, t, cond, *, step):
        """The model output for latents ``x`` at timestep ``t`` (``step``: the step's index in the schedule)."""

    def after_step(self, x, t, cond, *, step, scheduler, state, last):
        """The latents after the scheduler's step. ``t``: the timestep just taken, ``step``: its index;
        ``state``: the scheduler's state after the step (its current timestep is the next one); ``last``: a
        boolean array, true after the loop's final step."""
        return x


def guided_output(denoiser: Denoiser, x, t, cond, guidance: Guidance, *, step):
    """The (guided) model output at ``x``, ``t``."""
    if not guidance.enabled:
        return denoiser(x, t, cond, step=step)
    if guidance.mode == "separate":
        negative, positive = cond
        return combine_guidance(denoiser(x, t, negative, step=step), denoiser(x, t, positive, step=step), guidance)
    out = denoiser(jnp.concatenate([x, x]), t, cond, step=step)
    uncond, text = jnp.split(out, 2)
    return combine_guidance(uncond, text, guidance)


@eqx.filter_jit
def denoise_loop(denoiser: Denoiser, scheduler, state, latents: Float[Array, "batch *spatial channels"], cond,
                 key: PRNGKeyArray, *, guidance: Guidance = Guidance(1.0),
                 num_steps: int | Int[Array, ""] | None = None, progress: bool = False):
    """Run the scheduler's remaining steps from ``state`` (or the first ``num_steps`` of them, to stop early as
    ``denoising_end`` does): the whole loop is one ``lax.fori_loop``.

    Each step scales the latents for the model (``scheduler.scale_model_input``), takes the guided model output
    and the scheduler's step (stochastic schedulers draw from ``key``), then :meth:`Denoiser.after_step`.
    ``num_steps`` given as an array is a traced trip count: runs stopping at different steps share one program.
    """
    remaining = scheduler.remaining_steps(state)
    steps = remaining if num_steps is None else num_steps
    if isinstance(steps, int) and not 0 <= steps <= remaining:
        raise ValueError(f"num_steps={num_steps} must be in [0, {remaining}] (the steps left in the schedule)")
    end = state.step_index + steps

    def body(_, carry):
        x, st, k = carry
        t = scheduler.current_timestep(st)
        step = st.step_index
        out = guided_output(denoiser, scheduler.scale_model_input(st, x), t, cond, guidance, step=step)
        k, sub = jax.random.split(k)
        x, st = scheduler.step(st, out.astype(x.dtype), x, key=sub)
        x = denoiser.after_step(x, t, cond, step=step, scheduler=scheduler, state=st, last=st.step_index >= end)
        if progress:
            jax.debug.callback(tick, st.step_index)
        return x, st, k

    latents, state, _ = jax.lax.fori_loop(0, steps, body, (latents, state, key))
    return latents


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The part of a scheduler's timesteps a pipeline runs: the loop takes ``num_steps`` steps from ``state``
    (which starts at ``state.begin_index``). ``adds_noise``: the start latents are an image's latents noised to
    the first step (image-to-image by ``strength``), not latents handed over as they are (``denoising_start``)."""

    state: Any
    num_steps: int
    adds_noise: bool = True


def _fraction(name: str, value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise ValueError(f"{name}={value!r} must be a float in (0, 1): the fraction of the schedule "
                         f"{'before the hand-off' if name == 'denoising_start' else 'to run'}")
    return float(value)


def _cutoff(scheduler, fraction: float) -> int:
    n = scheduler.config.num_train_timesteps
    return round(n - fraction * n)


def plan_schedule(scheduler, num_inference_steps: int | None, *, sample_shape: tuple[int, ...],
                  strength: float | None = None, denoising_start: float | None = None,
                  denoising_end: float | None = None, **schedule) -> Schedule:
    """The scheduler state and step count for a pipeline call, as diffusers' pipelines cut the timesteps.

    ``schedule``: a custom schedule for the scheduler's ``init`` (``timesteps=``, ``sigmas=``; ``None`` values are
    dropped); it replaces ``num_inference_steps``, as in diffusers' ``retrieve_timesteps``.

    ``strength`` (image-to-image) starts at ``N - int(N * strength)`` steps in. ``denoising_start`` (the second
    pipeline of a hand-off, a fraction of the training timesteps) starts at the first timestep below
    ``round(T - denoising_start * T)`` and overrides ``strength``; the latents there are given, not noised.
    ``denoising_end`` (the first pipeline of a hand-off) stops before the first timestep below
    ``round(T - denoising_end * T)``. Base and refiner given the same fraction split one schedule exactly.
    """
    start, end = _fraction("denoising_start", denoising_start), _fraction("denoising_end", denoising_end)
    if start is not None and end is not None and start >= end:
        raise ValueError(f"denoising_start={start} must be smaller than denoising_end={end}")
    if strength is not None and (isinstance(strength, bool) or not 0.0 < strength <= 1.0):
        raise ValueError(f"strength must be in (0, 1], got {strength}")
    schedule = {k: v for k, v in schedule.items() if v is not None}
    if schedule:
        num_inference_steps = None
    if start is not None:
        timesteps = np.asarray(scheduler.init(num_inference_steps, sample_shape=sample_shape, **schedule).timesteps)
        count = int(np.sum(timesteps < _cutoff(scheduler, start)))
        if scheduler.order == 2 and count % 2 == 0:  # do not stop between a second-order step's two evaluations
            count += 1
        state = scheduler.init(num_inference_steps, sample_shape=sample_shape,
                               begin_index=len(timesteps) - min(count, len(timesteps)), **schedule)
    else:
        state = scheduler.init(num_inference_steps, sample_shape=sample_shape, strength=strength, **schedule)
    num_steps = scheduler.remaining_steps(state)
    if end is not None:
        run = np.asarray(scheduler.timesteps_to_run(state))
        num_steps = int(np.sum(run >= _cutoff(scheduler, end)))
    if num_steps < 1:
        what = (f"denoising_start={start}" if start is not None else f"strength={strength}"
                if strength is not None else f"denoising_end={end}")
        raise ValueError(f"{what} with {state.timesteps.shape[0]} steps leaves no denoising step; raise "
                         "num_inference_steps or move the fraction")
    return Schedule(state, num_steps, adds_noise=start is None)
