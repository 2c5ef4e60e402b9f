"""Euler on the rectified-flow ODE (SD3, Flux, Wan, LTX-Video), matching
``diffusers.FlowMatchEulerDiscreteScheduler``.

The flow is ``x_s = (1 - s) x0 + s noise`` for ``s`` (sigma) from 1 to 0; the model predicts the velocity
``noise - x0`` and a step is ``x + (s_next - s) * v``. Sigmas are spaced linearly in ``[sigma_min, sigma_max]``
of the training schedule, then shifted: statically by ``shift``, or by ``mu`` under ``use_dynamic_shifting``
(``time_shift_type`` exponential or linear), stretched to ``shift_terminal``, optionally respaced as Karras,
exponential or beta sigmas. Timesteps are ``sigmas * num_train_timesteps``.
"""

import dataclasses
import functools
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import numpy as np

from .._typing import Array, Float, typechecked
from ._base import (
    BOOLS,
    AbstractScheduler,
    SchedulerConfig,
    SigmaState,
    check_num_steps,
    counters,
    custom_schedule,
    resolve_begin_index,
    step_noise,
    to_device,
)
from ._sigmas import SHIFT_TYPES, dynamic_shift_mu, respace, shift_flow_sigmas

SPACINGS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")


@dataclasses.dataclass(frozen=True)
class FlowMatchEulerConfig(SchedulerConfig):
    SUPPORTED_VALUES: ClassVar[Mapping[str, tuple]] = {
        "use_dynamic_shifting": BOOLS, "invert_sigmas": BOOLS, "use_karras_sigmas": BOOLS,
        "use_exponential_sigmas": BOOLS, "use_beta_sigmas": BOOLS, "time_shift_type": SHIFT_TYPES,
        "stochastic_sampling": BOOLS}

    SCHEDULE_ONLY: ClassVar[frozenset[str]] = frozenset({
        *SPACINGS, "shift", "use_dynamic_shifting", "base_shift", "max_shift", "base_image_seq_len",
        "max_image_seq_len", "invert_sigmas", "shift_terminal", "time_shift_type"})

    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float | None = 0.5
    max_shift: float | None = 1.15
    base_image_seq_len: int = 256
    max_image_seq_len: int = 4096
    invert_sigmas: bool = False
    shift_terminal: float | None = None
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    time_shift_type: str = "exponential"
    stochastic_sampling: bool = False

    def __post_init__(self):
        super().__post_init__()
        self.check(self.shift > 0, "shift", "must be > 0")
        spacing = [k for k in SPACINGS if getattr(self, k)]
        self.check(len(spacing) <= 1, spacing[0] if spacing else "use_karras_sigmas",
                   f"cannot be combined with {'=True, '.join(spacing[1:])}=True (pick one spacing)")
        if self.shift_terminal is not None:
            self.check(0 < self.shift_terminal < 1, "shift_terminal", "must be in (0, 1) (or None)")


@functools.lru_cache(maxsize=32)
def _training_schedule(config: FlowMatchEulerConfig) -> tuple[np.ndarray, np.ndarray]:
    # diffusers' __init__, in float32 like its torch tensors.
    n = config.num_train_timesteps
    sigmas = np.linspace(1, n, n, dtype=np.float32)[::-1] / np.float32(n)
    if not config.use_dynamic_shifting:
        shift = np.float32(config.shift)
        sigmas = shift * sigmas / (np.float32(1) + np.float32(config.shift - 1) * sigmas)
    timesteps = sigmas * np.float32(n)
    for a in (sigmas, timesteps):
        a.setflags(write=False)
    return timesteps, sigmas


