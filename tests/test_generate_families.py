"""``eqxdiff-generate`` on the SDXL, refiner, inpainting, ControlNet and single-file paths, run in-process as a user
runs it (files in, PNGs out) and compared with diffusers from the same draws (every pixel within 2/255): an SDXL
base read from a single file with ``--config``, with its second prompt and micro-conditioning flags, handing its
latents over to a ``--refiner`` at ``--denoising-end``; SDXL inpainting from ``--image`` and ``--mask`` files; two
ControlNets loaded from their own folders onto a Stable Diffusion base (per-net scales, a window); a lone UNet file
in place of the SDXL base's (``--unet``, SDXL-Lightning's recipe), also as the Python recipe runs it. Then, without
loading: the pipeline each combination runs (SDXL's ControlNet pipeline, ControlNet image-to-image, a ControlNet
pipeline folder), the flags each shows, and the errors, which all come before anything is loaded.

Tiny folders are built once for the module; each run compiles its own programs (two steps, three for the hand-off),
so the module takes about a minute.
"""

import argparse
import json

import numpy as np
import pytest
import torch
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.loading import CheckpointError
from eqxdiff.pipelines import InputError, read_parameters, save_single_file, seed_key
from eqxdiff.pipelines._latents import noise_draws

from . import _tiny_controlnet as tiny_cn
from . import _tiny_sdxl as tiny_xl
from ._single_file_util import configs_only
from ._tiny_sd import build_pipeline
from ._util import nhwc_to_nchw

PROMPT = "a red cat"
XL_SHAPE = (1, 16, 16, 4)  # latents of one 32x32 image from the tiny SDXL VAE
SD_SHAPE = (1, 16, 16, 4)  # the tiny SD pipeline at 32x32 (its VAE downsamples by 2)
COMMON = ["--steps", "2", "--no-progress"]


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _png(path) -> np.ndarray:
    return np.asarray(Image.open(path))


def _run(ref, **kwargs):
    ref.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return ref(output_type="np", **kwargs).images


def _generate(out, *argv) -> tuple[np.ndarray, dict]:
    (path,) = generate.main([*COMMON, *argv, "--output-dir", str(out)])  # a test's own --steps wins
    return _png(path), read_parameters(path)


