"""tests/test_bad_inputs.py's rules for the pipelines that need a loaded tiny folder (video families and their
image-conditioned kin): every bad call argument raises a typed error (:class:`InputError` / :class:`InputTypeError`)
whose message is one line naming the argument and the fix, before any stage of the call (encoding the prompt, the
image, ...) starts. The tiny folders (tests/_tiny_wan.py, tests/_tiny_ltx.py) are built once; nothing compiles."""

import types

import numpy as np
import pytest
from PIL import Image

import eqxdiff
from eqxdiff.pipelines import InputError, InputTypeError, _base
from eqxdiff.pipelines.ltx_condition import LTXConditionPipeline, LTXVideoCondition
from eqxdiff.pipelines.ltx_i2v import LTXImageToVideoPipeline
from eqxdiff.pipelines.wan import WanPipeline
from eqxdiff.pipelines.wan_i2v import WanImageToVideoPipeline

from . import _tiny_ltx as tiny_ltx
from . import _tiny_wan as tiny_wan

WAN = dict(height=32, width=32, num_frames=5, num_inference_steps=2, progress=False)
LTX = dict(height=16, width=16, num_frames=9, num_inference_steps=2, progress=False)
PICTURE = np.full((32, 32, 3), 128, np.uint8)
SMALL = PICTURE[:16, :16]  # the LTX videos' size


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_video")
    tiny_wan.build_i2v(root / "wan_i2v")
    i2v = eqxdiff.load_pipeline(root / "wan_i2v")
    tiny_ltx.build_pipeline(root / "ltx")
    ltx = eqxdiff.load_pipeline(root / "ltx")
    Image.fromarray(PICTURE).save(root / "picture.png")
    return types.SimpleNamespace(wan_i2v=i2v, wan=WanPipeline.from_pipe(i2v), ltx=ltx,
                                 ltx_cond=LTXConditionPipeline.from_pipe(ltx), root=root)


def _cond(c, *conditions, **kwargs):
    return c.ltx_cond(list(conditions), prompt="a cat", **{**LTX, **kwargs})


def _i2v(c, image=PICTURE, **kwargs):
    return c.wan_i2v(image, "a cat", **{**WAN, **kwargs})


