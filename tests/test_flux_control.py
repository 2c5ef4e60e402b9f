"""Flux.1 with a control image (FLUX.1-Canny-dev / Depth-dev style) against diffusers' FluxControlPipeline,
FluxControlImg2ImgPipeline and FluxControlInpaintPipeline: every pixel within 2/255 from the same initial noise and
the same VAE posterior noise for the control (and image) latents; then eqxdiff-generate with --control-image, and the
errors a user can make.

One tiny folder (``tests._tiny_flux_pipeline``'s ``"control"``: a dev transformer with 8 input channels, 4 output),
built once for the module; the calls share their compiled programs (batch 2, 8x8 pixels, 3 steps).
"""

import jax
import numpy as np
import pytest
import torch
from diffusers.models.autoencoders import vae as diffusers_vae
from diffusers.pipelines.flux import pipeline_flux_control_img2img, pipeline_flux_control_inpaint
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.loading import CheckpointError
from eqxdiff.pipelines import InputError
from eqxdiff.pipelines._latents import noise_draws
from eqxdiff.pipelines.flux import FluxPipeline
from eqxdiff.pipelines.flux_control import FluxControlImg2ImgPipeline, FluxControlInpaintPipeline, FluxControlPipeline

from . import _tiny_flux_pipeline as tiny
from ._util import nhwc_to_nchw

PROMPTS = ["a red cat", "two dogs"]
SIZE = {"height": 8, "width": 8}
COMMON = dict(num_inference_steps=3, max_sequence_length=12, **SIZE)
SHAPE = (2, 8, 8, 1)  # latents: vae scale factor 1, one latent channel


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


class Control:
    def __init__(self, folder):
        self.folder = folder
        self.ref = tiny.build(folder, "control")
        self.pipe = eqxdiff.load_pipeline(folder)
        self.noise = np.random.default_rng(5).standard_normal(SHAPE).astype(np.float32)

    def expected(self, monkeypatch, *, seed: int, latents, **kwargs):
        """diffusers' images with the control latents sampled with our posterior noise (``seed``'s image draw)."""
        posterior = nhwc_to_nchw(np.array(noise_draws(jax.random.key(seed), SHAPE).image))
        monkeypatch.setattr(diffusers_vae.DiagonalGaussianDistribution, "sample",
                            lambda dist, generator=None: dist.mean + dist.std * posterior)
        n, h, w, c = latents.shape
        packed = self.ref._pack_latents(nhwc_to_nchw(latents), n, c, h, w)
        with torch.no_grad():
            return self.ref(output_type="np", latents=packed, **kwargs).images

    def expected_from_image(self, monkeypatch, module, *, seed: int, latents, **kwargs):
        """diffusers' ``module`` class (a fresh pipeline) from ``latents`` (the noise added to the image's latents),
        the image's posterior sampled with ``seed``'s image draw and the control image's with its masked-image
        draw."""
        draws = noise_draws(jax.random.key(seed), SHAPE)
        image, control = (nhwc_to_nchw(np.array(d)) for d in (draws.image, draws.masked_image))
        monkeypatch.setattr(diffusers_vae.DiagonalGaussianDistribution, "sample",
                            lambda dist, generator=None: dist.mean + dist.std * control)
        # retrieve_latents: the image's (and, for inpainting, the unused masked image's) posterior samples
        monkeypatch.setattr(module, "retrieve_latents",
                            lambda out, generator=None, sample_mode="sample": out.latent_dist.mean
                            + out.latent_dist.std * image)
        monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(latents))
        name = "FluxControlInpaintPipeline" if module is pipeline_flux_control_inpaint else "FluxControlImg2ImgPipeline"
        ref = getattr(module, name)(**self.ref.components)
        ref.set_progress_bar_config(disable=True)
        with torch.no_grad():
            return ref(output_type="np", **kwargs).images


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    return Control(tmp_path_factory.mktemp("flux_control"))


