"""Hugging Face ``datasets`` of clips + captions: :class:`HFDatasetSource` whose media column holds clips.

The column holds clip file paths (relative to the dataset's folder, or absolute), or ``{"path", "bytes"}`` dicts
(a ``datasets.Video`` feature, read undecoded). Embedded ``bytes`` are written once to a file named by their hash
in ``cache_dir`` (ffmpeg reads files), then read as the path-only rows are.
"""

import hashlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ._common import DataError
from ._hf import HFDatasetSource, _import_datasets, _load
from ._video import VIDEO_EXTENSIONS, ClipRecords, FrameSampling, video_problem


def _clip_path(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("path")
    return value if isinstance(value, str) else None


def holds_clips(path, *, split: str = "train", column: str | None = None) -> str | None:
    """The column of the dataset at ``path`` (or of a loaded one: :func:`~eqxdiff.data.load_hf_dataset`) that holds
    clips, or None (an image dataset): ``column`` (default ``video`` where the dataset has it and no ``image``
    column), when it is a ``datasets.Video`` feature or its first row names a file with a video extension (GIFs stay
    images here)."""
    datasets = _import_datasets()
    ds, _ = _load(path, split, {})
    if column is None:
        column = "video" if "video" in ds.column_names and "image" not in ds.column_names else "image"
    if column not in ds.column_names or len(ds) == 0:
        return None
    if isinstance(ds.features[column], datasets.Video):
        return column
    if isinstance(ds.features[column], datasets.Image):
        return None
    first = _clip_path(ds.select_columns([column])[0][column])
    clip = first is not None and first.lower().endswith(tuple(e for e in VIDEO_EXTENSIONS if e != ".gif"))
    return column if clip else None


class HFVideoDatasetSource(ClipRecords, HFDatasetSource):
    """Clip + caption records (``{"video": path, "caption", "name"}``) from a Hugging Face dataset, read as
    :class:`~eqxdiff.data.HFDatasetSource` reads images (same ``path``, ``split``, ``caption_column``,
    ``**load_kwargs``); ``video_column``: the clips; ``frames``: which frames of each clip train. ``check``:
    ``"index"`` (columns and captions), ``"headers"`` (also each clip's frame count from ffmpeg, against
    ``frames``; the default) or ``"full"`` (also decodes the frames taken); problems raise one ``DataError``
    naming the rows; ``dataset``: the split already loaded (:func:`~eqxdiff.data.load_hf_dataset`). ``cache_dir``:
    where embedded clip bytes are written (default: ``eqxdiff-clips`` in the system temp folder), once per clip by
    content hash and kept for later runs, as ``datasets`` keeps its own cache: delete the folder to free the
    space."""

    record_key = "video"

    def __init__(self, path, *, frames: FrameSampling = FrameSampling(), split: str = "train",
                 video_column: str = "video", caption_column: str = "text", check: str = "headers",
                 cache_dir=None, dataset=None, **load_kwargs):
        self.frames = frames
        self.cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "eqxdiff-clips")
        super().__init__(path, split=split, image_column=video_column, caption_column=caption_column, check=check,
                         dataset=dataset, **load_kwargs)

    def _media_problems(self, clips: list, names: list[str], check: str) -> list[str]:
        def problem(i):
            why = video_problem(clips[i], self.frames, check)
            return why and f"{names[i]}: {why}"

        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            return [p for p in pool.map(problem, range(len(clips))) if p]

    def _resolve(self, clip):
        if isinstance(clip, dict) and clip.get("bytes") is not None:
            suffix = Path(clip.get("path") or "clip.mp4").suffix or ".mp4"
            file = self.cache_dir / (hashlib.sha256(clip["bytes"]).hexdigest()[:32] + suffix)
            if not file.is_file():  # written once: to a temporary name, then renamed (readers never see a part)
                self.cache_dir.mkdir(parents=True, exist_ok=True)
                part = file.with_suffix(f".{os.getpid()}.part")
                part.write_bytes(clip["bytes"])
                os.replace(part, file)
            return str(file)
        path = _clip_path(clip)
        if path is None:
            raise DataError(f"a clip must be a file path or a {{'path', 'bytes'}} dict, got {type(clip).__name__}: "
                            f"{clip!r:.60}")
        return super()._resolve(path)

    def __repr__(self) -> str:
        return f"HFVideoDatasetSource({self.where!r}, {len(self)} clips, {self.frames})"