# (id, call(ctx) with ctx.wan (a WanPipeline) / ctx.wan_i2v (WanImageToVideoPipeline) / ctx.ltx (LTXPipeline) /
# ctx.ltx_cond (LTXConditionPipeline), error type, message pattern)
CASES = [
    # a ZeroDivisionError (Wan) or a run of no video (LTX): num_videos_per_prompt was not checked like its image twin
    ("videos-per-prompt-zero", lambda c: c.wan("a cat", num_videos_per_prompt=0, **WAN), InputError,
     r"^num_videos_per_prompt=0 must be >= 1$"),
    ("videos-per-prompt-float", lambda c: c.wan("a cat", num_videos_per_prompt=2.0, **WAN), InputTypeError,
     r"^num_videos_per_prompt=2.0 must be an int$"),
    # image-to-video's picture reached CLIP's image processor first (transformers' 'Could not make a flat list of
    # images'), or the pixel conversion's untyped ValueError
    ("i2v-image-grey", lambda c: _i2v(c, np.zeros((32, 32), np.uint8)), InputError, r"^image must be \[n, height, "
     r"width, 3\] \(channels-last RGB\), got shape \(32, 32\); pass uint8 \[H, W, 3\] or \[n, H, W, 3\], floats in "
     r"\[0, 1\], or PIL images \(grey or RGBA converted to RGB, channels moved last\)$"),
    ("i2v-image-rgba", lambda c: _i2v(c, np.zeros((32, 32, 4), np.uint8)), InputError, r"^image must be \[n, height, "
     r"width, 3\] \(channels-last RGB\), got shape \(32, 32, 4\)"),
    ("i2v-image-channels-first", lambda c: _i2v(c, np.zeros((3, 32, 32), np.uint8)), InputError, r"got shape "
     r"\(3, 32, 32\)"),
    ("i2v-image-rank5", lambda c: _i2v(c, np.zeros((1, 1, 32, 32, 3), np.uint8)), InputError, r"got shape "
     r"\(1, 1, 32, 32, 3\)"),
    ("i2v-image-no-pixels", lambda c: _i2v(c, np.zeros((0, 32, 3), np.uint8)), InputError, r"got shape "
     r"\(0, 32, 3\)"),  # transformers' ZeroDivisionError
    ("i2v-image-path", lambda c: _i2v(c, "cat.png"), InputTypeError, r"^image='cat.png' is a path, not a picture; "
     r"read it first: image=eqxdiff.pipelines.read_image\(path\)"),
    ("i2v-image-empty-list", lambda c: _i2v(c, []), InputError, r"^image is an empty list; pass a picture"),  # an
    # IndexError
    ("i2v-image-ragged-list", lambda c: _i2v(c, [PICTURE, "x"]), InputError, r"^image holds pictures of different "
     r"sizes or kinds \(ValueError: .*\); pass uint8 .*, all of one size$"),
    # an int64 picture of 0-255 values was refused as 'float images must lie in [0, 1]'; one of 0s and 1s ran as
    # floats; a bool one ran as black and white
    ("i2v-image-int64", lambda c: _i2v(c, np.full((32, 32, 3), 7, np.int64)), InputTypeError, r"^image has dtype "
     r"int64; pass uint8 \(0-255\), floats in \[0, 1\] or PIL images \(eqxdiff does not guess the range of other "
     r"integers\)$"),
    ("i2v-image-bool", lambda c: _i2v(c, np.ones((32, 32, 3), bool)), InputTypeError, r"^image has dtype bool"),
    ("i2v-image-float-255", lambda c: _i2v(c, np.full((32, 32, 3), 200.0, np.float32)), InputError, r"^image holds "
     r"floats outside \[0, 1\]; pass floats in \[0, 1\], or uint8 for 0-255 images$"),
    # last_image's RGBA reached the pixel conversion after CLIP had encoded both pictures (a compile)
    ("i2v-last-image-rgba", lambda c: _i2v(c, last_image=np.zeros((32, 32, 4), np.uint8)), InputError,
     r"^last_image must be \[n, height, width, 3\] \(channels-last RGB\), got shape \(32, 32, 4\)"),
    # three images for two prompts were refused only after the prompts were encoded (LTX too)
    ("ltx-i2v-images-for-prompts", lambda c: LTXImageToVideoPipeline.from_pipe(c.ltx)(
        np.zeros((3, 16, 16, 3), np.uint8), ["a", "b"], **LTX), InputError, r"^image holds 3 images for 2 prompts; "
     r"pass one picture \(it conditions every video\) or one per prompt$"),
    ("progress-word", lambda c: c.wan("a cat", **{**WAN, "progress": "no"}), InputTypeError, r"^progress='no' must "
     r"be True or False$"),  # a truthy word: a progress bar
    # text where an array goes: 'could not convert string to float' from jnp.asarray
    ("latents-text", lambda c: c.wan("a cat", latents="noise", **WAN), InputTypeError, r"^latents must be numbers "
     r"\(an array: NumPy, JAX or torch\), got str 'noise'$"),
    ("prompt-embeds-text", lambda c: c.wan(prompt_embeds="a cat", **WAN), InputTypeError, r"^prompt_embeds must be "
     r"numbers"),
    ("image-embeds-ragged", lambda c: _i2v(c, image_embeds=[[0.0], [1.0, 2.0]]), InputTypeError, r"^image_embeds "
     r"must be numbers .*, got list \[\[0.0\], \[1.0, 2.0\]\]$"),
    ("ltx-decode-timestep-text", lambda c: c.ltx("a cat", decode_timestep="0.05", **LTX), InputTypeError,
     r"^decode_timestep must be numbers"),
    # decode_timestep / decode_noise_scale outside [0, 1] ran (diffusers takes any float; no card or training does)
    ("ltx-decode-timestep-negative", lambda c: c.ltx("a cat", decode_timestep=-0.05, **LTX), InputError,
     r"^decode_timestep=-0.05 must be in \[0, 1\] \(got -0.05\): the decoder's timestep and the noise mixed in as "
     r"fractions \(0 decodes the latents as they are, 0.03-0.05 is recommended\)$"),
    ("ltx-decode-noise-scale-above-one", lambda c: c.ltx("a cat", decode_noise_scale=[0.05, 1.5], **LTX), InputError,
     r"^decode_noise_scale=\[0.05, 1.5\] must be in \[0, 1\] \(got 1.5\)"),
    ("ltx-attention-mask-objects", lambda c: c.ltx(prompt_embeds=np.zeros((1, 4, 16), np.float32),
                                                   prompt_attention_mask=np.full((2, 3), None), **LTX),
     InputTypeError, r"^prompt_attention_mask must be numbers .*, got ndarray"),
    # LTXConditionPipeline's conditions= were checked only after the prompts were encoded: a dict or an array
    # there was an AttributeError ('... has no attribute image'), a condition's strength 2 ran (the call's strength=2
    # is refused), and frame_index= / strength= beside conditions= were dropped without a word (as diffusers does)
    ("ltx-condition-a-dict", lambda c: _cond(c, {"image": SMALL}), InputTypeError, r"^conditions must be "
     r"LTXVideoCondition s .*, got dict$"),
    ("ltx-condition-an-array", lambda c: _cond(c, SMALL), InputTypeError, r"^conditions must be LTXVideoCondition s "
     r".*, got ndarray$"),
    ("ltx-condition-strength-two", lambda c: _cond(c, LTXVideoCondition(image=SMALL, strength=2.0)), InputError,
     r"^a condition's strength=2.0: give a number in \[0, 1\] \(1: the frames are given\)$"),
    ("ltx-condition-frame-index-float", lambda c: _cond(c, LTXVideoCondition(image=SMALL, frame_index=1.5)),
     InputError, r"^a condition's frame_index=1.5: give a frame index \(an int >= 0\)$"),
    ("ltx-condition-frame-past-the-video", lambda c: _cond(c, LTXVideoCondition(image=SMALL, frame_index=9)),
     InputError, r"^frame_index=9 lies outside the video's 9 frames; pass 0 to 8$"),
    ("ltx-condition-empty", lambda c: _cond(c, LTXVideoCondition()), InputError, r"^each condition holds an image or "
     r"a video clip \(one of them\)$"),
    ("ltx-frame-index-beside-conditions", lambda c: _cond(c, LTXVideoCondition(image=SMALL), frame_index=[0, 8]),
     InputError, r"^frame_index=\[0, 8\] applies to image= / video=; with conditions= set each LTXVideoCondition's "
     r"frame_index \(LTXVideoCondition\(image=..., frame_index=...\)\)$"),
    ("ltx-strength-beside-conditions", lambda c: _cond(c, LTXVideoCondition(image=SMALL), strength=0.5), InputError,
     r"^strength=0.5 applies to image= / video=; with conditions= set each LTXVideoCondition's strength"),
    # a diffusers argument this pipeline does not take, inside its LoRA-scale dict: the keyword's own reason
    ("ip-adapter-masks-in-attention-kwargs", lambda c: c.wan("a cat", attention_kwargs={"ip_adapter_masks": [None]},
                                                           **WAN), InputError,
     r"^attention_kwargs holds 'ip_adapter_masks': this pipeline takes no IP-Adapter \(eqxdiff's SD and SDXL "
     r"pipelines do: load_ip_adapter\)"),
    ("i2v-images-for-prompts", lambda c: c.wan_i2v(np.zeros((3, 32, 32, 3), np.uint8), ["a", "b"], **WAN),
     InputError, r"^image holds 3 images; pass one picture \(it starts every video\)$"),
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


def test_a_good_picture_passes_the_checks(pipes, monkeypatch):
    """The checks above refuse only what they should: a uint8 array, floats in [0, 1] and a PIL image reach the
    first stage."""
    monkeypatch.setattr(_base.DiffusionPipeline, "timed", _no_stage)
    for image in (PICTURE, PICTURE / 255.0, Image.fromarray(PICTURE), [Image.fromarray(PICTURE)]):
        with pytest.raises(AssertionError, match="stage starts"):
            _i2v(pipes, image)
    assert isinstance(pipes.wan_i2v, WanImageToVideoPipeline)


def test_generate_checks_the_pictures_before_loading(pipes, monkeypatch):
    """eqxdiff-generate runs image-to-video's check_call on a stand-in before loading: the picture check there
    (added with the one above) called super() and raised 'super(type, obj): obj must be an instance' for every
    --image. A good picture passes; the --model folder is not loaded."""
    from eqxdiff.cli import generate

    monkeypatch.setattr(generate, "load_pipeline", _no_stage)
    checked = generate.validate(["--model", str(pipes.root / "wan_i2v"), "--prompt", "a cat", "--image",
                                 str(pipes.root / "picture.png"), "--num-frames", "5", "--steps", "2"])
    assert checked.kwargs["image"].shape == (32, 32, 3)


def test_generate_checks_the_boundary_before_loading(pipes, monkeypatch, capsys):
    """--boundary-ratio 2 was taken by eqxdiff-generate's checks and refused only once the
    folder was loaded (the range needs no folder): one error line, exit 2, nothing loaded."""
    from eqxdiff.cli import generate

    monkeypatch.setattr(generate, "load_pipeline", _no_stage)
    argv = ["--model", str(pipes.root / "wan_i2v"), "--prompt", "a cat", "--image", str(pipes.root / "picture.png"),
            "--num-frames", "5", "--boundary-ratio", "2"]
    with pytest.raises(InputError, match=r"^--boundary-ratio must be in \[0, 1\], got 2.0 \(the fraction of the "
                                         r"training timesteps above which the high-noise expert runs: 0.875 for Wan "
                                         r"2.2 text-to-video, 0.9 for image-to-video\)$"):
        generate.validate(argv)
    monkeypatch.setattr("sys.argv", ["eqxdiff-generate", *argv])
    with pytest.raises(SystemExit) as info:
        generate.cli()
    lines = capsys.readouterr().err.splitlines()
    assert info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: --boundary-ratio"), lines


ONE_EXPERT = [  # (flag, value, the loaded pipeline's message) on a folder with one transformer
    ("--boundary-ratio", "0.9", "boundary_ratio=0.9 switches to a second expert, but this pipeline has no "
                                "transformer_2 (a Wan 2.2 A14B folder has one); leave boundary_ratio out"),
    ("--guidance-scale-2", "3", "guidance_scale_2=3.0 applies to the low-noise expert (transformer_2), which runs "
                                "only below a boundary_ratio; pass boundary_ratio= (0.875 is Wan 2.2's for "
                                "text-to-video) or leave guidance_scale_2 out")]


@pytest.mark.parametrize(("flag", "value", "message"), ONE_EXPERT, ids=[c[0] for c in ONE_EXPERT])
def test_generate_checks_the_experts_against_the_folder_before_loading(flag, value, message, pipes, monkeypatch):
    """The experts' flags on a folder with one transformer were refused only once it was loaded: now from its
    model_index.json, with the loaded pipeline's message in flags."""
    from eqxdiff.cli import generate

    name = flag[2:].replace("-", "_")
    with pytest.raises(InputError) as loaded:
        pipes.wan_i2v.check_call({name: float(value)})
    assert str(loaded.value) == message
    monkeypatch.setattr(generate, "load_pipeline", _no_stage)
    with pytest.raises(InputError) as info:
        generate.validate(["--model", str(pipes.root / "wan_i2v"), "--prompt", "a cat", "--image",
                           str(pipes.root / "picture.png"), "--num-frames", "5", flag, value])
    assert str(info.value).startswith(message.replace(f"{name}=", f"{flag} ").split(" (")[0])


@pytest.mark.parametrize(("frames", "fits"), [(17, "try 9 or 25"), (10, "try 9 or 25"), (5, "try 9"),
                                             (33, "try 25 or 41")])
def test_ltx_frames_make_whole_temporal_patches(frames, fits, pipes):
    """A transformer with ``patch_size_t=2`` takes an even number of latent frames: ``num_frames`` 16k + 9 at the
    VAE's factor 8. Another count got the transformer's reshape error; now the pipeline's one line names the nearest
    counts that fit, before anything runs (and ``eqxdiff-generate`` reads the same limits from the folder)."""
    from eqxdiff.models.ltx import LTXVideoTransformer3DConfig
    from eqxdiff.pipelines.ltx import LTXPipeline

    patched = LTXVideoTransformer3DConfig.from_dict(tiny_ltx.TRANSFORMER_PATCHED)
    limits = LTXPipeline.limits_from(pipes.ltx.vae.config, patched)
    with pytest.raises(InputError, match=rf"^num_frames={frames} must be 16k\+9 \(the VAE keeps the first frame and "
                                         rf"compresses time by 8 after it, and the transformer takes patches of 2 "
                                         rf"latent frames\); {fits}$"):
        LTXPipeline.check_arguments({"num_frames": frames}, limits)
    LTXPipeline.check_arguments({"num_frames": 25}, limits)
    with pytest.raises(InputError, match=r"^num_frames=10 must be 8k\+1 .*; try 9 or 17$"):  # patch_size_t 1: as before
        LTXPipeline.check_arguments({"num_frames": 10}, pipes.ltx.call_limits())
