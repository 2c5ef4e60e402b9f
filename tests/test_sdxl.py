"""SDXL end to end against diffusers (every pixel within 2/255 from the same initial noise): text-to-image on two
UNet configs (with and without ``force_zeros_for_empty_prompt``; negative prompts for each encoder),
image-to-image, the refiner (aesthetic score, no first text encoder), the base -> refiner hand-off, few-step
distilled runs (SDXL-Lightning's trailing Euler at guidance 0 with a UNet read from a lone .safetensors file, and its
one-step x0 variant; Hyper-SD's LCM at ``timesteps=[800]``, trailing DDIM and one-step TCD at guidance 0; LCM and
TCD with a guidance-embedding UNet), and the errors a user can make.

One tiny pipeline folder per role, built once for the module; tests share compiled programs (same shapes, guidance
and scheduler), so most of the time is the first compile of each program.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.pipelines import (
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    StableDiffusionXLPipeline,
    save_pipeline,
)
from eqxdiff.pipelines import stable_diffusion_xl as sdxl
from eqxdiff.pipelines._latents import noise_draws

from . import _tiny_sdxl as tiny
from ._util import assert_close, nchw_to_nhwc, nhwc_to_nchw

PROMPTS = ["a red cat", "two dogs"]
SHAPE = (2, 16, 16, 4)  # latents of two 32x32 images


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _run(ref, **kwargs):
    with torch.no_grad():
        return ref(output_type="np", **kwargs).images


def _image_tensor(image):
    return torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255


def _mock_draws(monkeypatch, module, *, posterior=(), noise=()):
    """diffusers' VAE posterior samples and initial noise from our arrays (channels-last), in call order."""
    posterior, noise = iter(posterior), iter(noise)
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(next(noise)))
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(next(posterior)))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl_base")
    ref = tiny.build_base(folder)
    return folder, ref, eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def refiner(tmp_path_factory, base):
    folder = tmp_path_factory.mktemp("sdxl_refiner")
    ref = tiny.build_refiner(folder, base[1])
    return folder, ref, eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def latents():
    return np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)


def test_text_to_image_matches_diffusers(base, latents):
    """UNet A, zeros for the empty negative prompt (force_zeros_for_empty_prompt), prompt_2 for the second
    encoder, negative micro-conditioning; then the same call from diffusers' own prompt embeddings."""
    _, ref, pipe = base
    assert type(pipe) is StableDiffusionXLPipeline and pipe.force_zeros_for_empty_prompt
    assert pipe.text_encoder is not None and pipe.tokenizer is not None
    kwargs = dict(num_inference_steps=4, guidance_scale=5.0, height=32, width=32, prompt_2=["green", "blue sky"],
                  crops_coords_top_left=(2, 3), original_size=(40, 24))
    expected = _run(ref, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **kwargs)
    ours = pipe(PROMPTS, latents=latents, progress=False, **kwargs)
    assert ours.shape == (2, 32, 32, 3) and ours.dtype == np.uint8
    assert _pixels_off(ours, expected) <= 2
    assert np.std(ours) > 1

    with torch.no_grad():
        embeds, negative, pooled, negative_pooled = ref.encode_prompt(PROMPTS, kwargs.pop("prompt_2"),
                                                                      do_classifier_free_guidance=True)
    assert not negative.any() and not negative_pooled.any()
    ours_embeds, ours_pooled = pipe.text_conditioning(PROMPTS, ["green", "blue sky"], guidance=sdxl.Guidance(5.0))
    assert_close(ours_embeds, torch.cat([negative, embeds]).numpy(), 1e-4, "prompt embeddings")
    assert_close(ours_pooled, torch.cat([negative_pooled, pooled]).numpy(), 1e-4, "pooled embeddings")
    given = pipe(prompt_embeds=embeds.numpy(), pooled_prompt_embeds=pooled.numpy(),
                 negative_prompt_embeds=negative.numpy(), negative_pooled_prompt_embeds=negative_pooled.numpy(),
                 latents=latents, progress=False, **kwargs)
    assert _pixels_off(given, expected) <= 2

    # one prompt, two images (each row keeps its own noise and the prompt's conditioning)
    kwargs.update(num_images_per_prompt=2, prompt_2="green")
    expected = _run(ref, prompt="a red cat", latents=nhwc_to_nchw(latents), **kwargs)
    assert _pixels_off(pipe("a red cat", latents=latents, progress=False, **kwargs), expected) <= 2


