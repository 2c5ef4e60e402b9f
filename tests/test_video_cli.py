"""The video families as a new user meets them from the command line (issues 20 and 21), beyond what the families'
own tests run: clips read frame by frame as stored, no JAX fork warning at each video written or read, and
``eqxdiff-generate``'s refusals before anything is loaded (``--fps``, a task's missing input, a flag of another task
of the folder's family, ``--pipeline-class``). Nothing here compiles: the tiny folders are only read for their
configs (tests/_tiny_wan.py, tests/_tiny_ltx.py)."""

import json
import re
import warnings
from typing import ClassVar

import jax
import numpy as np
import pytest
from PIL import Image

from eqxdiff.cli import generate
from eqxdiff.cli import train as train_cli
from eqxdiff.cli._command import FlagError
from eqxdiff.data import DataError, FrameSampling, VideoFolderSource, read_frames
from eqxdiff.parallel import MeshError
from eqxdiff.pipelines import InputError, read_parameters, read_video, write_video

from . import _tiny_ltx as tiny_ltx
from . import _tiny_wan as tiny_wan

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


def test_a_gif_without_frame_delays_reads_every_frame(tmp_path):
    """A GIF written without delays (GIF87a, Pillow's default writer): ffmpeg read its 5 frames as 1, so the folder
    check said 1 frame and the reader failed; Pillow reads all 5, with the same frame sampling as other clips."""
    clip = np.random.default_rng(0).integers(0, 256, (5, 16, 16, 3), dtype=np.uint8)  # 8x8 noise ffmpeg read right
    frames = [Image.fromarray(f) for f in clip]
    gif = tmp_path / "nodelay.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:])
    assert gif.read_bytes()[:6] == b"GIF87a"
    (tmp_path / "nodelay.txt").write_text("noise")
    source = VideoFolderSource(tmp_path, frames=FrameSampling(count=2, stride=2, start=1))
    np.testing.assert_array_equal(read_frames(source[0]["video"], source.frames), clip[[1, 3]])  # 256 colours: exact
    np.testing.assert_array_equal(read_video(gif), clip)
    with pytest.raises(DataError, match=r"nodelay\.gif has 5 frames; .* needs 6"):
        VideoFolderSource(tmp_path, frames=FrameSampling(count=3, stride=2, start=1))


def test_a_corrupt_clip_is_one_short_line(tmp_path):
    """A corrupt mp4, read or checked: one line naming the file, the problem and the fix, with ffmpeg's last line;
    the message was the last 300 characters of ffmpeg's stderr, cut mid-word, five lines with ffmpeg's addresses."""
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all" * 10)
    (tmp_path / "broken.txt").write_text("nothing")
    expected = (r"video .*broken\.mp4 cannot be decoded \(Error opening input files: Invalid data found when "
                r"processing input\); re-encode it \(.*\) or remove it from the folder")
    for read in (lambda: read_frames(tmp_path / "broken.mp4", FrameSampling(count=2)),
                 lambda: VideoFolderSource(tmp_path, frames=FrameSampling(count=2))):
        with pytest.raises(DataError, match=expected) as caught:
            read()
        line = str(caught.value).splitlines()[-1]  # the folder check puts its own heading line above
        assert "@ 0x" not in line and len(line) < 300, line


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


def test_a_short_clip_names_what_fits_when_the_folder_is_checked(tmp_path):
    """The folder check (ffmpeg's frame count, before training) names the frames that fit, as the reader does; it
    said only 'has 5 frames; ... needs 9'."""
    write_video(np.stack([np.full((8, 8, 3), v, np.uint8) for v in LEVELS[:5]]), tmp_path / "short.mp4", fps=8)
    (tmp_path / "short.txt").write_text("a short grey clip")
    with pytest.raises(DataError, match=r"short\.mp4 has 5 frames; .* needs 9 .*Lower frames.count \(at most 3 fit "
                                        r"at this start and stride\)"):
        VideoFolderSource(tmp_path, frames=FrameSampling(count=5, stride=2))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_cli")
    tiny_wan.build_ti2v(root / "ti2v")
    tiny_ltx.build_pipeline(root / "ltx")
    tiny_ltx.build_upsampler(root / "up", tiny_ltx.vae())
    return root


def _argv(folder, *extra):
    return ["--model", str(folder), "--prompt", "x", "--height", "32", "--width", "32", "--num-frames", "9",
            "--steps", "2", *extra]


def test_generate_refuses_fps_before_loading(folders, tmp_path):
    """--fps -1 was refused only after generating (by the MP4 writer, in Python's words), --fps 0 wrote the default
    rate and --fps nan failed with 'cannot convert NaN to integer ratio'."""
    for fps in ("-1", "0", "nan", "inf"):
        with pytest.raises(InputError, match=rf"^--fps {fps} must be a positive number of frames per second; leave "
                                             "it out for the model's own rate$"):
            generate.validate(_argv(folders / "ti2v", "--fps", fps, "--output-dir", str(tmp_path)))


