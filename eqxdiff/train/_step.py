"""The train state and the pure, jitted train step, shared by every family.

>>> model = LatentDiffusion(unet=unet, text_encoder=text_encoder, vae=vae, null_input_ids=tokenize([""])[0])
>>> optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-4, warmup_steps=500, total_steps=10_000))
>>> state, frozen = init_state(model, optimizer, key=jax.random.key(0), ema_decay=0.999)
>>> state, metrics = train_step(state, frozen, batch, scheduler=scheduler, objective=Objective(),
...                             optimizer=optimizer)

``model`` is a family's bundle (:class:`eqxdiff.train.TrainModel`: :class:`LatentDiffusion` for Stable Diffusion,
``SDXLLatentDiffusion``, ``FluxFlowMatching``). Only the leaves that ``trainable_filter`` marks (by default the
denoiser's arrays: the UNet, the transformer) are in ``state.params`` and get gradients and optimizer state;
everything else (VAE, text encoders, the unconditional prompt) rides in ``frozen``, which the step never changes.
A batch holds either ``pixel_values`` + token ids (encoded each step) or the cached ``latent_mean`` + ``latent_std``
+ the text encoders' outputs (see :func:`eqxdiff.train.cache_arrays`), plus the family's per-image conditioning
(``model.batch_keys``), and optionally per-sample ``loss_weight`` s: prior preservation's batches hold the
instance rows weighted 2, then as many class rows weighted ``2 prior_loss_weight``, so the batch mean is the
instance loss plus ``prior_loss_weight`` times the class loss, as diffusers' DreamBooth scripts compute it. The
objective follows the noise scheduler: DDPM noise/v/sample prediction, or flow matching on a flow-matching
scheduler (:func:`eqxdiff.train.diffusion_loss`). With LoRA (:func:`eqxdiff.train.lora_filter`) the trainable
leaves are the adapters' alone.
"""

import dataclasses
import functools
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .._typing import Array, Int, PRNGKeyArray
from ._checks import check_choice
from ._family import TrainModel
from ._objectives import Objective, diffusion_loss
from ._sd import LatentDiffusion

__all__ = ["LatentDiffusion", "OptimizerConfig", "TrainState", "batch_loss", "init_state", "make_optimizer",
           "train_step", "trainable_filter"]

SCHEDULES = ("constant", "cosine", "linear")
LOSS_WEIGHT = "loss_weight"  # a batch key: per-sample loss weights (prior preservation's instance / class rows)


