"""Local video folders with captions: clips (mp4, webm, gif, mov, mkv, avi) read with ``imageio-ffmpeg``.

The folder is laid out as an image folder (:class:`~eqxdiff.data.ImageFolderSource`): a ``metadata.jsonl`` (or
``metadata.csv``) with ``file_name`` and a caption column, or a ``.txt`` caption beside each clip. Each clip gives
the frames a :class:`FrameSampling` picks (``count`` frames, every ``stride``-th, from frame ``start``), resized to
cover the training size, cropped at one place for all frames and flipped as one (:class:`VideoCaptionTransform`),
``float32 [count, height, width, 3]`` in [-1, 1] under ``pixel_values``.

Why ``imageio-ffmpeg``: it is a thin, well-kept binding over a bundled ffmpeg binary that eqxdiff already uses to
write MP4 (:func:`eqxdiff.pipelines.write_video`), it reads every container ffmpeg reads, and it decodes frames
as they stream out of one subprocess (a clip is read only up to its last sampled frame); PyAV would be a second,
compiled dependency for the same job. GIFs alone are read with Pillow (:func:`eqxdiff.core.gif_frames`): ffmpeg
times a GIF's frames by their delays and read one written without any (GIF87a, Pillow's default) as a single frame.
"""

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..core import FFMPEG_AS_STORED, ffmpeg_problem, gif_frame_count, gif_frames, imageio_ffmpeg
from ._common import (
    IMAGE_EXTENSIONS,
    DataError,
    check_level,
    check_no_columns,
    files_below,
    raise_problems,
    with_txt_captions,
)
from ._folder import ImageFolderSource
from ._transforms import (
    ImageCaptionTransform,
    _size,
    crop_corner,
    resize_to_cover,
    to_unit_range,
)


def _ffmpeg():
    """``imageio_ffmpeg``, imported when a clip is first read (``import eqxdiff.data`` works without it)."""
    return imageio_ffmpeg(DataError)


VIDEO_EXTENSIONS = (".mp4", ".webm", ".gif", ".mov", ".mkv", ".avi", ".m4v")


@dataclasses.dataclass(frozen=True)
class FrameSampling:
    """Which frames of a clip train: ``count`` frames, every ``stride``-th, from frame ``start`` (0-based), i.e.
    frames ``start, start + stride, ..., start + (count - 1) * stride``. Wan and LTX-Video take ``4k + 1`` frames
    (their VAEs compress time by 4 after the first frame): 81 at Wan's 16 fps is five seconds."""

    count: int = 81
    """Frames per clip (the video latents then hold ``(count - 1) / 4 + 1`` frames in Wan's VAE)."""
    stride: int = 1
    """Take every this-many-th frame (2: half the clip's frame rate)."""
    start: int = 0
    """The first frame taken (0-based)."""

    def __post_init__(self):
        for key, least in (("count", 1), ("stride", 1), ("start", 0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"frames.{key}={value!r} must be an int >= {least}")

    @property
    def needed(self) -> int:
        """How many frames a clip must have: one past the last frame taken."""
        return self.start + (self.count - 1) * self.stride + 1

    def indices(self) -> np.ndarray:
        return np.arange(self.start, self.needed, self.stride)


def read_frames(path, frames: FrameSampling = FrameSampling()) -> np.ndarray:
    """The frames ``frames`` picks of the clip at ``path``: uint8 ``[frames.count, height, width, 3]``. Decoding stops
    after the last frame taken. A missing, unreadable or too short clip raises :class:`DataError` naming the file
    (and, for a short one, its length and what would fit)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"video file {path} not found")
    wanted = set(frames.indices().tolist())
    taken, seen = [], 0
    try:
        clip = _clip_frames(path)
        try:
            for seen, frame in enumerate(clip, 1):
                if seen - 1 in wanted:
                    taken.append(frame)
                if seen >= frames.needed:
                    break
        finally:
            clip.close()
    except DataError:
        raise
    except Exception as e:  # ffmpeg's errors come as RuntimeError / OSError / StopIteration with its stderr
        raise DataError(undecodable(path, e)) from e
    if len(taken) < frames.count:
        raise DataError(too_short(path, seen, frames))
    return np.stack(taken)


def _clip_frames(path: str):
    """Each frame of the clip at ``path`` once, as stored, uint8 ``[height, width, 3]``: a GIF's from Pillow (every
    frame, delays or not), any other clip's streamed out of ffmpeg."""
    if path.lower().endswith(".gif"):
        yield from gif_frames(path)
        return
    reader = _ffmpeg().read_frames(path, output_params=list(FFMPEG_AS_STORED))  # each frame once
    try:
        width, height = next(reader)["size"]
        for raw in reader:
            yield np.frombuffer(raw, np.uint8).reshape(height, width, 3)
    finally:
        reader.close()


def undecodable(path: str, error: BaseException) -> str:
    """One line for a clip ffmpeg (or Pillow, for a GIF) cannot decode: the file, the problem, the fix, and the last
    meaningful line of the decoder's message (ffmpeg's whole stderr is dozens of lines of banner)."""
    return (f"video {path} cannot be decoded ({ffmpeg_problem(error)}); re-encode it (e.g. ffmpeg -i IN -c:v libx264 "
            "-pix_fmt yuv420p OUT.mp4) or remove it from the folder")


