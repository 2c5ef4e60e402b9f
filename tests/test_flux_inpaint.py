"""Flux.1 inpainting against diffusers 0.42: FluxInpaintPipeline (the known region blended back after every step)
on the schnell-style folder (a two-level VAE: the latent mask is every 2nd pixel of the pixel mask) at strength 0.6
with true CFG and at 1.0; FluxFillPipeline (FLUX.1-Fill-dev style: the masked image's latents and the mask's 2x2
pixel patches packed beside the noisy latents) at strength 1.0 and 0.6. Every pixel within 2/255 of diffusers from
the same initial noise and the same VAE posterior noise. Then a Black Forest Labs Fill file, eqxdiff-generate with
--image and --mask, and the errors a user can make.

One tiny folder per variant, built once for the module; calls of one variant share their compiled programs.
"""

import inspect
import itertools
import json

import diffusers
import jax
import numpy as np
import pytest
import torch
from diffusers.pipelines.flux import pipeline_flux_fill, pipeline_flux_inpaint
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.cli._command import FlagError
from eqxdiff.loading import CheckpointError, state_dict, write_safetensors
from eqxdiff.pipelines import InputError, save_pipeline
from eqxdiff.pipelines._latents import noise_draws
from eqxdiff.pipelines.flux import FluxPipeline
from eqxdiff.pipelines.flux_inpaint import FluxFillPipeline, FluxInpaintPipeline

from . import _tiny_flux
from . import _tiny_flux_pipeline as tiny
from ._util import nhwc_to_nchw

PROMPTS = ["a red cat", "two dogs"]
SIZE = dict(height=16, width=16)  # a VAE factor of 2: latents 8x8, 16 packed tokens
COMMON = dict(num_inference_steps=3, max_sequence_length=12)
SHAPE = (2, 8, 8, 2)  # unpacked latents of both folders: 2 latent channels
rng = np.random.default_rng(0)
IMAGE = rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
MASK = (rng.random((2, 16, 16)) < 0.5).astype(np.uint8) * 255  # pixel by pixel: the 2x2 patches differ inside
NOISE = rng.standard_normal(SHAPE).astype(np.float32)


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _expected(module, reference, monkeypatch, *, seed: int, **kwargs):
    """diffusers' images from our initial noise and our posterior noise (``seed``'s image draw, then its
    masked-image draw: the order diffusers encodes the image and the masked image in)."""
    draws = noise_draws(jax.random.key(seed), SHAPE)
    posteriors = itertools.chain((draws.image, draws.masked_image), itertools.repeat(draws.masked_image))
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(NOISE))
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(np.array(next(posteriors))))
    reference.set_progress_bar_config(disable=True)
    with torch.no_grad():
        images = reference(**{"output_type": "np", **kwargs}).images
    return np.stack([np.asarray(im) for im in images]) if kwargs.get("output_type") == "pil" else images


class Folder:
    def __init__(self, folder, variant):
        self.folder, self.ref = folder, tiny.build(folder, variant)
        self.pipe = eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def schnell(tmp_path_factory):
    return Folder(tmp_path_factory.mktemp("flux_schnell"), "schnell")


@pytest.fixture(scope="module")
def fill(tmp_path_factory):
    return Folder(tmp_path_factory.mktemp("flux_fill"), "fill")


