"""The video families as a new user meets them from the command line (issues 20 and 21), beyond what the families'
own tests run: clips read frame by frame as stored, no JAX fork warning at each video written or read, and
``eqxdiff-generate``'s refusals before anything is loaded (``--fps``, a task's missing input, a flag of another task
of the folder's family, ``--pipeline-class``). Nothing here compiles: the tiny folders are only read for their
configs (tests/_tiny_wan.py, tests/_tiny_ltx.py)."""

import warnings

import jax
import numpy as np
import pytest
from PIL import Image

from eqxdiff.data import FrameSampling, read_frames
from eqxdiff.pipelines import read_video, write_video

LEVELS = np.arange(10) * 20 + 10  # frame i is a flat grey at LEVELS[i]


def test_a_variable_frame_rate_clip_reads_each_frame_once(tmp_path):
    """A GIF whose frames last different times (as a phone's MP4 has a variable rate): its 10 frames, each once.
    ffmpeg's default constant-rate output read it as 73 frames, the first 6 times, so frame sampling picked
    repeated frames (and the clip checks' frame count, 10, disagreed with the reader)."""
    frames = [Image.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in LEVELS]
    gif = tmp_path / "vfr.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], loop=0,
                   duration=[100, 300, 50, 100, 200, 100, 100, 70, 100, 100])
    for got in (read_frames(gif, FrameSampling(count=10)), read_video(gif)):
        assert got.shape == (10, 8, 8, 3)
        np.testing.assert_allclose(got.mean(axis=(1, 2, 3)), LEVELS, atol=3)
    picked = read_frames(gif, FrameSampling(count=3, stride=3, start=1))
    np.testing.assert_allclose(picked.mean(axis=(1, 2, 3)), LEVELS[[1, 4, 7]], atol=3)


def test_videos_are_written_and_read_without_a_fork_warning(tmp_path):
    """imageio-ffmpeg starts ffmpeg in its own process group (``preexec_fn``), a fork JAX warned about ('os.fork()
    was called ... will likely lead to a deadlock') at every video an eqxdiff command wrote or read."""
    jax.devices()  # JAX's fork hook is installed with its backend
    clip = np.stack([np.full((8, 8, 3), v, np.uint8) for v in LEVELS[:3]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = write_video(clip, tmp_path / "clip.mp4", fps=8)
        read_video(path)
        read_frames(path, FrameSampling(count=2))
    assert not [w for w in caught if "fork" in str(w.message)], [str(w.message) for w in caught]
    for fps in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be a positive number of frames per second"):
            write_video(clip, tmp_path / "bad.mp4", fps=fps)
