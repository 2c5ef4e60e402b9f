"""A short autoencoder stage for models trained from scratch (the digits model): reconstruction MSE plus a small
KL term, then the latent ``scaling_factor`` that gives the diffusion model unit-variance latents."""

import contextlib
import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from .._typing import Array, Float, PRNGKeyArray
from ..nn import build_abstract
from ._interrupt import TrainingInterrupted, stop_on_signals


def vae_loss(vae, images: Float[Array, "batch height width 3"], key: PRNGKeyArray, *,
             kl_weight: float = 1e-4) -> Float[Array, ""]:
    """``mean((decode(z) - x)^2) + kl_weight * KL(q(z|x) || N(0, 1)) / latent elements``, ``z ~ q(z|x)``."""
    dist = vae.encode(images)
    recon = vae.decode(dist.sample(key=key))
    per_latent = dist.kl() / np.prod(dist.mean.shape[1:])
    return jnp.mean(jnp.square(recon - images)) + kl_weight * jnp.mean(per_latent)


@eqx.filter_jit
def _vae_step(carry, images, key, optimizer, kl_weight):
    vae, opt_state = carry
    loss, grads = eqx.filter_value_and_grad(vae_loss)(vae, images, key, kl_weight=kl_weight)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(vae, eqx.is_array))
    return (eqx.apply_updates(vae, updates), opt_state), loss


def train_autoencoder(vae, batches, *, steps: int, key: PRNGKeyArray, learning_rate: float = 1e-3,
                      kl_weight: float = 1e-4, log_every: int = 100, log=print, progress: bool = False):
    """Train ``vae`` on ``batches`` (dicts with ``pixel_values``) for ``steps`` steps of AdamW with cosine decay;
    returns ``(vae, losses)``. ``progress``: show a progress bar named ``autoencoder stage``.

    Ctrl-C (SIGINT) or SIGTERM stop it at the next step boundary with :class:`eqxdiff.train.TrainingInterrupted`
    (no checkpoint: the stage keeps nothing, and a run started again trains it from the start); a second Ctrl-C
    aborts at once."""
    if steps < 1:
        raise ValueError(f"autoencoder steps={steps} must be >= 1")
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(optax.warmup_cosine_decay_schedule(0.0, learning_rate, min(100, steps // 2),
                                                                           steps, learning_rate * 0.05)))
    carry = (vae, optimizer.init(eqx.filter(vae, eqx.is_array)))
    losses = []
    bar = tqdm(total=steps, desc="autoencoder stage", dynamic_ncols=True) if progress else None
    with stop_on_signals(notice="stopping the autoencoder stage after this step; it keeps nothing (Ctrl-C "
                                 "again aborts at once)") as stop, bar or contextlib.nullcontext():
        for i, k in zip(range(steps), jax.random.split(key, steps)):
            carry, loss = _vae_step(carry, jnp.asarray(next(batches)["pixel_values"]), k, optimizer, kl_weight)
            if (i + 1) % log_every == 0 or i + 1 == steps:
                losses.append(float(loss))
                log(f"autoencoder step {i + 1}/{steps}: loss {losses[-1]:.5f}")
            if bar is not None:
                bar.update(1)
                if (i + 1) % log_every == 0:
                    bar.set_postfix(loss=f"{losses[-1]:.5f}")
            if stop.requested is not None and i + 1 < steps:
                raise TrainingInterrupted(i + 1, None, f"autoencoder stage interrupted at step {i + 1} of {steps}; "
                                          "nothing of it was kept (run the same command to train it again from "
                                          "the start)")
    return carry[0], losses


def with_config(module, **changes):
    """``module`` rebuilt with ``dataclasses.replace(module.config, **changes)``, same weights (the config is a
    static field, so it cannot be swapped with ``eqx.tree_at``)."""
    config = dataclasses.replace(module.config, **changes)
    skeleton = build_abstract(type(module), config, key=jax.random.key(0))
    return jax.tree.unflatten(jax.tree.structure(skeleton), jax.tree.leaves(module))


def fit_scaling_factor(vae, images: Float[Array, "n height width 3"], *, key: PRNGKeyArray, batch_size: int = 256):
    """``vae`` with ``scaling_factor = 1 / std`` of posterior samples of ``images`` (latent-diffusion's recipe)."""
    encode = eqx.filter_jit(lambda v, x, k: v.encode(x).sample(key=k))
    samples = [np.asarray(encode(vae, jnp.asarray(images[i:i + batch_size]), k))
               for i, k in zip(range(0, len(images), batch_size), jax.random.split(key, len(images)))]
    std = float(np.concatenate(samples).std())
    return with_config(vae, scaling_factor=1.0 / std, shift_factor=None)
