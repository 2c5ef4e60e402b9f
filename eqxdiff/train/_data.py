"""In-memory datasets for training: checks that fail before training starts, and caching of VAE latents and text
embeddings (the shuffled batches whose position is their whole state are :class:`eqxdiff.data.ArrayBatches`)."""

from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..data import DataError  # one error class for bad data, raised by every source and check


def check_batch(batch: Mapping[str, np.ndarray], *, where: str = "batch") -> None:
    """Raise :class:`DataError` unless ``batch`` is a text-to-image batch: ``pixel_values`` float ``[b, h, w, 3]``
    in ``[-1, 1]`` and ``input_ids`` int ``[b, seq]`` (or the cached ``latent_mean``/``latent_std``/
    ``encoder_hidden_states``), all with the same nonzero ``b``."""
    if "latent_mean" in batch:
        keys = ("latent_mean", "latent_std", "encoder_hidden_states")
    else:
        keys = ("pixel_values", "input_ids")
    missing = [k for k in keys if k not in batch]
    if missing:
        raise DataError(f"{where} lacks {missing}; a batch holds {list(keys)} (got keys {sorted(batch)})")
    sizes = {k: int(np.shape(batch[k])[0]) if np.ndim(batch[k]) else 0 for k in keys}
    if len(set(sizes.values())) != 1 or 0 in sizes.values():
        raise DataError(f"{where} is empty or its arrays disagree on the batch size: {sizes}")
    if "pixel_values" in batch:
        px = np.asarray(batch["pixel_values"])
        if px.ndim != 4 or px.shape[-1] != 3:
            raise DataError(f"{where}: pixel_values must be [batch, height, width, 3] (channels-last), got {px.shape}")
        if not np.issubdtype(px.dtype, np.floating) or px.min() < -1.0 - 1e-3 or px.max() > 1.0 + 1e-3:
            raise DataError(f"{where}: pixel_values must be floats in [-1, 1], got {px.dtype} in "
                            f"[{px.min()}, {px.max()}]")
        ids = np.asarray(batch["input_ids"])
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise DataError(f"{where}: input_ids must be integer [batch, seq], got {ids.dtype} {ids.shape}")


def cache_arrays(model, arrays: Mapping[str, np.ndarray], *, batch_size: int = 256,
                 log: Callable = print) -> dict[str, np.ndarray]:
    """Encode a whole dataset once: ``pixel_values`` -> the VAE posterior's ``latent_mean``/``latent_std``
    (training still samples a fresh latent each step) and ``input_ids`` -> ``encoder_hidden_states``. Only valid
    while the VAE and the text encoder are frozen."""
    check_batch(arrays, where="dataset")

    @eqx.filter_jit
    def encode(m, px, ids):
        dist = m.vae.encode(px)
        return dist.mean, dist.std, m.encode_text(ids)

    n = len(arrays["pixel_values"])
    parts = []
    for i in range(0, n, batch_size):
        px = arrays["pixel_values"][i:i + batch_size]
        ids = arrays["input_ids"][i:i + batch_size]
        pad = batch_size - len(px) if n > batch_size else 0  # one compiled shape
        if pad:
            px = np.concatenate([px, np.repeat(px[-1:], pad, 0)])
            ids = np.concatenate([ids, np.repeat(ids[-1:], pad, 0)])
        out = jax.device_get(encode(model, jnp.asarray(px), jnp.asarray(ids)))
        parts.append([o[:len(o) - pad] for o in out])
    log(f"cached latents and text embeddings of {n} samples")
    keys = ("latent_mean", "latent_std", "encoder_hidden_states")
    return {k: np.concatenate([p[j] for p in parts]) for j, k in enumerate(keys)}
