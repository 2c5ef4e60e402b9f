"""ControlNet-Union on SDXL's image-to-image and inpainting machinery, against diffusers' union image pipelines
(every pixel within 2/255 from the same draws): one union net reading two control images of two modes. diffusers
draws the picture's VAE samples and the initial noise from its generator; the tests give it ours (``noise_draws`` of
the call's key) through its ``retrieve_latents`` / ``randn_tensor``. One set of components, saved as each class's
folder (the compiled encoders, VAE and nets are shared); :mod:`tests.test_controlnet_union` has text-to-image."""

import jax
import numpy as np
import pytest
import torch
from PIL import Image

import eqxdiff
from eqxdiff.pipelines import InputError, InputTypeError
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


# -- bad inputs (tests/test_bad_inputs.py's rules: a typed one-line error before any stage of the call starts) --------

@pytest.fixture(scope="module")
def union(components, tmp_path_factory):
    """The union text-to-image, image-to-image and inpainting classes on one loaded folder."""
    _, pipe = _pipelines("StableDiffusionXLControlNetUnionPipeline", components, tmp_path_factory.mktemp("union"))
    return {"t2i": pipe, "i2i": StableDiffusionXLControlNetUnionImg2ImgPipeline.from_pipe(pipe),
            "inpaint": StableDiffusionXLControlNetUnionInpaintPipeline.from_pipe(pipe)}


PICTURE = np.full((32, 32, 3), 128, np.uint8)
MASK = np.full((32, 32), 255, np.uint8)
BAD = [  # (id, class, call arguments, error type, message pattern)
    # a float mode was cut to an int and ran; a word was int()'s 'invalid literal'; out of range, the model's ValueError
    ("mode-float", "t2i", dict(control_image=PICTURE, control_mode=1.5), InputTypeError, r"^control_mode=1.5 must be "
     r"ints: each control image's index in the net's control types \(e.g. 1 for 'depth' in xinsir's union nets\)$"),
    ("mode-word", "t2i", dict(control_image=PICTURE, control_mode="canny"), InputTypeError, r"^control_mode='canny' "
     r"must be ints"),
    ("mode-out-of-range", "t2i", dict(control_image=PICTURE, control_mode=4), InputError, r"^control_mode 4 is out of "
     r"range: this ControlNet-Union knows 4 control modes, 0 to 3$"),
    # no control image at all ran as plain SDXL
    ("control-empty", "t2i", dict(control_image=[], control_mode=[]), InputError, r"^control_image is an empty list; "
     r"pass a control image"),
    # an int64 0-255 map was refused as 'a float control image must lie in [0, 1]' (and 0/1 ints ran as floats)
    ("control-int64", "t2i", dict(control_image=np.full((32, 32, 3), 9, np.int64), control_mode=0), InputTypeError,
     r"^a control image of dtype int64: pass uint8 \(0-255\), floats in \[0, 1\] or PIL images"),
    # a control image under the VAE's factor set the output size to 0: 'height=0 must be a positive multiple' (arrays)
    # or PIL's own ValueError, though height was never passed
    ("control-tiny", "t2i", dict(control_image=np.zeros((1, 3, 3), np.uint8), control_mode=0), InputError,
     r"^the control image has width 3, height 1 pixels, under the VAE's factor \d+: it sets no output size; pass a "
     r"larger control image or set height= and width=$"),
    ("control-tiny-pil", "t2i", dict(control_image=Image.new("RGB", (3, 1)), control_mode=0), InputError,
     r"^the control image has width 3, height 1 pixels, under the VAE's factor"),
    # a switch given as a word was truthy: guess_mode='no' ran in guess mode (and Kontext's _auto_resize='no' resized)
    ("guess-mode-word", "t2i", dict(control_image=PICTURE, control_mode=0, guess_mode="no"), InputTypeError,
     r"^guess_mode='no' must be True or False$"),
    # text-to-image passed strength= / denoising_start= on to SDXL's call, which dropped them without a picture
    ("t2i-strength", "t2i", dict(control_image=PICTURE, control_mode=0, strength=0.5), InputError, r"^strength= "
     r"needs a picture to start from, which this pipeline does not take; use its family's image-to-image or "
     r"inpainting pipeline, or leave strength out$"),
    ("t2i-denoising-start", "t2i", dict(control_image=PICTURE, control_mode=0, denoising_start=0.5), InputError,
     r"^denoising_start= needs a picture to start from"),
    # three control images for two prompts were refused only after the prompts were encoded (a compile)
    ("control-count", "t2i", dict(prompt=["a", "b"], control_image=np.zeros((3, 32, 32, 3), np.uint8),
                                  control_mode=0), InputError, r"^control image 0: got 3 images for 2 prompts; pass "
     r"one image or one per prompt$"),
    # the shared ControlNet, inpainting and UNet-pipeline checks raised untyped ValueErrors
    ("control-rgba", "t2i", dict(control_image=np.zeros((32, 32, 4), np.uint8), control_mode=0), InputError,
     r"^control image 0 has 4 channels; its ControlNet takes 3 \(conditioning_channels\)$"),
    ("control-grey", "t2i", dict(control_image=MASK, control_mode=0), InputError, r"^a control image must be PIL "
     r"image\(s\) or an array \[n, height, width, channels\]"),
    ("i2i-no-image", "i2i", dict(control_image=PICTURE, control_mode=0), InputError, r"needs image="),
    ("mask-rgba", "inpaint", dict(image=PICTURE, mask_image=np.zeros((32, 32, 4), np.uint8), control_image=PICTURE,
                                  control_mode=0), InputError, r"^mask_image of shape \(32, 32, 4\) looks like an "
     r"RGB\(A\) picture"),
    ("mask-size", "inpaint", dict(image=PICTURE, mask_image=MASK[:16, :16], control_image=PICTURE, control_mode=0),
     InputError, r"^mask_image has width 16, height 16 but the image has width 32, height 32"),
]


@pytest.mark.parametrize(("cls", "kwargs", "error", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_are_refused_before_any_stage(union, cls, kwargs, error, match, monkeypatch):
    from eqxdiff.pipelines import _base

    real = _base.DiffusionPipeline.timed

    def no_stage(self, stage):
        if stage == "call":  # the call's own timing, around the checks
            return real(self, stage)
        raise AssertionError(f"a bad argument must be refused before the call's {stage!r} stage starts")

    monkeypatch.setattr(_base.DiffusionPipeline, "timed", no_stage)
    with pytest.raises(error, match=match) as info:
        union[cls](**{"prompt": "a cat", **kwargs}, num_inference_steps=2, progress=False)
    assert type(info.value) is error and "\n" not in str(info.value)
