"""The ControlNet pipelines that start from a picture, against diffusers' (every pixel within 2/255 from the same
draws): SDXL image-to-image (aesthetic-score conditioning, diffusers' default strength and scale), SD and SDXL
inpainting (9-channel UNet at diffusers' defaults, 4-channel at partial strength). diffusers draws the picture's VAE
samples and the initial noise from its generator; the tests give it ours (``noise_draws`` of the call's key) through
its ``retrieve_latents`` / ``randn_tensor``. One folder and one compiled loop per case (:mod:`tests.test_controlnet`
has the text-to-image ones and SD image-to-image)."""

import jax
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.pipelines import InputError
from eqxdiff.pipelines.controlnet import (
    StableDiffusionControlNetInpaintPipeline,
    StableDiffusionXLControlNetImg2ImgPipeline,
    StableDiffusionXLControlNetInpaintPipeline,
)

from . import _tiny_controlnet as tiny
from . import _tiny_sdxl

PROMPTS = ["a red cat", "two dogs"]
SHAPE = (2, 16, 16, 4)


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _tensor(image):
    return torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255


def test_sdxl_controlnet_img2img_matches_diffusers(tmp_path, monkeypatch):
    """diffusers' defaults (strength 0.8, controlnet_conditioning_scale 0.8, guidance 5) on a UNet and net
    conditioned on the aesthetic score (requires_aesthetics_score), loaded from the saved folder."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_sd_xl_img2img as module

    width = 5 * 8 + _tiny_sdxl.POOLED  # time ids: sizes, crop and the aesthetic score
    components = _tiny_sdxl.base_components(unet_config=dict(_tiny_sdxl.UNET_A,
                                                             projection_class_embeddings_input_dim=width))
    net = tiny.controlnet(tiny.SDXL_PIPE_CONTROLNET, 24, projection_class_embeddings_input_dim=width)
    ref = _tiny_sdxl.save(module.StableDiffusionXLControlNetImg2ImgPipeline(
        **components, controlnet=net, requires_aesthetics_score=True, add_watermarker=False), tmp_path)
    pipe = eqxdiff.load_pipeline(tmp_path)
    assert type(pipe) is StableDiffusionXLControlNetImg2ImgPipeline and pipe.requires_aesthetics_score
    key = jax.random.key(3)
    tiny.with_our_draws(module, monkeypatch, key, SHAPE)
    picture = np.random.default_rng(4).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    control = tiny.control_images(1, 32, seed=5)
    # diffusers' aesthetic-score time ids fail on its default original_size (a torch.Size): pass it as a tuple
    kw = dict(num_inference_steps=5, original_size=(32, 32))
    with torch.no_grad():
        expected = ref(PROMPTS, image=_tensor(picture), control_image=_tensor(control), output_type="np",
                       **kw).images
    ours = pipe(PROMPTS, image=picture, control_image=control, key=key, progress=False, **kw)
    assert ours.shape == (2, 32, 32, 3) and _pixels_off(ours, expected) <= 2


def _picture_and_mask(seed: int):
    """Two 32x32 pictures and masks (uint8, white = repaint: a different box in each)."""
    picture = np.random.default_rng(seed).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    mask = np.zeros((2, 32, 32), np.uint8)
    mask[0, 4:20, 8:30] = 255
    mask[1, 10:32, 0:14] = 255
    return picture, mask


def _sd_inpaint(folder, channels: int):
    """diffusers' tiny SD ControlNet inpainting pipeline (a ``channels``-input UNet), saved, and ours loaded."""
    import diffusers

    from ._tiny_sd import build_pipeline, randomize_

    base = build_pipeline(folder / "base", scheduler="ddim")
    unet = base.unet
    if channels == 9:
        unet = diffusers.UNet2DConditionModel.from_config({**base.unet.config, "in_channels": 9})
        randomize_(unet, seed=9)
    ref = diffusers.StableDiffusionControlNetInpaintPipeline(**{**base.components, "unet": unet.eval()},
                                                             controlnet=tiny.controlnet(tiny.SD_PIPE_CONTROLNET, 14))
    ref.set_progress_bar_config(disable=True)
    ref.save_pretrained(folder / "pipe", safe_serialization=True)
    pipe = eqxdiff.load_pipeline(folder / "pipe")
    assert type(pipe) is StableDiffusionControlNetInpaintPipeline and pipe.unet.config.in_channels == channels
    return ref, pipe