def too_short(path: str, count: int, frames: FrameSampling) -> str:
    """What a clip of ``count`` frames lacks for ``frames``, and the fix."""
    fit = max((count - 1 - frames.start) // frames.stride + 1, 0) if count > frames.start else 0
    return (f"video {path} has {count} frames; frames {frames} needs {frames.needed} (start + (count - 1) * stride "
            f"+ 1). Lower frames.count (at most {fit} fit at this start and stride), frames.stride or frames.start, "
            "or drop the clip")


def holds_videos(root) -> bool:
    """Whether the folder ``root`` holds video clips and no still images (a :class:`VideoFolderSource`, not an image
    folder), by the file names in its tree; GIFs count as clips here."""
    stills = tuple(e for e in IMAGE_EXTENSIONS if e not in VIDEO_EXTENSIONS)
    names = [n.lower() for _, _, files in os.walk(root) for n in files if not n.startswith(".")]
    return any(n.endswith(VIDEO_EXTENSIONS) for n in names) and not any(n.endswith(stills) for n in names)


def video_problem(path: str, frames: FrameSampling, check: str) -> str | None:
    """Why the clip at ``path`` cannot train, or None: ``headers`` asks ffmpeg for its frame count (Pillow a GIF's;
    no decoding), ``full`` decodes the frames taken."""
    if check == "index":
        return None
    if not os.path.isfile(path):
        return f"video file {path} not found"
    try:
        if check == "full":
            read_frames(path, frames)
            return None
        if path.lower().endswith(".gif"):
            count = gif_frame_count(path)
        else:
            count, _ = _ffmpeg().count_frames_and_secs(path)
    except DataError as e:
        return str(e)
    except (RuntimeError, OSError, ValueError) as e:  # ffmpeg's failure, with its stderr
        return undecodable(path, e)
    if count < frames.needed:
        return too_short(path, count, frames)
    return None


class ClipRecords:
    """What a source of ``{"video": path, "caption", "name"}`` records shares: its ``frames`` and the transform
    :func:`eqxdiff.data.make_dataset` gives its records (:meth:`record_transform`)."""

    frames: FrameSampling

    def record_transform(self, images: ImageCaptionTransform) -> "VideoCaptionTransform":
        """The transform of this source's records: ``images``' (tokenizers, size, crops, flips) on clips of
        ``frames``."""
        if images.image_keys:
            raise ValueError(f"image_keys {list(images.image_keys)} are per-image facts; a clip source records none")
        fields = {f.name: getattr(images, f.name) for f in dataclasses.fields(images)}
        return VideoCaptionTransform(**fields, frames=self.frames)


class VideoFolderSource(ClipRecords, ImageFolderSource):
    """Clip + caption records from a local folder (``metadata.jsonl``/``metadata.csv``, or ``.txt`` files beside
    the clips), as :class:`~eqxdiff.data.ImageFolderSource` reads images; ``frames``: which frames of each clip
    train. ``check``: ``"index"`` (files and captions), ``"headers"`` (also each clip's frame count from ffmpeg,
    against ``frames``; the default), ``"full"`` (also decodes the frames taken). Problems raise one
    :class:`DataError` naming the files. Its records are ``{"video": path, "caption", "name"}``, and it gives
    :func:`eqxdiff.data.make_dataset` its own transform (:meth:`record_transform`)."""

    def __init__(self, root, *, frames: FrameSampling = FrameSampling(), caption_column: str = "text",
                 video_column: str = "file_name", check: str = "headers"):
        check_level(check)
        self.root, self.frames = Path(root), frames
        if not self.root.is_dir():
            raise DataError(f"video folder {self.root} does not exist or is not a folder")
        self.caption_column, self.image_column = caption_column, video_column
        metadata = [self.root / n for n in ("metadata.jsonl", "metadata.csv") if (self.root / n).is_file()]
        self.index_file = metadata[0] if metadata else None
        if metadata:
            rows = self._read_metadata(metadata[0])
        else:
            check_no_columns(self.root, {"caption_column": caption_column, "video_column": video_column},
                             {"caption_column": "text", "video_column": "file_name"}, "a .txt caption beside each clip")
            how = f"no metadata.jsonl, metadata.csv or clips with extensions {VIDEO_EXTENSIONS}"
            rows = with_txt_captions(files_below(self.root, VIDEO_EXTENSIONS, how), self.root)
        self.paths = [str(p) for p, _ in rows]
        self.captions = [c for _, c in rows]
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            problems = [p for p in pool.map(lambda p: video_problem(p, frames, check), self.paths) if p]
        raise_problems(problems, str(self.index_file or self.root))

    def __getitem__(self, index: int) -> dict:
        return {"video": self.paths[index], "caption": self.captions[index], "name": self.paths[index]}

    def __repr__(self) -> str:
        return f"VideoFolderSource({str(self.root)!r}, {len(self)} clips, {self.frames})"


@dataclasses.dataclass(frozen=True)
class VideoCaptionTransform(ImageCaptionTransform):
    """One clip record to ``{"pixel_values": float32 [frames.count, height, width, 3] in [-1, 1], <token ids>}``:
    the frames :func:`read_frames` picks, each resized to cover the size, all cropped at one corner (the center, or
    one random corner per clip) and flipped together; the caption tokenized as
    :class:`~eqxdiff.data.ImageCaptionTransform` does."""

    frames: FrameSampling = FrameSampling()

    def __call__(self, record: dict, rng: np.random.Generator) -> dict:
        height, width = _size(self.resolution)
        clip = read_frames(record["video"], self.frames)
        clip = np.stack([resize_to_cover(f, height, width, self.interpolation) for f in clip])
        top, left = crop_corner(clip[0], height, width, None if self.center_crop else rng)
        clip = clip[:, top:top + height, left:left + width]
        if self.random_flip and rng.random() < 0.5:
            clip = clip[:, :, ::-1]
        return {"pixel_values": to_unit_range(clip), **self.caption_ids(record["caption"], rng)}
