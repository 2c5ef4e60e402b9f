"""The train state and the pure, jitted train step.

>>> model = LatentDiffusion(unet=unet, text_encoder=text_encoder, vae=vae, null_input_ids=tokenize([""])[0])
>>> optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-4, warmup_steps=500, total_steps=10_000))
>>> state, frozen = init_state(model, optimizer, key=jax.random.key(0), ema_decay=0.999)
>>> state, metrics = train_step(state, frozen, batch, scheduler=scheduler, objective=Objective(),
...                             optimizer=optimizer)

Only the leaves that ``trainable_filter`` marks (by default the UNet's arrays) are in ``state.params`` and get
gradients and optimizer state; everything else (VAE, text encoder, the unconditional prompt) rides in ``frozen``,
which the step never changes. A batch holds either ``pixel_values`` + ``input_ids`` (encoded each step) or the
cached ``latent_mean`` + ``latent_std`` + ``encoder_hidden_states`` (see :func:`eqxdiff.train.cache_arrays`).
"""

import dataclasses
import functools
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from .._typing import Array, Int, PRNGKeyArray
from ._objectives import Objective, diffusion_loss

SCHEDULES = ("constant", "cosine", "linear")


class LatentDiffusion(eqx.Module):
    """What a text-to-image train step needs: the denoiser, the text encoder, the VAE, and the token ids of the
    empty prompt (caption dropout swaps them in, so the model learns the unconditional branch of guidance)."""

    unet: Any
    text_encoder: Any
    vae: Any
    null_input_ids: Int[Array, " seq"]

    PARAM_AXES: ClassVar = {"null_input_ids": (None,)}  # token ids: replicated

    def encode_text(self, input_ids):
        return self.text_encoder(input_ids).last_hidden_state


def trainable_filter(model: LatentDiffusion, *, train_text_encoder: bool = False, train_vae: bool = False):
    """A filter spec (same structure, bools at the leaves): the UNet's arrays, plus the text encoder's/VAE's if
    asked. ``eqx.partition(model, spec)`` splits the model into trainable and frozen halves."""
    spec = jax.tree.map(lambda _: False, model)
    arrays = lambda m: jax.tree.map(eqx.is_inexact_array, m)  # noqa: E731
    spec = eqx.tree_at(lambda m: m.unet, spec, arrays(model.unet))
    if train_text_encoder:
        spec = eqx.tree_at(lambda m: m.text_encoder, spec, arrays(model.text_encoder))
    if train_vae:
        spec = eqx.tree_at(lambda m: m.vae, spec, arrays(model.vae))
    return spec


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then a ``cosine``/``linear``/``constant`` schedule, global-norm clipping and
    gradient accumulation (``optax.MultiSteps``: one optimizer update per ``accumulation_steps`` micro-steps)."""

    learning_rate: float = 1e-4
    warmup_steps: int = 0
    total_steps: int = 10_000
    schedule: str = "cosine"
    final_learning_rate_fraction: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float | None = 1.0
    accumulation_steps: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r}; choose one of {list(SCHEDULES)}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate={self.learning_rate} must be positive")
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={self.accumulation_steps} must be >= 1")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {self.warmup_steps}, "
                             f"{self.total_steps}")

    @property
    def update_steps(self) -> int:
        """Optimizer updates over the run: ``total_steps // accumulation_steps`` (the schedule's length)."""
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
    """diffusers' ``EMAModel`` decay without warmup: ``min(decay, (1 + n) / (10 + n))`` after ``n`` updates."""
    n = update.astype(jnp.float32)
    return jnp.minimum(decay, (1.0 + n) / (10.0 + n))


def batch_loss(params, frozen, batch: dict, key, *, scheduler, objective: Objective):
    """The loss of one batch (see the module docstring for the two batch layouts)."""
    model = eqx.combine(params, frozen)
    k_latent, k_drop, k_loss = jax.random.split(key, 3)
    if "latent_mean" in batch:
        mean, std = batch["latent_mean"], batch["latent_std"]
        latents = model.vae.scale_latents(mean + std * jax.random.normal(k_latent, mean.shape, mean.dtype))
    else:
        dist = model.vae.encode(batch["pixel_values"])
        latents = model.vae.scale_latents(dist.sample(key=k_latent))
    latents = jax.lax.stop_gradient(latents)
    b = latents.shape[0]
    if "encoder_hidden_states" in batch:
        context = batch["encoder_hidden_states"]
        if objective.caption_dropout > 0:
            null = model.encode_text(model.null_input_ids[None])
            drop = jax.random.bernoulli(k_drop, objective.caption_dropout, (b, 1, 1))
            context = jnp.where(drop, null.astype(context.dtype), context)
    else:
        ids = batch["input_ids"]
        if objective.caption_dropout > 0:
            drop = jax.random.bernoulli(k_drop, objective.caption_dropout, (b, 1))
            ids = jnp.where(drop, model.null_input_ids[None], ids)
        context = model.encode_text(ids)
    return diffusion_loss(model.unet, scheduler, objective, latents, context, k_loss)


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
