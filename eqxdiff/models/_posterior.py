"""The posterior every VAE's ``encode`` returns (image and video VAEs alike): ``N(mean, exp(logvar))`` per latent
element, diffusers' ``DiagonalGaussianDistribution``."""

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, PRNGKeyArray


class DiagonalGaussian(eqx.Module):
    """The posterior ``N(mean, exp(logvar))`` per latent element, as diffusers' ``DiagonalGaussianDistribution``:
    image latents ``[batch, height, width, latent]`` or video latents ``[batch, frames, height, width, latent]``."""

    mean: Float[Array, "batch *spatial latent"]
    logvar: Float[Array, "batch *spatial latent"]

    @classmethod
    def from_moments(cls, moments: Float[Array, "batch *spatial channels"]) -> "DiagonalGaussian":
        """Split ``[mean, logvar]`` along channels; ``logvar`` is clipped to ``[-30, 20]`` as in diffusers."""
        mean, logvar = jnp.split(moments, 2, axis=-1)
        return cls(mean, jnp.clip(logvar, -30.0, 20.0))

    @property
    def std(self) -> Array:
        """``exp(logvar / 2)``: what the train stack caches beside :attr:`mean` (``latent_std``)."""
        return jnp.exp(0.5 * self.logvar)

    @property
    def var(self) -> Array:
        return jnp.exp(self.logvar)

    def sample(self, *, key: PRNGKeyArray) -> Float[Array, "batch *spatial latent"]:
        return self.mean + self.std * jax.random.normal(key, self.mean.shape, self.mean.dtype)

    def mode(self) -> Float[Array, "batch *spatial latent"]:
        return self.mean

    def kl(self, other: "DiagonalGaussian | None" = None) -> Float[Array, " batch"]:
        """KL(self || other) summed over each sample (image or video); ``other=None`` is the standard normal."""
        if other is None:
            terms = jnp.square(self.mean) + self.var - 1.0 - self.logvar
        else:
            terms = (jnp.square(self.mean - other.mean) / other.var + self.var / other.var - 1.0 - self.logvar
                     + other.logvar)
        return 0.5 * jnp.sum(terms, axis=tuple(range(1, terms.ndim)))
