"""tests/test_bad_inputs.py's rules for the pipelines that need a loaded tiny folder (video families and their
image-conditioned kin): every bad call argument raises a typed error (:class:`InputError` / :class:`InputTypeError`)
whose message is one line naming the argument and the fix, before any stage of the call (encoding the prompt, the
image, ...) starts. The tiny folders (tests/_tiny_wan.py, tests/_tiny_ltx.py) are built once; nothing compiles."""

import types

import numpy as np
import pytest

import eqxdiff
from eqxdiff.pipelines import InputError, InputTypeError, _base
from eqxdiff.pipelines.wan import WanPipeline

from . import _tiny_wan as tiny_wan

WAN = dict(height=32, width=32, num_frames=5, num_inference_steps=2, progress=False)
PICTURE = np.full((32, 32, 3), 128, np.uint8)


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_video")
    tiny_wan.build_i2v(root / "wan_i2v")
    i2v = eqxdiff.load_pipeline(root / "wan_i2v")
    return types.SimpleNamespace(wan_i2v=i2v, wan=WanPipeline.from_pipe(i2v))


def _i2v(c, image=PICTURE, **kwargs):
    return c.wan_i2v(image, "a cat", **{**WAN, **kwargs})


# (id, call(ctx) with ctx.wan (a WanPipeline) / ctx.wan_i2v (WanImageToVideoPipeline), error type, message pattern)
CASES = [
    # a ZeroDivisionError (Wan) or a run of no video (LTX): num_videos_per_prompt was not checked like its image twin
    ("videos-per-prompt-zero", lambda c: c.wan("a cat", num_videos_per_prompt=0, **WAN), InputError,
     r"^num_videos_per_prompt=0 must be >= 1$"),
    ("videos-per-prompt-float", lambda c: c.wan("a cat", num_videos_per_prompt=2.0, **WAN), InputTypeError,
     r"^num_videos_per_prompt=2.0 must be an int$"),
]


def _no_stage(self, stage):
    raise AssertionError(f"a bad argument must be refused before the call's {stage!r} stage starts")


@pytest.mark.parametrize(("call", "error", "match"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_any_stage(call, error, match, pipes, monkeypatch):
    real = _base.DiffusionPipeline.timed
    monkeypatch.setattr(_base.DiffusionPipeline, "timed", lambda self, stage: real(self, stage) if stage == "call"
                        else _no_stage(self, stage))
    with pytest.raises(error, match=match) as info:
        call(pipes)
    message = str(info.value)
    assert "\n" not in message and message.strip() == message, f"not one line: {message!r}"
