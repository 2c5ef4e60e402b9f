"""The Flux.1 pipelines end to end against diffusers (every pixel within 2/255 from the same initial noise):
text-to-image with a guidance-distilled (dev-style) transformer and with a schnell-style one (other sizes, a
two-level VAE), true classifier-free guidance, image-to-image, Kontext editing; the prompts tokenized by character
tokenizers saved in the folders (so both sides tokenize alike) and given as embeddings. Then an FSDP x context
mesh gives the one-device images, a Black Forest Labs transformer file and a ComfyUI all-in-one file loaded with
config= equal the folder pipeline, saved folders load in diffusers, eqxdiff-generate lists the family's flags and
runs a BFL file, and the errors a user can make.

One tiny folder per variant, built once for the module; calls of one variant share their compiled programs.
"""

import copy
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.pipelines.flux import pipeline_flux_img2img, pipeline_flux_kontext

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.core import ConfigError
from eqxdiff.loading import CheckpointError, SafetensorsFile, formats, state_dict, write_safetensors
from eqxdiff.loading import single_file as layouts
from eqxdiff.parallel import MeshConfig, make_mesh
from eqxdiff.pipelines import CallLimits, InputError, InputTypeError, InputWarning, save_pipeline, save_single_file
from eqxdiff.pipelines._latents import noise_draws
from eqxdiff.pipelines.flux import COMFY_CLIP_L, COMFY_VAE, SINGLE_FILE_LAYOUTS, FluxPipeline
from eqxdiff.pipelines.flux_image import FluxImg2ImgPipeline, FluxKontextPipeline, kontext_size

from . import _tiny_flux
from . import _tiny_flux_pipeline as tiny
from ._util import assert_close, nhwc_to_nchw, rel_error

PROMPTS = ["a red cat", "two dogs"]
NEGATIVES = ["blurry", "dark room"]
SIZE = {"dev": 8, "schnell": 16}  # pixels: 16 packed tokens either way (vae scale factor 1 and 2)
COMMON = dict(num_inference_steps=3, max_sequence_length=12)


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _run(ref, **kwargs):
    with torch.no_grad():
        return ref(output_type="np", **kwargs).images


def _packed(ref, noise):
    """diffusers' packed latents of our channels-last noise ``[n, h, w, C]``."""
    n, h, w, c = noise.shape
    return ref._pack_latents(nhwc_to_nchw(noise), n, c, h, w)


def _pixels(image):
    return torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255


