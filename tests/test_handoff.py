"""The SDXL base -> refiner hand-offs beyond text-to-image -> image-to-image (:mod:`tests.test_sdxl` has that one),
against diffusers 0.42.1 (the handed latents within 1e-4, every pixel within 2/255, from the same draws):

- inpainting: a 9-channel or an ordinary base stops at ``denoising_end``, the refiner folder loaded as
  ``StableDiffusionXLInpaintPipeline`` finishes from ``denoising_start`` with the same mask (diffusers' documented
  recipe: the refiner's ordinary UNet blends the handed latents, noised to each next step, back outside the mask);
- ControlNet and ControlNet-Union text-to-image bases stop at ``denoising_end`` (the nets' windows counted over the
  whole schedule, as diffusers counts them) and a plain image-to-image refiner finishes;
- ControlNet and ControlNet-Union inpainting stop at ``denoising_end`` for the inpainting refiner, and start at
  ``denoising_start``: from a picture (its latents not noised, as there) and from handed latents, which diffusers'
  two pipelines cannot take (their masked picture multiplies the latents by the pixel mask: a size error): there the
  run equals diffusers' from a picture whose VAE latents are the handed ones.

Changing either fraction compiles nothing. One tiny refiner serves every base (its second text encoder is theirs).
"""

import jax
import numpy as np
import pytest
import torch
from PIL import Image

import eqxdiff
from eqxdiff.cli import generate
from eqxdiff.cli._compose import refiner_class
from eqxdiff.core import resolve_class
from eqxdiff.pipelines import (
    InputError,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLInpaintPipeline,
    read_parameters,
    seed_key,
)
from eqxdiff.pipelines._latents import noise_draws
from eqxdiff.pipelines.controlnet import StableDiffusionXLControlNetInpaintPipeline, StableDiffusionXLControlNetPipeline
from eqxdiff.pipelines.controlnet_union import StableDiffusionXLControlNetUnionInpaintPipeline

from . import _tiny_controlnet as tiny_cn
from . import _tiny_controlnet_union as tiny_union
from . import _tiny_sdxl as tiny
from ._util import assert_close, nchw_to_nhwc, nhwc_to_nchw
from .test_recompile import no_compile, sweep

PROMPTS = ["a red cat"]  # one image: the eqxdiff-generate runs below share the compiled programs
SHAPE = (1, 16, 16, 4)
STEPS = dict(num_inference_steps=4, guidance_scale=5.0)  # Euler, leading: 751, 501 | 251, 1 split at 0.5
REFINE = dict(STEPS, aesthetic_score=7.0, negative_aesthetic_score=2.0)


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _tensor(image):
    return torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255


def _draws(module, monkeypatch, key, posterior=("image", "masked"), image_latents=None, scale=None):
    """diffusers' ``module`` draws what our call with ``key`` draws; with ``image_latents`` its VAE encodes the
    picture to them (channels-last, scaled by the VAE's ``scale``; the masked picture as before)."""
    tiny_cn.with_our_draws(module, monkeypatch, key, SHAPE, posterior)
    if image_latents is not None:
        draws = noise_draws(key, SHAPE)
        calls = iter([lambda out: nhwc_to_nchw(image_latents) / scale,
                      lambda out: out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(draws.masked_image)])
        monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                            next(calls)(out))


@pytest.fixture(scope="module")
def inputs():
    """A picture, its mask (white = repaint) and a control image."""
    picture = np.random.default_rng(50).integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)
    mask = np.zeros((1, 32, 32), np.uint8)
    mask[0, 4:20, 8:30] = 255
    return picture, mask, torch.from_numpy(mask[:, None] / 255).float(), tiny_cn.control_images(1, 32, seed=51)


@pytest.fixture(scope="module")
def refiner(tmp_path_factory):
    """The tiny refiner folder (image-to-image, aesthetic scores, no first encoder) beside a plain base folder:
    ``(folder, base folder, diffusers' base)``."""
    root = tmp_path_factory.mktemp("handoff")
    base = tiny.build_base(root / "base")
    tiny.build_refiner(root / "refiner", base)
    return root / "refiner", root / "base", base


