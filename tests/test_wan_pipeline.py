"""The Wan pipelines end to end against diffusers 0.42 in float32 (every pixel within 2/255 from the same initial
latents): text-to-video (Wan 2.1), the two experts of Wan 2.2 A14B (different weights, guidance_scale_2, the boundary
inside one compiled loop; resident or offloaded), image-to-video with CLIP image tokens through added k/v (2.1),
first-last-frame (FLF2V), 2.2 A14B's two experts on image latents (no CLIP), and TI2V-5B's first frame through
per-token timesteps. Prompts go through a character tokenizer saved in the folders (both sides tokenize alike), a
tiny UMT5 with the attention mask and zero padding, and Wan's UniPC with flow sigmas. Then the same call on 8
simulated devices (FSDP 2 x context 2 x tensor 2) gives the one device's frames, eqxdiff-generate writes an MP4 that
reads back, the flags come from the signatures, and the errors.

Tiny folders are built once for the module; every video has 9 frames of 32x32 pixels (3 latent frames) and every
call 3 steps, so calls of one pipeline share their compiled programs.
"""

import types

import diffusers
import equinox as eqx
import jax
import numpy as np
import pytest
import torch
from diffusers.pipelines.wan import pipeline_wan_i2v
from jax.sharding import PartitionSpec as P
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.core import resolve_class
from eqxdiff.parallel import MeshConfig, make_mesh
from eqxdiff.pipelines import (
    CallLimits,
    InputError,
    check_arguments,
    read_parameters,
    read_video,
    save_pipeline,
    wan_i2v,
)
from eqxdiff.pipelines.wan import WanPipeline, clean_prompt
from eqxdiff.pipelines.wan_i2v import WanImageToVideoPipeline

from . import _tiny_wan as tiny
from ._util import assert_close

PROMPTS = ["a red cat", " two  dogs in &#116;he\tpark "]  # cleaned: "two dogs in the park"
NEGATIVES = ["blurry", ""]
VIDEO = dict(height=32, width=32, num_frames=9, num_inference_steps=3)
SHAPE = (2, 3, 4, 4, 16)  # latents of two 9-frame 32x32 videos through the 2.1 VAE


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _noise(shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _ncthw(latents) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(np.asarray(latents), -1, 1)))


def _run(ref, latents, **kwargs):
    with torch.no_grad():
        return ref(latents=_ncthw(latents), output_type="np", **kwargs).frames


