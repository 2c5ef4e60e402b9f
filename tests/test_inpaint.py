"""Inpainting against diffusers, every pixel within 2/255 from the same draws: Stable Diffusion and SDXL, with an
inpainting UNet (9 channels: latents, mask, masked-image latents) and with an ordinary one (4 channels: the known
region blended back after every step), at full and partial strength; the mask's handling and its errors.

diffusers draws the image's and the masked image's VAE samples and the initial noise from its generator; the tests
give it ours (``noise_draws`` of the call's key) through its ``retrieve_latents`` / ``randn_tensor``.
"""

import jax
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.pipelines import StableDiffusionInpaintPipeline, StableDiffusionXLInpaintPipeline
from eqxdiff.pipelines._images import to_model_range
from eqxdiff.pipelines._inpaint import latent_mask, prepare_mask
from eqxdiff.pipelines._latents import encode_image_latents, noise_draws

from . import _tiny_sdxl as tiny
from ._tiny_sd import build_pipeline, randomize_
from ._util import nhwc_to_nchw

PROMPTS = ["a red cat", "two dogs"]
SHAPE = (2, 16, 16, 4)


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _inputs(seed: int):
    """Two 32x32 images and masks (uint8, white = repaint: a different box in each)."""
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    mask = np.zeros((2, 32, 32), np.uint8)
    mask[0, 4:20, 8:30] = 255
    mask[1, 10:32, 0:14] = 255
    return image, mask


def _with_our_draws(ref, module, monkeypatch, *, seed, posterior_calls):
    """Make diffusers' pipeline ``ref`` draw what eqxdiff draws from ``seed``: its initial noise, and the VAE posterior
    samples its retrieve_latents takes in the order ``posterior_calls`` names them."""
    draws = noise_draws(jax.random.key(seed), SHAPE)
    posterior = iter([{"image": draws.image, "masked": draws.masked_image}[k] for k in posterior_calls])
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(draws.noise))
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(next(posterior)))
    ref.set_progress_bar_config(disable=True)


def _reference(ref, module, monkeypatch, *, image, mask, seed, posterior_calls, **kwargs):
    """diffusers' output with our draws: ``posterior_calls`` names what its retrieve_latents samples, in order."""
    _with_our_draws(ref, module, monkeypatch, seed=seed, posterior_calls=posterior_calls)
    with torch.no_grad():
        return ref(PROMPTS, image=torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255,
                   mask_image=torch.from_numpy(mask[:, None].astype(np.float32) / 255), height=32, width=32,
                   output_type="np", **kwargs).images


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """A tiny SD folder (4-channel UNet, DDIM) and an inpainting folder beside it (its UNet with 9 inputs)."""
    from diffusers import StableDiffusionInpaintPipeline as Reference
    from diffusers import UNet2DConditionModel

    root = tmp_path_factory.mktemp("sd_inpaint")
    ref = build_pipeline(root / "plain", scheduler="ddim")
    unet = UNet2DConditionModel.from_config({**ref.unet.config, "in_channels": 9})
    randomize_(unet, seed=9)
    inpaint = Reference(**{**ref.components, "unet": unet.eval()})
    inpaint.save_pretrained(root / "inpaint", safe_serialization=True)
    return root, Reference(**ref.components), inpaint


def test_sd_inpainting_unet_matches_diffusers(sd, monkeypatch):
    """9-channel UNet, strength 1: pure noise start, the masked image's latents as input channels."""
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as module

    root, _, ref = sd
    pipe = eqxdiff.load_pipeline(root / "inpaint")
    assert type(pipe) is StableDiffusionInpaintPipeline and pipe.unet.config.in_channels == 9
    image, mask = _inputs(0)
    kwargs = dict(num_inference_steps=3, guidance_scale=6.0, negative_prompt=["blurry", "ugly"])
    expected = _reference(ref, module, monkeypatch, image=image, mask=mask, seed=1, posterior_calls=["masked"],
                          **kwargs)
    ours = pipe(PROMPTS, image=image, mask_image=mask, seed=1, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2
    # diffusers' masked_image_latents (here not the image's: one array for both outputs) replace the encoded ones
    given = np.random.default_rng(9).standard_normal((1, *SHAPE[1:])).astype(np.float32)
    expected = _reference(ref, module, monkeypatch, image=image, mask=mask, seed=1, posterior_calls=[],
                          masked_image_latents=nhwc_to_nchw(given), **kwargs)
    ours_given = pipe(PROMPTS, image=image, mask_image=mask, seed=1, masked_image_latents=given, progress=False,
                      **kwargs)
    assert _pixels_off(ours_given, expected) <= 2 and np.abs(ours_given.astype(int) - ours).max() > 10


def _mask_crop_matches_diffusers(pipe, ref, module, monkeypatch, *, seed, posterior_calls, **kwargs):
    """padding_mask_crop: a 40x56 PIL picture's box around its mask (padded, widened to 32x32's aspect) inpainted
    at 32x32 and pasted back at 40x56 over the kept pixels, as diffusers' (the same compiled loop as at 32x32)."""
    from PIL import Image

    rng = np.random.default_rng(5)
    picture = Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8))
    mask = np.zeros((40, 56), np.uint8)
    mask[12:20, 30:41] = 255
    mask = Image.fromarray(mask)
    kwargs = dict(height=32, width=32, padding_mask_crop=3, **kwargs)
    _with_our_draws(ref, module, monkeypatch, seed=seed, posterior_calls=posterior_calls)
    with torch.no_grad():
        expected = np.stack([np.asarray(im) for im in ref(PROMPTS, image=picture, mask_image=mask,
                                                            output_type="pil", **kwargs).images])
    ours = pipe(PROMPTS, image=picture, mask_image=mask, seed=seed, progress=False, **kwargs)
    assert ours.shape == (2, 40, 56, 3) and ours.dtype == np.uint8
    assert np.abs(ours.astype(int) - expected).max() <= 2
    keep = np.asarray(mask) == 0
    assert np.array_equal(ours[:, keep], np.broadcast_to(np.asarray(picture)[keep], ours[:, keep].shape))
    return picture, mask, kwargs, ours