def test_pipeline_class_runs_a_folder_as_another_task_of_its_family(folders, tmp_path, capsys):
    """A Wan 2.2 TI2V-5B folder (WanPipeline) runs image-to-video and an LTX-Video folder image-to-video or with
    conditions through --pipeline-class, as load_pipeline(pipeline_class=...); the command line had no way to, and
    --image was an unrecognized argument without a word on what takes it."""
    image = tmp_path / "first.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    out = ["--output-dir", str(tmp_path / "out")]
    with pytest.raises(FlagError, match=r"unrecognized argument\(s\) --image .*; --image is an option of "
                                        r"WanImageToVideoPipeline: add --pipeline-class WanImageToVideoPipeline to "
                                        "run the --model folder's WanPipeline as one$"):
        generate.validate(_argv(folders / "ti2v", "--image", str(image), *out))
    with pytest.raises(FlagError, match=r"--image is an option of LTXConditionPipeline and LTXImageToVideoPipeline: "
                                        r"add --pipeline-class LTXConditionPipeline \(or another of them\)"):
        generate.validate(_argv(folders / "ltx", "--image", str(image), *out))
    checked = generate.validate(_argv(folders / "ti2v", "--image", str(image), "--pipeline-class",
                                      "WanImageToVideoPipeline", *out))
    assert checked.load_class.__name__ == "WanImageToVideoPipeline" and checked.kwargs["image"].shape == (32, 32, 3)
    # the task's own input is required before loading (it was refused after the weights were loaded)
    with pytest.raises(InputError, match=r"^pass --image \(the first frame of the video\)$"):
        generate.validate(_argv(folders / "ti2v", "--pipeline-class", "WanImageToVideoPipeline", *out))
    with pytest.raises(InputError, match=r"^pass --image \(the first frame of the video\)$"):
        generate.validate(_argv(folders / "ltx", "--pipeline-class", "LTXImageToVideoPipeline", *out))
    assert generate.validate(_argv(folders / "ltx", "--pipeline-class", "LTXConditionPipeline", "--image", str(image),
                                   "--frame-index", "8", *out)).load_class.__name__ == "LTXConditionPipeline"
    with pytest.raises(FlagError, match=r"^--pipeline-class WanPipeline: cannot run it; the --model folder's "
                                        r"LTXPipeline runs as LTXPipeline, LTXConditionPipeline, "
                                        "LTXImageToVideoPipeline: pass one of those or leave the flag out$"):
        generate.validate(_argv(folders / "ltx", "--pipeline-class", "WanPipeline", *out))
    with pytest.raises(FlagError, match="--pipeline-class Foo: is no pipeline eqxdiff serves"):
        generate.validate(_argv(folders / "ltx", "--pipeline-class", "Foo", *out))
    with pytest.raises(SystemExit):
        generate.main(["--model", str(folders / "ltx"), "--pipeline-class", "LTXConditionPipeline", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "LTXConditionPipeline's (the --model folder's LTXPipeline as --pipeline-class)" in shown
    for flag in ("--image", "--video", "--frame-index", "--strength", "--denoise-strength", "--pipeline-class"):
        assert flag in shown, flag


def _picture(tmp_path, name="frame.png"):
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / name)
    return str(tmp_path / name)


def test_condition_flags_repeat_for_several_conditions(folders, tmp_path, capsys):
    """LTXConditionPipeline takes a list of images (and clips) with one frame index and strength each; the command
    line took one --image and one --frame-index (a second one silently replaced the first), so the README's
    two-image recipe was Python-only. A flag whose argument takes one value or a list (read from the signature)
    repeats: once is the one value, repeated the list; counts that disagree are refused before loading."""
    first, last = _picture(tmp_path, "first.png"), _picture(tmp_path, "last.png")
    argv = _argv(folders / "ltx", "--pipeline-class", "LTXConditionPipeline", "--output-dir", str(tmp_path / "out"))
    checked = generate.validate([*argv, "--image", first, "--frame-index", "0", "--image", last, "--frame-index", "8",
                                 "--strength", "0.9"])
    kwargs = checked.kwargs
    assert [i.shape for i in kwargs["image"]] == [(32, 32, 3)] * 2 and kwargs["frame_index"] == [0, 8]
    assert kwargs["strength"] == 0.9 and kwargs["prompt"] == "x" and kwargs["video"] is None  # once: the one value
    once = generate.validate([*argv, "--image", last, "--frame-index", "8"]).kwargs
    assert once["image"].shape == (32, 32, 3) and once["frame_index"] == 8
    with pytest.raises(InputError, match=r"^--frame-index has 3 values for 2 conditions; pass one, or one per "
                                         r"condition \(images first, then video clips\)$"):
        generate.validate([*argv, "--image", first, "--image", last, *("--frame-index", "0") * 3])
    with pytest.raises(InputError, match=r"^--frame-index 9 lies outside the video's 9 frames; pass 0 to 8$"):
        generate.validate([*argv, "--image", first, "--frame-index", "0", "--image", last, "--frame-index", "9"])
    with pytest.raises(FlagError, match=r"^--frame-index expects an integer, got 'x'$"):
        generate.validate([*argv, "--image", first, "--frame-index", "x"])
    with pytest.raises(SystemExit):
        generate.main([*argv, "--help"])
    shown = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert re.search(r"--frame-index INT .*\(repeatable: once for one value, repeated for a list; default: 0\)",
                     shown), shown


class _Stub:
    """A loaded pipeline's stand-in for the command's wiring: its call returns 9 black frames or raises ``error``."""

    INIT_IMAGE = None
    default_fps = 25
    call_defaults: ClassVar[dict] = {}

    def __init__(self, error=None):
        self.error, self.timings = error, {"call_compile": 0.0}

    def __call__(self, **kwargs):
        if self.error:
            raise InputError(self.error)
        return np.zeros((1, 9, 32, 32, 3), np.uint8)


def test_errors_of_the_call_and_the_mesh_name_the_flags(folders, tmp_path, monkeypatch):
    """Errors raised inside the call said frame_index=9 where the user gave --frame-index, the upsampler asked for
    latents= (no flag) when --video was missing, and a mesh that does not fit the devices named
    ici_context_parallelism=3, no flag; all go through the flag names now (no pipeline is loaded)."""
    out = ["--output-dir", str(tmp_path / "out")]
    with pytest.raises(InputError, match=r"^pass --video \(frames to encode\)$"):
        generate.validate(["--model", str(folders / "up"), *out])
    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: _Stub("frame_index=7 lies outside the video"))
    argv = _argv(folders / "ltx", "--pipeline-class", "LTXConditionPipeline", "--image", _picture(tmp_path), *out)
    with pytest.raises(InputError, match="^--frame-index 7 lies outside the video$"):
        generate.main(argv)
    fixed = r"--mesh.ici-context-parallelism 3, --mesh.ici-tensor-parallelism 1: the fixed sizes multiply to 3, "
    with pytest.raises(MeshError, match=fixed + r"which does not divide the 8 device\(s\) per slice; change "
                                        r"--mesh.ici-context-parallelism 3 so that"):
        generate.main([*argv, "--mesh.ici-context-parallelism", "3"])
    clips = tmp_path / "clips"
    clips.mkdir()
    write_video(np.zeros((9, 32, 32, 3), np.uint8), clips / "a.mp4", fps=8)
    (clips / "a.txt").write_text("a grey clip")
    train = ["wan2.1-14b", "--model", str(folders / "ti2v"), "--data", str(clips), "--output-dir",
             str(tmp_path / "run"), "--resolution", "32", "--frames.count", "9"]
    with pytest.raises(MeshError, match=r"8 device\(s\) per slice; change --mesh.ici-context-parallelism 3 so that"):
        train_cli.main([*train, "--mesh.ici-context-parallelism", "3"])