def _noise(seed: int, shape) -> torch.Tensor:
    """The initial noise a call with ``seed`` draws, as diffusers' ``latents`` (channels-first)."""
    return nhwc_to_nchw(noise_draws(seed_key(seed), shape).noise)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A picture, an inpainting mask (white = repaint) and two control images, as PNG files."""
    root = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / "photo.png")
    mask = np.zeros((32, 32), np.uint8)
    mask[4:20, 8:30] = 255
    Image.fromarray(mask).save(root / "mask.png")
    for i, name in enumerate(("edges", "depth")):
        Image.fromarray(tiny_cn.control_images(1, 32, seed=3 + i)[0]).save(root / f"{name}.png")
    return argparse.Namespace(**{p.stem: p for p in root.iterdir()})


@pytest.fixture(scope="module")
def xl(tmp_path_factory):
    """SDXL base, refiner and inpainting folders; the base as one A1111/SGM-layout file and its configs without
    weights (the file's --config); a ControlNet folder for the base."""
    root = tmp_path_factory.mktemp("sdxl")
    base = tiny_xl.build_base(root / "base")
    refiner = tiny_xl.build_refiner(root / "refiner", base)
    inpaint = tiny_xl.build_inpaint(root / "inpaint")
    save_single_file(eqxdiff.load_pipeline(root / "base"), root / "sdxl_base.safetensors")
    configs_only(root / "base", root / "configs")
    tiny_cn.controlnet(tiny_cn.SDXL_PIPE_CONTROLNET, 21).save_pretrained(root / "controlnet", safe_serialization=True)
    return argparse.Namespace(root=root, base=base, refiner=refiner, inpaint=inpaint)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """A Stable Diffusion base folder and two ControlNet folders for it (the second reads bgr)."""
    root = tmp_path_factory.mktemp("sd")
    base = build_pipeline(root / "base", scheduler="ddim")
    nets = [tiny_cn.controlnet(tiny_cn.SD_PIPE_CONTROLNET, 11),
            tiny_cn.controlnet(tiny_cn.SD_PIPE_CONTROLNET, 12, controlnet_conditioning_channel_order="bgr")]
    for i, net in enumerate(nets):
        net.save_pretrained(root / f"controlnet_{i}", safe_serialization=True)
    return argparse.Namespace(root=root, base=base, nets=nets)


# -- SDXL ---------------------------------------------------------------------------------------------------------

def test_sdxl_single_file_hands_over_to_the_refiner(xl, tmp_path):
    """The base from its single file (--config: the folder's configs and tokenizers, no weights) with SDXL's own
    flags (--prompt-2, --negative-prompt, --original-size), stopped at --denoising-end; the --refiner folder (its
    aesthetic-score conditioning, --aesthetic-score) runs the rest of the schedule from the handed-over latents."""
    file = xl.root / "sdxl_base.safetensors"
    ours, params = _generate(tmp_path, "--model", str(file), "--config", str(xl.root / "configs"), "--refiner",
                             str(xl.root / "refiner"), "--denoising-end", "0.5", "--steps", "3", "--prompt", PROMPT,
                             "--prompt-2", "two dogs", "--negative-prompt", "blurry", "--original-size", "40", "48",
                             "--guidance-scale", "5", "--aesthetic-score", "7", "--seed", "5")
    prompts = {"prompt": PROMPT, "negative_prompt": "blurry", "guidance_scale": 5.0, "num_inference_steps": 3}
    base = {**prompts, "prompt_2": "two dogs", "original_size": (40, 48), "latents": _noise(5, XL_SHAPE),
            "denoising_end": 0.5}
    with torch.no_grad():
        handed = xl.base(**base, output_type="latent").images
    expected = _run(xl.refiner, image=handed, denoising_start=0.5, aesthetic_score=7.0, original_size=(40, 48),
                    **prompts)
    assert ours.shape == (32, 32, 3) and _pixels_off(ours[None], expected) <= 2
    assert _pixels_off(ours[None], _run(xl.base, **base)) > 10  # the base alone, stopped there, decodes other pixels
    assert params["model"] == str(file) and params["config"] == str(xl.root / "configs")
    assert params["pipeline"] == "StableDiffusionXLPipeline" and params["scheduler"] == "euler"
    assert params["refiner"] == str(xl.root / "refiner") and params["denoising_end"] == 0.5
    assert params["refiner_pipeline"] == "StableDiffusionXLImg2ImgPipeline" and params["refiner_scheduler"] == "euler"
    assert params["prompt_2"] == "two dogs" and params["original_size"] == [40, 48] and params["aesthetic_score"] == 7


def test_sdxl_inpainting_from_image_and_mask_files(xl, files, tmp_path, monkeypatch):
    """--image and --mask (files; the mask read in grayscale) on an SDXL inpainting folder: diffusers given the
    same noise and VAE samples."""
    from diffusers.pipelines.stable_diffusion_xl import (
        pipeline_stable_diffusion_xl_inpaint as module,
    )

    ours, params = _generate(tmp_path, "--model", str(xl.root / "inpaint"), "--image", str(files.photo),
                             "--mask", str(files.mask), "--prompt", PROMPT, "--guidance-scale", "5", "--seed", "4")
    draws = noise_draws(seed_key(4), XL_SHAPE)
    posterior = iter([draws.image, draws.masked_image])
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(draws.noise))
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(next(posterior)))
    expected = _run(xl.inpaint, prompt=PROMPT, image=Image.open(files.photo), mask_image=Image.open(files.mask),
                    guidance_scale=5.0, num_inference_steps=2)
    assert _pixels_off(ours[None], expected) <= 2
    assert params["image"] == str(files.photo) and params["mask_image"] == str(files.mask)
    assert params["pipeline"] == "StableDiffusionXLInpaintPipeline" and params["strength"] is None