def trainable_filter(model: TrainModel, *, train_text_encoder: bool = False, train_vae: bool = False):
    """A filter spec (same structure, bools at the leaves): the denoiser's arrays, plus the text encoders'/VAE's if
    asked (:meth:`eqxdiff.train.TrainModel.trainable`). ``eqx.partition(model, spec)`` splits the model into
    trainable and frozen halves."""
    return model.trainable(train_text_encoder=train_text_encoder, train_vae=train_vae)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then a ``cosine``/``linear``/``constant`` schedule, global-norm clipping and
    gradient accumulation (``optax.MultiSteps``: one optimizer update per ``accumulation_steps`` micro-steps)."""

    learning_rate: float = 1e-4
    """The peak learning rate (reached after ``warmup_steps``)."""
    warmup_steps: int = 0
    """Optimizer updates of linear warmup from 0 to ``learning_rate``."""
    total_steps: int | None = None
    """Micro-steps the schedule spans; the schedule has total_steps // accumulation_steps updates. None: the run's
    ``steps`` (``TrainConfig.resolved``; a bare optimizer needs it given: :meth:`spanning`)."""
    schedule: str = "cosine"
    """After warmup: ``cosine`` or ``linear`` decay to ``final_learning_rate_fraction``, or ``constant``."""
    final_learning_rate_fraction: float = 0.0
    """Where the cosine/linear decay ends, as a fraction of ``learning_rate``."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.999
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon (added to the root of the second moment)."""
    weight_decay: float = 1e-2
    """AdamW's decoupled weight decay."""
    max_grad_norm: float | None = 1.0
    """Clip the gradients' global norm to this (None: no clipping)."""
    accumulation_steps: int = 1
    """Micro-steps whose gradients are averaged into one optimizer update."""

    def __post_init__(self):
        check_choice("schedule", self.schedule, SCHEDULES)
        if not 0 < self.learning_rate < math.inf:
            raise ValueError(f"learning_rate={self.learning_rate} must be a positive number")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ValueError(f"{key}={getattr(self, key)} must be in [0, 1)")
        if not 0.0 < self.eps < math.inf or not 0.0 <= self.weight_decay < math.inf:
            raise ValueError(f"eps={self.eps} must be > 0 and weight_decay={self.weight_decay} >= 0 (finite)")
        if self.max_grad_norm is not None and not 0.0 < self.max_grad_norm < math.inf:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be > 0 (or None: no clipping)")
        if not 0.0 <= self.final_learning_rate_fraction <= 1.0:
            raise ValueError(f"final_learning_rate_fraction={self.final_learning_rate_fraction} must be in [0, 1]")
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps} must be >= 1")
        if self.warmup_steps < 0 or (self.total_steps is not None and self.total_steps < 1):
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {self.warmup_steps}, "
                             f"{self.total_steps}")

    def spanning(self, steps: int) -> "OptimizerConfig":
        """This config with ``total_steps=steps`` where it leaves it to the run (``None``); as it is otherwise."""
        return self if self.total_steps is not None else dataclasses.replace(self, total_steps=steps)

    @property
    def update_steps(self) -> int:
        """Optimizer updates over the run: ``total_steps // accumulation_steps`` (the schedule's length)."""
        if self.total_steps is None:
            raise ValueError("total_steps=None leaves the schedule's length to the run; give it, or use "
                             "config.spanning(steps) (TrainConfig fills in its steps)")
        return max(self.total_steps // self.accumulation_steps, 1)

    def learning_rate_schedule(self) -> optax.Schedule:
        peak, n, warm = self.learning_rate, self.update_steps, min(self.warmup_steps, self.update_steps)
        end = peak * self.final_learning_rate_fraction
        if self.schedule == "constant":
            after = optax.constant_schedule(peak)
        elif self.schedule == "cosine":
            after = optax.cosine_decay_schedule(peak, max(n - warm, 1), alpha=self.final_learning_rate_fraction)
        else:
            after = optax.linear_schedule(peak, end, max(n - warm, 1))
        if warm == 0:
            return after
        return optax.join_schedules([optax.linear_schedule(0.0, peak, warm), after], [warm])


@functools.lru_cache(maxsize=32)
def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """The optax transformation for ``config`` (clip, AdamW, schedule, accumulation). Cached per config: the
    jitted step treats the optimizer as static, so equal configs must give the same object to share a compile."""
    parts = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    parts.append(optax.adamw(config.learning_rate_schedule(), b1=config.beta1, b2=config.beta2, eps=config.eps,
                             weight_decay=config.weight_decay))
    tx = optax.chain(*parts)
    if config.accumulation_steps > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=config.accumulation_steps).gradient_transformation()
    return _Optimizer(tx.init, tx.update, config)


class _Optimizer(eqx.Module):
    """An optax transformation that remembers its config (the schedule for logging, the accumulation count)."""

    init: Any = eqx.field(static=True)
    update: Any = eqx.field(static=True)
    config: OptimizerConfig = eqx.field(static=True)


class TrainState(eqx.Module):
    """Everything a run changes: trainable ``params`` (the model's trainable leaves, ``None`` elsewhere), optimizer
    state, EMA copies of ``params`` (or ``None``), the micro-step counter and the PRNG key."""

    params: Any
    opt_state: Any
    ema: Any
    step: Int[Array, ""]
    key: PRNGKeyArray

    def model(self, frozen, *, use_ema: bool = False):
        """The full model: ``params`` (or their EMA) combined with the frozen half."""
        params = self.ema if use_ema and self.ema is not None else self.params
        return eqx.combine(params, frozen)