@pytest.mark.parametrize("channels,posterior_calls,kw", [
    (9, ["masked"], {}),  # diffusers' defaults: strength 1, scale 0.5, guidance 7.5
    (4, ["image", "masked"], dict(strength=0.7, controlnet_conditioning_scale=0.9, control_guidance_end=0.6)),
])
def test_sd_controlnet_inpaint_matches_diffusers(tmp_path, monkeypatch, channels, posterior_calls, kw):
    """An inpainting UNet (latents, mask, masked-image latents) and an ordinary one (the known region blended back
    after each step); the nets see the latents alone and the control image unmasked, as diffusers'. With the
    ordinary UNet the control image is an inpainting net's condition (floats, the masked pixels -1)."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_inpaint as module

    ref, pipe = _sd_inpaint(tmp_path, channels)
    key = jax.random.key(6)
    tiny.with_our_draws(module, monkeypatch, key, SHAPE, posterior_calls)
    picture, mask = _picture_and_mask(7)
    control = tiny.control_images(1, 32, seed=8) / np.float32(255)
    if channels == 4:  # diffusers' make_inpaint_condition: the picture, the masked pixels -1
        control = np.where(mask[:1, :, :, None] > 0, np.float32(-1), picture[:1] / np.float32(255))
    with torch.no_grad():
        expected = ref(PROMPTS, image=_tensor(picture), mask_image=torch.from_numpy(mask[:, None] / 255).float(),
                       control_image=torch.from_numpy(control).permute(0, 3, 1, 2).float(), output_type="np",
                       num_inference_steps=4, **kw).images
    ours = pipe(PROMPTS, image=picture, mask_image=mask, control_image=control, key=key, num_inference_steps=4,
                progress=False, **kw)
    assert ours.shape == (2, 32, 32, 3) and _pixels_off(ours, expected) <= 2


def _sdxl_inpaint(folder, channels: int):
    from diffusers.pipelines.controlnet import pipeline_controlnet_inpaint_sd_xl as module

    ref = _tiny_sdxl.save(module.StableDiffusionXLControlNetInpaintPipeline(
        **_tiny_sdxl.base_components(in_channels=channels, seed=30),
        controlnet=tiny.controlnet(tiny.SDXL_PIPE_CONTROLNET, 25), add_watermarker=False), folder)
    pipe = eqxdiff.load_pipeline(folder)
    assert type(pipe) is StableDiffusionXLControlNetInpaintPipeline and pipe.unet.config.in_channels == channels
    return ref, pipe


@pytest.mark.parametrize("xl", [False, True])
def test_controlnet_inpaint_crops_the_control_image_as_diffusers(tmp_path, monkeypatch, xl):
    """padding_mask_crop: a 40x56 PIL picture's box around its mask (padded, widened to the picture's aspect), the
    control image cut to the same box, inpainted at the picture's size (diffusers' default here) and pasted back."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_inpaint as sd_module
    from diffusers.pipelines.controlnet import pipeline_controlnet_inpaint_sd_xl as xl_module
    from PIL import Image

    ref, pipe = (_sdxl_inpaint if xl else _sd_inpaint)(tmp_path, 9)
    module = xl_module if xl else sd_module
    rng = np.random.default_rng(12)
    picture = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    control = Image.fromarray(np.repeat(np.repeat(rng.integers(0, 256, (10, 14, 3), dtype=np.uint8), 4, 0), 4, 1))
    mask = np.zeros((40, 56), np.uint8)
    mask[12:20, 30:41] = 255
    mask = Image.fromarray(mask)
    key = jax.random.key(13)
    tiny.with_our_draws(module, monkeypatch, key, (2, 20, 28, 4), ["image", "masked"] if xl else ["masked"])
    with torch.no_grad():
        expected = np.stack([np.asarray(im) for im in ref(PROMPTS, image=picture, mask_image=mask,
                                                            control_image=control, padding_mask_crop=3,
                                                            num_inference_steps=3).images])
    ours = pipe(PROMPTS, image=picture, mask_image=mask, control_image=control, padding_mask_crop=3, key=key,
                num_inference_steps=3, progress=False)
    assert ours.shape == (2, 40, 56, 3) and np.abs(ours.astype(int) - expected).max() <= 2
    with pytest.raises(InputError, match="padding_mask_crop needs image=, mask_image= and control_image= as PIL"):
        pipe(PROMPTS, image=picture, mask_image=mask, control_image=np.asarray(control), padding_mask_crop=3)