def test_a_lone_unet_file_replaces_the_base_unet(xl, tmp_path):
    """--unet FILE: a distilled UNet published as one .safetensors file in diffusers' names without a config
    (SDXL-Lightning's, Hyper-SDXL's) runs in the --model base, read into its UNet's config, with its recipe's
    scheduler flags (Lightning: Euler, trailing timesteps, no guidance): diffusers' pipeline holding that UNet from
    the same draws, and exactly the Python recipe's images (README: eqxdiff.load(file, config=base,
    subfolder="unet"), from_pipe), which reuses the command's compiled programs."""
    from diffusers import EulerDiscreteScheduler
    from safetensors.torch import save_file

    from eqxdiff.pipelines import StableDiffusionXLPipeline

    lightning = tiny_xl.unet(tiny_xl.UNET_A, seed=40)
    file = tmp_path / "lightning_2step_unet.safetensors"
    save_file(lightning.state_dict(), file)
    ours, params = _generate(tmp_path / "out", "--model", str(xl.root / "base"), "--unet", str(file), "--scheduler",
                             "euler", "--scheduler-option", "timestep_spacing=trailing", "--guidance-scale", "0",
                             "--prompt", PROMPT, "--seed", "3")
    scheduler = EulerDiscreteScheduler.from_config(xl.base.scheduler.config, timestep_spacing="trailing")
    kwargs = {"prompt": PROMPT, "guidance_scale": 0.0, "num_inference_steps": 2, "latents": _noise(3, XL_SHAPE)}
    expected = _run(type(xl.base)(**{**xl.base.components, "unet": lightning, "scheduler": scheduler}), **kwargs)
    assert ours.shape == (32, 32, 3) and _pixels_off(ours[None], expected) <= 2
    own = _run(type(xl.base)(**{**xl.base.components, "scheduler": scheduler}), **kwargs)
    assert _pixels_off(ours[None], own) > 10  # the base's own UNet draws other pixels

    base = eqxdiff.load_pipeline(xl.root / "base")
    unet = eqxdiff.load(file, config=xl.root / "base", subfolder="unet")
    recipe = StableDiffusionXLPipeline.from_pipe(base, unet=unet).with_scheduler("euler", timestep_spacing="trailing")
    np.testing.assert_array_equal(ours[None], recipe(PROMPT, num_inference_steps=2, guidance_scale=0.0, seed=3,
                                                     progress=False))
    assert recipe.timings["call_compile"] == 0.0  # the same programs: the command's UNet is the recipe's
    assert params["unet"] == str(file) and params["model"] == str(xl.root / "base")
    assert params["pipeline"] == "StableDiffusionXLPipeline" and params["scheduler"] == "euler"
    assert params["scheduler_options"] == {"timestep_spacing": "trailing"} and params["guidance_scale"] == 0


def test_the_unet_loads_as_the_other_components(xl, tmp_path, monkeypatch):
    """--unet honours --weights-dtype, the mesh, --scan-layers and --attention as the pipeline's own models do:
    bfloat16 leaves read onto the FSDP mesh, the repeated transformer layers stacked, the chosen kernel (the command
    is stopped once the UNet is loaded: nothing compiles)."""
    import equinox as eqx
    import jax
    from safetensors.torch import save_file

    from eqxdiff.nn import Stacked

    class Loaded(Exception):
        pass

    def stop(path, pipe, **kwargs):
        raise Loaded(load_unet(path, pipe, **kwargs), pipe)

    load_unet = generate.load_unet
    monkeypatch.setattr(generate, "load_unet", stop)
    save_file(tiny_xl.unet(tiny_xl.UNET_A, seed=41).state_dict(), tmp_path / "unet.safetensors")
    with pytest.raises(Loaded) as info:
        _generate(tmp_path / "out", "--model", str(xl.root / "base"), "--unet", str(tmp_path / "unet.safetensors"),
                  "--weights-dtype", "bfloat16", "--scan-layers", "--attention", "chunked",
                  "--mesh.ici-data-parallelism", "1", "--mesh.ici-fsdp-parallelism", "-1")
    unet, pipe = info.value.args
    leaves = jax.tree.leaves(eqx.filter(unet, eqx.is_array))
    assert {x.dtype for x in leaves} == {np.dtype(jax.numpy.bfloat16)}
    assert dict(pipe.mesh.shape)["fsdp"] == 8 and all(x.sharding.mesh == pipe.mesh for x in leaves)
    assert any(x.sharding.spec != jax.sharding.PartitionSpec() for x in leaves)  # sharded, not replicated
    assert any(isinstance(m, Stacked) for m in jax.tree.leaves(unet, is_leaf=lambda m: isinstance(m, Stacked)))
    kernels = jax.tree.leaves(unet, is_leaf=lambda m: hasattr(m, "implementation"))
    assert {m.implementation for m in kernels if hasattr(m, "implementation")} == {"chunked"}


