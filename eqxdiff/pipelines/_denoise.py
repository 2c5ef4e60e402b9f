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
from ..core import program
from ..schedulers import pad_schedule, to_device
from ._checks import FRACTION_RANGE, FRACTION_TOP
from ._progress import tick

GUIDANCE_MODES = ("batched", "separate")


class Guidance(eqx.Module):
    """Classifier-free guidance: ``uncond + scale * (cond - uncond)``, then optionally rescaled toward the
    conditional output's std (``rescale``, Lin et al. 2023).

    ``scale`` and ``rescale`` are arrays, traced in the loop: a call that changes only them compiles nothing.
    ``scale`` is one value, or one per timestep of the schedule (``[steps]``, indexed by the scheduler's step
    index: Wan 2.2's ``guidance_scale_2`` below its boundary, interval guidance). What shapes the traced graph is
    static: whether guidance runs at all (``enabled``: some scale above 1, as diffusers' ``guidance_scale > 1``)
    and how (``mode``). ``"batched"`` runs both halves in one call (the conditioning arrays hold
    ``[negative; positive]`` along the batch, as diffusers' UNet pipelines do); ``"separate"`` makes two calls with
    ``cond = (negative, positive)`` (Flux's true CFG, whose two halves may differ in shape)."""

    scale: Float[Array, "*steps"]
    rescale: Float[Array, ""]
    mode: str = eqx.field(static=True)
    enabled: bool = eqx.field(static=True)

    def __init__(self, scale=7.5, rescale=0.0, mode: str = "batched", *, enabled: bool | None = None):
        if mode not in GUIDANCE_MODES:
            raise ValueError(f"Guidance: mode={mode!r}; choose one of {GUIDANCE_MODES}")
        self.scale, self.rescale = _float32(scale), _float32(rescale)
        if self.scale.ndim > 1 or self.rescale.ndim:
            raise ValueError(f"Guidance: scale must be one value or one per step (got shape {self.scale.shape}), "
                             f"rescale one value (got shape {self.rescale.shape})")
        self.mode = mode
        self.enabled = bool(np.any(np.asarray(self.scale) > 1.0)) if enabled is None else bool(enabled)

    def at(self, step) -> Float[Array, ""]:
        """The scale at the scheduler's step index ``step``."""
        return self.scale if self.scale.ndim == 0 else self.scale[step]

    def padded(self, length: int) -> "Guidance":
        """A per-step scale padded (repeating its last value) to ``length`` steps, the loop's fixed schedule
        length; a single scale as it is."""
        if self.scale.ndim == 0 or self.scale.shape[0] == length:
            return self
        if self.scale.shape[0] > length:
            raise ValueError(f"Guidance: {self.scale.shape[0]} per-step scales for a schedule of {length} steps")
        scale = np.pad(np.asarray(self.scale), (0, length - self.scale.shape[0]), mode="edge")
        return Guidance(scale, self.rescale, self.mode, enabled=self.enabled)


def _float32(value):
    """A float32 array of ``value``; host values go to the device as they are (``jnp.asarray`` of a new shape would
    compile a copy program: a new per-step length must compile nothing)."""
    if isinstance(value, jax.Array):
        return value if value.dtype == jnp.float32 else value.astype(jnp.float32)
    return to_device(value, np.float32)


def rescale_noise_cfg(noise_cfg, noise_text, guidance_rescale):
    """Rescale guided noise toward the text-conditioned noise's std (Lin et al. 2023, sec. 3.4)."""
    axes = tuple(range(1, noise_cfg.ndim))
    std_text = jnp.std(noise_text, axis=axes, keepdims=True, ddof=1)
    std_cfg = jnp.std(noise_cfg, axis=axes, keepdims=True, ddof=1)
    rescaled = noise_cfg * (std_text / std_cfg)
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


def combine_guidance(uncond, cond, guidance: Guidance, step=0):
    """``uncond + scale * (cond - uncond)`` at the step index ``step``, rescaled where ``guidance.rescale > 0``
    (a traced choice: the rescaled output is computed every step and selected, never mixed in at 0).

    Computed in float32 (or wider) and rounded once to the model outputs' dtype: in bfloat16 the scale itself (3.14
    becomes 3.140625), the difference, the product and the sum would each be rounded, and a guidance scale of 7.5
    multiplies the difference's rounding error 7.5 times. Float32 outputs give the same bits as before."""
    dtype = uncond.dtype
    compute = jnp.promote_types(dtype, jnp.float32)
    uncond, cond = uncond.astype(compute), cond.astype(compute)
    out = uncond + guidance.at(step).astype(compute) * (cond - uncond)
    rescale = guidance.rescale.astype(compute)
    return jnp.where(rescale > 0, rescale_noise_cfg(out, cond, rescale), out).astype(dtype)


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
        return combine_guidance(denoiser(x, t, negative, step=step), denoiser(x, t, positive, step=step), guidance,
                                step)
    out = denoiser(jnp.concatenate([x, x]), t, cond, step=step)
    uncond, text = jnp.split(out, 2)
    return combine_guidance(uncond, text, guidance, step)