def _inpaint_refiner(folder):
    """The refiner folder as diffusers' and eqxdiff's inpainting pipeline (the recipe's ``from_pretrained``)."""
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as module

    ref = module.StableDiffusionXLInpaintPipeline.from_pretrained(folder)
    ref.set_progress_bar_config(disable=True)
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(folder)
    assert pipe.requires_aesthetics_score and ref.config.requires_aesthetics_score and pipe.text_encoder is None
    return module, ref, pipe


def _refine_inpainting(folder, handed, ours_handed, inputs, monkeypatch):
    """The refiner's inpainting half from diffusers' and our handed latents: ours, diffusers' (uint8 / floats)."""
    module, ref, pipe = _inpaint_refiner(folder)
    _, mask, mask_tensor, _ = inputs
    key = jax.random.key(60)
    _draws(module, monkeypatch, key, posterior=())
    with torch.no_grad():
        expected = ref(PROMPTS, image=handed, mask_image=mask_tensor, height=32, width=32, denoising_start=0.5,
                       output_type="np", **REFINE).images
    return pipe(PROMPTS, image=ours_handed, mask_image=mask, key=key, denoising_start=0.5, progress=False,
                **REFINE), expected


@pytest.mark.parametrize("channels", [9, 4])
def test_inpainting_base_hands_off_to_the_refiner_as_inpainting(refiner, inputs, tmp_path, monkeypatch, channels):
    """diffusers' inpainting recipe: base(image, mask_image, denoising_end, output_type="latent") then the refiner
    folder as StableDiffusionXLInpaintPipeline(image=latents, mask_image, denoising_start). A 9-channel base (its
    own folder) and an ordinary one (the base folder as inpainting, the known region blended until its last step)."""
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as module

    folder, base_folder, base = refiner
    if channels == 9:
        ref = tiny.build_inpaint(tmp_path)
        pipe = eqxdiff.load_pipeline(tmp_path)
    else:
        ref = module.StableDiffusionXLInpaintPipeline(**base.components)
        pipe = StableDiffusionXLInpaintPipeline.from_pretrained(base_folder)
    assert type(pipe) is StableDiffusionXLInpaintPipeline and pipe.unet.config.in_channels == channels
    ref.set_progress_bar_config(disable=True)
    picture, mask, mask_tensor, _ = inputs
    key = jax.random.key(61)
    _draws(module, monkeypatch, key)
    with torch.no_grad():
        handed = ref(PROMPTS, image=_tensor(picture), mask_image=mask_tensor, height=32, width=32,
                     denoising_end=0.5, output_type="latent", **STEPS).images
    ours_handed = pipe(PROMPTS, image=picture, mask_image=mask, key=key, denoising_end=0.5, output_type="latent",
                       progress=False, **STEPS)
    assert_close(ours_handed, nchw_to_nhwc(handed), 1e-4, "handed-over latents")
    ours, expected = _refine_inpainting(folder, handed, ours_handed, inputs, monkeypatch)
    assert ours.shape == (1, 32, 32, 3) and _pixels_off(ours, expected) <= 2


@pytest.fixture(scope="module")
def controlnet_bases(tmp_path_factory):
    """Tiny SDXL ControlNet (``"cn"``) and ControlNet-Union text-to-image folders: kind -> (diffusers', ours)."""
    import diffusers

    root = tmp_path_factory.mktemp("handoff_controlnet")
    refs = {"cn": diffusers.StableDiffusionXLControlNetPipeline(
                **tiny.base_components(seed=30), controlnet=tiny_cn.controlnet(tiny_cn.SDXL_PIPE_CONTROLNET, 25),
                add_watermarker=False),
            "union": diffusers.StableDiffusionXLControlNetUnionPipeline(
                **tiny.base_components(seed=40), controlnet=tiny_union.union_net(41), add_watermarker=False)}
    return {kind: (tiny.save(ref, root / kind), eqxdiff.load_pipeline(root / kind)) for kind, ref in refs.items()}


def _control(kind: str, control, *, torch_images: bool, name: str = "image") -> dict:
    image = _tensor(control) if torch_images else control
    if kind == "cn":
        return {name: image}
    return {"control_image": [image], "control_mode": [1]}