# -- ControlNet ---------------------------------------------------------------------------------------------------

def test_two_controlnets_from_their_folders_on_an_sd_base(sd, files, tmp_path):
    """--controlnet twice on a Stable Diffusion base folder: diffusers' StableDiffusionControlNetPipeline of the same
    components with both nets (MultiControlNetModel), control images given as PIL images (diffusers' load_image)."""
    ours, params = _generate(tmp_path, "--model", str(sd.root / "base"), "--controlnet", str(sd.root / "controlnet_0"),
                             "--controlnet", str(sd.root / "controlnet_1"), "--control-image", str(files.edges),
                             "--control-image", str(files.depth), "--controlnet-scale", "0.5", "--controlnet-scale",
                             "1.3", "--control-guidance-end", "0.6", "--prompt", PROMPT, "--guidance-scale", "6",
                             "--seed", "7")
    from diffusers import StableDiffusionControlNetPipeline

    reference = StableDiffusionControlNetPipeline(**sd.base.components, controlnet=sd.nets)
    images = [Image.open(files.edges).convert("RGB"), Image.open(files.depth).convert("RGB")]
    kwargs = {"prompt": PROMPT, "image": images, "guidance_scale": 6.0, "num_inference_steps": 2,
              "control_guidance_end": 0.6, "latents": _noise(7, SD_SHAPE)}
    expected = _run(reference, controlnet_conditioning_scale=[0.5, 1.3], **kwargs)
    assert ours.shape == (32, 32, 3) and _pixels_off(ours[None], expected) <= 2
    assert _pixels_off(ours[None], _run(reference, controlnet_conditioning_scale=[1.3, 0.5], **kwargs)) > 10
    assert params["pipeline"] == "StableDiffusionControlNetPipeline"
    assert params["controlnet"] == [str(sd.root / "controlnet_0"), str(sd.root / "controlnet_1")]
    assert params["control_image"] == [str(files.edges), str(files.depth)]
    assert params["controlnet_conditioning_scale"] == [0.5, 1.3] and params["control_guidance_end"] == 0.6


def test_a_controlnet_on_an_sdxl_base_is_sdxls_controlnet_pipeline(xl, files):
    checked = generate.validate(["--model", str(xl.root / "base"), "--controlnet", str(xl.root / "controlnet"),
                                 "--control-image", str(files.edges), "--prompt-2", "two dogs"])
    assert checked.family.pipeline_class.__name__ == "StableDiffusionXLControlNetPipeline" and checked.nets == 1
    assert isinstance(checked.kwargs["image"], Image.Image) and checked.kwargs["prompt_2"] == "two dogs"
    assert "controlnet_conditioning_scale" not in checked.kwargs  # the pipeline's default


# -- flags and errors ---------------------------------------------------------------------------------------------

