"""Video in and out of pipelines, and what a generated file says about how it was made.

Videos are MP4 (H.264, yuv420p) written through ``imageio-ffmpeg``'s bundled ffmpeg, with the generation parameters
as a JSON ``comment`` tag; :func:`read_parameters` reads them back from MP4 and PNG files alike. :func:`save_outputs`
saves what a pipeline returned: uint8 images ``[n, H, W, 3]`` as PNGs, frames ``[n, F, H, W, 3]`` as MP4s.
"""

import json
import math
import numbers
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..core import FFMPEG_AS_STORED, gif_frames, imageio_ffmpeg
from ._checks import InputError
from ._images import next_index, output_folder, save_images

DEFAULT_FPS = 16


def _ffmpeg():
    """``imageio_ffmpeg``, imported when a video is first written or read (``import eqxdiff.pipelines`` works
    without it: a machine that only makes images)."""
    return imageio_ffmpeg()


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_video(frames: np.ndarray, path: str | os.PathLike, *, fps: float = DEFAULT_FPS,
                parameters: Mapping | None = None, quality: float = 5) -> Path:
    """Write uint8 frames ``[F, H, W, 3]`` to an MP4 file with ``parameters`` as its JSON ``comment`` tag.

    ``quality`` is imageio-ffmpeg's 0-10 scale (diffusers' ``export_to_video`` uses 5). Frame sizes are kept
    exactly when even; an odd height or width is scaled up by one pixel (H.264 in yuv420p needs even sizes).
    """
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [frames, height, width, 3], got {frames.dtype} {frames.shape}")
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps={fps!r} must be a positive number of frames per second (16, 24 and 25 are "
                         "usual)")
    path = Path(path)
    extra = [] if parameters is None else ["-metadata", f"comment={json.dumps(dict(parameters), default=str)}"]
    height, width = frames.shape[1:3]
    writer = _ffmpeg().write_frames(os.fspath(path), (width, height), fps=fps, quality=quality,
                                         macro_block_size=2, output_params=extra)
    writer.send(None)  # start ffmpeg
    try:
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
    finally:
        writer.close()
    return path


def read_video(path: str | os.PathLike) -> np.ndarray:
    """The frames of a video file as uint8 ``[F, H, W, 3]`` (any format the bundled ffmpeg reads), each frame once
    as stored (a variable-frame-rate clip is not resampled to a constant rate; a GIF read with Pillow, every frame)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"video file {os.fspath(path)!r} not found")
    if os.fspath(path).lower().endswith(".gif"):  # ffmpeg reads a GIF without frame delays as one frame
        return np.stack(list(gif_frames(os.fspath(path))))
    reader = _ffmpeg().read_frames(os.fspath(path), output_params=list(FFMPEG_AS_STORED))
    meta = next(reader)
    width, height = meta["size"]
    frames = [np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader]
    return np.stack(frames) if frames else np.zeros((0, height, width, 3), np.uint8)


def video_fps(path: str | os.PathLike) -> float | None:
    """The frame rate a video file says it plays at (its container's, as ffmpeg reports it), ``None`` if it says
    none; the frames are not decoded."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"video file {os.fspath(path)!r} not found")
    reader = _ffmpeg().read_frames(os.fspath(path), output_params=list(FFMPEG_AS_STORED))
    try:
        fps = next(reader).get("fps")
    finally:
        reader.close()
    return float(fps) if isinstance(fps, numbers.Real) and math.isfinite(fps) and fps > 0 else None


def read_image(path: str | os.PathLike) -> np.ndarray:
    """An image file as uint8 RGB ``[H, W, 3]``; a missing file raises ``FileNotFoundError``, one PIL cannot read
    :class:`~eqxdiff.pipelines.InputError`, each naming the file."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"image file {os.fspath(path)!r} not found")
    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB"))
    except (UnidentifiedImageError, OSError, SyntaxError) as e:  # PIL raises all three for damaged files
        raise InputError(f"{os.fspath(path)!r} is not an image file Pillow can read ({type(e).__name__}); pass a "
                         "PNG, JPEG or WebP image") from None


def save_videos(videos: np.ndarray, folder: str | os.PathLike, parameters: Mapping, *, fps: float | None = None,
                prefix: str = "video", overwrite: bool = False) -> list[Path]:
    """Save uint8 ``[n, F, H, W, 3]`` videos as ``{prefix}_{i}.mp4`` at ``fps`` frames per second (default 16),
    numbered on after the files already in ``folder`` (from 0 with ``overwrite``), each with ``parameters`` plus its
    ``index`` in the batch and ``fps``."""
    fps = DEFAULT_FPS if fps is None else fps
    videos = np.asarray(videos)
    if videos.ndim != 5:
        raise ValueError(f"videos must be uint8 [n, frames, height, width, 3], got shape {videos.shape}")
    folder = output_folder(folder)
    start = 0 if overwrite else next_index(folder, prefix, ".mp4")
    return [write_video(v, folder / f"{prefix}_{start + i}.mp4", fps=fps,
                        parameters={**parameters, "fps": fps, "index": i}) for i, v in enumerate(videos)]


def save_outputs(outputs: np.ndarray, folder: str | os.PathLike, parameters: Mapping, *, fps: float | None = None,
                 overwrite: bool = False) -> list[Path]:
    """What a pipeline returned, saved with its generation parameters: images ``[n, H, W, 3]`` as
    ``image_{i}.png`` (:func:`save_images`), frames ``[n, F, H, W, 3]`` as ``video_{i}.mp4`` (:func:`save_videos`)."""
    outputs = np.asarray(outputs)
    if outputs.ndim == 4:
        return save_images(outputs, folder, parameters, overwrite=overwrite)
    if outputs.ndim == 5:
        return save_videos(outputs, folder, parameters, fps=fps, overwrite=overwrite)
    raise ValueError(f"expected images [n, height, width, 3] or videos [n, frames, height, width, 3], got shape "
                     f"{outputs.shape}")


def _unescape_ffmetadata(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value, flags=re.DOTALL)


def read_parameters(path: str | os.PathLike) -> dict:
    """The generation parameters stored in a PNG (:func:`save_images`) or an MP4 (:func:`save_videos`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{os.fspath(path)!r} not found")
    with open(path, "rb") as f:
        is_png = f.read(len(_PNG_SIGNATURE)) == _PNG_SIGNATURE
    if is_png:
        with Image.open(path) as im:
            text = im.text.get("eqxdiff")
    else:
        out = subprocess.run([_ffmpeg().get_ffmpeg_exe(), "-v", "error", "-i", os.fspath(path), "-f",
                              "ffmetadata", "-"], capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise ValueError(f"ffmpeg cannot read {os.fspath(path)!r}: {out.stderr.strip()}")
        text = next((_unescape_ffmetadata(line[len("comment="):]) for line in out.stdout.splitlines()
                     if line.startswith("comment=")), None)
    if text is None:
        raise ValueError(f"{os.fspath(path)!r} holds no eqxdiff generation parameters")
    return json.loads(text)