class Variant:
    def __init__(self, folder, variant):
        self.folder, self.name = folder, variant
        self.ref = tiny.build(folder, variant)
        self.pipe = eqxdiff.load_pipeline(folder)
        size = SIZE[variant]
        self.size = dict(height=size, width=size)
        f = self.pipe.vae_scale_factor
        self.shape = (2, size // f, size // f, self.pipe.latent_channels)
        self.noise = np.random.default_rng(len(variant)).standard_normal(self.shape).astype(np.float32)


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
    return Variant(tmp_path_factory.mktemp("flux_dev"), "dev")


@pytest.fixture(scope="module")
def schnell(tmp_path_factory):
    return Variant(tmp_path_factory.mktemp("flux_schnell"), "schnell")


def test_dev_text_to_image_matches_diffusers(dev):
    """Guidance embeds (dev): prompts through both character tokenizers, prompt_2 for T5, the dynamic shift; then
    diffusers' own embeddings as prompt_embeds / pooled_prompt_embeds; one prompt, two images."""
    pipe, ref = dev.pipe, dev.ref
    assert type(pipe) is FluxPipeline and pipe.transformer.config.guidance_embeds
    assert pipe.scheduler.config.use_dynamic_shifting
    kwargs = dict(guidance_scale=4.0, **dev.size, **COMMON)
    expected = _run(ref, prompt=PROMPTS, prompt_2=["green", "blue sky"], latents=_packed(ref, dev.noise), **kwargs)
    ours = pipe(PROMPTS, ["green", "blue sky"], latents=dev.noise, progress=False, **kwargs)
    assert ours.shape == (2, 8, 8, 3) and ours.dtype == np.uint8
    assert _pixels_off(ours, expected) <= 2 and np.std(ours) > 1

    with torch.no_grad():
        embeds, pooled, _ = ref.encode_prompt(PROMPTS, ["green", "blue sky"], max_sequence_length=12)
    text = pipe.encode_prompt(PROMPTS, ["green", "blue sky"], max_sequence_length=12)
    assert_close(text.embeds, embeds.numpy(), 1e-4, "T5 embeddings")
    assert_close(text.pooled, pooled.numpy(), 1e-4, "CLIP pooled embeddings")
    given = pipe(prompt_embeds=embeds.numpy(), pooled_prompt_embeds=pooled.numpy(), latents=dev.noise,
                 progress=False, **kwargs)
    assert _pixels_off(given, expected) <= 2

    # a custom schedule (shifted by mu as diffusers' set_timesteps shifts it)
    custom = dict(kwargs, sigmas=[1.0, 0.7, 0.2])
    expected = _run(ref, prompt=PROMPTS, latents=_packed(ref, dev.noise), **custom)
    assert _pixels_off(pipe(PROMPTS, latents=dev.noise, progress=False, **custom), expected) <= 2

    # another distilled guidance scale is another input of the same program; one prompt, two images
    kwargs.update(guidance_scale=2.0, num_images_per_prompt=2)
    expected = _run(ref, prompt="a red cat", latents=_packed(ref, dev.noise), **kwargs)
    assert _pixels_off(pipe("a red cat", latents=dev.noise, progress=False, **kwargs), expected) <= 2
    latents = pipe("a red cat", latents=dev.noise, output_type="latent", progress=False, **kwargs)
    assert latents.shape == dev.shape  # unpacked, channels-last


def test_schnell_text_to_image_and_true_cfg_match_diffusers(schnell):
    """No guidance embedder (schnell), 2 + 2 blocks, a two-level VAE (vae scale factor 2, 2 latent channels),
    static shift; then true CFG with negative prompts (two passes a step), and from negative embeddings."""
    pipe, ref = schnell.pipe, schnell.ref
    assert not pipe.transformer.config.guidance_embeds and pipe.vae_scale_factor == 2
    kwargs = dict(**schnell.size, **COMMON)
    expected = _run(ref, prompt=PROMPTS, latents=_packed(ref, schnell.noise), **kwargs)
    ours = pipe(PROMPTS, latents=schnell.noise, progress=False, **kwargs)
    assert ours.shape == (2, 16, 16, 3) and _pixels_off(ours, expected) <= 2

    cfg = dict(true_cfg_scale=3.0, negative_prompt=NEGATIVES, negative_prompt_2=["grey", "noise"], **kwargs)
    expected_cfg = _run(ref, prompt=PROMPTS, latents=_packed(ref, schnell.noise), **cfg)
    ours_cfg = pipe(PROMPTS, latents=schnell.noise, progress=False, **cfg)
    assert _pixels_off(ours_cfg, expected_cfg) <= 2
    assert _pixels_off(ours_cfg, expected) > 2  # the negative half changed the images

    with torch.no_grad():
        negative, negative_pooled, _ = ref.encode_prompt(NEGATIVES, ["grey", "noise"], max_sequence_length=12)
    given = pipe(PROMPTS, latents=schnell.noise, true_cfg_scale=3.0, negative_prompt_embeds=negative.numpy(),
                 negative_pooled_prompt_embeds=negative_pooled.numpy(), progress=False, **kwargs)
    assert _pixels_off(given, expected_cfg) <= 2
    with pytest.warns(InputWarning, match="true CFG runs only with true_cfg_scale > 1"):
        pipe(PROMPTS, latents=schnell.noise, negative_prompt=NEGATIVES, progress=False, **kwargs)


def test_image_to_image_matches_diffusers(dev, monkeypatch):
    """The dev folder as FluxImg2ImgPipeline: the image's VAE posterior sample (from our key) noised to strength
    by the same noise, the dynamic shift at the image's token count, the schedule cut as diffusers cuts it."""
    pipe = FluxImg2ImgPipeline.from_pretrained(dev.folder)
    assert type(pipe) is FluxImg2ImgPipeline
    image = np.random.default_rng(1).integers(0, 256, (2, 8, 8, 3), dtype=np.uint8)
    draws = noise_draws(jax.random.key(7), dev.shape)
    monkeypatch.setattr(pipeline_flux_img2img, "randn_tensor", lambda *a, **k: nhwc_to_nchw(dev.noise))
    monkeypatch.setattr(pipeline_flux_img2img, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(np.array(draws.image)))
    kwargs = dict(strength=0.6, guidance_scale=5.0, **COMMON)  # 3 steps from 1: the text-to-image program
    reference = pipeline_flux_img2img.FluxImg2ImgPipeline(**dev.ref.components)
    expected = _run(reference, prompt=PROMPTS, image=_pixels(image), **dev.size, **kwargs)
    ours = pipe(PROMPTS, image=image, latents=dev.noise, seed=7, progress=False, **kwargs)
    assert ours.shape == (2, 8, 8, 3) and _pixels_off(ours, expected) <= 2


def test_kontext_with_true_cfg_matches_diffusers(dev):
    """Kontext on the dev folder: a 16x8 reference image's latent tokens appended at positions (1, row, col) to
    an 8x8 output's, distilled guidance and true CFG together; the reference's size kept (_auto_resize=False)."""
    from diffusers import FluxKontextPipeline as Reference

    pipe = FluxKontextPipeline.from_pipe(dev.pipe)
    image = np.random.default_rng(2).integers(0, 256, (2, 16, 8, 3), dtype=np.uint8)
    kwargs = dict(guidance_scale=3.0, true_cfg_scale=2.5, negative_prompt=NEGATIVES, max_area=64, **dev.size,
                  **COMMON)
    expected = _run(Reference(**dev.ref.components), prompt=PROMPTS, image=_pixels(image),
                    latents=_packed(dev.ref, dev.noise), _auto_resize=False, **kwargs)
    ours = pipe(PROMPTS, image=image, latents=dev.noise, _auto_resize=False, progress=False, **kwargs)
    assert ours.shape == (2, 8, 8, 3) and _pixels_off(ours, expected) <= 2
    # diffusers' name, underscore included; the bare one (eqxdiff's before) is refused naming diffusers'
    with pytest.raises(InputTypeError, match=r"'auto_resize' \(diffusers' name, which this call takes: _auto_resize="):
        pipe(PROMPTS, image=image, auto_resize=False)


def test_kontext_sizes_follow_diffusers(dev):
    """The output size (aspect ratio at max_area, rounded down) and the reference resized to the nearest trained
    resolution as diffusers' FluxKontextPipeline does: PIL with Lanczos, arrays nearest-neighbour."""
    from PIL import Image

    Reference = pipeline_flux_kontext.FluxKontextPipeline

    pipe = FluxKontextPipeline.from_pipe(dev.pipe)
    processor = Reference(**dev.ref.components).image_processor
    assert kontext_size(1024, 1024, max_area=1024**2, multiple_of=16) == (1024, 1024)
    assert kontext_size(512, 768, max_area=1024**2, multiple_of=16) == (832, 1248)  # round(sqrt(A*r)) floored
    picture = Image.fromarray(np.random.default_rng(3).integers(0, 256, (90, 140, 3), dtype=np.uint8))
    resized = pipe.reference_image(picture)
    height, width = processor.get_default_height_width(picture)
    preferred = pipeline_flux_kontext.PREFERRED_KONTEXT_RESOLUTIONS
    _, w, h = min((abs(width / height - w / h), w, h) for w, h in preferred)
    assert (resized.height, resized.width) == (h, w)
    np.testing.assert_array_equal(np.asarray(resized), np.asarray(processor.resize(picture, h, w)))
    assert pipe.reference_image(picture, auto_resize=False).size == (140, 90)  # already multiples of 2
    # arrays are resized nearest-neighbour, as diffusers' resize does them (floats in [0, 1]; uint8 the same pixels)
    array = np.asarray(picture)
    floats = pipe.reference_image(array[None].astype(np.float32) / 255)
    theirs = processor.resize(array[None].astype(np.float32) / 255, h, w)
    assert floats.shape == theirs.shape == (1, h, w, 3)
    np.testing.assert_array_equal(floats, theirs)
    np.testing.assert_array_equal(pipe.reference_image(array), np.round(theirs[0] * 255).astype(np.uint8))


def test_mesh_equals_one_device(dev):
    """On an FSDP x context mesh (weights sharded, batch over fsdp, tokens split over context: the joint attention
    runs the ring kernel; the rotary tables stay whole), the text encoders offloaded: the one-device pipeline's
    images."""
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=4))
    kwargs = dict(guidance_scale=4.0, **dev.size, **COMMON)
    expected = dev.pipe(PROMPTS, latents=dev.noise, progress=False, **kwargs)
    pipe = eqxdiff.load_pipeline(dev.folder, mesh=mesh, offload_encoders=True)
    for name in ("text_encoder", "text_encoder_2"):  # in host memory, put on the devices only while encoding
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(getattr(pipe, name))), name
    assert all(isinstance(x, jax.Array) and x.sharding.mesh.shape == mesh.shape
               for x in jax.tree.leaves(pipe.transformer))
    ours = pipe(PROMPTS, latents=dev.noise, progress=False, **kwargs)
    assert np.max(np.abs(ours.astype(int) - expected.astype(int))) <= 1
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(pipe.text_encoder_2))  # still on the host after