def _help(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        generate.main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_each_path_shows_its_flags(xl, sd, capsys):
    text = _help(["--model", str(xl.root / "base")], capsys)
    for flag in ("--prompt-2", "--negative-prompt-2", "--denoising-end", "--aesthetic-score", "--original-size",
                 "--image", "--mask", "--mask-image", "--refiner", "--config", "--controlnet", "--control-image",
                 "--controlnet-scale"):
        assert flag in text, flag
    text = _help(["--model", str(sd.root / "base"), "--controlnet", str(sd.root / "controlnet_0")], capsys)
    assert "StableDiffusionControlNetPipeline's" in text
    for flag in ("--control-guidance-start", "--control-guidance-end", "--guess-mode", "--steps", "--seed"):
        assert flag in text, flag
    assert "--strength" not in text and "--mask" not in text  # no picture to start from: no image-to-image flags
    text = _help(["--model", str(sd.root / "base"), "--controlnet", str(sd.root / "controlnet_0"), "--image", "x.png"],
                 capsys)
    assert "StableDiffusionControlNetImg2ImgPipeline's" in text and "--strength" in text
    text = _help(["--model", str(sd.root / "base"), "--controlnet", str(sd.root / "controlnet_0"), "--image", "x.png",
                  "--mask", "m.png"], capsys)
    assert "StableDiffusionControlNetInpaintPipeline's" in text and "--mask" in text and "--strength" in text


def test_a_unet_goes_with_the_other_flags(xl, files):
    """--unet (a folder, or a lone file) with --controlnet, and on a single-file --model with or without --config
    (without, the --model UNet's widths are unknown before loading: only the file itself is checked)."""
    unet = xl.root / "base" / "unet"
    file, single = unet / "diffusion_pytorch_model.safetensors", str(xl.root / "sdxl_base.safetensors")
    checked = generate.validate(["--model", str(xl.root / "base"), "--unet", str(unet), "--controlnet",
                                 str(xl.root / "controlnet"), "--control-image", str(files.edges)])
    assert checked.family.pipeline_class.__name__ == "StableDiffusionXLControlNetPipeline"
    for argv in (["--model", single, "--config", str(xl.root / "configs")], ["--model", single]):
        assert generate.validate([*argv, "--unet", str(file)]).args.run.unet == str(file)


def test_controlnet_image_to_image_is_checked_with_its_picture(sd, files):
    checked = generate.validate(["--model", str(sd.root / "base"), "--controlnet", str(sd.root / "controlnet_0"),
                                 "--image", str(files.photo), "--control-image", str(files.edges), "--strength",
                                 "0.6", "--controlnet-scale", "0.9"])
    assert checked.family.pipeline_class.__name__ == "StableDiffusionControlNetImg2ImgPipeline"
    kwargs = checked.kwargs
    assert kwargs["image"].shape == (32, 32, 3) and isinstance(kwargs["control_image"], Image.Image)
    assert kwargs["controlnet_conditioning_scale"] == 0.9 and kwargs["strength"] == 0.6


def test_controlnet_inpainting_from_image_and_mask_files(sd, files, tmp_path, monkeypatch):
    """--image and --mask with an SD --controlnet: its inpainting pipeline (an ordinary UNet: the known region blended
    back), diffusers' given the same noise and VAE samples, at its defaults (strength 1, scale 0.5)."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_inpaint as module

    ours, params = _generate(tmp_path, "--model", str(sd.root / "base"), "--controlnet", str(sd.root / "controlnet_0"),
                             "--image", str(files.photo), "--mask", str(files.mask), "--control-image",
                             str(files.edges), "--prompt", PROMPT, "--guidance-scale", "6", "--seed", "5")
    draws = noise_draws(seed_key(5), SD_SHAPE)
    posterior = iter([draws.image, draws.masked_image])
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(draws.noise))
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(next(posterior)))
    reference = module.StableDiffusionControlNetInpaintPipeline(**sd.base.components, controlnet=sd.nets[0])
    expected = _run(reference, prompt=PROMPT, image=Image.open(files.photo), mask_image=Image.open(files.mask),
                    control_image=Image.open(files.edges).convert("RGB"), guidance_scale=6.0, num_inference_steps=2)
    assert _pixels_off(ours[None], expected) <= 2
    assert params["pipeline"] == "StableDiffusionControlNetInpaintPipeline" and params["mask_image"] == str(files.mask)


def _refused(error, match, argv):
    with pytest.raises(error, match=match):
        generate.validate(argv)


def test_errors_name_the_flags_before_loading(xl, sd, files, tmp_path):
    base, nets = str(sd.root / "base"), [str(sd.root / "controlnet_0"), str(sd.root / "controlnet_1")]
    two = ["--model", base, "--controlnet", nets[0], "--controlnet", nets[1]]
    _refused(InputError, "--control-image given 1 time for 2 ControlNets; give one control image per net, in "
             "--controlnet order", [*two, "--control-image", str(files.edges)])
    _refused(InputError, "--controlnet-scale given 3 times for 2 ControlNets", [
        *two, "--control-image", str(files.edges), "--control-image", str(files.depth), *["--controlnet-scale", "1"] * 3])
    _refused(InputError, "--control-image given 0 times for 2 ControlNets", [*two])
    _refused(InputError, "--control-guidance-start 0.5 and --control-guidance-end 0.5 must satisfy", [
        "--model", base, "--controlnet", nets[0], "--control-image", str(files.edges), "--control-guidance-start",
        "0.5", "--control-guidance-end", "0.5"])
    _refused(FileNotFoundError, "--control-image .*missing.png'?: no such file", [
        "--model", base, "--controlnet", nets[0], "--control-image", str(tmp_path / "missing.png")])
    _refused(InputError, "--control-image needs a ControlNet: pass --controlnet", [
        "--model", base, "--control-image", str(files.edges)])
    inpaint = generate.validate(["--model", base, "--controlnet", nets[0], "--image", str(files.photo), "--mask",
                                 str(files.mask), "--control-image", str(files.edges)])
    assert inpaint.family.pipeline_class.__name__ == "StableDiffusionControlNetInpaintPipeline"
    assert inpaint.kwargs["mask_image"] is not None and inpaint.kwargs["control_image"] is not None
    checked = generate.validate(["--model", str(xl.root / "base"), "--controlnet", str(xl.root / "controlnet"),
                                 "--image", str(files.photo), "--mask", str(files.mask), "--control-image",
                                 str(files.edges)])
    assert checked.family.pipeline_class.__name__ == "StableDiffusionXLControlNetInpaintPipeline"
    checked = generate.validate(["--model", str(xl.root / "base"), "--controlnet", str(xl.root / "controlnet"),
                                 "--image", str(files.photo), "--control-image", str(files.edges)])
    assert checked.family.pipeline_class.__name__ == "StableDiffusionXLControlNetImg2ImgPipeline"
    _refused(InputError, "no ControlNet pipeline for the --model folder's StableDiffusionXLInpaintPipeline", [
        "--model", str(xl.root / "inpaint"), "--controlnet", str(xl.root / "controlnet")])
    _refused(InputError, r"has cross_attention_dim=32 but the --model UNet has 80: it was trained for another base", [
        "--model", str(xl.root / "base"), "--controlnet", nets[0], "--control-image", str(files.edges)])
    _refused(CheckpointError, "holds a 'UNet2DConditionModel' .*not a ControlNetModel", [
        "--model", base, "--controlnet", str(sd.root / "base" / "unet"), "--control-image", str(files.edges)])
    _refused(CheckpointError, "holds no config.json", [
        "--model", base, "--controlnet", str(sd.root / "base"), "--control-image", str(files.edges)])
    _refused(InputError, "--config is for a single .safetensors --model", [
        "--model", base, "--config", str(xl.root / "configs")])
    _refused(InputError, "--refiner holds a StableDiffusionPipeline, which cannot start from handed-over latents", [
        "--model", str(xl.root / "base"), "--refiner", base])
    _refused(InputError, "--refiner: the --model's StableDiffusionPipeline cannot hand over latents", [
        "--model", base, "--refiner", str(xl.root / "refiner")])
    _refused(InputError, "--refiner with --image and a ControlNet: StableDiffusionXLControlNetImg2ImgPipeline stops", [
        "--model", str(xl.root / "base"), "--controlnet", str(xl.root / "controlnet"), "--control-image",
        str(files.edges), "--image", str(files.photo), "--refiner", str(xl.root / "refiner")])
    sd_unet = sd.root / "base" / "unet"  # a Stable Diffusion UNet on the SDXL base: its text width differs
    _refused(InputError, r"--unet '.*unet' has cross_attention_dim=32 \(in its config.json\) but the --model UNet has "
             "80: it was made for another base model", ["--model", str(xl.root / "base"), "--unet", str(sd_unet)])
    _refused(InputError, r"--unet '.*diffusion_pytorch_model.safetensors' has cross_attention_dim=32 \(by its "
             r"tensors' shapes\) but the --model UNet has 80", [
        "--model", str(xl.root / "base"), "--unet", str(sd_unet / "diffusion_pytorch_model.safetensors")])
    _refused(InputError, r"--unet .* has in_channels=9 \(in its config.json\) but the --model UNet has 4", [
        "--model", str(xl.root / "base"), "--unet", str(xl.root / "inpaint" / "unet")])
    _refused(InputError, "--denoising-end", [  # the refiner's start is the base's end: one flag, checked once
        "--model", str(xl.root / "base"), "--refiner", str(xl.root / "refiner"), "--denoising-end", "1.5"])


def test_a_controlnet_pipeline_folder_takes_the_same_flags(sd, files, tmp_path):
    """A StableDiffusionControlNetPipeline folder (its nets inside) takes --control-image per net and
    --controlnet-scale; --controlnet on it is refused."""
    from diffusers import StableDiffusionControlNetPipeline

    folder = tmp_path / "sd-controlnet"
    StableDiffusionControlNetPipeline(**sd.base.components, controlnet=sd.nets).save_pretrained(folder)
    checked = generate.validate(["--model", str(folder), "--control-image", str(files.edges), "--control-image",
                                 str(files.depth), "--controlnet-scale", "0.7"])
    assert checked.nets == 2 and len(checked.kwargs["image"]) == 2
    assert checked.kwargs["controlnet_conditioning_scale"] == 0.7
    _refused(InputError, "--control-image given 1 time for 2 ControlNets; give one control image per net$", [
        "--model", str(folder), "--control-image", str(files.edges)])
    _refused(InputError, "holds its ControlNet\\(s\\) already; leave out --controlnet", [
        "--model", str(folder), "--controlnet", str(sd.root / "controlnet_0")])
    img2img = generate.validate(["--model", str(folder), "--image", str(files.photo), "--control-image",
                                 str(files.edges), "--control-image", str(files.depth)])
    assert img2img.load_class.__name__ == "StableDiffusionControlNetImg2ImgPipeline"
    assert len(img2img.kwargs["control_image"]) == 2 and img2img.kwargs["image"].shape == (32, 32, 3)
    assert json.loads((folder / "model_index.json").read_text())["controlnet"][1] == "MultiControlNetModel"


def test_a_controlnet_pipeline_from_a_loaded_base_keeps_its_scheduler_settings(sd):
    """What the command does in Python (README): the ControlNet pipeline from a loaded base with from_pipe shares
    its components and keeps the scheduler config keys the swapped-in scheduler does not read (DDIM's clip_sample
    under Euler), so a later swap back still has them."""
    from eqxdiff.pipelines.controlnet import StableDiffusionControlNetPipeline

    base = eqxdiff.load_pipeline(sd.root / "base", scheduler="euler")
    assert base.scheduler_extras["clip_sample"] is False
    pipe = StableDiffusionControlNetPipeline.from_pipe(base, controlnet=[eqxdiff.load(sd.root / "controlnet_0")])
    assert pipe.unet is base.unet and pipe.scheduler_extras == base.scheduler_extras
    assert pipe.with_scheduler("ddim").scheduler.config.clip_sample is False