@pytest.mark.parametrize("kind", ["cn", "union"])
def test_controlnet_base_hands_off_to_a_plain_refiner(refiner, inputs, controlnet_bases, kind):
    """A ControlNet text-to-image base stops at denoising_end; its net's window (control_guidance_end=0.5) counts
    the whole schedule (on for both steps it runs; over its 2 steps it would be off for the second); the refiner
    (image-to-image) finishes."""
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_img2img as module

    folder, _, _ = refiner
    ref, pipe = controlnet_bases[kind]
    control = inputs[3]
    noise = np.random.default_rng(62).standard_normal(SHAPE).astype(np.float32)
    window = dict(control_guidance_end=0.5, **STEPS)
    with torch.no_grad():
        handed = ref(PROMPTS, latents=nhwc_to_nchw(noise), denoising_end=0.5, output_type="latent",
                     **_control(kind, control, torch_images=True), **window).images
    ours_handed = pipe(PROMPTS, latents=noise, denoising_end=0.5, output_type="latent", progress=False,
                       **_control(kind, control, torch_images=False), **window)
    assert_close(ours_handed, nchw_to_nhwc(handed), 1e-4, "handed-over latents")
    refine_ref = module.StableDiffusionXLImg2ImgPipeline.from_pretrained(folder)
    refine_ref.set_progress_bar_config(disable=True)
    with torch.no_grad():
        expected = refine_ref(PROMPTS, image=handed, denoising_start=0.5, output_type="np", **REFINE).images
    ours = eqxdiff.load_pipeline(folder)(PROMPTS, image=ours_handed, denoising_start=0.5, progress=False, **REFINE)
    assert _pixels_off(ours, expected) <= 2