def init_state(model, optimizer, *, key: PRNGKeyArray, filter_spec=None, ema: bool = False):
    """``(state, frozen)`` for a fresh run: ``model`` split by ``filter_spec`` (default
    :func:`trainable_filter`), the optimizer initialised on the trainable half."""
    spec = trainable_filter(model) if filter_spec is None else filter_spec
    params, frozen = eqx.partition(model, spec)
    opt_state = optimizer.init(eqx.filter(params, eqx.is_array))
    ema_params = jax.tree.map(jnp.copy, params) if ema else None
    return TrainState(params, opt_state, ema_params, jnp.zeros((), jnp.int32), key), frozen


def ema_decay_at(update: Int[Array, ""], decay: float) -> Array:
    """diffusers' ``EMAModel.get_decay`` (no warmup, ``update_after_step=0``, ``min_decay=0``) at the ``update``-th
    optimizer update (from 1): 0 at the first (the EMA starts as the updated weights), then ``min(decay, (1 + s) /
    (10 + s))`` with ``s = update - 1``."""
    s = update.astype(jnp.float32) - 1.0
    return jnp.where(s <= 0, 0.0, jnp.minimum(decay, (1.0 + s) / (10.0 + s)))


def batch_loss(params, frozen, batch: dict, key, *, scheduler, objective: Objective):
    """The loss of one batch (see the module docstring for the batch layouts): a latent sample, the conditioning
    (the empty prompt's for ``objective.caption_dropout`` of the samples), and the family's denoiser under the
    scheduler's objective, called on what the bundle's :meth:`~eqxdiff.train.TrainModel.training_inputs` makes of
    the noisy latents (the identity, but for Wan 2.2 TI2V's first-frame conditioning)."""
    model = eqx.combine(params, frozen)
    k_latent, k_drop, k_loss = jax.random.split(key, 3)
    latents = jax.lax.stop_gradient(model.latents(batch, k_latent))
    cond = model.condition(batch, k_drop, objective.caption_dropout)
    inputs = functools.partial(model.training_inputs, key=jax.random.fold_in(key, 3))  # its own draws, of the key
    return diffusion_loss(model.denoise, scheduler, objective, latents, cond, k_loss, batch.get(LOSS_WEIGHT),
                          inputs)


@eqx.filter_jit
def train_step(state: TrainState, frozen, batch: dict, *, scheduler, objective: Objective, optimizer,
               ema_decay: float = 0.9999, shardings: TrainState | None = None):
    """One micro-step: loss and gradients of the trainable leaves, an optimizer update (applied every
    ``accumulation_steps`` calls), the EMA update when the optimizer applied one. Returns ``(state, metrics)``
    with ``loss``, ``grad_norm`` and ``learning_rate``.

    ``shardings`` (a :class:`TrainState` of shardings, :func:`eqxdiff.train.state_shardings`): the gradients are
    constrained to the params' shardings and the new state to ``shardings``, so the output state is laid out as
    the input was and the next call runs the same compiled program."""
    key, sub = jax.random.split(state.key)
    diff, static = eqx.partition(state.params, eqx.is_inexact_array)

    def loss_of(d):
        return batch_loss(eqx.combine(d, static), frozen, batch, sub, scheduler=scheduler, objective=objective)

    loss, grads = jax.value_and_grad(loss_of)(diff)
    if shardings is not None:
        grads = jax.lax.with_sharding_constraint(grads, shardings.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, diff)
    new_diff = optax.apply_updates(diff, updates)
    params = eqx.combine(new_diff, static)
    k = optimizer.config.accumulation_steps
    update_count = (state.step + 1) // k  # optimizer updates applied after this micro-step
    ema = state.ema
    if ema is not None:
        applied = (state.step + 1) % k == 0
        decay = jnp.where(applied, ema_decay_at(update_count, ema_decay), 1.0)
        ema = jax.tree.map(lambda e, p: None if e is None else decay * e + (1 - decay) * p, ema, params,
                           is_leaf=lambda x: x is None)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
               "learning_rate": optimizer.config.learning_rate_schedule()(state.step // k)}
    new_state = TrainState(params, opt_state, ema, state.step + 1, key)
    if shardings is not None:
        new_state = jax.lax.with_sharding_constraint(new_state, shardings)
    return new_state, metrics