def _picture(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_a14b")
    return tiny.build_a14b(folder), eqxdiff.load_pipeline(folder), folder


@pytest.fixture(scope="module")
def t2v(a14b):
    """Wan 2.1 text-to-video: the A14B folder's high-noise transformer alone."""
    ref, pipe, _ = a14b
    ours = WanPipeline.from_pipe(pipe, transformer_2=None, boundary_ratio=None)
    return type(ref)(**{**ref.components, "transformer_2": None}, boundary_ratio=None), ours


@pytest.fixture(scope="module", autouse=True)
def _ftfy_or_not():
    """diffusers' image-to-video module calls ``ftfy.fix_text`` even where ftfy is not installed (its text-to-video
    module checks); without ftfy both sides clean prompts without it, as eqxdiff and diffusers' WanPipeline do."""
    with pytest.MonkeyPatch.context() as patch:
        if not hasattr(pipeline_wan_i2v, "ftfy"):
            patch.setattr(pipeline_wan_i2v, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)
        yield


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wan_i2v")
    return tiny.build_i2v(folder), eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    """Wan 2.2 TI2V-5B's layout: a text-to-video folder (expand_timesteps) that image-to-video loads too."""
    folder = tmp_path_factory.mktemp("wan_ti2v")
    ref = tiny.build_ti2v(folder)
    i2v_ref = diffusers.WanImageToVideoPipeline(**ref.components, expand_timesteps=True)
    return (ref, eqxdiff.load_pipeline(folder)), (i2v_ref, WanImageToVideoPipeline.from_pretrained(folder))


# -- parity with diffusers ------------------------------------------------------------------------------------------


def test_text_to_video_matches_diffusers(t2v):
    """Two prompts (one cleaned: doubled spaces, an HTML entity) with negatives; then diffusers' own embeddings as
    prompt_embeds; the latents out are channels-last."""
    ref, pipe = t2v
    assert type(pipe) is WanPipeline and pipe.transformer_2 is None and pipe.vae_temporal_factor == 4
    noise = _noise(SHAPE)
    kwargs = dict(guidance_scale=4.0, **VIDEO)
    expected = _run(ref, noise, prompt=PROMPTS, negative_prompt=NEGATIVES, **kwargs)
    ours = pipe(PROMPTS, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs)
    assert ours.shape == (2, 9, 32, 32, 3) and ours.dtype == np.uint8
    assert _pixels_off(ours, expected) <= 2 and np.std(ours) > 1
    # diffusers' other output types from the same loop: "np" the float32 frames in [0, 1] before quantisation (as
    # diffusers' to float32 precision, not 1/255), "pil" the uint8 frames as a list per video of PIL images
    floats = pipe(PROMPTS, negative_prompt=NEGATIVES, latents=noise, output_type="np", progress=False, **kwargs)
    assert floats.dtype == np.float32 and floats.shape == expected.shape == (2, 9, 32, 32, 3)
    assert pipe.timings["denoise_compile"] == 0.0  # the same loop program; only the post-processing is new
    assert_close(floats, expected, 2e-5, "output_type='np' vs diffusers'")  # measured <= 5e-6; 1/510 if quantised
    assert np.array_equal((floats * 255).round().astype(np.uint8), ours)  # the uint8 output quantises these
    pil = pipe(PROMPTS, negative_prompt=NEGATIVES, latents=noise, output_type="pil", progress=False, **kwargs)
    assert isinstance(pil, list) and all(isinstance(video, list) and len(video) == 9 for video in pil) and len(pil) == 2
    assert {(im.mode, im.size) for video in pil for im in video} == {("RGB", (32, 32))}
    assert np.array_equal(np.stack([np.stack([np.asarray(im) for im in video]) for video in pil]), ours)

    assert clean_prompt(" two  dogs &amp;amp; a\tball ") == "two dogs & a ball"
    with torch.no_grad():
        embeds, negative = ref.encode_prompt(PROMPTS, NEGATIVES, max_sequence_length=512)
    assert_close(pipe.encode_prompt(PROMPTS), embeds.numpy(), 1e-4, "UMT5 embeddings (zero-padded)")
    given = pipe(prompt_embeds=embeds.numpy(), negative_prompt_embeds=negative.numpy(), latents=noise, progress=False,
                 **kwargs)
    assert _pixels_off(given, expected) <= 2
    latents = pipe(PROMPTS, latents=noise, output_type="latent", progress=False, **kwargs)
    assert latents.shape == SHAPE
    pipe.enable_vae_tiling()  # videos decoded one latent frame at a time (a lax.scan): the same frames
    try:
        assert pipe.vae_frame_chunk == 1
        assert _pixels_off(pipe(PROMPTS, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs),
                           ours / 255) <= 1
    finally:
        pipe.enable_vae_tiling(False)


def test_two_experts_match_diffusers(a14b):
    """Wan 2.2 A14B: the high-noise expert with guidance_scale above the boundary, the low-noise one (different
    weights) with guidance_scale_2 below, switched inside one compiled loop; offloading the experts gives the same
    frames, each expert on the device only for its steps."""
    ref, pipe, _ = a14b
    assert pipe.boundary_ratio == 0.875 and pipe.transformer_2 is not None
    assert not np.array_equal(pipe.transformer.proj_out.weight, pipe.transformer_2.proj_out.weight)
    noise = _noise(SHAPE, seed=1)
    kwargs = dict(guidance_scale=4.0, guidance_scale_2=2.5, **VIDEO)
    expected = _run(ref, noise, prompt=PROMPTS, negative_prompt=NEGATIVES, **kwargs)
    ours = pipe(PROMPTS, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2
    # the call's boundary_ratio overrides the folder's: 0.5 gives the high-noise expert two steps of three
    expected = _run(type(ref)(**ref.components, boundary_ratio=0.5), noise, prompt=PROMPTS,
                    negative_prompt=NEGATIVES, **kwargs)
    ours_half = pipe(PROMPTS, negative_prompt=NEGATIVES, latents=noise, boundary_ratio=0.5, progress=False, **kwargs)
    assert _pixels_off(ours_half, expected) <= 2 and _pixels_off(ours_half, ours / 255) > 2

    pipe.enable_expert_offload()
    try:
        assert isinstance(pipe.transformer.proj_out.weight, np.ndarray)  # in host memory between calls
        offloaded = pipe(PROMPTS, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs)
    finally:
        pipe.enable_expert_offload(False)
    assert _pixels_off(offloaded, ours / 255) <= 1


def test_offloaded_experts_split_a_strength_cut_schedule_as_resident_ones(a14b):
    """Video-to-video on the A14B folder: with strength 0.7 of 6 steps the loop starts at step 2, and the offloaded
    experts' segments count their high-noise steps from there (they counted from step 0: latents 1.2 apart)."""
    _, pipe, _ = a14b
    v2v = resolve_class("WanVideoToVideoPipeline").from_pipe(pipe)
    video = np.stack([_picture(i) for i in range(5)])
    kwargs = dict(prompt=PROMPTS, num_inference_steps=6, strength=0.7, guidance_scale=3.0, seed=0,
                  max_sequence_length=16, output_type="latent", progress=False)
    resident = v2v(video, **kwargs)
    v2v.enable_expert_offload()
    assert_close(v2v(video, **kwargs), resident, 1e-6, "offloaded experts")


def test_halves_of_two_lengths_run_apart_as_diffusers(a14b):
    """prompt_embeds of 512 tokens beside a negative prompt encoded at max_sequence_length=16: diffusers runs the two
    halves of guidance as two model calls of their own lengths, and so does eqxdiff (both experts, resident or
    offloaded); the negative was encoded at 512 before (56/255 off diffusers with one expert), then refused.
    Slow (tests/_slow.py): guidance apart compiles its own loop."""
    ref, pipe, _ = a14b
    noise = _noise(SHAPE, seed=4)
    kwargs = dict(guidance_scale=4.0, guidance_scale_2=2.5, max_sequence_length=16, **VIDEO)
    with torch.no_grad():
        embeds, _ = ref.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=512)
    expected = _run(ref, noise, prompt_embeds=embeds, negative_prompt=NEGATIVES, **kwargs)
    ours = pipe(prompt_embeds=embeds.numpy(), negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2
    pipe.enable_expert_offload()
    try:
        offloaded = pipe(prompt_embeds=embeds.numpy(), negative_prompt=NEGATIVES, latents=noise, progress=False,
                         **kwargs)
    finally:
        pipe.enable_expert_offload(False)
    assert _pixels_off(offloaded, ours / 255) <= 1


def test_a_negative_of_another_length_is_kept_at_its_own(t2v):
    """Wan encodes the negative prompt at max_sequence_length beside prompt_embeds of another length and keeps the
    two lengths (the halves then run apart: the slow test above checks the frames against diffusers)."""
    _, pipe = t2v
    given = np.zeros((2, 7, pipe.transformer.config.text_dim), np.float32)
    positive, negative = pipe.text_conditioning(prompt_embeds=given, negative_prompt=NEGATIVES, guided=True,
                                                max_sequence_length=16)
    assert positive.shape == (2, 7, given.shape[-1]) and negative.shape == (2, 16, given.shape[-1])
    assert np.any(np.asarray(negative) != 0)


def test_image_to_video_with_clip_tokens_matches_diffusers(i2v):
    """Wan 2.1 image-to-video: the image's VAE latents and mask as extra channels, its CLIP tokens (penultimate
    hidden state, through the folder's image processor) through added k/v; then the tokens given as image_embeds."""
    ref, pipe = i2v
    assert type(pipe) is WanImageToVideoPipeline and pipe.image_encoder is not None
    image, noise = _picture(3), _noise(SHAPE, seed=2)
    kwargs = dict(guidance_scale=5.0, **VIDEO)
    expected = _run(ref, noise, image=Image.fromarray(image), prompt=PROMPTS, negative_prompt=NEGATIVES, **kwargs)
    ours = pipe(image, PROMPTS, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs)
    assert ours.shape == (2, 9, 32, 32, 3) and _pixels_off(ours, expected) <= 2

    with torch.no_grad():
        embeds = ref.encode_image(Image.fromarray(image), "cpu")
    assert_close(pipe.encode_image(image), embeds.numpy(), 1e-4, "CLIP image tokens")
    given = pipe(image, PROMPTS, negative_prompt=NEGATIVES, image_embeds=embeds.numpy(), latents=noise,
                 progress=False, **kwargs)
    assert _pixels_off(given, expected) <= 2


def test_vae_tiling_encodes_the_condition_video_in_tiles(i2v, monkeypatch):
    """``enable_vae_tiling()`` tiles the condition video's encode too, as diffusers' ``vae.enable_tiling()`` does
    (``tests/test_wan_vae.py::test_tiled_encode_equals_diffusers_tiling``: the latents differ from the whole
    video's above the tile size); without it, the whole video."""
    _, pipe = i2v
    seen = []

    def spy(vae, video, *, tiled=False):
        seen.append(tiled)
        return np.zeros((1, 3, 4, 4, 16), np.float32)

    monkeypatch.setattr(wan_i2v, "condition_latents", spy)
    pipe.enable_vae_tiling()
    try:
        pipe.image_condition(_picture(1), None, shape=SHAPE, num_frames=9)
    finally:
        pipe.enable_vae_tiling(False)
    pipe.image_condition(_picture(1), None, shape=SHAPE, num_frames=9)
    assert seen == [True, False]


def test_condition_mask_has_the_vae_temporal_factor_channels(i2v, tmp_path):
    """The mask beside the image latents has one channel per frame of a latent frame, the VAE's temporal factor
    (diffusers' ``mask_lat_size``): a VAE halving time once (factor 2) makes a 2-channel mask, a 34-channel
    transformer. The channel check assumed 4 (36) and refused such folders; the condition equals diffusers'."""
    ref, pipe = i2v
    torch.manual_seed(0)
    vae = tiny.vae(dict(tiny.VAE_21, temperal_downsample=[False, False, True], scale_factor_temporal=2), seed=12)
    vae.save_pretrained(tmp_path / "vae", safe_serialization=True)
    config = eqxdiff.models.wan.WanTransformer3DConfig(**{**tiny.I2V_PIPELINE, "in_channels": 34})
    shapes = eqx.filter_eval_shape(eqxdiff.models.wan.WanTransformer3DModel, config, key=jax.random.key(0))
    transformer = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)  # its channels are what is checked
    ours = WanImageToVideoPipeline.from_pipe(pipe, vae=eqxdiff.load(tmp_path / "vae"), transformer=transformer)
    ours._check_channels()
    image = _picture(7)
    condition = ours.image_condition(image, None, shape=(1, 3, 4, 4, 16), num_frames=5)["condition"]
    ref = type(ref)(**{**ref.components, "vae": vae})
    pixels = ref.video_processor.preprocess(Image.fromarray(image), height=32, width=32)
    with torch.no_grad():
        _, expected = ref.prepare_latents(pixels, 1, 16, 32, 32, 5, torch.float32, "cpu", latents=torch.zeros(
            1, 16, 3, 4, 4))
    assert condition.shape == (1, 3, 4, 4, 18)
    assert_close(condition, np.moveaxis(expected.numpy(), 1, -1), 1e-4, "condition (mask, image latents)")


def test_first_last_frame_matches_diffusers(i2v, tmp_path):
    """FLF2V: both images' CLIP tokens (learned positions, pos_embed), the last frame in the condition video and
    its mask."""
    ref, pipe = i2v
    transformer = tiny.build_transformer(tiny.FLF2V_PIPELINE, seed=11)
    transformer.save_pretrained(tmp_path / "transformer", safe_serialization=True)
    flf2v = WanImageToVideoPipeline.from_pipe(pipe, transformer=eqxdiff.load(tmp_path / "transformer"))
    ref = type(ref)(**{**ref.components, "transformer": transformer})
    first, last, noise = _picture(4), _picture(5), _noise(SHAPE, seed=3)
    kwargs = dict(guidance_scale=3.0, **VIDEO)
    expected = _run(ref, noise, image=Image.fromarray(first), last_image=Image.fromarray(last), prompt=PROMPTS,
                    negative_prompt=NEGATIVES, **kwargs)
    ours = flf2v(first, PROMPTS, last_image=last, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2


def test_two_expert_image_to_video_matches_diffusers(i2v, tmp_path):
    """Wan 2.2 I2V-A14B's layout: two experts (different weights) taking latents, mask and image latents (36
    channels), no CLIP tokens, the boundary at 0.9 (at 3 steps one high-noise step, then two low-noise ones with
    guidance_scale_2)."""
    ref, pipe = i2v
    experts = {name: tiny.build_transformer(dict(tiny.T2V_PIPELINE, in_channels=36), seed=seed)
               for name, seed in (("transformer", 12), ("transformer_2", 13))}
    for name, model in experts.items():
        model.save_pretrained(tmp_path / name, safe_serialization=True)
    a14b = WanImageToVideoPipeline.from_pipe(pipe, image_encoder=None, image_processor=None, boundary_ratio=0.9,
                                             **{name: eqxdiff.load(tmp_path / name) for name in experts})
    ref = type(ref)(**{**ref.components, **experts, "image_encoder": None, "image_processor": None},
                    boundary_ratio=0.9)
    image, noise = _picture(8), _noise(SHAPE, seed=5)
    kwargs = dict(guidance_scale=4.0, guidance_scale_2=2.0, **VIDEO)
    expected = _run(ref, noise, image=Image.fromarray(image), prompt=PROMPTS, negative_prompt=NEGATIVES, **kwargs)
    ours = a14b(image, PROMPTS, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2


def test_ti2v_matches_diffusers(ti2v):
    """Wan 2.2 TI2V-5B (expand_timesteps), its text-to-video folder loaded both ways: image-to-video, where the
    image's latents replace the first latent frame at every step and its tokens get timestep 0; text-to-video, where
    every token's timestep is the step's (diffusers' per-token call; one per sample here, the same numbers). The 2.2
    VAE (z 48, 16x, patchified)."""
    (t2v_ref, t2v), (ref, pipe) = ti2v
    assert type(t2v) is WanPipeline and type(pipe) is WanImageToVideoPipeline and pipe.image_encoder is None
    assert pipe.expand_timesteps and pipe.vae_scale_factor == 16 and pipe.default_fps == 24
    image, noise = _picture(6), _noise((2, 3, 2, 2, 48), seed=4)
    kwargs = dict(guidance_scale=4.0, **VIDEO)
    expected = _run(ref, noise, image=Image.fromarray(image), prompt=PROMPTS, negative_prompt=NEGATIVES, **kwargs)
    ours = pipe(image, PROMPTS, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2
    expected = _run(t2v_ref, noise, prompt=PROMPTS, negative_prompt=NEGATIVES, **kwargs)
    assert _pixels_off(t2v(PROMPTS, negative_prompt=NEGATIVES, latents=noise, progress=False, **kwargs),
                       expected) <= 2


# -- across devices, files, flags -----------------------------------------------------------------------------------


def _implementations(model) -> set:
    layers = jax.tree_util.tree_leaves(model, is_leaf=lambda m: hasattr(m, "implementation"))
    return {m.implementation for m in layers if hasattr(m, "implementation")}


def test_attention_picks_the_denoisers_kernel_and_leaves_the_encoder_its_own(a14b):
    """load_pipeline(attention=) sets the experts' (and the VAE's) kernel; UMT5 keeps its own, since its
    relative-position bias needs a kernel that takes a logits bias (flash, cuDNN, ring and Ulysses refused every
    prompt before, naming no encoder)."""
    _, pipe, folder = a14b
    flash = eqxdiff.load_pipeline(folder, attention="flash")
    assert _implementations(flash.transformer) == _implementations(flash.transformer_2) == {"flash"}
    assert _implementations(flash.text_encoder) == _implementations(pipe.text_encoder) != {"flash"}
    np.testing.assert_array_equal(flash.encode_prompt(PROMPTS), pipe.encode_prompt(PROMPTS))


def test_mesh_equals_one_device(a14b):
    """On 8 devices (FSDP 2 x context 2 x tensor 2): the weights over fsdp, the heads over tensor, the video tokens
    over context, the guided batch [negative; positive] over the batch axes; the two experts' frames are the one
    device's."""
    _, pipe, folder = a14b
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=2,
                                ici_tensor_parallelism=2))
    sharded = eqxdiff.load_pipeline(folder, mesh=mesh)
    q = sharded.transformer_2.blocks[0].attn1.to_q.weight
    assert q.sharding.spec == P("tensor", "fsdp")
    noise = _noise((1, 3, 4, 4, 16), seed=5)
    kwargs = dict(guidance_scale=4.0, guidance_scale_2=2.0, latents=noise, output_type="latent", progress=False,
                  **VIDEO)
    one = pipe(PROMPTS[0], **kwargs)
    assert_close(sharded(PROMPTS[0], **kwargs), one, 1e-4, "mesh vs one device")


def test_generate_writes_an_mp4_and_lists_the_video_flags(t2v, i2v, tmp_path, capsys):
    """eqxdiff-generate on a saved Wan folder: an MP4 of the pipeline's frames (lossy H.264: close, not equal) with
    its parameters; the flags come from the signatures (an image-to-video folder's --image, --last-image)."""
    _, pipe = t2v
    folder = save_pipeline(pipe, tmp_path / "t2v")
    argv = ["--model", str(folder), "--prompt", "a red cat", "--num-frames", "9", "--height", "32", "--width", "32",
            "--steps", "3", "--seed", "3", "--no-progress", "--output-dir", str(tmp_path / "out")]
    (path,) = generate.main(argv)
    assert path.name == "video_0.mp4"
    frames = read_video(path)
    assert frames.shape == (9, 32, 32, 3)
    ours = pipe("a red cat", seed=3, progress=False, **VIDEO)[0]
    assert np.mean(np.abs(frames.astype(float) - ours)) < 12
    params = read_parameters(path)
    assert params["num_frames"] == 9 and params["fps"] == 16 and params["pipeline"] == "WanPipeline"

    with pytest.raises(SystemExit):
        generate.main(["--model", str(folder), "--help"])
    t2v_help = " ".join(capsys.readouterr().out.split())
    for flag in ("--num-frames", "--fps", "--boundary-ratio", "--guidance-scale-2", "--num-videos-per-prompt"):
        assert flag in t2v_help, flag
    i2v_folder = save_pipeline(i2v[1], tmp_path / "i2v")
    with pytest.raises(SystemExit):
        generate.main(["--model", str(i2v_folder), "--help"])
    i2v_help = " ".join(capsys.readouterr().out.split())
    assert "--image" in i2v_help and "--last-image" in i2v_help and "--latents" not in i2v_help


# -- errors ---------------------------------------------------------------------------------------------------------


def test_num_frames_and_sizes_name_the_nearest_valid_values(t2v, tmp_path):
    """The shared check (CallLimits.frame_factor: 4 for Wan's VAE, 8 for LTX-Video's), through the pipeline and
    through eqxdiff-generate before loading."""
    with pytest.raises(InputError, match=r"num_frames=80 must be 8k\+1 .*compresses time by 8.*; try 73 or 81"):
        check_arguments({"num_frames": 80}, CallLimits(frame_factor=8))
    check_arguments({"num_frames": 161}, CallLimits(frame_factor=8))
    _, pipe = t2v
    assert pipe.call_limits().frame_factor == 4
    with pytest.raises(ValueError, match="frame_chunk=0 must be a positive int"):
        pipe.enable_vae_tiling(frame_chunk=0)
    with pytest.raises(InputError, match=r"num_frames=80 must be 4k\+1 .*compresses time by 4.*; try 77 or 81"):
        pipe("a cat", num_frames=80, progress=False)
    with pytest.raises(InputError, match=r"height=40 must be a multiple of 16 \(the VAE downsamples by 8 and the "
                                         r"transformer takes 2x2 patches\); try height=32"):
        pipe("a cat", height=40, progress=False)
    folder = save_pipeline(pipe, tmp_path / "t2v")  # eqxdiff-generate refuses before loading
    with pytest.raises(InputError, match=r"--num-frames 10 must be 4k\+1 .*; try 9 or 13"):
        generate.validate(["--model", str(folder), "--prompt", "x", "--num-frames", "10"])


def test_expert_and_image_errors(t2v, a14b, i2v, ti2v):
    ti2v = ti2v[1][1]  # image-to-video
    _, pipe = t2v
    with pytest.raises(InputError, match="guidance_scale_2=3.0 applies to the low-noise expert"):
        pipe("a cat", guidance_scale_2=3.0, progress=False)
    with pytest.raises(InputError, match="boundary_ratio=0.9 switches to a second expert, but this pipeline has no "
                                         "transformer_2"):
        pipe("a cat", boundary_ratio=0.9, progress=False)
    with pytest.raises(InputError, match=r"^boundary_ratio must be in \[0, 1\], got 1.5 \(the fraction of the"):
        a14b[1]("a cat", boundary_ratio=1.5, progress=False)
    image = _picture(0)
    with pytest.raises(InputError, match="image has width 32, height 32 pixels but the video has width 64, height 32"):
        i2v[1](image, "a cat", width=64, progress=False)
    with pytest.raises(InputError, match=r"image has width 32, height 24 pixels, not multiples of 16 \(the VAE "
                                         r"downsamples by 8 and the transformer takes 2x2 patches\); resize or crop it "
                                         "to width 32, height 16"):
        i2v[1](image[:24], "a cat", progress=False)
    with pytest.raises(InputError, match="pass image="):
        i2v[1](prompt="a cat", progress=False)
    with pytest.raises(InputError, match="last_image is the video's last frame .* num_frames=1 gives them one "
                                         "frame; pass num_frames of at least 5"):  # found by fuzzing: a TypeError
        i2v[1](image, "a cat", last_image=image, num_frames=1, progress=False)
    with pytest.raises(InputError, match="last_image: this pipeline .* conditions on the first frame only"):
        ti2v(image, "a cat", last_image=image, progress=False, **VIDEO)
    with pytest.raises(InputError, match="image_embeds: this transformer takes no CLIP image tokens"):
        ti2v(image, "a cat", image_embeds=np.zeros((1, 5, 4), np.float32), progress=False, **VIDEO)
