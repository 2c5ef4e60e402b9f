"""Wan video-to-video against diffusers' ``WanVideoToVideoPipeline`` 0.42.1 at float32 on the tiny Wan config
(tests/_tiny_wan.py): the video's latents noised to ``strength`` with the same noise (diffusers' ``randn_tensor``
handed it), then the text-to-video loop; bad videos refused before anything compiles; ``--video`` on the command
line. That changed values compile nothing is tests/test_recompile.py's sweep."""

import types
from unittest import mock

import diffusers
import numpy as np
import pytest
import torch
from diffusers.pipelines.wan import pipeline_wan_video2video as reference
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.pipelines import InputError, write_video
from eqxdiff.pipelines.wan_v2v import WanVideoToVideoPipeline
from eqxdiff.schedulers import FlowMatchEulerDiscreteScheduler

from . import _tiny_wan as tiny

PROMPTS = ["a red cat", "two dogs"]
NEGATIVES = ["blurry", ""]
SHAPE = (2, 3, 4, 4, 16)  # latents of two 9-frame 32x32 videos through the 2.1 VAE
FRAMES = np.random.default_rng(0).integers(0, 256, (9, 32, 32, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def v2v(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_v2v")
    ref = tiny.save(diffusers.WanVideoToVideoPipeline(
        **tiny.text_components(0), vae=tiny.vae(tiny.VAE_21, 5), scheduler=tiny.scheduler(),
        transformer=tiny.build_transformer(tiny.T2V_PIPELINE, seed=7)), folder)
    return ref, eqxdiff.load_pipeline(folder), folder


@pytest.fixture(scope="module", autouse=True)
def _ftfy_or_not():
    """diffusers' video-to-video module calls ``ftfy.fix_text`` even where ftfy is not installed; without it both
    sides clean prompts without it."""
    with pytest.MonkeyPatch.context() as patch:
        if not hasattr(reference, "ftfy"):
            patch.setattr(reference, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)
        yield


def _diffusers(ref, noise, **kwargs) -> np.ndarray:
    """diffusers' frames (float32 in [0, 1]) with ``noise`` (channels-last) as its one Gaussian draw."""
    drawn = torch.from_numpy(np.ascontiguousarray(np.moveaxis(noise, -1, 1)))
    with mock.patch.object(reference, "randn_tensor", lambda *a, **k: drawn.clone()), torch.no_grad():
        return ref(height=32, width=32, output_type="np", **kwargs).frames


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def test_video_to_video_matches_diffusers(v2v):
    """Two prompts with negatives at two strengths (2 and 3 of 4 UniPC steps: the video's latents noised at
    another sigma each): one video as PIL frames, then one clip per prompt (``[2, F, H, W, 3]`` floats); then the
    frames as a uint8 array and diffusers' embeddings as prompt_embeds give the same frames."""
    ref, pipe, _ = v2v
    assert type(pipe) is WanVideoToVideoPipeline
    noise = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    clips = np.stack([FRAMES, 255 - FRAMES]).astype(np.float32) / 255
    kwargs = dict(prompt=PROMPTS, negative_prompt=NEGATIVES, guidance_scale=4.0, num_inference_steps=4,
                  max_sequence_length=16)
    outputs = []
    for video, strength in (([Image.fromarray(f) for f in FRAMES], 0.5), (clips, 0.75)):
        expected = _diffusers(ref, noise, video=video, strength=strength, **kwargs)
        ours = pipe(video, latents=noise, strength=strength, progress=False, **kwargs)
        assert ours.shape == (2, 9, 32, 32, 3) and ours.dtype == np.uint8
        assert _pixels_off(ours, expected) <= 2, strength
        outputs.append(ours)
    assert _pixels_off(outputs[0][:1], outputs[1][:1] / 255) > 20  # the two strengths start from different latents
    assert np.array_equal(pipe(FRAMES, latents=noise, strength=0.5, progress=False, **kwargs), outputs[0])

    with torch.no_grad():
        embeds, negative = ref.encode_prompt(PROMPTS, NEGATIVES, max_sequence_length=16)
    given = pipe(FRAMES, prompt_embeds=embeds.numpy(), negative_prompt_embeds=negative.numpy(), latents=noise,
                 strength=0.5, guidance_scale=4.0, num_inference_steps=4, progress=False)
    assert _pixels_off(given, outputs[0] / 255) <= 1


def test_strength_rounds_as_wan_whatever_the_scheduler(v2v):
    """A flow-matching Euler scheduler in the folder: diffusers' Wan pipeline still skips ``N - int(N * strength)``
    steps (8 of 10 at 0.274), where the scheduler's own rule (Flux's ``int(N - N * strength)``) skipped 7: 54/255
    off before the pipeline passed its rounding (``whole_steps``); a custom ``timesteps`` schedule likewise."""
    ref, pipe, _ = v2v
    euler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref = diffusers.WanVideoToVideoPipeline(**{**ref.components, "scheduler": euler})
    ours = WanVideoToVideoPipeline.from_pipe(pipe, scheduler=FlowMatchEulerDiscreteScheduler.from_config(euler.config))
    noise = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    kwargs = dict(prompt=PROMPTS, guidance_scale=1.0, num_inference_steps=10, strength=0.274, max_sequence_length=16)
    expected = _diffusers(ref, noise, video=[Image.fromarray(f) for f in FRAMES], **kwargs)
    assert _pixels_off(ours(FRAMES, latents=noise, progress=False, **kwargs), expected) <= 2
    # diffusers' custom timesteps (N = their count: 2 of 5 kept at 0.5)
    kwargs = dict(kwargs, num_inference_steps=None, timesteps=[1000.0, 800.0, 600.0, 400.0, 200.0], strength=0.5)
    expected = _diffusers(ref, noise, video=[Image.fromarray(f) for f in FRAMES], **kwargs)
    assert _pixels_off(ours(FRAMES, latents=noise, progress=False, **kwargs), expected) <= 2


def test_bad_videos_are_refused_with_the_fix(v2v):
    _, pipe, _ = v2v
    call = dict(prompt="a cat", num_inference_steps=2, progress=False)
    with pytest.raises(InputError, match=r"video has 8 frames; Wan's VAE takes 4k\+1 frames .* trim it to 5 or "
                                         "extend it to 9 frames"):
        pipe(FRAMES[:8], **call)
    with pytest.raises(InputError, match=r"^pass video= \(the video to start from"):
        pipe(None, **call)
    with pytest.raises(InputError, match=r"^video must be \[n, height, width, 3\] \(channels-last RGB\), got shape "
                                         r"\(9, 32, 32\); .* \(a clip is frames \[F, H, W, 3\] or a list of PIL "
                                         r"images\)$"):
        pipe(FRAMES[..., 0], **call)
    with pytest.raises(InputError, match="video holds 3 clips for 2 prompts; pass one clip"):
        pipe(np.stack([FRAMES] * 3), prompt=PROMPTS, num_inference_steps=2, progress=False)
    with pytest.raises(InputError, match=r"the clips differ in shape"):
        pipe([FRAMES, FRAMES[:5]], prompt=PROMPTS, num_inference_steps=2, progress=False)
    with pytest.raises(InputError, match=r"height=48 but the video is width 32, height 32 pixels; resize the video"):
        pipe(FRAMES, height=48, **call)
    with pytest.raises(InputError, match=r"video has width 40, height 40 pixels, not multiples of 16 "
                                         r".*resize or crop it to width 32, height 32"):
        pipe(np.stack([np.pad(FRAMES, ((0, 0), (0, 8), (0, 8), (0, 0)))] * 2), prompt=PROMPTS,
             num_inference_steps=2, progress=False)
    with pytest.raises(ValueError, match=r"strength=0.2 with 2 steps leaves no denoising step"):
        pipe(FRAMES, strength=0.2, **call)


def test_generate_reads_the_video_flag(v2v, tmp_path):
    """``eqxdiff-generate --video clip.mp4`` reads the clip's frames into ``video`` (nothing loaded or compiled)."""
    _, _, folder = v2v
    clip = write_video(FRAMES, tmp_path / "clip.mp4", fps=8)
    checked = generate.validate(["--model", str(folder), "--prompt", "x", "--video", str(clip), "--strength", "0.6",
                                 "--output-dir", str(tmp_path / "out")])
    assert checked.family.pipeline_class is WanVideoToVideoPipeline and checked.input_fps == 8
    assert checked.kwargs["video"].shape == (9, 32, 32, 3) and checked.kwargs["strength"] == 0.6
    with pytest.raises(InputError, match=r"^pass --video \(the video to start from"):
        generate.validate(["--model", str(folder), "--prompt", "x", "--output-dir", str(tmp_path / "out")])


def test_mesh_equals_one_device(v2v):
    """On 8 devices (FSDP 2 x context 2 x tensor 2): the video encoded, noised to strength and denoised gives the
    one device's latents (the weights over fsdp, the heads over tensor, the video tokens over context)."""
    from eqxdiff.parallel import MeshConfig, make_mesh

    from ._util import assert_close

    _, pipe, folder = v2v
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=2,
                                ici_tensor_parallelism=2))
    sharded = eqxdiff.load_pipeline(folder, mesh=mesh)
    noise = np.random.default_rng(1).standard_normal((1, *SHAPE[1:])).astype(np.float32)
    kwargs = dict(video=FRAMES, prompt=PROMPTS[0], negative_prompt=NEGATIVES[0], strength=0.7, num_inference_steps=4,
                  guidance_scale=4.0, latents=noise, output_type="latent", progress=False)
    assert_close(sharded(**kwargs), pipe(**kwargs), 1e-4, "mesh vs one device")