def _controlnet_inpaint(bases, kind: str):
    """The ControlNet base of ``kind`` as inpainting, diffusers' and ours (the same components), and its module."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_inpaint_sd_xl as cn_module
    from diffusers.pipelines.controlnet import pipeline_controlnet_union_inpaint_sd_xl as union_module

    ref, pipe = bases[kind]
    if kind == "cn":
        module, cls = cn_module, StableDiffusionXLControlNetInpaintPipeline
        ref = cn_module.StableDiffusionXLControlNetInpaintPipeline(**ref.components)
    else:
        module, cls = union_module, StableDiffusionXLControlNetUnionInpaintPipeline
        ref = union_module.StableDiffusionXLControlNetUnionInpaintPipeline(**ref.components)
    ref.set_progress_bar_config(disable=True)
    return module, ref, cls.from_pipe(pipe)


@pytest.mark.parametrize("kind", ["cn", "union"])
def test_controlnet_inpainting_hands_off_both_ways(refiner, inputs, controlnet_bases, monkeypatch, kind):
    """ControlNet inpainting stops at denoising_end for the inpainting refiner; then it starts at denoising_start
    (control_guidance_start=0.5: counted over the steps it runs) from a picture, and from handed latents."""
    folder, _, _ = refiner
    module, ref, pipe = _controlnet_inpaint(controlnet_bases, kind)
    picture, mask, mask_tensor, control = inputs
    key = jax.random.key(63)
    _draws(module, monkeypatch, key)
    call = dict(image=_tensor(picture), mask_image=mask_tensor, **_control(kind, control, torch_images=True,
                                                                           name="control_image"), **STEPS)
    ours_call = dict(image=picture, mask_image=mask, **_control(kind, control, torch_images=False,
                                                                  name="control_image"), **STEPS)
    with torch.no_grad():
        handed = ref(PROMPTS, denoising_end=0.5, output_type="latent", **call).images
    ours_handed = pipe(PROMPTS, key=key, denoising_end=0.5, output_type="latent", progress=False, **ours_call)
    assert_close(ours_handed, nchw_to_nhwc(handed), 1e-4, "handed-over latents")
    ours, expected = _refine_inpainting(folder, handed, ours_handed, inputs, monkeypatch)
    assert _pixels_off(ours, expected) <= 2

    second = dict(denoising_start=0.5, control_guidance_start=0.5)
    key = jax.random.key(64)
    _draws(module, monkeypatch, key)
    with torch.no_grad():
        expected = ref(PROMPTS, output_type="np", **second, **call).images
    ours = pipe(PROMPTS, key=key, progress=False, **second, **ours_call)
    assert _pixels_off(ours, expected) <= 2
    _draws(module, monkeypatch, key, image_latents=ours_handed, scale=ref.vae.config.scaling_factor)
    with torch.no_grad():
        expected = ref(PROMPTS, output_type="np", **second, **call).images
    ours = pipe(PROMPTS, key=key, progress=False, **second, **dict(ours_call, image=ours_handed))
    assert _pixels_off(ours, expected) <= 2


def test_hand_off_fractions_compile_nothing(refiner, inputs, controlnet_bases):
    """Another denoising_end (an inpainting base, a ControlNet base) or denoising_start (the inpainting refiner,
    ControlNet inpainting from handed latents) reuses the compiled programs."""
    folder, base_folder, _ = refiner
    picture, mask, _, control = inputs
    base = StableDiffusionXLInpaintPipeline.from_pretrained(base_folder)
    controlnet = controlnet_bases["cn"][1]
    run = dict(prompt=PROMPTS[0], num_inference_steps=6, seed=0, output_type="latent", progress=False)
    handed = {}
    for name, pipe, given in (("inpainting", base, dict(image=picture, mask_image=mask)),
                              ("ControlNet", controlnet, dict(image=control))):
        handed[name] = pipe(**run, **given, denoising_end=0.7)
        with no_compile(f"the {name} base with another denoising_end"):
            other = pipe(**run, **given, denoising_end=0.4)
        assert not np.array_equal(np.asarray(handed[name]), np.asarray(other))
    run = dict(prompt=PROMPTS[0], num_inference_steps=6, seed=0, mask_image=mask, denoising_start=0.7)
    changes = [dict(denoising_start=0.5), dict(denoising_start=0.85)]
    sweep(StableDiffusionXLInpaintPipeline.from_pretrained(folder), dict(run, image=handed["inpainting"]), changes)
    sweep(StableDiffusionXLControlNetInpaintPipeline.from_pipe(controlnet),
          dict(run, image=handed["ControlNet"], control_image=control), changes)


# -- eqxdiff-generate --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(refiner, inputs):
    """The first picture, its mask and the control image as PNG files; a ControlNet folder for the plain base."""
    root = refiner[0].parent
    picture, mask, _, control = inputs
    for name, array in (("photo", picture[0]), ("mask", mask[0]), ("edges", control[0])):
        Image.fromarray(array).save(root / f"{name}.png")
    tiny_cn.controlnet(tiny_cn.SDXL_PIPE_CONTROLNET, 52).save_pretrained(root / "controlnet", safe_serialization=True)
    return root


def _cli(out, *argv):
    (path,) = generate.main(["--no-progress", "--steps", "4", "--guidance-scale", "5", "--seed", "7", "--prompt",
                             PROMPTS[0], *argv, "--output-dir", str(out)])
    return np.asarray(Image.open(path))[None], read_parameters(path)


def test_cli_inpainting_hands_off_to_the_refiner_folder_as_inpainting(refiner, inputs, files, tmp_path, monkeypatch):
    """--image --mask --refiner --denoising-end: the base inpaints the first half, the refiner folder loaded as
    StableDiffusionXLInpaintPipeline the rest under the same mask; the library's two calls give the same pixels, and
    diffusers' recipe (the base folder as its inpainting pipeline, the same draws) within 2/255."""
    from diffusers.pipelines.stable_diffusion_xl import pipeline_stable_diffusion_xl_inpaint as module

    folder, base_folder, base = refiner
    ours, params = _cli(tmp_path, "--model", str(base_folder), "--pipeline-class", "StableDiffusionXLInpaintPipeline",
                        "--image", str(files / "photo.png"), "--mask", str(files / "mask.png"), "--refiner",
                        str(folder), "--denoising-end", "0.5", "--aesthetic-score", "7")
    assert params["refiner_pipeline"] == "StableDiffusionXLInpaintPipeline" and params["denoising_end"] == 0.5
    picture, mask = inputs[0], inputs[1]
    call = dict(prompt=PROMPTS[0], mask_image=mask, seed=7, num_inference_steps=4, guidance_scale=5.0, progress=False)
    handed = StableDiffusionXLInpaintPipeline.from_pretrained(base_folder)(
        image=picture, denoising_end=0.5, output_type="latent", **call)
    library = StableDiffusionXLInpaintPipeline.from_pretrained(folder)(image=handed, denoising_start=0.5,
                                                                        aesthetic_score=7.0, **call)
    assert np.abs(ours.astype(int) - library).max() <= 1
    tiny_cn.with_our_draws(module, monkeypatch, seed_key(7), (1, 16, 16, 4), ("image", "masked"))
    ref = module.StableDiffusionXLInpaintPipeline(**base.components)
    ref.set_progress_bar_config(disable=True)
    common = dict(prompt=PROMPTS[0], mask_image=Image.fromarray(mask[0]), num_inference_steps=4, guidance_scale=5.0)
    with torch.no_grad():
        latents = ref(image=Image.fromarray(picture[0]), denoising_end=0.5, output_type="latent", **common).images
    _, refine_ref, _ = _inpaint_refiner(folder)
    with torch.no_grad():
        expected = refine_ref(image=latents, height=32, width=32, denoising_start=0.5, aesthetic_score=7.0,
                              output_type="np", **common).images
    assert _pixels_off(ours, expected) <= 2