def test_inpaint_matches_diffusers(schnell, monkeypatch):
    """Strength 0.6 with true CFG (the blend reads the known region from the pair of halves' conditioning) and
    strength 1.0 with one PIL mask for both outputs; the known region is the image's latents after the last step."""
    pipe = FluxInpaintPipeline.from_pipe(schnell.pipe)
    reference = pipeline_flux_inpaint.FluxInpaintPipeline(**schnell.ref.components)
    cfg = dict(true_cfg_scale=2.5, negative_prompt=["blurry", "dark"], strength=0.6, **SIZE, **COMMON)
    expected = _expected(pipeline_flux_inpaint, reference, monkeypatch, seed=7, prompt=PROMPTS,
                         image=torch.from_numpy(IMAGE).permute(0, 3, 1, 2).float() / 255,
                         mask_image=torch.from_numpy(MASK[:, None]).float() / 255, **cfg)
    ours = pipe(PROMPTS, image=IMAGE, mask_image=MASK, latents=NOISE, seed=7, progress=False, **cfg)
    assert ours.shape == (2, 16, 16, 3) and _pixels_off(ours, expected) <= 2 and np.std(ours) > 1

    mask = Image.fromarray(MASK[0])
    kwargs = dict(strength=1.0, guidance_scale=5.0, **SIZE, **COMMON)
    expected = _expected(pipeline_flux_inpaint, reference, monkeypatch, seed=3, prompt=PROMPTS,
                         image=[Image.fromarray(a) for a in IMAGE], mask_image=mask, **kwargs)
    ours = pipe(PROMPTS, image=IMAGE, mask_image=mask, latents=NOISE, seed=3, progress=False, **kwargs)
    assert _pixels_off(ours, expected) <= 2

    latents = np.asarray(pipe(PROMPTS, image=IMAGE, mask_image=mask, latents=NOISE, seed=3, output_type="latent",
                              progress=False, **kwargs))
    clean = np.asarray(pipe._image_latents(IMAGE, 2, jax.random.split(jax.random.key(3), 3)[1], sample=True))
    known = MASK[0, ::2, ::2] < 128
    np.testing.assert_allclose(latents[:, known], clean[:, known], atol=1e-6)
    assert np.abs(latents[:, ~known] - clean[:, ~known]).max() > 0.1
    handed = pipe(PROMPTS, image=clean, mask_image=mask, latents=NOISE, seed=3, output_type="latent", progress=False,
                  **kwargs)  # the image as latents handed over (channels-last): the same run
    np.testing.assert_allclose(np.asarray(handed), latents, atol=1e-6)

    # padding_mask_crop: a 24x20 picture's box around its mask inpainted at 16x16 and pasted back (the same program)
    picture = Image.fromarray(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8))
    box = np.zeros((24, 20), np.uint8)
    box[6:13, 9:15] = 255
    box = Image.fromarray(box)
    expected = _expected(pipeline_flux_inpaint, reference, monkeypatch, seed=3, prompt=PROMPTS, image=picture,
                         mask_image=box, padding_mask_crop=2, output_type="pil", **kwargs)  # (diffusers asks for pil)
    ours = pipe(PROMPTS, image=picture, mask_image=box, latents=NOISE, seed=3, padding_mask_crop=2, progress=False,
                **kwargs)
    assert ours.shape == (2, 24, 20, 3) and np.abs(ours.astype(int) - expected).max() <= 2


def test_fill_matches_diffusers(fill, monkeypatch):
    """The Fill folder at diffusers' default strength 1.0 (pure noise), then at strength 0.6 (the image's latents
    noised) with another guidance scale: the transformer sees [noisy, masked-image latents, mask patches]."""
    pipe = fill.pipe
    assert type(pipe) is FluxFillPipeline and pipe.latent_channels == 2 and pipe.vae_scale_factor == 2
    reference = fill.ref
    for seed, kwargs in ((7, dict(guidance_scale=30.0)), (3, dict(strength=0.6, guidance_scale=8.0))):
        expected = _expected(pipeline_flux_fill, reference, monkeypatch, seed=seed, prompt=PROMPTS,
                             image=[Image.fromarray(a) for a in IMAGE], mask_image=[Image.fromarray(m) for m in MASK],
                             **SIZE, **COMMON, **kwargs)
        ours = pipe(PROMPTS, image=IMAGE, mask_image=MASK, latents=NOISE, seed=seed, progress=False, **COMMON,
                    **kwargs)
        assert ours.shape == (2, 16, 16, 3) and _pixels_off(ours, expected) <= 2 and np.std(ours) > 1
    other = pipe(PROMPTS, image=IMAGE, mask_image=MASK[::-1], latents=NOISE, seed=3, progress=False, **COMMON,
                 **kwargs)
    assert _pixels_off(other, expected) > 2  # the mask steers the transformer


