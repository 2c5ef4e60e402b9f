"""Flux.1 with a control image (FLUX.1-Canny-dev / Depth-dev style) against diffusers' FluxControlPipeline: every
pixel within 2/255 from the same initial noise and the same VAE posterior noise for the control latents; then
eqxdiff-generate with --control-image, and the errors a user can make.

One tiny folder (``tests._tiny_flux_pipeline``'s ``"control"``: a dev transformer with 8 input channels, 4 output),
built once for the module; the calls share their compiled programs (batch 2, 8x8 pixels, 3 steps).
"""

import jax
import numpy as np
import pytest
import torch
from diffusers.models.autoencoders import vae as diffusers_vae
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.loading import CheckpointError
from eqxdiff.pipelines import InputError
from eqxdiff.pipelines._latents import noise_draws
from eqxdiff.pipelines.flux import FluxPipeline
from eqxdiff.pipelines.flux_control import FluxControlPipeline

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


def test_errors_name_the_problem_and_the_fix(control):
    pipe = control.pipe
    with pytest.raises(InputError, match="FluxControlPipeline needs control_image="):
        pipe("a cat", **COMMON)
    with pytest.raises(InputError, match="got 3 control images for 2 prompts; pass one control image or one per "
                                         "prompt"):
        pipe(PROMPTS, control_image=np.zeros((3, 8, 8, 3), np.uint8), progress=False, **COMMON)
    with pytest.raises(InputError, match="control_image must be RGB"):
        pipe(PROMPTS, control_image=np.zeros((1, 8, 8, 1), np.uint8), progress=False, **COMMON)
    with pytest.raises(CheckpointError, match="the transformer takes 8 input channels .* FluxPipeline drives Flux "
                                              "transformers taking 4. .* Canny and Depth ones \\(8: the control "
                                              "image's latents too\\) as FluxControlPipeline"):
        FluxPipeline.from_pipe(pipe)("a cat", progress=False, **COMMON)


def test_saved_folder_lists_the_components_diffusers_takes(control, tmp_path):
    """A saved FluxControlPipeline's model_index.json names the components diffusers' FluxControlPipeline takes (no
    image_encoder / feature_extractor entries, which diffusers warns about and ignores)."""
    import inspect
    import json

    import diffusers

    from eqxdiff.pipelines import save_pipeline

    index = json.loads((save_pipeline(control.pipe, tmp_path / "saved") / "model_index.json").read_text())
    takes = set(inspect.signature(diffusers.FluxControlPipeline.__init__).parameters) - {"self"}
    assert set(index) - {"_class_name", "_diffusers_version"} == takes