def test_cli_controlnet_base_hands_off_to_the_refiner(refiner, files, tmp_path):
    """--controlnet --control-image --refiner --denoising-end: the base's ControlNet pipeline stops there, the refiner
    folder (image-to-image) finishes; the library's calls give the same pixels, diffusers' within 2/255."""
    import diffusers

    folder, base_folder, base = refiner
    net = files / "controlnet"
    ours, params = _cli(tmp_path, "--model", str(base_folder), "--controlnet", str(net), "--control-image",
                        str(files / "edges.png"), "--refiner", str(folder), "--denoising-end", "0.5")
    assert params["pipeline"] == "StableDiffusionXLControlNetPipeline"
    assert params["refiner_pipeline"] == "StableDiffusionXLImg2ImgPipeline"
    edges = Image.open(files / "edges.png")
    call = dict(prompt=PROMPTS[0], num_inference_steps=4, guidance_scale=5.0)
    pipe = StableDiffusionXLControlNetPipeline.from_pipe(eqxdiff.load_pipeline(base_folder),
                                                         controlnet=eqxdiff.load(net))
    handed = pipe(image=edges, seed=7, denoising_end=0.5, output_type="latent", progress=False, **call)
    library = StableDiffusionXLImg2ImgPipeline.from_pretrained(folder)(image=handed, seed=7, denoising_start=0.5,
                                                                       progress=False, **call)
    assert np.abs(ours.astype(int) - library).max() <= 1
    ref = diffusers.StableDiffusionXLControlNetPipeline(**base.components, controlnet=diffusers.ControlNetModel
                                                        .from_pretrained(net))
    ref.set_progress_bar_config(disable=True)
    noise = nhwc_to_nchw(noise_draws(seed_key(7), (1, 16, 16, 4)).noise)
    refine_ref = diffusers.StableDiffusionXLImg2ImgPipeline.from_pretrained(folder)
    refine_ref.set_progress_bar_config(disable=True)
    with torch.no_grad():
        latents = ref(image=edges, latents=noise, denoising_end=0.5, output_type="latent", **call).images
        expected = refine_ref(image=latents, denoising_start=0.5, output_type="np", **call).images
    assert _pixels_off(ours, expected) <= 2


def test_cli_picks_the_hand_off_classes_and_refuses_what_diffusers_cannot(refiner, files):
    """ControlNet inpainting hands over to the refiner folder as inpainting; ControlNet image-to-image (diffusers'
    takes no denoising_end) is refused, naming the flags to leave out, before anything loads."""
    folder, base_folder, _ = refiner
    argv = ["--model", str(base_folder), "--controlnet", str(files / "controlnet"), "--control-image",
            str(files / "edges.png"), "--image", str(files / "photo.png"), "--refiner", str(folder),
            "--denoising-end", "0.5"]
    checked = generate.validate([*argv, "--mask", str(files / "mask.png")])
    assert checked.family.pipeline_class.__name__ == "StableDiffusionXLControlNetInpaintPipeline"
    assert checked.refiner.pipeline_class is StableDiffusionXLInpaintPipeline
    with pytest.raises(InputError, match="--refiner with --image and a ControlNet: StableDiffusionXLControlNetImg2Img"
                       "Pipeline stops at no denoising_end .* leave out --refiner or --image"):
        generate.validate(argv)
    assert refiner_class(StableDiffusionXLImg2ImgPipeline, mask=False) is StableDiffusionXLImg2ImgPipeline
    with pytest.raises(InputError, match="--mask with --refiner: eqxdiff has no inpainting pipeline that loads the "
                       "--refiner folder's WanPipeline .* leave out --mask or --refiner"):
        refiner_class(resolve_class("WanPipeline"), mask=True)
