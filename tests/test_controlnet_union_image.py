"""ControlNet-Union on SDXL's image-to-image and inpainting machinery, against diffusers' union image pipelines
(every pixel within 2/255 from the same draws): one union net reading two control images of two modes. diffusers
draws the picture's VAE samples and the initial noise from its generator; the tests give it ours (``noise_draws`` of
the call's key) through its ``retrieve_latents`` / ``randn_tensor``. One set of components, saved as each class's
folder (the compiled encoders, VAE and nets are shared); :mod:`tests.test_controlnet_union` has text-to-image."""

import jax
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.pipelines import InputError
from eqxdiff.pipelines.controlnet_union import (
    StableDiffusionXLControlNetUnionImg2ImgPipeline,
    StableDiffusionXLControlNetUnionInpaintPipeline,
)

from . import _tiny_controlnet as tiny_cn
from . import _tiny_controlnet_union as tiny
from . import _tiny_sdxl

PROMPTS = ["a red cat", "two dogs"]
SHAPE = (2, 16, 16, 4)
STEPS = 4


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _tensor(image):
    return torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255


@pytest.fixture(scope="module")
def components():
    return dict(_tiny_sdxl.base_components(seed=40), controlnet=tiny.union_net(41))


@pytest.fixture(scope="module")
def inputs():
    """A picture per prompt, masks (white = repaint: a different box in each) and two control images."""
    picture = np.random.default_rng(42).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    mask = np.zeros((2, 32, 32), np.uint8)
    mask[0, 4:20, 8:30] = 255
    mask[1, 10:32, 0:14] = 255
    return picture, mask, [tiny_cn.control_images(1, 32, seed=43), tiny_cn.control_images(2, 32, seed=44)]


def _pipelines(cls_name, components, folder, **options):
    import diffusers

    ref = _tiny_sdxl.save(getattr(diffusers, cls_name)(**components, add_watermarker=False, **options), folder)
    return ref, eqxdiff.load_pipeline(folder)


@pytest.mark.parametrize("kw", [{}, dict(strength=0.6, controlnet_conditioning_scale=[0.5, 1.3],
                                         control_guidance_end=[0.5, 1.0], original_size=(48, 40))])
def test_union_img2img_matches_diffusers(components, inputs, tmp_path, monkeypatch, kw):
    """diffusers' defaults (strength 0.8, scale 0.8 for each image, guidance 5); then per-image scales and windows."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_union_sd_xl_img2img as module

    ref, pipe = _pipelines("StableDiffusionXLControlNetUnionImg2ImgPipeline", components, tmp_path)
    assert type(pipe) is StableDiffusionXLControlNetUnionImg2ImgPipeline
    picture, _, control = inputs
    key = jax.random.key(45)
    tiny_cn.with_our_draws(module, monkeypatch, key, SHAPE, ["image"])
    with torch.no_grad():
        expected = ref(PROMPTS, image=_tensor(picture), control_image=[_tensor(c) for c in control],
                       control_mode=[1, 3], num_inference_steps=STEPS, output_type="np", **kw).images
    ours = pipe(PROMPTS, image=picture, control_image=control, control_mode=[1, 3], key=key,
                num_inference_steps=STEPS, progress=False, **kw)
    assert ours.shape == (2, 32, 32, 3) and _pixels_off(ours, expected) <= 2


@pytest.mark.parametrize("kw", [{}, dict(strength=0.7, controlnet_conditioning_scale=[0.6, 1.2],
                                         control_guidance_start=0.25, guidance_rescale=0.5)])
def test_union_inpaint_matches_diffusers(components, inputs, tmp_path, monkeypatch, kw):
    """diffusers' defaults (strength 0.9999, scale 1.0, guidance 5); then a partial strength, per-image scales, a
    window and guidance_rescale (which diffusers' union inpainting applies). An ordinary UNet: the known region
    blended back after each step."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_union_inpaint_sd_xl as module

    ref, pipe = _pipelines("StableDiffusionXLControlNetUnionInpaintPipeline", components, tmp_path)
    assert type(pipe) is StableDiffusionXLControlNetUnionInpaintPipeline
    picture, mask, control = inputs
    key = jax.random.key(46)
    tiny_cn.with_our_draws(module, monkeypatch, key, SHAPE, ["image", "masked"])
    with torch.no_grad():
        expected = ref(PROMPTS, image=_tensor(picture), mask_image=torch.from_numpy(mask[:, None] / 255).float(),
                       control_image=[_tensor(c) for c in control], control_mode=[0, 2],
                       num_inference_steps=STEPS, output_type="np", **kw).images
    ours = pipe(PROMPTS, image=picture, mask_image=mask, control_image=control, control_mode=[0, 2], key=key,
                num_inference_steps=STEPS, progress=False, **kw)
    assert ours.shape == (2, 32, 32, 3) and _pixels_off(ours, expected) <= 2
    with pytest.raises(InputError, match="takes no padding_mask_crop"):
        pipe(PROMPTS, image=picture, mask_image=mask, control_image=control, control_mode=[0, 2], padding_mask_crop=2)
    if kw:  # an inpainting (9-channel) UNet is refused before anything runs, as diffusers' call refuses it
        _tiny_sdxl.unet(_tiny_sdxl.UNET_A, in_channels=9).save_pretrained(tmp_path / "unet9")
        nine = type(pipe).from_pipe(pipe, unet=eqxdiff.load(tmp_path / "unet9"))
        with pytest.raises(InputError, match="runs an ordinary 4-channel UNet.*this UNet takes 9 channels"):
            nine(PROMPTS, image=picture, mask_image=mask, control_image=control, control_mode=[0, 2], progress=False)
