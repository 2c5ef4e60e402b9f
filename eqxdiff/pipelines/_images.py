"""Images in and out of pipelines: uint8 <-> [-1, 1] floats, PNG files carrying their generation parameters (read
back with :func:`eqxdiff.pipelines.read_parameters`, which reads MP4 files too)."""

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from PIL import Image, PngImagePlugin

from ..core import program
from ._checks import InputError, InputTypeError


def to_uint8(images) -> np.ndarray:
    """``[-1, 1]`` float images to uint8, rounding as diffusers' ``numpy_to_pil`` does."""
    x = np.clip(np.asarray(images, dtype=np.float32) / 2 + 0.5, 0.0, 1.0)
    return (x * 255).round().astype(np.uint8)


def _unit(images):
    """Whether each ``[-1, 1]`` image is finite (``bool [n]``) and the images in ``[0, 1]``, in float32."""
    x = images.astype(jnp.float32)
    return jnp.isfinite(x).reshape(x.shape[0], -1).all(axis=1), jnp.clip(x / 2 + 0.5, 0.0, 1.0)


@program
def uint8_on_device(images):
    """:func:`to_uint8` where ``images`` lie (the same float32 arithmetic), and whether each image is finite
    (``bool [n]``): a pipeline's output crosses to the host as uint8."""
    finite, x = _unit(images)
    return finite, (x * 255).round().astype(jnp.uint8)


@program
def unit_on_device(images):
    """``[-1, 1]`` images as float32 in ``[0, 1]`` where they lie (diffusers' ``denormalize``, ``(x / 2 +
    0.5).clamp(0, 1)``: its ``output_type="np"`` values), and whether each image is finite (``bool [n]``)."""
    return _unit(images)


def to_pil(pixels: np.ndarray) -> list:
    """uint8 images ``[n, H, W, 3]`` as a list of PIL images, videos ``[n, F, H, W, 3]`` as a list per video of its
    frames (diffusers' ``output_type="pil"``, from ``VaeImageProcessor`` / ``VideoProcessor.postprocess_video``)."""
    if pixels.ndim == 5:
        return [to_pil(video) for video in pixels]
    return [Image.fromarray(image) for image in pixels]


def pil_to_array(images, mode: str = "RGB"):
    """A PIL image or a list of them as one uint8 array ``[n, h, w, c]`` (``[n, h, w]`` for mode ``"L"``),
    converted to ``mode``; anything else is returned as it is."""
    if isinstance(images, Image.Image):
        images = [images]
    if isinstance(images, Sequence) and images and isinstance(images[0], Image.Image):
        return np.stack([np.asarray(im.convert(mode)) for im in images])
    return images


def resize_nearest(arr: np.ndarray, height: int, width: int) -> np.ndarray:
    """Nearest-neighbour resize of ``[n, h, w, c]`` as ``torch.nn.functional.interpolate`` does (diffusers'
    ``VaeImageProcessor.resize`` of array inputs): source index ``floor(i * (in / out))`` with the ratio in float32.
    It only picks pixels, so uint8 and float arrays give the same picture."""

    def index(size_in: int, size_out: int) -> np.ndarray:
        if size_in == size_out:
            return np.arange(size_out)
        ratio = np.float32(size_in) / np.float32(size_out)
        return np.minimum(np.floor(np.arange(size_out, dtype=np.float32) * ratio).astype(np.int64), size_in - 1)

    return arr[:, index(arr.shape[1], height)][:, :, index(arr.shape[2], width)]


def is_picture(x) -> bool:
    """Whether ``x`` is one picture: a PIL image or an array ``[H, W, c]``."""
    return isinstance(x, Image.Image) or (hasattr(x, "shape") and np.ndim(x) == 3)


def video_clips(video) -> list:
    """``video`` as a list of clips, read as diffusers' ``VideoProcessor.preprocess_video`` reads its input: one clip
    (frames ``[F, H, W, 3]``, or a list of pictures), several (an array ``[n, F, H, W, 3]``, or a list of clips);
    ``[]`` for ``None``."""
    if video is None:
        return []
    if hasattr(video, "shape"):
        return [video[i] for i in range(video.shape[0])] if np.ndim(video) == 5 else [video]
    if isinstance(video, (list, tuple)) and video and is_picture(video[0]):
        return [video]
    return list(video)


def clip_frames(clip):
    """A clip's frames as one array ``[F, H, W, 3]`` (a list of PIL images or of frames stacked; an array as it
    is)."""
    if isinstance(clip, (list, tuple)):
        return np.stack([np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f) for f in clip])
    return clip


PICTURE_FORMS = "uint8 [H, W, 3] or [n, H, W, 3], floats in [0, 1], or PIL images"