def denoise_loop(denoiser: Denoiser, scheduler, state, latents: Float[Array, "batch *spatial channels"], cond,
                 key: PRNGKeyArray, *, guidance: Guidance | None = None,
                 num_steps: int | Int[Array, ""] | None = None, progress: bool = False, return_state: bool = False):
    """Run the scheduler's remaining steps from ``state`` (or the first ``num_steps`` of them, to stop early as
    ``denoising_end`` does): the whole loop is one jitted ``lax.fori_loop``. ``return_state``: return
    ``(latents, state, key)``, from which a later call goes on where this one stopped (the same steps as one run:
    a loop run in segments, e.g. with another model's weights on the devices).

    Each step scales the latents for the model (``scheduler.scale_model_input``), takes the guided model output
    and the scheduler's step (stochastic schedulers draw from ``key``), then :meth:`Denoiser.after_step`.

    Values are traced and shapes compile: the schedule is padded to its fixed length (``pad_schedule``), the trip
    count is an array, the scheduler is its :meth:`~eqxdiff.schedulers.AbstractScheduler.stepper` and guidance
    holds arrays, so calls that differ in the number of steps, the start (``strength``), the guidance values, the
    noise or a schedule-only scheduler option share one compiled program. ``progress`` advances the progress bar
    that :func:`~eqxdiff.pipelines._progress.progress_bar` opened after each step: that same program then runs one
    step per call (the same numbers), the bar moved between calls. (A host callback inside the loop would keep JAX
    from saving the program in its persistent compilation cache.)
    """
    state = pad_schedule(state)
    guidance = (Guidance(1.0) if guidance is None else guidance).padded(state.timesteps.shape[0])
    remaining = scheduler.remaining_steps(state)
    steps = remaining if num_steps is None else num_steps
    given, left = _concrete_int(steps), _concrete_int(remaining)
    if given is not None and left is not None and not 0 <= given <= left:
        raise ValueError(f"num_steps={num_steps} must be in [0, {left}] (the steps left in the schedule)")
    stepper, index = scheduler.stepper(), _concrete_int(state.step_index)
    if given is None or index is None:  # inside a trace: one call, no bar to move between steps
        carry = _denoise_loop(denoiser, stepper, state, latents, cond, key, guidance, jnp.asarray(steps, jnp.int32),
                              state.step_index + steps)
        return carry if return_state else carry[0]
    end = np.asarray(index + given, np.int32)  # the step after the loop's last, for after_step's last=
    if not progress:
        carry = _denoise_loop(denoiser, stepper, state, latents, cond, key, guidance, np.asarray(given, np.int32),
                              end)
        return carry if return_state else carry[0]
    one = np.asarray(1, np.int32)
    for _ in range(given):
        latents, state, key = _denoise_loop(denoiser, stepper, state, latents, cond, key, guidance, one, end)
        jax.block_until_ready(latents)
        tick()
    return (latents, state, key) if return_state else latents


def _concrete_int(value) -> int | None:
    """``value`` as a Python int, or ``None`` when it is traced."""
    return None if isinstance(value, jax.core.Tracer) else int(value)


@program
def _denoise_loop(denoiser: Denoiser, scheduler, state, latents, cond, key, guidance: Guidance, steps, end):
    """:func:`denoise_loop`'s program: ``steps`` steps of a loop that ends before step index ``end``; the latents,
    the scheduler state and the key after them."""

    def body(_, carry):
        x, st, k = carry
        t = scheduler.current_timestep(st)
        step = st.step_index
        out = guided_output(denoiser, scheduler.scale_model_input(st, x), t, cond, guidance, step=step)
        k, sub = jax.random.split(k)
        x, st = scheduler.step(st, out.astype(x.dtype), x, key=sub)
        x = denoiser.after_step(x, t, cond, step=step, scheduler=scheduler, state=st, last=st.step_index >= end)
        return x, st, k

    return jax.lax.fori_loop(0, steps, body, (latents, state, key))


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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= FRACTION_TOP[name]:
        raise ValueError(f"{name}={value!r} must be a float in {FRACTION_RANGE[name]}: the fraction of the schedule "
                         f"{'before the hand-off' if name == 'denoising_start' else 'to run'}")
    return float(value)


def _cutoff(scheduler, fraction: float) -> int:
    n = scheduler.config.num_train_timesteps
    return round(n - fraction * n)


def plan_schedule(scheduler, num_inference_steps: int | None, *, sample_shape: tuple[int, ...],
                  strength: float | None = None, denoising_start: float | None = None,
                  denoising_end: float | None = None, whole_steps: bool | None = None, **schedule) -> Schedule:
    """The scheduler state and step count for a pipeline call, as diffusers' pipelines cut the timesteps.

    ``schedule``: a custom schedule for the scheduler's ``init`` (``timesteps=``, ``sigmas=``; ``None`` values are
    dropped); it replaces ``num_inference_steps``, as in diffusers' ``retrieve_timesteps``.

    ``strength`` (image-to-image) starts at ``N - int(N * strength)`` steps in, or ``int(N - N * strength)``: the
    pipeline's rounding, ``whole_steps`` (``None``: the scheduler's usual one; ``AbstractScheduler.init``).
    ``denoising_start`` (the second
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
        state = scheduler.init(num_inference_steps, sample_shape=sample_shape, strength=strength,
                               whole_steps=None if strength is None else whole_steps, **schedule)
    num_steps = remaining = int(scheduler.remaining_steps(state))
    if end is not None:
        run = np.asarray(scheduler.timesteps_to_run(state))
        num_steps = int(np.sum(run >= _cutoff(scheduler, end)))
    if num_steps < 1:
        what = f"denoising_start={start}" if start is not None else None if strength is None else f"strength={strength}"
        if remaining >= 1 or what is None:  # denoising_end cuts off every step the start leaves
            what = f"denoising_end={end}" + ("" if what is None else f" after {what}")
        raise ValueError(f"{what} with {state.timesteps.shape[0]} steps leaves no denoising step; raise "
                         "num_inference_steps or move the fraction")
    return Schedule(pad_schedule(state), num_steps, adds_noise=start is None)