def test_an_upsampled_video_keeps_its_frame_rate(folders, tmp_path, monkeypatch):
    """The upsampler has no frame_rate: a --video was saved at its default 25 fps whatever its own rate; it is
    saved at the input's rate now, unless --fps says otherwise."""
    clip = tmp_path / "clip.mp4"
    write_video(np.zeros((9, 32, 32, 3), np.uint8), clip, fps=12)
    monkeypatch.setattr(generate, "load_pipeline", lambda *a, **k: _Stub())
    argv = ["--model", str(folders / "up"), "--video", str(clip), "--output-dir", str(tmp_path / "out")]
    assert read_parameters(generate.main(argv)[0])["fps"] == 12
    assert read_parameters(generate.main([*argv, "--fps", "8"])[0])["fps"] == 8


def test_a_preset_refuses_a_folder_without_what_it_trains(folders, tmp_path):
    """wan2.2-a14b (two experts) and wan2.2-ti2v-5b (first-frame conditioning) trained a folder without a second
    expert or per-token timesteps without a word; the preset's declared needs are checked against model_index.json
    before loading, naming the preset, what the folder lacks and the presets it fits."""
    single = tmp_path / "t2v"
    single.mkdir()
    index = json.loads((folders / "ti2v" / "model_index.json").read_text())
    (single / "model_index.json").write_text(json.dumps({**index, "expand_timesteps": False}))
    for name in ("vae", "transformer"):
        (single / name).symlink_to(folders / "ti2v" / name)
    for folder, preset, lacks, fits in (
            (folders / "ti2v", "wan2.2-a14b", r"transformer_2 \(Wan 2.2 A14B's second, low-noise expert\)",
             "wan2.1-1.3b, wan2.1-14b, wan2.2-ti2v-5b"),
            (single, "wan2.2-ti2v-5b", r"expand_timesteps true \(Wan 2.2 TI2V-5B's per-token timesteps, .*\)",
             "wan2.1-1.3b, wan2.1-14b")):
        with pytest.raises(InputError, match=rf"^the {preset} preset trains a folder with {lacks}, which --model "
                                             rf"'{folder}' lacks; pass such a folder \(Wan-AI/.*\), or start from a "
                                             rf"preset this folder fits \({fits}\)$"):
            train_cli.validate([preset, "--model", str(folder), "--data", str(tmp_path), "--output-dir",
                                str(tmp_path / "run")])