def test_bfloat16_dev_pipeline_runs_close_to_float32(dev):
    """The dev folder loaded in bfloat16 (weights and activations, as on a GPU): every transformer leaf bfloat16, the
    scheduler's schedule and step arithmetic float32 (a bfloat16 sample in, float32 math, the sample's dtype out, as
    diffusers' FlowMatchEulerDiscreteScheduler does), finite images close to the float32 run's.

    The bound is loose and documented: bfloat16 keeps 8 mantissa bits (2**-8 = 0.4% per rounding), and this
    pipeline chains four bfloat16 models (CLIP, T5, the transformer three steps running, the VAE). The final latents
    measured 0.76% (max |difference| over max |latents|) and the images 2 levels at most, 0.44 on average, on the
    machine that wrote this (5.2%, 8 and 1.1 before activations, guidance and Flux's timestep embedding were computed
    in float32: tests/test_dtypes.py); the bounds are about twice the latents' figure and three times the images'."""
    pipe = eqxdiff.load_pipeline(dev.folder, dtype="bfloat16")
    assert pipe.activations_dtype == jnp.bfloat16
    floats = [x for x in jax.tree.leaves(pipe.transformer) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
    kwargs = dict(guidance_scale=4.0, **dev.size, **COMMON)
    latents = {name: p(PROMPTS, latents=dev.noise, output_type="latent", progress=False, **kwargs)
               for name, p in (("float32", dev.pipe), ("bfloat16", pipe))}
    assert latents["bfloat16"].dtype == jnp.bfloat16 and latents["float32"].dtype == jnp.float32
    assert rel_error(np.asarray(latents["bfloat16"], np.float32), latents["float32"]) <= 0.02
    images = pipe(PROMPTS, latents=dev.noise, progress=False, **kwargs)  # NaN or inf would raise NonFiniteError
    off = np.abs(images.astype(int) - dev.pipe(PROMPTS, latents=dev.noise, progress=False, **kwargs).astype(int))
    assert images.shape == (2, 8, 8, 3) and np.std(images) > 1 and off.max() <= 6 and off.mean() <= 1.5

    state = pipe.scheduler.init(3, sample_shape=dev.shape, **pipe.schedule_keywords(3, None, 16))
    assert state.sigmas.dtype == state.timesteps.dtype == jnp.float32
    sample, velocity = (jnp.asarray(a, jnp.bfloat16) for a in np.random.default_rng(5).standard_normal((2, 4, 16)))
    stepped, _ = pipe.scheduler.step(state, velocity, sample)
    sigma, following = state.sigmas[0], state.sigmas[1]
    float32_step = sample.astype(jnp.float32) + (following - sigma) * velocity.astype(jnp.float32)
    assert stepped.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(stepped, np.float32), np.asarray(float32_step.astype(jnp.bfloat16),
                                                                                np.float32))