def _unpacked(packed, h: int, w: int) -> np.ndarray:
    """diffusers' packed ``[n, h/2 * w/2, 4 * c]`` tokens as unpacked channels-last latents ``[n, h, w, c]``."""
    x = np.asarray(packed)
    n, c = x.shape[0], x.shape[-1] // 4
    return x.reshape(n, h // 2, w // 2, c, 2, 2).transpose(0, 1, 4, 2, 5, 3).reshape(n, h, w, c)


def test_masked_image_latents(fill, schnell, monkeypatch):
    """Fill from the masked_image_latents diffusers computes from the image and mask (its prepare_mask_latents'
    packed pair, unpacked: [masked-image latents, mask patches]) gives diffusers' images from the image and mask;
    Inpaint checks them and, as diffusers, does not use them. Wrong shapes or mixed inputs: one line with the fix."""
    made, reference = [], fill.ref
    keep = reference.prepare_mask_latents
    monkeypatch.setattr(reference, "prepare_mask_latents", lambda *a, **k: made.append(keep(*a, **k)) or made[-1])
    expected = _expected(pipeline_flux_fill, reference, monkeypatch, seed=7, prompt=PROMPTS, guidance_scale=30.0,
                         image=[Image.fromarray(a) for a in IMAGE], mask_image=[Image.fromarray(m) for m in MASK],
                         **SIZE, **COMMON)
    mask, masked = made[-1]
    condition = np.concatenate([_unpacked(masked, 8, 8), _unpacked(mask, 8, 8)], axis=-1)  # [2, 8, 8, 2 + 2 * 2]
    ours = fill.pipe(PROMPTS, masked_image_latents=condition, latents=NOISE, seed=7, guidance_scale=30.0,
                     progress=False, **COMMON)
    assert ours.shape == (2, 16, 16, 3) and _pixels_off(ours, expected) <= 2
    for kwargs, message in [
        (dict(masked_image_latents=condition[..., :5]), r"masked_image_latents must be floats \[1 or 2, 8, 8, 6\] "
                                                        r"\(unpacked, channels-last.*got shape \(2, 8, 8, 5\)"),
        (dict(masked_image_latents=condition.astype(np.uint8)), r"must be floats .*got shape \(2, 8, 8, 6\) uint8"),
        (dict(masked_image_latents=condition, image=IMAGE), r"pass image= or masked_image_latents=, not both"),
        (dict(masked_image_latents=condition, mask_image=MASK), r"pass mask_image= or .*holds the mask too"),
        (dict(masked_image_latents=condition, strength=0.6), r"strength=0\.6 starts from the image's latents"),
        (dict(masked_image_latents=condition, height=32), r"height=32 but masked_image_latents give height 16"),
    ]:
        with pytest.raises(InputError, match=message):
            fill.pipe(PROMPTS, progress=False, **COMMON, **kwargs)

    pipe = FluxInpaintPipeline.from_pipe(schnell.pipe)
    kwargs = dict(image=IMAGE, mask_image=MASK, latents=NOISE, seed=3, strength=1.0, progress=False, **COMMON)
    plain = pipe(PROMPTS, **kwargs)
    np.testing.assert_array_equal(pipe(PROMPTS, masked_image_latents=NOISE[:1], **kwargs), plain)
    with pytest.raises(InputError, match=r"masked_image_latents must be floats \[1 or 2, 8, 8, 2\]"):
        pipe(PROMPTS, masked_image_latents=np.zeros((2, 2, 8, 8), np.float32), **kwargs)


def test_fill_bfl_file_saved_folder_and_generate(fill, tmp_path):
    """A Black Forest Labs Fill file (img_in reading 32 = 8 + 8 + 16 channels, final_layer writing 8) loads with
    config= the Fill folder as FluxFillPipeline with the folder's weights; the pipeline saved lists the components
    diffusers' FluxFillPipeline takes (no image_encoder) and loads in diffusers; eqxdiff-generate runs the folder
    with --image and --mask files and gives the pipeline's images."""
    path = tmp_path / "flux1-fill-tiny.safetensors"
    write_safetensors(_tiny_flux.bfl_tensors(fill.ref.transformer), path)
    pipe = eqxdiff.load_pipeline(path, config=fill.folder)
    assert type(pipe) is FluxFillPipeline
    config = pipe.transformer.config
    assert (config.in_channels, config.out_channels) == (32, 8)
    for key, value in state_dict(fill.pipe.transformer).items():
        np.testing.assert_array_equal(state_dict(pipe.transformer)[key], value, err_msg=key)
    saved = save_pipeline(pipe, tmp_path / "saved")
    index = json.loads((saved / "model_index.json").read_text())
    takes = set(inspect.signature(diffusers.FluxFillPipeline.__init__).parameters) - {"self"}
    assert index["_class_name"] == "FluxFillPipeline" and set(index) - {"_class_name", "_diffusers_version"} == takes
    assert type(diffusers.DiffusionPipeline.from_pretrained(saved)) is diffusers.FluxFillPipeline

    Image.fromarray(IMAGE[0]).save(tmp_path / "photo.png")
    Image.fromarray(MASK[0]).save(tmp_path / "mask.png")
    argv = ["--model", str(fill.folder), "--image", str(tmp_path / "photo.png"), "--mask", str(tmp_path / "mask.png"),
            "--prompt", "a red cat", "--num-images", "2", "--steps", "3", "--max-sequence-length", "12", "--seed", "6",
            "--output-dir", str(tmp_path / "out"), "--no-progress"]
    saved = np.stack([np.asarray(Image.open(p)) for p in generate.main(argv)])
    expected = fill.pipe("a red cat", image=Image.open(tmp_path / "photo.png"), mask_image=Image.open(
        tmp_path / "mask.png"), num_images_per_prompt=2, seed=6, progress=False, **COMMON)
    np.testing.assert_array_equal(saved, expected)


def test_errors_name_the_problem_and_the_fix(schnell, fill, tmp_path):
    # eqxdiff-generate on a text-to-image folder with --image: the hint names the classes that drive its transformer
    Image.fromarray(IMAGE[0]).save(tmp_path / "photo.png")
    with pytest.raises(FlagError, match=r"--image is an option of FluxImg2ImgPipeline and FluxInpaintPipeline and "
                                        r"FluxKontextPipeline: add --pipeline-class FluxImg2ImgPipeline \(or another"):
        generate.main(["--model", str(schnell.folder), "--image", str(tmp_path / "photo.png"), "--prompt", "a cat"])
    with pytest.raises(FlagError, match="--image is an option of FluxFillPipeline: add --pipeline-class "
                                        "FluxFillPipeline to run the --model folder's FluxFillPipeline as one"):
        generate.main(["--model", str(fill.folder), "--pipeline-class", "FluxPipeline", "--image",
                       str(tmp_path / "photo.png"), "--prompt", "a cat"])
    inpaint = FluxInpaintPipeline.from_pipe(schnell.pipe)
    for pipe in (inpaint, fill.pipe):
        name = type(pipe).__name__
        with pytest.raises(InputError, match=f"{name} needs mask_image= \\(white where the image is repainted"):
            pipe("a cat", image=IMAGE, **COMMON)
        with pytest.raises(InputError, match=f"{name} needs image= \\(the picture to repaint\\)"):
            pipe("a cat", mask_image=MASK, **COMMON)
        with pytest.raises(InputError, match="mask_image has width 8, height 8 but the image has width 16, "
                                             "height 16; resize the mask"):
            pipe(PROMPTS, image=IMAGE, mask_image=MASK[:, :8, :8], progress=False, **COMMON)
    with pytest.raises(InputError, match="FluxFillPipeline needs image= as pixels"):
        fill.pipe(PROMPTS, image=NOISE, mask_image=MASK, progress=False, **COMMON)
    # a Fill transformer where a text-to-image one goes, and the other way round
    for cls, inputs in ((FluxPipeline, SIZE), (FluxInpaintPipeline, dict(image=IMAGE, mask_image=MASK))):
        with pytest.raises(CheckpointError, match=f"the transformer takes 32 input channels .* {cls.__name__} drives "
                                                  "Flux transformers taking 8. .* Fill ones \\(32: the masked image's "
                                                  "latents and the 4-pixel mask patches too\\) as FluxFillPipeline"):
            cls.from_pipe(fill.pipe)(PROMPTS, progress=False, **inputs, **COMMON)
    with pytest.raises(CheckpointError, match="the transformer takes 8 input channels .* FluxFillPipeline drives Flux "
                                              "transformers taking 32. Text-to-image ones \\(8\\) run as FluxPipeline"):
        FluxFillPipeline.from_pipe(schnell.pipe)(PROMPTS, image=IMAGE, mask_image=MASK, progress=False, **COMMON)
