"""Training data checks that fail before training starts, and caching of VAE latents and text embeddings: an
in-memory dataset in memory (:func:`cache_arrays`), a stream to ``.npy`` files read back as memory maps
(:func:`cache_stream`). Cached arrays are served by :class:`eqxdiff.data.ArrayBatches` (shuffled batches whose
position is their whole state: exact resume)."""

import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..data import DataError  # one error class for bad data, raised by every source and check
from ._family import CACHED_LATENTS, TrainModel, encode_batch
from ._sd import LatentDiffusion


def check_batch(batch: Mapping[str, np.ndarray], *, where: str = "batch",
                model: TrainModel | type[TrainModel] | None = None) -> None:
    """Raise :class:`DataError` unless ``batch`` is a training batch of ``model``'s family (a bundle or its class;
    default: Stable Diffusion's): ``pixel_values`` float ``[b, h, w, 3]`` in ``[-1, 1]`` and int ``[b, seq]`` token
    ids per text encoder (``input_ids``, ``input_ids_2``), or the cached ``latent_mean``/``latent_std`` and text encoder outputs;
    with the per-image facts the family conditions on (``IMAGE_KEYS``: int pairs ``[b, 2]``); all with the same
    nonzero ``b``."""
    family = LatentDiffusion if model is None else model if isinstance(model, type) else type(model)
    keys = family.batch_keys(cached=CACHED_LATENTS[0] in batch)
    missing = [k for k in keys if k not in batch]
    if missing:
        raise DataError(f"{where} lacks {missing}; a {family.__name__} batch holds {list(keys)} (got keys "
                        f"{sorted(batch)})")
    sizes = {k: int(np.shape(batch[k])[0]) if np.ndim(batch[k]) else 0 for k in keys}
    if len(set(sizes.values())) != 1 or 0 in sizes.values():
        raise DataError(f"{where} is empty or its arrays disagree on the batch size: {sizes}")
    for k in family.IMAGE_KEYS:
        if np.ndim(batch[k]) != 2 or np.shape(batch[k])[1] != 2:
            raise DataError(f"{where}: {k} must be [batch, 2] (a pair per image), got {np.shape(batch[k])}")
    if "pixel_values" in batch:
        px = np.asarray(batch["pixel_values"])
        if px.ndim not in (4, 5) or px.shape[-1] != 3:
            raise DataError(f"{where}: pixel_values must be [batch, height, width, 3] (channels-last; videos [batch, "
                            f"frames, height, width, 3]), got {px.shape}")
        if not np.issubdtype(px.dtype, np.floating) or px.min() < -1.0 - 1e-3 or px.max() > 1.0 + 1e-3:
            raise DataError(f"{where}: pixel_values must be floats in [-1, 1], got {px.dtype} in "
                            f"[{px.min()}, {px.max()}]")
        for t in family.TEXT:
            ids = np.asarray(batch[t.key])
            if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
                raise DataError(f"{where}: {t.key} must be integer [batch, seq], got {ids.dtype} {ids.shape}")


def _encoded(model: TrainModel, batch: Mapping[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """:func:`encode_batch` of a host batch padded to ``size`` rows (one compiled shape), the padding cut off."""
    n = len(batch["pixel_values"])
    inputs = {k: batch[k] for k in model.batch_keys(cached=False)}
    if n < size:
        inputs = {k: np.concatenate([v, np.repeat(v[-1:], size - n, 0)]) for k, v in inputs.items()}
    out = jax.device_get(encode_batch(model, {k: jnp.asarray(v) for k, v in inputs.items()}))
    return {k: np.asarray(v[:n]) for k, v in out.items()}


def cache_arrays(model: TrainModel, arrays: Mapping[str, np.ndarray], *, batch_size: int = 256,
                 log: Callable = print) -> dict[str, np.ndarray]:
    """Encode a whole in-memory dataset once: ``pixel_values`` -> the VAE posterior's ``latent_mean``/
    ``latent_std`` (training still samples a fresh latent each step) and the token ids -> the text encoders'
    outputs (``encoder_hidden_states``, and the pooled embedding of families with one); per-image conditioning is
    kept. Only valid while the VAE and the text encoders are frozen."""
    check_batch(arrays, where="dataset", model=model)
    n = len(arrays["pixel_values"])
    size = min(batch_size, n)
    parts = [_encoded(model, {k: v[i:i + size] for k, v in arrays.items()}, size) for i in range(0, n, size)]
    log(f"cached latents and text embeddings of {n} samples")
    return {k: np.concatenate([p[k] for p in parts]) for k in model.batch_keys(cached=True)}


def cache_stream(model: TrainModel, batches: Iterable[Mapping[str, np.ndarray]], folder, *, size: int,
                 fingerprint: Mapping, log: Callable = print) -> dict[str, np.ndarray]:
    """Encode one pass of a stream (``size`` samples in ``batches``, e.g. one unshuffled epoch of
    :func:`eqxdiff.data.make_dataset`: its random crops and flips drawn once) into ``.npy`` files in ``folder``,
    and return them as read-only memory maps (``{key: array}``, the keys of ``model.batch_keys(cached=True)``), so
    a dataset larger than memory trains from the page cache.

    ``fingerprint`` (JSON-able: the model, the data settings) is written beside them: a later call with the same
    fingerprint (a resumed run) reads the files instead of encoding again; another fingerprint, or an unfinished
    cache, is encoded again. Only valid while the VAE and the text encoders are frozen."""
    folder = Path(folder)
    meta = folder / "cache.json"
    want = json.loads(json.dumps({"fingerprint": dict(fingerprint), "size": size, "complete": True}, default=str))
    keys = model.batch_keys(cached=True)
    if meta.is_file() and json.loads(meta.read_text()) == want and all((folder / f"{k}.npy").is_file()
                                                                       for k in keys):
        log(f"cache: reusing the {size} encoded samples in {folder}")
        return {k: np.load(folder / f"{k}.npy", mmap_mode="r") for k in keys}
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    files, at, batch_size = {}, 0, None
    for batch in batches:
        if at == 0:
            check_batch(batch, where="the first batch to cache", model=model)
            batch_size = len(batch["pixel_values"])
        out = _encoded(model, batch, batch_size)
        n = len(out[keys[0]])
        if at + n > size:
            raise DataError(f"the stream to cache gave more than the {size} samples expected")
        for k in keys:
            if k not in files:
                files[k] = np.lib.format.open_memmap(folder / f"{k}.npy", mode="w+", dtype=out[k].dtype,
                                                     shape=(size, *out[k].shape[1:]))
            files[k][at:at + n] = out[k]
        at += n
    if at != size:
        raise DataError(f"the stream to cache gave {at} samples, {size} expected")
    for f in files.values():
        f.flush()
    del files
    meta.write_text(json.dumps(want, indent=2))
    log(f"cache: encoded latents and text embeddings of {size} samples into {folder}")
    return {k: np.load(folder / f"{k}.npy", mmap_mode="r") for k in keys}