@pytest.fixture(scope="module")
def bfl_file(dev, tmp_path_factory):
    """The dev transformer as a Black Forest Labs file (BFL's names, fused qkv / linear1)."""
    path = tmp_path_factory.mktemp("bfl") / "flux1-tiny.safetensors"
    write_safetensors(_tiny_flux.bfl_tensors(dev.ref.transformer), path)
    return path


def test_bfl_and_all_in_one_files_equal_the_folder(dev, bfl_file, tmp_path):
    """A Black Forest Labs transformer file with config= the folder; a ComfyUI all-in-one file (the transformer
    under model.diffusion_model., the VAE in the LDM layout, CLIP-L and T5 in transformers' names) with config=;
    offload_encoders. All give the folder pipeline's images exactly. save_single_file writes the pipeline as such a
    file (the shared writer, the Flux layout's data), which reads back into the same weights."""
    kwargs = dict(guidance_scale=4.0, **dev.size, **COMMON)
    expected = dev.pipe(PROMPTS, latents=dev.noise, progress=False, **kwargs)
    bfl = bfl_file
    pipe = eqxdiff.load_pipeline(bfl, config=dev.folder)
    assert type(pipe) is FluxPipeline
    np.testing.assert_array_equal(pipe(PROMPTS, latents=dev.noise, progress=False, **kwargs), expected)

    tensors = _tiny_flux.bfl_tensors(dev.ref.transformer, prefix=formats.FLUX_DIFFUSION_MODEL)
    tensors.update(layouts.layout_tensors(dev.pipe.vae, layouts.ldm_vae(dev.pipe.vae.config, prefix=COMFY_VAE)))
    for prefix, model in ((COMFY_CLIP_L, dev.ref.text_encoder), (formats.COMFY_T5XXL, dev.ref.text_encoder_2)):
        tensors.update({prefix + k: v.numpy() for k, v in model.state_dict().items()})
    write_safetensors(tensors, tmp_path / "flux1-tiny-all-in-one.safetensors")
    folder = tmp_path / "configs_only"  # the components' configs, tokenizers and scheduler; no weights
    shutil.copytree(dev.folder, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    pipe = eqxdiff.load_pipeline(tmp_path / "flux1-tiny-all-in-one.safetensors", config=folder,
                                 offload_encoders=True)
    for name in ("vae", "text_encoder", "text_encoder_2", "transformer"):
        for key, value in state_dict(getattr(dev.pipe, name)).items():
            np.testing.assert_array_equal(state_dict(getattr(pipe, name))[key], value, err_msg=f"{name}.{key}")
    np.testing.assert_array_equal(pipe(PROMPTS, latents=dev.noise, progress=False, **kwargs), expected)

    # written by eqxdiff: the same layout (the transformer's tensors BFL's, as built above), read back the same
    written = SafetensorsFile(save_single_file(dev.pipe, tmp_path / "written.safetensors"))
    assert layouts.detect_in(written, "file", SINGLE_FILE_LAYOUTS).name == "flux_comfyui"
    transformer = {n: v for n, v in tensors.items() if n.startswith(formats.FLUX_DIFFUSION_MODEL)}
    assert {n for n in written.names() if n.startswith(formats.FLUX_DIFFUSION_MODEL)} == transformer.keys()
    for n, v in transformer.items():
        np.testing.assert_array_equal(written.get(n), v, err_msg=n)
    again = eqxdiff.load_pipeline(tmp_path / "written.safetensors", config=folder)
    for name in ("vae", "text_encoder", "text_encoder_2", "transformer"):
        for key, value in state_dict(getattr(dev.pipe, name)).items():
            np.testing.assert_array_equal(state_dict(getattr(again, name))[key], value, err_msg=f"{name}.{key}")
    with pytest.raises(ValueError, match="FluxPipeline has no unet, which a sd1 single file holds"):
        save_single_file(dev.pipe, tmp_path / "sd1.safetensors", layout="sd1")
    with pytest.raises(ValueError, match=r"layout='flux'; choose one of \['flux_bfl', 'flux_comfyui', "):
        save_single_file(dev.pipe, tmp_path / "flux.safetensors", layout="flux")

    with pytest.raises(CheckpointError, match="pass config= a diffusers Flux folder"):
        eqxdiff.load_pipeline(bfl)
    with pytest.raises(CheckpointError, match="does not hold the vae, so it is read from config="):
        eqxdiff.load_pipeline(bfl, config=folder)  # no weights for the components the file lacks
    no_transformer = tmp_path / "no_transformer"  # sizes from the tensors; a tiny head's rope split is not FLUX.1's
    shutil.copytree(dev.folder, no_transformer, ignore=shutil.ignore_patterns("transformer"))
    with pytest.raises(CheckpointError, match="heads of 16 channels.*or pass config= a Flux folder holding "
                                              "transformer/config.json"):
        eqxdiff.load_pipeline(bfl, config=no_transformer)


def test_fused_projections_from_a_folder_and_a_bfl_file(dev, bfl_file):
    """config_overrides asks the transformer for fused projections from load_pipeline (a folder, and a BFL file with
    config=): its fused weights are diffusers' tensors concatenated, and its images are the unfused pipeline's (one
    more compiled loop; the file's pipeline reuses it and gives the folder's images exactly)."""
    kwargs = dict(guidance_scale=4.0, **dev.size, **COMMON)
    fused_transformer = {"transformer": {"fused_projections": True}}
    fused = eqxdiff.load_pipeline(dev.folder, config_overrides=fused_transformer)
    assert fused.transformer.config.fused_projections and not dev.pipe.transformer.config.fused_projections
    assert state_dict(fused.transformer).keys() != state_dict(dev.pipe.transformer).keys()
    images = fused(PROMPTS, latents=dev.noise, progress=False, **kwargs)
    expected = dev.pipe(PROMPTS, latents=dev.noise, progress=False, **kwargs)
    assert np.max(np.abs(images.astype(int) - expected.astype(int))) <= 1  # float32 rounding of larger matmuls only
    from_file = eqxdiff.load_pipeline(bfl_file, config=dev.folder, config_overrides=fused_transformer)
    for key, value in state_dict(fused.transformer).items():
        np.testing.assert_array_equal(state_dict(from_file.transformer)[key], value, err_msg=key)
    np.testing.assert_array_equal(from_file(PROMPTS, latents=dev.noise, progress=False, **kwargs), images)

    with pytest.raises(ConfigError, match=r"config_overrides=\{'fused_projections': True\} must map model components "
                                          r"to the config keys .*'transformer'"):
        eqxdiff.load_pipeline(dev.folder, config_overrides={"fused_projections": True})
    with pytest.raises(ConfigError, match=r"config_overrides names \['unet'\], not models of a FluxPipeline: its "
                                          r"models are \['vae', 'text_encoder', 'text_encoder_2', 'transformer'\]"):
        eqxdiff.load_pipeline(bfl_file, config=dev.folder, config_overrides={"unet": {"sample_size": 8}})
    with pytest.raises(ConfigError, match=r"config_overrides \['fused_projection'\] are not settings of a "
                                          r"FluxTransformer2DConfig .*'fused_projections'"):
        eqxdiff.load_pipeline(dev.folder, config_overrides={"transformer": {"fused_projection": True}})


def test_saved_folders_load_in_diffusers(dev, tmp_path):
    """save_pipeline writes folders diffusers' FluxPipeline and FluxKontextPipeline load, with the same images."""
    import diffusers

    kwargs = dict(guidance_scale=4.0, **dev.size, **COMMON)
    save_pipeline(dev.pipe, tmp_path / "flux")
    index = json.loads((tmp_path / "flux" / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline" and index["tokenizer_2"][0] == "transformers"
    back = diffusers.FluxPipeline.from_pretrained(tmp_path / "flux")
    back.set_progress_bar_config(disable=True)
    latents = _packed(dev.ref, dev.noise)
    np.testing.assert_array_equal(_run(back, prompt=PROMPTS, latents=latents, **kwargs),
                                  _run(dev.ref, prompt=PROMPTS, latents=latents, **kwargs))

    save_pipeline(FluxKontextPipeline.from_pipe(dev.pipe), tmp_path / "kontext")
    assert type(eqxdiff.load_pipeline(tmp_path / "kontext")) is FluxKontextPipeline
    assert type(diffusers.DiffusionPipeline.from_pretrained(tmp_path / "kontext")) is diffusers.FluxKontextPipeline


def test_generate_runs_a_bfl_file(dev, bfl_file, tmp_path, capsys):
    """eqxdiff-generate --model flux1-*.safetensors --config FOLDER: the file's class and options (its config's),
    the same images as the folder pipeline from the same seed."""
    with pytest.raises(SystemExit):
        generate.main(["--model", str(bfl_file), "--config", str(dev.folder), "--help"])
    assert "--true-cfg-scale" in capsys.readouterr().out
    argv = ["--model", str(bfl_file), "--config", str(dev.folder), "--prompt", "a red cat", "--num-images", "2",
            "--height", "8", "--width", "8", "--steps", "3", "--max-sequence-length", "12", "--seed", "5",
            "--output-dir", str(tmp_path), "--no-progress"]
    paths = generate.main(argv)
    from PIL import Image

    saved = np.stack([np.asarray(Image.open(p)) for p in paths])
    expected = dev.pipe("a red cat", num_images_per_prompt=2, seed=5, progress=False, **dev.size, **COMMON)
    np.testing.assert_array_equal(saved, expected)


@pytest.fixture(scope="module")
def kontext_folder(dev, tmp_path_factory):
    """The dev pipeline saved as a FluxKontextPipeline folder."""
    return save_pipeline(FluxKontextPipeline.from_pipe(dev.pipe), tmp_path_factory.mktemp("flux") / "kontext")


def test_generate_runs_a_kontext_folder_with_an_image_file(dev, kontext_folder, tmp_path):
    """eqxdiff-generate --model KONTEXT_FOLDER --image file.png: diffusers' FluxKontextPipeline's images (within
    2/255) from the same noise (the seed's) and reference, with true CFG and distilled guidance; the sizes and scales
    of test_kontext_with_true_cfg_matches_diffusers, whose compiled programs it reuses."""
    from PIL import Image
    from diffusers import FluxKontextPipeline as Reference

    image = np.random.default_rng(4).integers(0, 256, (16, 8, 3), dtype=np.uint8)
    Image.fromarray(image).save(tmp_path / "reference.png")
    argv = ["--model", str(kontext_folder), "--image", str(tmp_path / "reference.png"), "--prompt", "a red cat",
            "--negative-prompt", "blurry", "--true-cfg-scale", "2.5", "--guidance-scale", "3.0", "--num-images", "2",
            "--height", "8", "--width", "8", "--max-area", "64", "--no-auto-resize", "--steps", "3",
            "--max-sequence-length", "12", "--seed", "6", "--output-dir", str(tmp_path / "out"), "--no-progress"]
    saved = np.stack([np.asarray(Image.open(p)) for p in generate.main(argv)])
    noise = np.array(noise_draws(jax.random.key(6), dev.shape).noise)  # writable, for torch
    expected = _run(Reference(**dev.ref.components), prompt="a red cat", negative_prompt="blurry",
                    num_images_per_prompt=2, image=_pixels(image[None]), latents=_packed(dev.ref, noise),
                    _auto_resize=False, guidance_scale=3.0, true_cfg_scale=2.5, max_area=64, **dev.size, **COMMON)
    assert saved.shape == (2, 8, 8, 3) and _pixels_off(saved, expected) <= 2 and np.std(saved) > 1


def test_generate_lists_the_flux_options(dev, kontext_folder, capsys):
    """eqxdiff-generate reads the options of a Flux folder's class from its __call__ (Kontext's image too)."""
    for folder, flags in ((dev.folder, ("--true-cfg-scale", "--guidance-scale", "--max-sequence-length",
                                        "--prompt-2", "--negative-prompt-2", "--sigmas", "FluxPipeline")),
                          (kontext_folder, ("--image", "--max-area", "--auto-resize", "FluxKontextPipeline"))):
        with pytest.raises(SystemExit) as e:
            generate.main(["--model", str(folder), "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        for flag in flags:
            assert flag in text, flag
        assert "--prompt-embeds" not in text and "--latents" not in text


class _Stopped(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stopped


def test_t5_prompts_get_the_shared_tokenizer_checks(dev, monkeypatch):
    """T5's prompts go through the shared tokenization (``pipelines._text``): a prompt cut to max_sequence_length
    warns with the part cut off, and a tokenizer_2 whose ids overrun text_encoder_2's vocabulary is refused, each
    naming the T5 side. Stopped before the encoders run: nothing compiles."""
    from eqxdiff.pipelines import flux

    monkeypatch.setattr(flux, "clip_pooled", lambda encoder, ids: None)
    monkeypatch.setattr(flux, "t5_embeddings", _stop)
    with pytest.warns(InputWarning, match=r"^the prompt 'two dogs and a red cat' has 19 tokens but text_encoder_2 "
                                          r"reads 12: 7 token\(s\) were cut off, starting 'a red cat'. Shorten the prompt or raise "
                                          r"max_sequence_length \(at most 512\)$"), pytest.raises(_Stopped):
        dev.pipe.encode_prompt("a cat", "two dogs and a red cat", max_sequence_length=12)
    encoder = copy.copy(dev.pipe.text_encoder_2)  # the same weights, a config that says the vocabulary is smaller
    object.__setattr__(encoder, "config", dataclasses.replace(encoder.config, vocab_size=5))
    smaller = FluxPipeline.from_pipe(dev.pipe, text_encoder_2=encoder)
    with pytest.raises(CheckpointError, match=r"tokenizer_2 gave token id \d+, outside text_encoder_2's vocabulary of "
                                              r"5 \(vocab_size in its config.json\)"):
        smaller.encode_prompt("a cat", max_sequence_length=12)


def test_errors_name_the_problem_and_the_fix(dev):
    pipe = dev.pipe
    with pytest.raises(InputError, match=r"height=1000 must be a multiple of 16 \(the VAE downsamples by 8 .*"
                                         r"nearest valid height is 1008"):
        FluxPipeline.check_arguments({"height": 1000}, CallLimits(size_factor=16))
    with pytest.raises(InputError, match="width=9 must be a multiple of 2 .*nearest valid width is 10"):
        pipe(PROMPTS, width=9, height=8, progress=False)
    with pytest.raises(InputError, match=r"prompt_embeds must be \[n, seq, 32\]"):
        pipe(prompt_embeds=np.zeros((1, 4, 16), np.float32), pooled_prompt_embeds=np.zeros((1, 32), np.float32))
    with pytest.raises(InputError, match=r"pooled_prompt_embeds must be \[1, 32\]"):
        pipe(prompt_embeds=np.zeros((1, 4, 32), np.float32), pooled_prompt_embeds=np.zeros((1, 8), np.float32))
    with pytest.raises(InputError, match="needs pooled_prompt_embeds"):
        pipe(prompt_embeds=np.zeros((1, 4, 32), np.float32))
    with pytest.raises(InputError, match="not both"):
        pipe("a cat", prompt_embeds=np.zeros((1, 4, 32), np.float32))
    with pytest.raises(InputError, match="max_sequence_length=600 cannot be greater than 512"):
        pipe("a cat", max_sequence_length=600)
    with pytest.raises(InputError, match="FluxKontextPipeline needs image="):
        FluxKontextPipeline.from_pipe(pipe)("a cat")
    with pytest.raises(InputError, match="FluxImg2ImgPipeline needs image="):
        FluxImg2ImgPipeline.from_pipe(pipe)("a cat")
    with pytest.raises(InputError, match="image has width 8, height 9 pixels, not multiples of 2 .* resize or crop it "
                       "to width 8, height 10"):
        FluxImg2ImgPipeline.from_pipe(pipe)("a cat", image=np.zeros((1, 9, 8, 3), np.uint8))
    with pytest.raises(InputError, match="height=16 but the image's height is 8"):
        FluxImg2ImgPipeline.from_pipe(pipe)("a cat", image=np.zeros((1, 8, 8, 3), np.uint8), height=16)
    with pytest.raises(ValueError, match=r"latents must have shape \(2, 8, 8, 1\)"):
        pipe(PROMPTS, latents=np.zeros((2, 4, 4, 1), np.float32), progress=False, **dev.size)
    with pytest.warns(InputWarning, match="true_cfg_scale=4.0 has no effect without negative_prompt"):
        pipe.text_conditioning(PROMPTS, true_cfg_scale=4.0, max_sequence_length=12)
