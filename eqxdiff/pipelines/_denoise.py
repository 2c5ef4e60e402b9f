"""The one denoising loop every pipeline runs, and classifier-free guidance.

A family supplies a :class:`Denoiser`: an ``eqx.Module`` holding its model(s) whose ``__call__(x, t, cond, *,
step)`` returns the model output for latents ``x`` at timestep ``t`` (``cond`` is whatever arrays the family
conditions on: text embeddings, pooled embeddings, time ids, control images ...). :func:`denoise_loop` runs the
scheduler's remaining steps from a state as one jitted ``lax.fori_loop``, with or without guidance.
"""

import abc
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray
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

    def after_step(self, x, t, cond, *, step):
        """The latents after the scheduler's step (``t``: the timestep just taken, ``step``: its index)."""
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
                 key: PRNGKeyArray, *, guidance: Guidance = Guidance(1.0), progress: bool = False):
    """Run the scheduler's remaining steps from ``state``: the whole loop is one ``lax.fori_loop``.

    Each step scales the latents for the model (``scheduler.scale_model_input``), takes the guided model output
    and the scheduler's step (stochastic schedulers draw from ``key``), then :meth:`Denoiser.after_step`.
    """

    def body(_, carry):
        x, st, k = carry
        t = scheduler.current_timestep(st)
        step = st.step_index
        out = guided_output(denoiser, scheduler.scale_model_input(st, x), t, cond, guidance, step=step)
        k, sub = jax.random.split(k)
        x, st = scheduler.step(st, out.astype(x.dtype), x, key=sub)
        x = denoiser.after_step(x, t, cond, step=step)
        if progress:
            jax.debug.callback(tick, st.step_index)
        return x, st, k

    steps = scheduler.remaining_steps(state)
    latents, state, _ = jax.lax.fori_loop(0, steps, body, (latents, state, key))
    return latents