def test_empty_second_prompts_fall_back_as_in_diffusers(base):
    """diffusers' ``prompt_2 or prompt``: an empty string as ``prompt_2`` / ``negative_prompt_2`` means the first
    prompt (found fuzzing the SDXL ControlNet pipelines: prompt_2="" gave 141/255)."""
    _, ref, pipe = base
    with torch.no_grad():
        embeds, negative, pooled, negative_pooled = ref.encode_prompt(
            "a red cat", "", negative_prompt="blurry", negative_prompt_2="", do_classifier_free_guidance=True)
    ours_embeds, ours_pooled = pipe.text_conditioning("a red cat", "", "blurry", "", guidance=sdxl.Guidance(5.0))
    assert_close(ours_embeds, torch.cat([negative, embeds]).numpy(), 1e-4, "prompt embeddings")
    assert_close(ours_pooled, torch.cat([negative_pooled, pooled]).numpy(), 1e-4, "pooled embeddings")


def test_time_ids_follow_diffusers(base, refiner):
    """Micro-conditioning rules: text-to-image (negative sizes only when both are given), image-to-image (they
    default to the positive ones; the positive crop), the refiner's aesthetic scores."""
    _, ref, pipe = base
    _, ref_refiner, refiner_pipe = refiner
    sizes = dict(original_size=(40, 24), crops_coords_top_left=(2, 3), target_size=(16, 8))
    for negative in [dict(negative_original_size=(64, 48)),
                     dict(negative_original_size=(64, 48), negative_crops_coords_top_left=(1, 1),
                          negative_target_size=(16, 24))]:
        ours = pipe.add_time_ids(height=32, width=32, pooled_dim=tiny.POOLED, **sizes, **negative)
        both = "negative_target_size" in negative
        expected = ref._get_add_time_ids(sizes["original_size"], sizes["crops_coords_top_left"], sizes["target_size"],
                                         dtype=torch.float32, text_encoder_projection_dim=tiny.POOLED)
        expected_negative = ref._get_add_time_ids(
            negative["negative_original_size"], negative["negative_crops_coords_top_left"],
            negative["negative_target_size"], dtype=torch.float32,
            text_encoder_projection_dim=tiny.POOLED) if both else expected
        np.testing.assert_array_equal(ours[0], expected[0].numpy())
        np.testing.assert_array_equal(ours[1], expected_negative[0].numpy())
    img2img = StableDiffusionXLImg2ImgPipeline.from_pipe(pipe)
    from diffusers import StableDiffusionXLImg2ImgPipeline as Reference

    ref_img2img = Reference(**ref.components)
    for ours_pipe, reference, scores in ((img2img, ref_img2img, (6.0, 2.5)), (refiner_pipe, ref_refiner, (7.0, 1.5))):
        ours = ours_pipe.add_time_ids(height=32, width=32, pooled_dim=tiny.POOLED, aesthetic_score=scores[0],
                                      negative_aesthetic_score=scores[1], negative_crops_coords_top_left=(5, 5),
                                      negative_target_size=(8, 8), **sizes)
        expected = reference._get_add_time_ids(sizes["original_size"], sizes["crops_coords_top_left"],
                                               sizes["target_size"], *scores, sizes["original_size"], (5, 5), (8, 8),
                                               dtype=torch.float32, text_encoder_projection_dim=tiny.POOLED)
        np.testing.assert_array_equal(np.stack(ours), torch.cat(expected).numpy())


