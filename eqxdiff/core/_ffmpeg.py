"""``imageio-ffmpeg``, as every video reader and writer of eqxdiff uses it (``pipelines``' MP4 files, ``data``'s
training clips).

- :data:`AS_STORED`: ffmpeg's output options that hand over a clip's frames as stored. Without them ffmpeg turns a
  variable-frame-rate clip (a GIF whose frames last different times, a phone's MP4) into a constant rate by repeating
  and dropping frames: a GIF of 10 frames read as 73, its first frame 6 times, so frame indices picked nothing of the
  clip's own sequence (and ``count_frames_and_secs`` said 10).
- :func:`imageio_ffmpeg` imports the module on first use and keeps JAX's ``os.fork() was called`` warning from
  printing for imageio-ffmpeg's own ffmpeg processes. imageio-ffmpeg starts ffmpeg with ``preexec_fn=os.setpgrp``
  (its own process group, so that Ctrl-C stops eqxdiff at a step instead of killing ffmpeg mid-file), which makes
  ``subprocess`` fork and run the fork hooks, and JAX warns at every video written or read that a deadlock is
  likely. The child only calls ``setpgrp`` before ``exec``; the warning is silenced for forks by ``subprocess``
  alone (a fork of the user's own still warns).
- :func:`gif_frames`: a GIF's frames, read with Pillow, not ffmpeg. ffmpeg's GIF demuxer times frames by their
  delays; a GIF written without any (GIF87a, Pillow's default writer) came out of ffmpeg as 1 frame of 5 (and
  ``count_frames_and_secs`` said 1), while every GIF reader shows all of them. Pillow is already a dependency.
- :func:`ffmpeg_problem`: the last meaningful line of ffmpeg's stderr in one of imageio-ffmpeg's errors (they carry
  its whole banner and configuration).
"""

import re
import warnings
from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageSequence

AS_STORED = ("-fps_mode", "passthrough")


def imageio_ffmpeg(error: type[Exception] = ImportError):
    """The ``imageio_ffmpeg`` module; ``error`` (naming the fix) when it is not installed."""
    try:
        import imageio_ffmpeg as module
    except ImportError as e:
        raise error("reading and writing videos needs imageio-ffmpeg: pip install imageio-ffmpeg") from e
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning,
                            module="subprocess")
    return module


def gif_frames(path: str) -> Iterator[np.ndarray]:
    """Each frame of the GIF at ``path`` once, as uint8 RGB ``[height, width, 3]``, whatever delays it says."""
    with Image.open(path) as image:
        for frame in ImageSequence.Iterator(image):
            yield np.asarray(frame.convert("RGB"))


def gif_frame_count(path: str) -> int:
    """How many frames the GIF at ``path`` holds (read from its blocks, not decoded)."""
    with Image.open(path) as image:
        return getattr(image, "n_frames", 1)


_ADDRESS = re.compile(r"^\[[^\]]*@ 0x[0-9a-f]+\]\s*")


def ffmpeg_problem(error: BaseException) -> str:
    """The last non-empty line of ``error``'s text (imageio-ffmpeg puts ffmpeg's whole stderr in it), without
    ffmpeg's ``[in#0 @ 0x...]`` prefix and at most 160 characters; the exception's type name if it says nothing."""
    lines = [_ADDRESS.sub("", line.strip()) for line in str(error).splitlines()]
    lines = [line for line in lines if line and line != "=== stderr ==="]
    return lines[-1][:160] if lines else type(error).__name__