def test_padding_mask_crop_inpaints_the_box_around_the_mask_as_diffusers(sd, monkeypatch):
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as module
    from PIL import Image

    root, _, ref = sd
    pipe = eqxdiff.load_pipeline(root / "inpaint")
    picture, mask, kwargs, ours = _mask_crop_matches_diffusers(
        pipe, ref, module, monkeypatch, seed=4, posterior_calls=["masked"], num_inference_steps=3, guidance_scale=6.0)
    pil = pipe(PROMPTS, image=picture, mask_image=mask, seed=4, progress=False, output_type="pil", **kwargs)
    assert np.array_equal(np.stack([np.asarray(im) for im in pil]), ours)
    for bad, match in [(dict(mask_image=None), "padding_mask_crop is for inpainting"),
                       (dict(image=np.asarray(picture)), "needs image= and mask_image= as PIL images"),
                       (dict(output_type="latent"), "output_type must be 'uint8' or 'pil'"),
                       (dict(padding_mask_crop=-1), "must be a number of pixels"),
                       (dict(mask_image=Image.new("L", (56, 40))), "black everywhere")]:
        with pytest.raises(ValueError, match=match):
            pipe(PROMPTS, **{**dict(image=picture, mask_image=mask, progress=False, **kwargs), **bad})


def test_sd_ordinary_unet_blends_the_known_region(sd, monkeypatch):
    """4-channel UNet at strength 0.75: the image's latents noised to the start, the known region re-noised to each
    next timestep (DDIM's alphas) and clean after the last step."""
    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion_inpaint as module

    root, ref, _ = sd
    pipe = StableDiffusionInpaintPipeline.from_pretrained(root / "plain")
    image, mask = _inputs(1)
    kwargs = dict(num_inference_steps=4, strength=0.75, guidance_scale=6.0)
    expected = _reference(ref, module, monkeypatch, image=image, mask=mask, seed=2,
                          posterior_calls=["image", "masked"], **kwargs)
    ours = pipe(PROMPTS, image=image, mask_image=mask, seed=2, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2
    # after the last step the latents outside the mask are the image's clean latents; inside they are new
    latents = pipe(PROMPTS, image=image, mask_image=mask, seed=2, progress=False, output_type="latent", **kwargs)
    clean = encode_image_latents(pipe.vae, to_model_range(image), noise_draws(jax.random.key(2), SHAPE).image)
    keep = np.asarray(latent_mask(prepare_mask(mask, batch=2, height=32, width=32), 2))[..., 0] == 0
    # Exactly: after the last step the blend is (1 - 0) * clean + 0 * x, and the pipeline's clean latents come from
    # the same compiled encode_image_latents on the same pixels and posterior noise as these (no rounding to bound).
    np.testing.assert_array_equal(np.asarray(latents)[keep], np.asarray(clean)[keep])
    assert np.abs(np.asarray(latents) - np.asarray(clean))[~keep].min() > 1e-3


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    root = tmp_path_factory.mktemp("sdxl_inpaint")
    inpaint = tiny.build_inpaint(root / "inpaint")
    base = tiny.build_base(root / "base")
    return root, inpaint, base


def test_sdxl_inpainting_unet_matches_diffusers(sdxl, monkeypatch):
    """SDXL's 9-channel UNet at diffusers' default strength 0.9999 (the image's latents noised, not pure noise),
    image-to-image micro-conditioning."""
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as module

    root, ref, _ = sdxl
    pipe = eqxdiff.load_pipeline(root / "inpaint")
    assert type(pipe) is StableDiffusionXLInpaintPipeline and pipe.unet.config.in_channels == 9
    image, mask = _inputs(2)
    kwargs = dict(num_inference_steps=3, guidance_scale=5.0, original_size=(40, 40))
    expected = _reference(ref, module, monkeypatch, image=image, mask=mask, seed=3,
                          posterior_calls=["image", "masked"], **kwargs)
    ours = pipe(PROMPTS, image=image, mask_image=mask, seed=3, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2


def test_sdxl_ordinary_unet_matches_diffusers(sdxl, monkeypatch):
    """The SDXL base folder as StableDiffusionXLInpaintPipeline (4 channels), strength 1, Euler's sigmas for the
    blend."""
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as module

    root, _, base = sdxl
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(root / "base")
    image, mask = _inputs(3)
    kwargs = dict(num_inference_steps=3, guidance_scale=5.0, strength=1.0)
    ref = module.StableDiffusionXLInpaintPipeline(**base.components)
    expected = _reference(ref, module, monkeypatch, image=image, mask=mask, seed=4,
                          posterior_calls=["image", "masked"], **kwargs)
    ours = pipe(PROMPTS, image=image, mask_image=mask, seed=4, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2
    _mask_crop_matches_diffusers(pipe, ref, module, monkeypatch, seed=4, posterior_calls=["image", "masked"],
                                 **kwargs)


def test_mask_inputs_and_errors():
    from PIL import Image

    box = np.zeros((32, 32), np.uint8)
    box[8:16, 8:24] = 200
    as_float = prepare_mask(box / 255.0, batch=2, height=32, width=32)
    assert as_float.shape == (2, 32, 32, 1) and set(np.unique(as_float)) == {0.0, 1.0}
    for same in (box, box[None, :, :, None] > 0, Image.fromarray(box), [Image.fromarray(box)] * 2):
        np.testing.assert_array_equal(prepare_mask(same, batch=2, height=32, width=32), as_float)
    np.testing.assert_array_equal(latent_mask(as_float, 8)[0, :, :, 0], [[0, 0, 0, 0], [0, 1, 1, 0]] + [[0] * 4] * 2)
    with pytest.raises(ValueError, match="mask_image has width 32, height 16 but the image has width 32, height 32; "
                       "resize the mask"):
        prepare_mask(box[:16], batch=1, height=32, width=32)
    with pytest.raises(ValueError, match="got 3 masks for 2 outputs"):
        prepare_mask(np.stack([box] * 3), batch=2, height=32, width=32)
    with pytest.raises(ValueError, match="floats in \\[0, 1\\]"):
        prepare_mask(box.astype(np.float32), batch=1, height=32, width=32)
    with pytest.raises(ValueError, match="one channel"):
        prepare_mask(np.zeros((1, 32, 32, 3), np.uint8), batch=1, height=32, width=32)
    with pytest.raises(ValueError, match=r"mask_image of shape \(32, 32, 3\) looks like an RGB\(A\) picture"):
        prepare_mask(np.zeros((32, 32, 3), np.uint8), batch=1, height=32, width=32)


def test_inpainting_errors(sd):
    root, _, _ = sd
    pipe = eqxdiff.load_pipeline(root / "inpaint")
    plain = eqxdiff.load_pipeline(root / "plain")
    image, mask = _inputs(0)
    with pytest.raises(ValueError, match="needs image= and mask_image="):
        pipe("a cat")
    with pytest.raises(ValueError, match="needs mask_image="):
        pipe("a cat", image=image[:1])
    with pytest.raises(ValueError, match="an inpainting UNet: latents, mask and masked-image latents"):
        type(plain).from_pipe(pipe)("a cat")
    with pytest.raises(ValueError, match="mask_image needs image="):
        plain("a cat", mask_image=mask[:1])
    with pytest.raises(ValueError, match="mask_image has width 16, height 32 but the image has width 32, height 32"):
        pipe("a cat", image=image[:1], mask_image=mask[:1, :, :16])
    with pytest.raises(ValueError, match="needs image= as pixels"):
        pipe("a cat", image=np.zeros((1, 16, 16, 4), np.float32), mask_image=mask[:1])
    with pytest.raises(ValueError, match="masked_image_latents are an inpainting UNet's input"):
        plain("a cat", image=image[:1], mask_image=mask[:1], masked_image_latents=np.zeros((1, 16, 16, 4)))
    with pytest.raises(ValueError, match=r"masked_image_latents must have shape \(1, 16, 16, 4\)"):
        pipe("a cat", image=image[:1], mask_image=mask[:1], masked_image_latents=np.zeros((1, 8, 8, 4)))
    with pytest.raises(ValueError, match="strength=0.1 with 4 steps leaves no denoising step"):
        pipe("a cat", image=image[:1], mask_image=mask[:1], strength=0.1, num_inference_steps=4)