def test_control_matches_diffusers(control, monkeypatch):
    """Two prompts with one control image each (floats in [0, 1]), distilled guidance; then one prompt, two images
    per prompt and one PIL control image of another size (resized with Lanczos to the output), a custom schedule."""
    pipe = control.pipe
    assert type(pipe) is FluxControlPipeline and pipe.latent_channels == 1
    images = np.random.default_rng(1).random((2, 8, 8, 3), dtype=np.float32)
    kwargs = dict(guidance_scale=4.0, **COMMON)
    expected = control.expected(monkeypatch, seed=7, latents=control.noise, prompt=PROMPTS, control_image=images,
                                **kwargs)
    ours = pipe(PROMPTS, control_image=images, latents=control.noise, seed=7, progress=False, **kwargs)
    assert ours.shape == (2, 8, 8, 3) and ours.dtype == np.uint8
    assert _pixels_off(ours, expected) <= 2 and np.std(ours) > 1
    other = pipe(PROMPTS, control_image=images[::-1], latents=control.noise, seed=7, progress=False, **kwargs)
    assert _pixels_off(other, expected) > 2  # the control image steers the output

    picture = Image.fromarray(np.random.default_rng(2).integers(0, 256, (16, 24, 3), dtype=np.uint8))
    kwargs.update(guidance_scale=6.0, num_images_per_prompt=2, sigmas=[1.0, 0.6, 0.3])
    expected = control.expected(monkeypatch, seed=3, latents=control.noise, prompt="a red cat",
                                control_image=picture, **kwargs)
    ours = pipe("a red cat", control_image=picture, latents=control.noise, seed=3, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2


def test_control_img2img_matches_diffusers(control, monkeypatch):
    """Two prompts, two pictures and two control images (floats in [0, 1]), strength 0.7 (2 of 3 steps run)."""
    pipe = FluxControlImg2ImgPipeline.from_pipe(control.pipe)
    rng = np.random.default_rng(8)
    image, control_image = rng.random((2, 2, 8, 8, 3), dtype=np.float32)
    kwargs = dict(guidance_scale=4.0, strength=0.7, **COMMON)
    expected = control.expected_from_image(monkeypatch, pipeline_flux_control_img2img, seed=5, latents=control.noise,
                                           prompt=PROMPTS, image=image, control_image=control_image, **kwargs)
    ours = pipe(PROMPTS, image=image, control_image=control_image, latents=control.noise, seed=5, progress=False,
                **kwargs)
    assert _pixels_off(ours, expected) <= 2 and np.std(ours) > 1
    other = pipe(PROMPTS, image=image, control_image=control_image[::-1], latents=control.noise, seed=5,
                 progress=False, **kwargs)
    assert _pixels_off(other, expected) > 2  # the control image steers the output


def test_control_inpaint_matches_diffusers(control, monkeypatch):
    """One prompt, two images per prompt, one picture (uint8), one mask and one PIL control image of another size
    (resized with Lanczos to the picture's); strength 0.8, a custom schedule. The region outside the mask stays the
    picture's."""
    pipe = FluxControlInpaintPipeline.from_pipe(control.pipe)
    rng = np.random.default_rng(9)
    image = rng.integers(0, 256, (1, 8, 8, 3), dtype=np.uint8)
    mask = np.zeros((8, 8), np.uint8)
    mask[2:6, 1:7] = 255
    picture = Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8))
    kwargs = dict(guidance_scale=6.0, strength=0.8, num_images_per_prompt=2, sigmas=[1.0, 0.6, 0.3], **COMMON)
    expected = control.expected_from_image(
        monkeypatch, pipeline_flux_control_inpaint, seed=3, latents=control.noise, prompt="a red cat",
        image=torch.from_numpy(image).permute(0, 3, 1, 2) / 255.0, control_image=picture,
        mask_image=torch.from_numpy(mask / 255.0)[None, None], **kwargs)
    ours = pipe("a red cat", image=image, mask_image=mask, control_image=picture, latents=control.noise, seed=3,
                progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2 and np.std(ours) > 1


def test_generate_takes_a_control_image(control, tmp_path, capsys):
    """eqxdiff-generate --model CONTROL_FOLDER --control-image FILE: the pipeline's images from the same seed (the
    file read as a PIL image); --control-image is listed, a ControlNet's flags are refused."""
    with pytest.raises(SystemExit) as e:
        generate.main(["--model", str(control.folder), "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--control-image" in text and "FluxControlPipeline" in text and "--true-cfg-scale" not in text
    image = np.random.default_rng(4).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    Image.fromarray(image).save(tmp_path / "edges.png")
    argv = ["--model", str(control.folder), "--control-image", str(tmp_path / "edges.png"), "--prompt", "a red cat",
            "--num-images", "2", "--height", "8", "--width", "8", "--steps", "3", "--max-sequence-length", "12",
            "--guidance-scale", "4.0", "--seed", "6", "--output-dir", str(tmp_path / "out"), "--no-progress"]
    saved = np.stack([np.asarray(Image.open(p)) for p in generate.main(argv)])
    expected = control.pipe("a red cat", control_image=Image.fromarray(image), num_images_per_prompt=2, seed=6,
                            guidance_scale=4.0, progress=False, **COMMON)
    np.testing.assert_array_equal(saved, expected)
    with pytest.raises(InputError, match="FluxControlPipeline takes one --control-image"):
        generate.main([*argv, "--control-image", str(tmp_path / "edges.png")])
    with pytest.raises(InputError, match="--controlnet-scale FluxControlPipeline takes one --control-image"):
        generate.main([*argv, "--controlnet-scale", "0.5"])


def test_generate_runs_control_inpainting_as_the_pipeline_class(control, tmp_path):
    """eqxdiff-generate --pipeline-class FluxControlInpaintPipeline --image --mask --control-image on the control
    folder: the class's images from the same seed (files read as PIL images)."""
    rng = np.random.default_rng(11)
    files = {}
    for name, array in (("photo", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)),
                        ("mask", (rng.random((8, 8)) < 0.5).astype(np.uint8) * 255),
                        ("edges", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))):
        Image.fromarray(array).save(tmp_path / f"{name}.png")
        files[name] = Image.open(tmp_path / f"{name}.png")
    argv = ["--model", str(control.folder), "--pipeline-class", "FluxControlInpaintPipeline", "--image",
            str(tmp_path / "photo.png"), "--mask", str(tmp_path / "mask.png"), "--control-image",
            str(tmp_path / "edges.png"), "--prompt", "a red cat", "--steps", "3", "--max-sequence-length", "12",
            "--strength", "0.8", "--seed", "6", "--output-dir", str(tmp_path / "out"), "--no-progress"]
    saved = np.stack([np.asarray(Image.open(p)) for p in generate.main(argv)])
    expected = FluxControlInpaintPipeline.from_pipe(control.pipe)(
        "a red cat", image=files["photo"], mask_image=files["mask"], control_image=files["edges"], strength=0.8,
        seed=6, progress=False, num_inference_steps=3, max_sequence_length=12)
    np.testing.assert_array_equal(saved, expected)


def test_errors_name_the_problem_and_the_fix(control):
    pipe = control.pipe
    with pytest.raises(InputError, match="FluxControlPipeline needs control_image="):
        pipe("a cat", **COMMON)
    with pytest.raises(InputError, match="got 3 control images for 2 prompts; pass one control image or one per "
                                         "prompt"):
        pipe(PROMPTS, control_image=np.zeros((3, 8, 8, 3), np.uint8), progress=False, **COMMON)
    with pytest.raises(InputError, match="FluxControlInpaintPipeline needs control_image= .* without one use "
                                         "FluxInpaintPipeline"):
        FluxControlInpaintPipeline.from_pipe(pipe)("a cat", image=np.zeros((8, 8, 3), np.uint8),
                                                   mask_image=np.zeros((8, 8), np.uint8), **COMMON)
    with pytest.raises(InputError, match="control_image must be RGB"):
        pipe(PROMPTS, control_image=np.zeros((1, 8, 8, 1), np.uint8), progress=False, **COMMON)
    with pytest.raises(CheckpointError, match="the transformer takes 8 input channels .* FluxPipeline drives Flux "
                                              "transformers taking 4. .* Canny and Depth ones \\(8: the control "
                                              "image's latents too\\) as FluxControlPipeline"):
        FluxPipeline.from_pipe(pipe)("a cat", progress=False, **COMMON)


@pytest.mark.parametrize("cls", [FluxControlPipeline, FluxControlImg2ImgPipeline, FluxControlInpaintPipeline])
def test_saved_folder_lists_the_components_diffusers_takes(control, tmp_path, cls):
    """A saved pipeline's model_index.json names the components diffusers' class of its name takes (no
    image_encoder / feature_extractor entries, which diffusers warns about and ignores); the folder loads as it, and
    so does Black Forest Labs' transformer file with the folder as config=."""
    import inspect
    import json

    import diffusers

    from eqxdiff.loading import write_safetensors
    from eqxdiff.pipelines import save_pipeline

    from . import _tiny_flux

    folder = save_pipeline(cls.from_pipe(control.pipe), tmp_path / "saved")
    index = json.loads((folder / "model_index.json").read_text())
    takes = set(inspect.signature(getattr(diffusers, cls.__name__).__init__).parameters) - {"self"}
    assert set(index) - {"_class_name", "_diffusers_version"} == takes and index["_class_name"] == cls.__name__
    assert type(eqxdiff.load_pipeline(folder)) is cls
    path = tmp_path / "flux1-control-tiny.safetensors"
    write_safetensors(_tiny_flux.bfl_tensors(control.ref.transformer), path)
    assert type(eqxdiff.load_pipeline(path, config=folder)) is cls


def test_control_image_errors_come_before_any_stage(control, monkeypatch):
    """The control image's count for the prompts, its channels and its dtype are refused before the prompts are
    encoded (the count and the channels were refused after: a compile; an int64 map as 'a float control image must
    lie in [0, 1]')."""
    from eqxdiff.pipelines import InputTypeError, _base

    real = _base.DiffusionPipeline.timed
    monkeypatch.setattr(_base.DiffusionPipeline, "timed", lambda self, stage: real(self, stage) if stage == "call"
                        else pytest.fail(f"the {stage!r} stage started before the refusal"))
    cases = [(np.zeros((3, 8, 8, 3), np.uint8), InputError, r"^got 3 control images for 2 prompts; pass one control "
              r"image or one per prompt$"),
             (np.zeros((1, 8, 8, 1), np.uint8), InputError, r"^control_image must be RGB \(3 channels"),
             (np.full((8, 8, 3), 9, np.int64), InputTypeError, r"^control_image: a control image of dtype int64")]
    for image, error, match in cases:
        with pytest.raises(error, match=match) as info:
            control.pipe(PROMPTS, control_image=image, progress=False, **COMMON)
        assert type(info.value) is error and "\n" not in str(info.value)