@pytest.mark.parametrize("channels,kw", [
    (9, {}),  # diffusers' defaults: strength 0.9999, scale 1.0, guidance 5
    (4, dict(strength=0.7, controlnet_conditioning_scale=0.7, guidance_rescale=0.5, control_guidance_start=0.3)),
])
def test_sdxl_controlnet_inpaint_matches_diffusers(tmp_path, monkeypatch, channels, kw):
    """SDXL: an inpainting UNet and an ordinary one, as SD's above, with SDXL's micro-conditioning."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_inpaint_sd_xl as module

    ref, pipe = _sdxl_inpaint(tmp_path, channels)
    key = jax.random.key(9)
    tiny.with_our_draws(module, monkeypatch, key, SHAPE, ["image", "masked"])
    picture, mask = _picture_and_mask(10)
    control = tiny.control_images(1, 32, seed=11)
    with torch.no_grad():
        expected = ref(PROMPTS, image=_tensor(picture), mask_image=torch.from_numpy(mask[:, None] / 255).float(),
                       control_image=_tensor(control), output_type="np", num_inference_steps=5, **kw).images
    ours = pipe(PROMPTS, image=picture, mask_image=mask, control_image=control, key=key, num_inference_steps=5,
                progress=False, **kw)
    assert ours.shape == (2, 32, 32, 3) and _pixels_off(ours, expected) <= 2


def test_sdxl_controlnet_inpaint_negative_time_ids_are_the_positive_ones(tmp_path):
    """diffusers' SDXL ControlNet inpainting builds the negative time ids from the positive sizes and crop (its call
    takes no negative ones), with the aesthetic score too, where SDXL inpainting's default negative crop is (0, 0)."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_inpaint_sd_xl as module

    width = 5 * 8 + _tiny_sdxl.POOLED
    components = _tiny_sdxl.base_components(unet_config=dict(_tiny_sdxl.UNET_A,
                                                             projection_class_embeddings_input_dim=width))
    net = tiny.controlnet(tiny.SDXL_PIPE_CONTROLNET, 26, projection_class_embeddings_input_dim=width)
    ref = _tiny_sdxl.save(module.StableDiffusionXLControlNetInpaintPipeline(
        **components, controlnet=net, requires_aesthetics_score=True, add_watermarker=False), tmp_path)
    pipe = eqxdiff.load_pipeline(tmp_path)
    sizes = dict(original_size=(40, 24), crops_coords_top_left=(17, 1), target_size=(32, 32))
    expected = ref._get_add_time_ids(*sizes.values(), 7.0, 2.0, dtype=torch.float32,
                                     text_encoder_projection_dim=_tiny_sdxl.POOLED)
    ours = pipe.add_time_ids(height=32, width=32, **sizes, aesthetic_score=7.0, negative_aesthetic_score=2.0,
                             pooled_dim=_tiny_sdxl.POOLED)
    np.testing.assert_array_equal(np.stack(ours), np.concatenate([e.numpy() for e in expected]))
    with pytest.raises(InputError, match="takes no negative_original_size"):
        pipe(PROMPTS, image=np.zeros((32, 32, 3), np.uint8), mask_image=np.zeros((32, 32), np.uint8),
             control_image=np.zeros((32, 32, 3), np.uint8), negative_original_size=(32, 32))
