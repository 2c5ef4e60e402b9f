"""Images in and out of pipelines: uint8 <-> [-1, 1] floats, PNG files carrying their generation parameters."""

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from PIL import Image, PngImagePlugin


def to_uint8(images) -> np.ndarray:
    """``[-1, 1]`` float images to uint8, rounding as diffusers' ``numpy_to_pil`` does."""
    x = np.clip(np.asarray(images, dtype=np.float32) / 2 + 0.5, 0.0, 1.0)
    return (x * 255).round().astype(np.uint8)


def to_model_range(images) -> jnp.ndarray:
    """uint8 ``[n, h, w, 3]`` images, PIL images, or floats in ``[0, 1]`` as float32 in ``[-1, 1]``."""
    if isinstance(images, Image.Image):
        images = [images]
    if isinstance(images, Sequence) and images and isinstance(images[0], Image.Image):
        images = np.stack([np.asarray(im.convert("RGB")) for im in images])
    arr = np.asarray(images)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"image must be [n, height, width, 3] (channels-last RGB), got shape {arr.shape}")
    if arr.dtype == np.uint8:
        arr = arr.astype(np.float32) / 255.0
    elif arr.min() < 0 or arr.max() > 1:
        raise ValueError("float images must lie in [0, 1]; pass uint8 for 0-255 images")
    return jnp.asarray(arr * 2.0 - 1.0, dtype=jnp.float32)


def save_images(images: np.ndarray, folder: str | os.PathLike, parameters: Mapping, *,
                prefix: str = "image") -> list[Path]:
    """Save uint8 ``[n, h, w, 3]`` images as ``{prefix}_{i}.png`` with ``parameters`` in the PNG text chunks.

    Each parameter is one text entry, and all of them together are a JSON entry ``eqxdiff``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, im in enumerate(np.asarray(images)):
        info = PngImagePlugin.PngInfo()
        meta = {**parameters, "index": i}
        for k, v in meta.items():
            info.add_text(str(k), str(v))
        info.add_text("eqxdiff", json.dumps(meta, default=str))
        path = folder / f"{prefix}_{i}.png"
        Image.fromarray(im).save(path, pnginfo=info)
        paths.append(path)
    return paths


def read_parameters(path: str | os.PathLike) -> dict:
    """The generation parameters :func:`save_images` stored in a PNG."""
    with Image.open(path) as im:
        return json.loads(im.text["eqxdiff"])