def pixel_array(images, name: str = "image") -> np.ndarray:
    """Pixel input ``images`` (argument ``name``) as one array ``[n, H, W, 3]``, uint8 or floats in ``[0, 1]``: PIL
    images (converted to RGB), an array ``[H, W, 3]`` / ``[n, H, W, 3]``, or a list of pictures of one size. Anything
    else raises :class:`~eqxdiff.pipelines.InputError` (:class:`~eqxdiff.pipelines.InputTypeError` for a type) naming
    ``name``, what it got and what to pass: a file path, an empty or ragged list, integers other than uint8 (read as
    0-255 or as [0, 1]?), another channel count or layout."""
    if isinstance(images, (str, os.PathLike)):
        raise InputTypeError(f"{name}={os.fspath(images)!r:.80} is a path, not a picture; read it first: "
                             f"{name}=eqxdiff.pipelines.read_image(path) (or pass {PICTURE_FORMS})")
    if isinstance(images, Sequence) and not images:
        raise InputError(f"{name} is an empty list; pass a picture ({PICTURE_FORMS})")
    try:
        arr = np.asarray(pil_to_array(images, "RGB"))
    except (ValueError, TypeError, AttributeError) as e:  # a ragged list, PIL images among arrays
        raise InputError(f"{name} holds pictures of different sizes or kinds ({type(e).__name__}: {e}); pass "
                         f"{PICTURE_FORMS}, all of one size") from None
    if arr.dtype != np.uint8 and not np.issubdtype(arr.dtype, np.floating):
        raise InputTypeError(f"{name} has dtype {arr.dtype}; pass uint8 (0-255), floats in [0, 1] or PIL images "
                             "(eqxdiff does not guess the range of other integers)")
    if arr.ndim not in (3, 4) or arr.shape[-1] != 3 or 0 in arr.shape:
        raise InputError(f"{name} must be [n, height, width, 3] (channels-last RGB), got shape {arr.shape}; pass "
                         f"{PICTURE_FORMS} (grey or RGBA converted to RGB, channels moved last)")
    if arr.dtype != np.uint8 and (arr.min() < 0 or arr.max() > 1):
        raise InputError(f"{name} holds floats outside [0, 1]; pass floats in [0, 1], or uint8 for 0-255 images")
    return arr[None] if arr.ndim == 3 else arr


def to_model_range(images, name: str = "image") -> jnp.ndarray:
    """uint8 ``[n, h, w, 3]`` images, PIL images, or floats in ``[0, 1]`` as float32 in ``[-1, 1]``
    (:func:`pixel_array`)."""
    arr = pixel_array(images, name)
    if arr.dtype == np.uint8:
        arr = arr.astype(np.float32) / 255.0
    return jnp.asarray(arr * 2.0 - 1.0, dtype=jnp.float32)


def next_index(folder: str | os.PathLike, prefix: str, suffix: str) -> int:
    """One past the highest ``i`` of the ``{prefix}_{i}{suffix}`` files in ``folder`` (0 if there are none)."""
    pattern = re.compile(rf"{re.escape(prefix)}_(\d+){re.escape(suffix)}")
    found = [int(m.group(1)) for p in Path(folder).glob(f"{prefix}_*{suffix}") if (m := pattern.fullmatch(p.name))]
    return max(found, default=-1) + 1


def output_folder(folder: str | os.PathLike) -> Path:
    """``folder`` created if needed; a file in its place raises ``ValueError`` (check it before a long run)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"output folder {os.fspath(folder)!r} is a file; pass a folder (it is created if missing)")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def save_images(images: np.ndarray, folder: str | os.PathLike, parameters: Mapping, *, prefix: str = "image",
                overwrite: bool = False) -> list[Path]:
    """Save uint8 ``[n, h, w, 3]`` images as ``{prefix}_{i}.png`` with ``parameters`` in the PNG text chunks.

    Numbering goes on after the last ``{prefix}_{i}.png`` already in ``folder``; ``overwrite`` numbers from 0,
    replacing earlier files. Each parameter is one text entry, and all of them together (plus ``index``, the image's
    place in the batch) are a JSON entry ``eqxdiff`` that :func:`read_parameters` reads back.
    """
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
        raise ValueError(f"images must be uint8 [n, height, width, 3], got {images.dtype} {images.shape}")
    folder = output_folder(folder)
    start = 0 if overwrite else next_index(folder, prefix, ".png")
    paths = []
    for i, im in enumerate(images):
        info = PngImagePlugin.PngInfo()
        meta = {**parameters, "index": i}
        for k, v in meta.items():
            info.add_text(str(k), str(v))
        info.add_text("eqxdiff", json.dumps(meta, default=str))
        path = folder / f"{prefix}_{start + i}.png"
        Image.fromarray(im).save(path, pnginfo=info)
        paths.append(path)
    return paths