class FlowMatchEulerDiscreteScheduler(AbstractScheduler):
    """Flow-matching Euler. ``init(n, mu=...)`` under dynamic shifting (:meth:`dynamic_shift_mu` gives Flux's
    ``mu`` for a token count); ``init(sigmas=[...])`` / ``init(timesteps=[...])`` take custom schedules as
    diffusers' ``set_timesteps`` does. With ``stochastic_sampling`` each step re-noises the predicted clean
    sample to the next sigma with fresh noise (``key=`` or ``noise=``). ``strength`` (img2img) follows the
    Flux / SD3 pipelines (:func:`resolve_begin_index` with ``whole_steps=False``)."""

    CONFIG: ClassVar[type[FlowMatchEulerConfig]] = FlowMatchEulerConfig
    config: FlowMatchEulerConfig = eqx.field(static=True, default=FlowMatchEulerConfig())
    SCHEDULE_KEYWORDS: ClassVar[tuple[str, ...]] = ("sigmas", "mu", "timesteps")

    def training_schedule(self) -> tuple[np.ndarray, np.ndarray]:
        """``(timesteps, sigmas)`` of the training schedule (``num_train_timesteps`` each, float32, read-only): what
        diffusers' scheduler holds before ``set_timesteps``, and what its training scripts index."""
        return _training_schedule(self.config)

    def dynamic_shift_mu(self, image_seq_len: int) -> float:
        """``mu`` for ``init`` at ``image_seq_len`` latent tokens, from this config's ``base_shift`` /
        ``max_shift`` and ``base_image_seq_len`` / ``max_image_seq_len`` (the Flux and SD3 pipelines' rule)."""
        cfg = self.config
        return dynamic_shift_mu(image_seq_len, base_seq_len=cfg.base_image_seq_len, max_seq_len=cfg.max_image_seq_len,
                                base_shift=cfg.base_shift, max_shift=cfg.max_shift)

    def _init(self, num_inference_steps: int | None, *, sample_shape, strength, begin_index, sigmas=None, mu=None,
              timesteps=None) -> SigmaState:
        cfg, name, big_n = self.config, "FlowMatchEulerDiscreteScheduler", self.config.num_train_timesteps
        if cfg.use_dynamic_shifting and mu is None:
            raise ValueError(f"{name}.init needs mu= with use_dynamic_shifting=True (scheduler.dynamic_shift_mu("
                             "image_seq_len) gives the pipelines' value)")
        if sigmas is not None:
            sigmas = custom_schedule(name, "sigmas", sigmas, np.float32)
        if timesteps is not None:
            timesteps = custom_schedule(name, "timesteps", timesteps, np.float32)
        lengths = {k: len(v) for k, v in (("sigmas", sigmas), ("timesteps", timesteps)) if v is not None}
        if num_inference_steps is not None:
            check_num_steps(cfg, num_inference_steps)
            lengths["num_inference_steps"] = num_inference_steps
        if not lengths:
            raise ValueError(f"{name}.init needs num_inference_steps (or sigmas= / timesteps=)")
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{name}.init: the schedule's lengths disagree: {lengths}")
        n = next(iter(lengths.values()))
        if sigmas is None:
            if timesteps is None:
                _, train = _training_schedule(cfg)  # the whole one (a subclass may keep part of it for training)
                grid = np.linspace(train[0].item() * big_n, train[-1].item() * big_n, n)
            else:
                grid = timesteps
            sigmas = grid / big_n
        sigmas = shift_flow_sigmas(sigmas, dynamic=cfg.use_dynamic_shifting, shift_type=cfg.time_shift_type, mu=mu,
                                   shift=cfg.shift, terminal=cfg.shift_terminal)
        for key, kind in zip(SPACINGS, ("karras", "exponential", "beta")):
            if getattr(cfg, key):
                sigmas = respace(kind, sigmas, n)
        sigmas = np.asarray(sigmas, np.float32)
        timesteps = timesteps if timesteps is not None else sigmas * np.float32(big_n)
        if cfg.invert_sigmas:
            sigmas = np.float32(1) - sigmas
            timesteps = sigmas * np.float32(big_n)
        sigmas = np.concatenate([sigmas, np.full(1, 1.0 if cfg.invert_sigmas else 0.0, np.float32)])
        begin = resolve_begin_index(n, n, self.order, strength, begin_index, whole_steps=False)
        return SigmaState(timesteps=to_device(timesteps, np.float32), sigmas=to_device(sigmas),
                          **counters(n, begin))

    def update(self, state: SigmaState, out, x, *, key=None, noise=None):
        sigma, sigma_next = state.sigmas[state.step_index], state.sigmas[state.step_index + 1]
        if self.config.stochastic_sampling:
            x0 = x - sigma * out
            fresh = step_noise("FlowMatchEulerDiscreteScheduler", x.shape, x.dtype, key, noise)
            return (1.0 - sigma_next) * x0 + sigma_next * fresh, state
        return x + (sigma_next - sigma) * out, state

    @typechecked
    def scale_noise(self, state: SigmaState, sample: Float[Array, "*dims"],
                    noise: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        """The forward process at the state's current step: ``sigma * noise + (1 - sigma) * sample`` (diffusers'
        ``scale_noise`` after ``set_begin_index``: img2img's noised start)."""
        sigma = state.sigmas[state.step_index]
        return (sigma * noise + (1.0 - sigma) * sample).astype(sample.dtype)

    def add_noise_at_step(self, state: SigmaState, original, noise):
        """:meth:`scale_noise` (the name every scheduler answers to for img2img)."""
        return self.scale_noise(state, original, noise)