def test_second_unet_config_encodes_the_empty_negative_prompt(tmp_path, latents):
    """UNet B (three levels, attention in the first two, other heads and time-id width) in a folder with
    force_zeros_for_empty_prompt=false: the negative is the encoded empty prompt. clip_skip and guidance_rescale;
    then negative_prompt and a different negative_prompt_2."""
    ref = tiny.build_base(tmp_path, unet_config=tiny.UNET_B, force_zeros_for_empty_prompt=False, seed=5)
    pipe = eqxdiff.load_pipeline(tmp_path)
    assert pipe.force_zeros_for_empty_prompt is False
    kwargs = dict(num_inference_steps=3, guidance_scale=4.0, guidance_rescale=0.6, clip_skip=1, height=32, width=32)
    expected = _run(ref, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **kwargs)
    ours = pipe(PROMPTS, latents=latents, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2
    # negative prompts for each encoder (the same compiled loop): negative_prompt_2 goes to the second encoder
    negatives = dict(negative_prompt=["blurry", "dark room"], negative_prompt_2=["grainy photo", "fog"])
    expected = _run(ref, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **negatives, **kwargs)
    ours_negatives = pipe(PROMPTS, latents=latents, progress=False, **negatives, **kwargs)
    assert _pixels_off(ours_negatives, expected) <= 2
    first_only = pipe(PROMPTS, latents=latents, progress=False, negative_prompt=negatives["negative_prompt"], **kwargs)
    assert _pixels_off(ours_negatives, first_only / 255) > 2
    # the folder's option round-trips through save_pipeline, and diffusers reads it back
    save_pipeline(pipe, tmp_path / "again")
    index = json.loads((tmp_path / "again" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and index["force_zeros_for_empty_prompt"] is False
    assert eqxdiff.load_pipeline(tmp_path / "again").force_zeros_for_empty_prompt is False


def test_image_to_image_matches_diffusers(base, monkeypatch):
    """The base folder as StableDiffusionXLImg2ImgPipeline (same components): strength, image-to-image
    micro-conditioning (negative sizes default to the positive ones)."""
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_img2img as module

    folder, ref, _ = base
    pipe = StableDiffusionXLImg2ImgPipeline.from_pretrained(folder)
    assert type(pipe) is StableDiffusionXLImg2ImgPipeline and pipe.requires_aesthetics_score is False
    image = np.random.default_rng(1).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    draws = noise_draws(jax.random.key(7), SHAPE)
    _mock_draws(monkeypatch, module, posterior=[draws.image], noise=[draws.noise])
    kwargs = dict(strength=0.5, num_inference_steps=4, guidance_scale=5.0, target_size=(40, 40))
    expected = _run(module.StableDiffusionXLImg2ImgPipeline(**ref.components), prompt=PROMPTS,
                    image=_image_tensor(image), **kwargs)
    ours = pipe(PROMPTS, image=image, seed=7, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2


def test_refiner_and_hand_off_match_diffusers(base, refiner, monkeypatch):
    """The refiner (no first text encoder, aesthetic scores, encoded empty negative) from pixels; then the base
    stops at denoising_end and hands its latents to the refiner from denoising_start, on one schedule."""
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_img2img as module

    _, base_ref, base_pipe = base
    _, ref, pipe = refiner
    assert type(pipe) is StableDiffusionXLImg2ImgPipeline and pipe.requires_aesthetics_score
    assert pipe.text_encoder is None and pipe.tokenizer is None and not pipe.force_zeros_for_empty_prompt
    common = dict(num_inference_steps=4, guidance_scale=5.0, aesthetic_score=7.0, negative_aesthetic_score=2.0)

    image = np.random.default_rng(2).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    draws = noise_draws(jax.random.key(3), SHAPE)
    _mock_draws(monkeypatch, module, posterior=[draws.image], noise=[draws.noise])
    expected = _run(ref, prompt=PROMPTS, image=_image_tensor(image), strength=0.5, **common)
    ours = pipe(PROMPTS, image=image, strength=0.5, seed=3, progress=False, **common)
    assert _pixels_off(ours, expected) <= 2

    noise = np.random.default_rng(4).standard_normal(SHAPE).astype(np.float32)
    steps = dict(num_inference_steps=4, guidance_scale=5.0)
    with torch.no_grad():
        handed = base_ref(PROMPTS, latents=nhwc_to_nchw(noise), denoising_end=0.5, output_type="latent",
                          **steps).images
    expected = _run(ref, prompt=PROMPTS, image=handed, denoising_start=0.5, **common)
    ours_handed = base_pipe(PROMPTS, latents=noise, denoising_end=0.5, output_type="latent", progress=False, **steps)
    assert ours_handed.shape == SHAPE
    assert_close(ours_handed, nchw_to_nhwc(handed), 1e-4, "handed-over latents")
    ours = pipe(PROMPTS, image=ours_handed, denoising_start=0.5, progress=False, **common)
    assert _pixels_off(ours, expected) <= 2

    # denoising_end=1 runs the whole schedule (diffusers ignores the value there: the same run, the same program)
    with torch.no_grad():
        whole = base_ref(PROMPTS, latents=nhwc_to_nchw(noise), denoising_end=1.0, output_type="latent", **steps).images
    assert_close(base_pipe(PROMPTS, latents=noise, denoising_end=1.0, output_type="latent", progress=False, **steps),
                 nchw_to_nhwc(whole), 1e-4, "denoising_end=1.0")


def test_lightning_unet_from_a_lone_file_with_trailing_euler(base, tmp_path, latents):
    """SDXL-Lightning as its users run it: a UNet state dict in one .safetensors file (diffusers' names, no
    config) loaded into the base's UNet config, Euler with trailing timesteps, guidance 0; its one-step x0 UNet.
    Then Hyper-SD's recipes on such a UNet at guidance 0: the 1-step UNet with LCM at timesteps=[800], N steps of
    DDIM with trailing timesteps, and the 1-step TCD recipe (eta=1)."""
    from diffusers import DDIMScheduler, EulerDiscreteScheduler, LCMScheduler, TCDScheduler
    from safetensors.torch import save_file

    folder, ref, pipe = base
    lightning = tiny.unet(tiny.UNET_A, seed=40)
    save_file(lightning.state_dict(), tmp_path / "lightning_4step_unet.safetensors")
    unet = eqxdiff.load(tmp_path / "lightning_4step_unet.safetensors", config=folder, subfolder="unet")
    distilled = StableDiffusionXLPipeline.from_pipe(pipe, unet=unet)
    fast = distilled.with_scheduler("euler", timestep_spacing="trailing")
    scheduler = EulerDiscreteScheduler.from_config(ref.scheduler.config, timestep_spacing="trailing")
    ref_fast = type(ref)(**{**ref.components, "unet": lightning, "scheduler": scheduler})
    kwargs = dict(num_inference_steps=4, guidance_scale=0.0, height=32, width=32)
    expected = _run(ref_fast, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **kwargs)
    ours = fast(PROMPTS, latents=latents, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2
    assert _pixels_off(ours, _run(ref, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **kwargs)) > 2  # its own UNet

    # the one-step x0 UNet: one trailing step (t = 999) predicting the sample itself
    x0 = fast.with_scheduler("euler", timestep_spacing="trailing", prediction_type="sample")
    ref_x0 = type(ref)(**{**ref_fast.components, "scheduler": EulerDiscreteScheduler.from_config(
        ref.scheduler.config, timestep_spacing="trailing", prediction_type="sample")})
    kwargs["num_inference_steps"] = 1
    expected = _run(ref_x0, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **kwargs)
    assert _pixels_off(x0(PROMPTS, latents=latents, progress=False, **kwargs), expected) <= 2

    # Hyper-SD (the lone file's UNet standing in for its UNet or fused LoRA), each scheduler from the base's: the
    # 1-step UNet with LCM from t = 800, N steps of trailing DDIM, the 1-step TCD recipe (the consistency
    # schedulers add no noise after their last step: nothing is drawn)
    for name, cls, options, recipe in (
            ("lcm", LCMScheduler, {}, dict(num_inference_steps=1, timesteps=[800])),
            ("ddim", DDIMScheduler, dict(timestep_spacing="trailing"), dict(num_inference_steps=4)),
            ("tcd", TCDScheduler, {}, dict(num_inference_steps=1, eta=1.0))):
        hyper = distilled.with_scheduler(name, **options)
        ref_hyper = type(ref)(**{**ref_fast.components, "scheduler": cls.from_config(ref.scheduler.config, **options)})
        common = dict(guidance_scale=0.0, height=32, width=32, **recipe)
        expected = _run(ref_hyper, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **common)
        assert _pixels_off(hyper(PROMPTS, latents=latents, progress=False, **common), expected) <= 2, name


def test_consistency_schedulers_with_a_guidance_embedding_unet(base, tmp_path, latents, monkeypatch):
    """An LCM-distilled UNet (time_cond_proj_dim: the guidance scale enters as an embedding, no classifier-free
    batch) with LCMScheduler on custom timesteps, then TCDScheduler with the pipeline's eta; the schedulers'
    re-noising draws are given to diffusers from our loop's key."""
    from diffusers import LCMScheduler, TCDScheduler
    from diffusers.schedulers import scheduling_lcm, scheduling_tcd

    _, ref, pipe = base
    distilled = tiny.unet(tiny.UNET_A, seed=50, time_cond_proj_dim=8)
    distilled.save_pretrained(tmp_path / "unet", safe_serialization=True)
    unet = eqxdiff.load(tmp_path / "unet")
    loop_key = noise_draws(jax.random.key(0), SHAPE).loop_key
    _, first = jax.random.split(loop_key)  # the loop's first step draws from this key
    renoise = nhwc_to_nchw(jax.random.normal(first, SHAPE, jnp.float32))
    for module, cls, name, kwargs in (
            (scheduling_lcm, LCMScheduler, "lcm", dict(timesteps=[999, 499])),
            (scheduling_tcd, TCDScheduler, "tcd", dict(num_inference_steps=2, eta=0.5))):
        monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: renoise)
        ref_fast = type(ref)(**{**ref.components, "unet": distilled, "scheduler": cls.from_config(ref.scheduler.config)})
        fast = StableDiffusionXLPipeline.from_pipe(pipe, unet=unet).with_scheduler(name)
        common = dict(guidance_scale=8.0, height=32, width=32)
        expected = _run(ref_fast, prompt=PROMPTS, latents=nhwc_to_nchw(latents), **common, **kwargs)
        ours = fast(PROMPTS, latents=latents, seed=0, progress=False, **common, **kwargs)
        assert _pixels_off(ours, expected) <= 2, name


def test_errors_name_the_fix(base, refiner, tmp_path):
    folder, _, pipe = base
    _, _, refiner_pipe = refiner
    with pytest.raises(ValueError, match="pass prompt or prompt_embeds"):
        pipe()
    with pytest.raises(ValueError, match="prompt_embeds needs pooled_prompt_embeds"):
        pipe(prompt_embeds=np.zeros((1, 16, 80), np.float32))
    with pytest.raises(ValueError, match=r"latents must have shape \(1, 16, 16, 4\)"):
        pipe("a cat", latents=np.zeros((1, 4, 16, 16), np.float32), height=32, width=32)
    with pytest.raises(ValueError, match=re.escape("height=31 must be a multiple of 2 (the VAE downsamples by 2); "
                                                   "try height=30")):
        pipe("a cat", height=31, width=32)
    with pytest.raises(ValueError, match="denoising_start needs image="):
        pipe("a cat", denoising_start=0.5)
    with pytest.raises(ValueError, match="denoising_end=1.5 must be a float in"):
        pipe("a cat", denoising_end=1.5)
    with pytest.raises(ValueError, match="denoising_start=0.8 must be smaller than denoising_end=0.5"):
        pipe("a cat", image=np.zeros((1, 32, 32, 3), np.uint8), denoising_start=0.8, denoising_end=0.5)
    image = np.zeros((1, 32, 32, 3), np.uint8)  # 2 of 4 steps left by strength, both above denoising_end's cut
    with pytest.raises(ValueError, match=r"denoising_end=0.3 after strength=0.5 with 4 steps leaves no denoising"):
        StableDiffusionXLImg2ImgPipeline.from_pipe(pipe)("a cat", image=image, strength=0.5, denoising_end=0.3,
                                                         num_inference_steps=4)
    with pytest.raises(ValueError, match="prompt_2 has 1 entries but prompt has 2"):
        pipe(PROMPTS, prompt_2=["x"])
    with pytest.raises(ValueError, match="needs image="):
        refiner_pipe("a cat")
    with pytest.raises(ValueError, match="output_type='PIL'; choose one of"):
        pipe("a cat", output_type="PIL")
    with pytest.raises(ValueError, match="got 3 images for 2 outputs"):
        refiner_pipe(PROMPTS, image=np.zeros((3, 32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="needs image= and mask_image="):
        StableDiffusionXLInpaintPipeline.from_pipe(pipe)("a cat")
    # the refiner's UNet wants an aesthetic score: without requires_aesthetics_score the hint says so
    plain = StableDiffusionXLImg2ImgPipeline.from_pipe(refiner_pipe, requires_aesthetics_score=False)
    with pytest.raises(ValueError, match="an aesthetic score in place of the target size: use "
                       "StableDiffusionXLImg2ImgPipeline with requires_aesthetics_score=True"):
        plain("a cat", image=np.zeros((1, 32, 32, 3), np.uint8))
    with pytest.raises(TypeError, match="missing component"):
        StableDiffusionXLPipeline.from_pipe(refiner_pipe, text_encoder_2=None)
    with pytest.raises(TypeError, match="give tokenizer and text_encoder together"):
        StableDiffusionXLPipeline.from_pipe(pipe, tokenizer=None)
    with pytest.raises(TypeError, match="option force_zeros_for_empty_prompt='yes' must be a bool"):
        StableDiffusionXLPipeline.from_pipe(pipe, force_zeros_for_empty_prompt="yes")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    (lacking / "model_index.json").write_text(json.dumps({k: v for k, v in index.items() if k != "text_encoder_2"}))
    with pytest.raises(eqxdiff.CheckpointError, match=r"lacks component\(s\) \['text_encoder_2'\]"):
        eqxdiff.load_pipeline(lacking)
    with pytest.raises(eqxdiff.CheckpointError, match="cannot use"):
        eqxdiff.pipelines.StableDiffusionPipeline.from_pretrained(folder)


def test_pipeline_classes_are_in_the_family_table():
    from eqxdiff.core import resolve_class

    for cls in (StableDiffusionXLPipeline, StableDiffusionXLImg2ImgPipeline, StableDiffusionXLInpaintPipeline):
        assert resolve_class(cls.CLASS_NAME) is cls
    assert jnp.asarray(sdxl.time_ids((1, 2), (3, 4), (5, 6))).tolist() == [1, 2, 3, 4, 5, 6]
