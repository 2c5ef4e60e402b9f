"""The digits model shipped inside the package (eqxdiff/assets/digits): small, complete, found by its bare name,
loads in diffusers and eqxdiff, and draws the digit it is asked for (scored by an SVC trained on the real dataset)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.data.digits import DIGIT_NAMES, caption, digit_classifier, downscale

from ._util import nhwc_to_nchw

MODEL = Path(eqxdiff.__file__).resolve().parent / "assets" / "digits"
STEPS, GUIDANCE, PER_DIGIT = 20, 4.0, 2


def test_digits_folder_is_a_small_complete_pipeline():
    size = sum(f.stat().st_size for f in MODEL.rglob("*") if f.is_file())
    assert size <= 20 * 2**20, f"eqxdiff/assets/digits is {size / 2**20:.1f} MiB"
    index = json.loads((MODEL / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["tokenizer"] == ["transformers", "CLIPTokenizer"]
    assert index["scheduler"] == ["diffusers", "DPMSolverMultistepScheduler"]
    for part in ("text_encoder", "unet", "vae", "tokenizer", "scheduler"):
        assert (MODEL / part).is_dir()


def test_digits_is_found_by_its_bare_name_unless_a_local_folder_has_it(tmp_path, monkeypatch):
    from eqxdiff.loading import resolve_folder

    monkeypatch.chdir(tmp_path)
    assert resolve_folder("digits") == MODEL
    assert resolve_folder("digits", "unet") == MODEL / "unet"
    (tmp_path / "digits").mkdir()
    assert resolve_folder("digits").resolve() == (tmp_path / "digits").resolve()


@pytest.fixture(scope="module")
def generated():
    """20 images (2 per digit, digit-major) from eqxdiff, from fixed initial latents."""
    pipe = eqxdiff.load_pipeline("digits")
    latents = np.random.default_rng(1).standard_normal((10 * PER_DIGIT, 4, 4, 4)).astype(np.float32)
    images = pipe([caption(d) for d in range(10)], num_images_per_prompt=PER_DIGIT, latents=latents,
                  num_inference_steps=STEPS, guidance_scale=GUIDANCE, progress=False)
    return latents, images


def test_digits_are_the_prompted_digits(generated):
    """200/200 of benchmarks/digits_quality.py's images (seed 0) are classified right; here 20 other samples must
    reach 90%."""
    _, images = generated
    assert images.shape == (20, 16, 16, 3) and images.dtype == np.uint8
    predicted = digit_classifier(16).predict(downscale(images))
    wanted = np.repeat(np.arange(10), PER_DIGIT)
    accuracy = float(np.mean(predicted == wanted))
    assert accuracy >= 0.9, f"accuracy {accuracy}: predicted {predicted.tolist()} for {wanted.tolist()}"
    assert np.std(images) > 20  # real strokes on a dark background, not a flat image


def test_digits_load_in_diffusers_and_match_eqxdiff(generated):
    from diffusers import StableDiffusionPipeline

    latents, ours = generated
    ref = StableDiffusionPipeline.from_pretrained(MODEL, safety_checker=None)
    ref.set_progress_bar_config(disable=True)
    assert type(ref.scheduler).__name__ == "DPMSolverMultistepScheduler"
    with torch.no_grad():
        expected = ref([f"a handwritten digit {n}" for n in DIGIT_NAMES], num_images_per_prompt=PER_DIGIT,
                       latents=nhwc_to_nchw(latents), num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                       height=16, width=16, output_type="np").images
    diff = np.abs(ours.astype(int) - (np.asarray(expected) * 255).round().astype(int))
    assert diff.max() <= 2, f"max pixel difference {diff.max()}"
