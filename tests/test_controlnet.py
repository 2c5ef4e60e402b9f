"""ControlNet: the model on the parity base (:mod:`tests._parity`) at diffusers' tiny SD and SDXL ControlNet configs
(plain and guess-mode residuals) against full-size layouts, a variant's forward (bgr, pooled residuals,
UNetMidBlock2D, a 1-channel control image downsampled 4x, a class embedding, encoder_hid_dim), from_unet, remat,
config and input errors; then the pipelines against diffusers' (every pixel within 2/255 from the same initial
latents): SD with one net (scale, start/end) and two (bgr, pooled, guess mode), a pooled net forcing guess mode
(alone, not as the second of two), SD image-to-image, SDXL with one net and two in guess mode; the multi-ControlNet
folder layout, control-image preparation, the per-step scales and the errors.

Pipeline folders are built once per module and share their compiled programs (the scales are a traced table: a
new scale or window reuses the loop)."""

import dataclasses
import json

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.core import ConfigError, Plan, Remat, checkpoint_names, with_plan
from eqxdiff.loading import state_dict
from eqxdiff.models.controlnet import ControlNetConfig, ControlNetModel, MultiControlNetModel
from eqxdiff.pipelines import save_pipeline
from eqxdiff.pipelines.controlnet import (
    ControlInput,
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionXLControlNetPipeline,
    control_scales,
    prepare_control_image,
)

from . import _tiny_controlnet as tiny
from ._parity import ModelParity
from ._util import assert_close_to_float64, nhwc_to_nchw

# -- full-size configs of real checkpoints (config.json values) -------------------------------------------------
SD15_CANNY = dict(attention_head_dim=8, block_out_channels=[320, 640, 1280, 1280], cross_attention_dim=768,
                  down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"], layers_per_block=2,
                  conditioning_embedding_out_channels=[16, 32, 96, 256])  # lllyasviel/sd-controlnet-canny
SD21_CANNY = dict(SD15_CANNY, attention_head_dim=[5, 10, 20, 20], cross_attention_dim=1024,
                  use_linear_projection=True, upcast_attention=True)  # thibaud/controlnet-sd21-canny-diffusers
SDXL_CANNY = dict(addition_embed_type="text_time", addition_time_embed_dim=256, attention_head_dim=[5, 10, 20],
                  block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
                  down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                  projection_class_embeddings_input_dim=2816, transformer_layers_per_block=[1, 2, 10],
                  use_linear_projection=True, global_pool_conditions=False)  # diffusers/controlnet-canny-sdxl-1.0
SD15_SHUFFLE = dict(SD15_CANNY, global_pool_conditions=True, controlnet_conditioning_channel_order="bgr")

SCALE = 0.7


def _torch(x):
    return torch.from_numpy(np.ascontiguousarray(x))


class ControlNetParity(ModelParity):
    model_class = ControlNetModel
    reference_class = diffusers.ControlNetModel

    def inputs(self, reference):
        rng = np.random.default_rng(1)
        c, b, size = reference.config, 2, 16
        f = 2 ** (len(c.conditioning_embedding_out_channels) - 1)
        out = dict(sample=rng.standard_normal((b, size, size, c.in_channels), np.float32),
                   timestep=np.array([3, 817], np.int32),
                   encoder_hidden_states=rng.standard_normal((b, 7, c.cross_attention_dim), np.float32),
                   controlnet_cond=rng.random((b, size * f, size * f, c.conditioning_channels), np.float32))
        if c.addition_embed_type == "text_time":
            text = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
            out["text_embeds"] = rng.standard_normal((b, text), np.float32)
            out["time_ids"] = np.array([[32, 32, 0, 0, 32, 32], [24, 20, 2, 1, 16, 16]], np.float32)
        if c.class_embed_type == "timestep":
            out["class_labels"] = np.array([250, 4], np.int32)
        return out

    def reference_outputs(self, reference, inputs):
        kw = dict(sample=nhwc_to_nchw(inputs["sample"]), timestep=_torch(inputs["timestep"]),
                  encoder_hidden_states=_torch(inputs["encoder_hidden_states"]),
                  controlnet_cond=nhwc_to_nchw(inputs["controlnet_cond"]), conditioning_scale=SCALE,
                  return_dict=False)
        if "class_labels" in inputs:
            kw["class_labels"] = _torch(inputs["class_labels"])
        if "text_embeds" in inputs:
            kw["added_cond_kwargs"] = dict(text_embeds=_torch(inputs["text_embeds"]),
                                           time_ids=_torch(inputs["time_ids"]))
        out = {}
        for guess in (False, True):
            down, mid = reference(**kw, guess_mode=guess)
            prefix = "guess_" if guess else ""
            out.update({f"{prefix}down_{i}": r.permute(0, 2, 3, 1).numpy() for i, r in enumerate(down)})
            out[f"{prefix}mid"] = mid.permute(0, 2, 3, 1).numpy()
        return out

    @staticmethod
    def outputs(model, inputs):
        x = dict(inputs)
        args = [x.pop(k) for k in ("sample", "timestep", "encoder_hidden_states", "controlnet_cond")]
        out = {}
        for guess in (False, True):
            down, mid = model(*args, conditioning_scale=SCALE, guess_mode=guess, **x)
            prefix = "guess_" if guess else ""
            out.update({f"{prefix}down_{i}": r for i, r in enumerate(down)})
            out[f"{prefix}mid"] = mid
        return out


class TestControlNetSD(ControlNetParity):
    config = tiny.SD_CONTROLNET
    full_size = {"sd15-canny": SD15_CANNY, "sd21-canny": SD21_CANNY, "sd15-shuffle": SD15_SHUFFLE}


class TestControlNetSDXL(ControlNetParity):
    config = tiny.SDXL_CONTROLNET
    full_size = {"sdxl-canny": SDXL_CANNY}


class ControlNetVariant(ControlNetParity):
    """bgr, spatially pooled residuals (guess mode then scales nothing), the mid block without attention (its
    ResNets taking the time embedding as scale and shift), per-block heads, a 1-channel control image embedded by
    three widths (4x downsampling), padding-0 downsampling, GELU, a "timestep" class embedding (SiLU whatever
    act_fn, added to the time embedding, as diffusers' ControlNet builds it) and an encoder_hid_proj (loaded, never
    applied: the text states are cross_attention_dim wide). Not collected: :func:`test_variant_matches_diffusers`
    checks its forward only."""

    config = dict(block_out_channels=(8, 16), layers_per_block=1, in_channels=4, norm_num_groups=4,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=(2, 4),
                  cross_attention_dim=24, conditioning_embedding_out_channels=(8, 16, 16), conditioning_channels=1,
                  controlnet_conditioning_channel_order="bgr", global_pool_conditions=True,
                  mid_block_type="UNetMidBlock2D", downsample_padding=0, flip_sin_to_cos=False, freq_shift=1,
                  resnet_time_scale_shift="scale_shift", act_fn="gelu", class_embed_type="timestep",
                  encoder_hid_dim=20)


# -- what the parity base does not check -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sd_case(tmp_path_factory):
    return TestControlNetSD.build(tmp_path_factory)


def test_variant_matches_diffusers(tmp_path_factory):
    case = ControlNetVariant.build(tmp_path_factory)
    ControlNetVariant.test_forward_parity(ControlNetVariant(), case)
    assert case.model.config.controlnet_conditioning_channel_order == "bgr"
    assert case.model.mid_block.attentions is None and len(case.model.mid_block.resnets) == 1
    assert all(case.actual[k].shape[1:3] == (1, 1) for k in case.actual)  # pooled
    assert len([k for k in case.actual if k.startswith("down_")]) == case.model.config.num_residuals == 4
    assert case.model.class_embedding is not None and case.model.encoder_hid_proj.weight.shape == (24, 20)
    # the class labels steer the residuals (the parity could not see them ignored on both sides otherwise)
    relabelled = ControlNetParity.run(case.model, dict(case.inputs, class_labels=case.inputs["class_labels"][::-1]))
    assert np.max(np.abs(relabelled["mid"] - case.actual["mid"])) > 1e-3 * np.max(np.abs(case.actual["mid"]))
    x = case.inputs  # the control image's one channel, and "bgr" reverses channels: a no-op to check by flipping
    flipped = ControlNetParity.run(case.model, dict(x, controlnet_cond=x["controlnet_cond"][:, ::-1]))
    assert np.max(np.abs(flipped["mid"] - case.actual["mid"])) > 1e-3 * np.max(np.abs(case.actual["mid"]))


def test_every_input_steers_the_residuals(sd_case):
    """The control image and guess mode each change the output (the parity could not see them otherwise); guess
    mode scales the first residual by 0.1 and the mid one by 1."""
    out, x = sd_case.actual, sd_case.inputs
    assert not np.allclose(out["guess_down_0"], out["down_0"])
    # each as accurate as the plain residual (against the float64 run), value by value
    out64 = TestControlNetSD.actual64(sd_case)
    assert_close_to_float64(out["guess_down_0"], 0.1 * np.asarray(out["down_0"]), 0.1 * out64["down_0"],
                            what="guess mode's first residual", elementwise=True)
    assert_close_to_float64(out["guess_mid"], out["mid"], out64["mid"], what="guess mode's mid residual",
                            elementwise=True)
    flipped = ControlNetParity.run(sd_case.model, dict(x, controlnet_cond=x["controlnet_cond"][:, ::-1]))
    assert np.max(np.abs(flipped["down_0"] - out["down_0"])) > 1e-3 * np.max(np.abs(out["down_0"]))


def test_from_unet_is_diffusers_from_unet(tmp_path):
    """Config, names and shapes as diffusers' from_unet; the encoder is the UNet's (its class embedding too), the
    control convs start at zero. diffusers leaves the (never applied) encoder_hid_proj as initialised; ours is the
    UNet's."""
    torch.manual_seed(0)
    unet_ref = diffusers.UNet2DConditionModel(**tiny.SDXL_UNET, class_embed_type="timestep", encoder_hid_dim=48)
    tiny.randomize_torch(unet_ref, seed=4)
    unet_ref.save_pretrained(tmp_path)
    ref = diffusers.ControlNetModel.from_unet(unet_ref, conditioning_embedding_out_channels=(16, 32))
    unet = eqxdiff.load(tmp_path)
    ours = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32), key=jax.random.key(2))
    assert ours.config == ControlNetConfig.from_dict(dict(ref.config))
    tensors, expected = state_dict(ours), ref.state_dict()
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: tuple(v.shape) for k, v in expected.items()}
    for name, value in expected.items():
        if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding.conv_out")):
            assert not np.any(tensors[name]) and not value.any(), name
        elif not name.startswith(("controlnet_cond_embedding", "encoder_hid_proj")):  # the UNet's, as diffusers'
            np.testing.assert_array_equal(tensors[name], value.numpy(), err_msg=name)
    config = unet.config
    with pytest.raises(ConfigError, match="time_cond_proj_dim=8"):
        ControlNetConfig.from_unet_config(type(config)(**{**config.__dict__, "time_cond_proj_dim": 8}))
    with pytest.raises(ConfigError, match="class_embeddings_concat=True"):  # diffusers cannot copy its ResNets
        ControlNetConfig.from_unet_config(type(config)(**{**config.__dict__, "class_embeddings_concat": True}))


def test_simple_projection_builds_no_class_embedding():
    """diffusers' ControlNetModel builds no class embedding for class_embed_type="simple_projection" (and needs no
    projection_class_embeddings_input_dim for it); neither does eqxdiff's."""
    config = ControlNetConfig.from_dict({**tiny.SD_CONTROLNET, "class_embed_type": "simple_projection"})
    with torch.device("meta"):
        ref = diffusers.ControlNetModel(**tiny.SD_CONTROLNET, class_embed_type="simple_projection")
    model = eqx.filter_eval_shape(ControlNetModel, config, key=jax.random.key(0))
    assert ref.class_embedding is None and model.class_embedding is None and not config.has_class_embedding


def test_checkpoint_names_and_remat(sd_case):
    model = sd_case.model
    assert checkpoint_names(model) == ("resnet", "transformer")
    remat = with_plan(model, Plan(remat=Remat.FULL))
    assert remat.plan is not None and remat.down_blocks[1].attentions[0].plan is not None

    def loss(m, x):
        down, mid = m(x["sample"], x["timestep"], x["encoder_hidden_states"], x["controlnet_cond"])
        return jnp.sum(mid ** 2) + sum(jnp.sum(r ** 2) for r in down)

    assert "remat" in str(jax.make_jaxpr(loss)(remat, sd_case.inputs))
    assert "remat" not in str(jax.make_jaxpr(loss)(model, sd_case.inputs))


# -- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,match", [
    ("controlnet_conditioning_channel_order", "rbg", "controlnet_conditioning_channel_order='rbg'"),
    ("mid_block_type", None, "mid_block_type=None"),
    ("layers_per_block", [1, 2], r"layers_per_block=\(1, 2\) must be one number"),
    ("cross_attention_dim", [32, 32], r"cross_attention_dim=\(32, 32\) must be one number"),
    ("time_cond_proj_dim", 4, "time_cond_proj_dim=4 is not a ControlNet setting"),
    ("class_embeddings_concat", True, "class_embeddings_concat=True is not a ControlNet setting"),
    ("encoder_hid_dim_type", "text_image_proj", "encoder_hid_dim_type='text_image_proj'"),
    ("conditioning_embedding_out_channels", [], "must list at least one width"),
])
def test_bad_configs_raise(key, value, match):
    with pytest.raises(ConfigError, match=match):
        ControlNetConfig.from_dict({**tiny.SD_CONTROLNET, key: value})


def test_config_json_is_diffusers_controlnet_only(sd_case):
    written = sd_case.model.checkpoint_config()
    assert written["_class_name"] == "ControlNetModel"
    assert "up_block_types" not in written and "out_channels" not in written
    assert set(written) - {"_class_name"} <= set(dict(sd_case.reference.config))


def test_bad_inputs_are_rejected_readably(sd_case):
    model = sd_case.model
    x = {k: jnp.asarray(v) for k, v in sd_case.inputs.items()}
    args = (x["sample"], 1, x["encoder_hidden_states"])
    with pytest.raises(ValueError, match=r"controlnet_cond must be \[2, 32, 32, 3\].*got shape \(2, 16, 16, 3\)"):
        model(*args, x["controlnet_cond"][:, ::2, ::2])
    with pytest.raises(ValueError, match="channels-last"):
        model(jnp.moveaxis(x["sample"], -1, 1), 1, x["encoder_hidden_states"], x["controlnet_cond"])
    with pytest.raises(ValueError, match="only used with addition_embed_type='text_time'"):
        model(*args, x["controlnet_cond"], text_embeds=jnp.zeros((2, 4)), time_ids=jnp.zeros((2, 6)))


# -- pipelines: every pixel within 2/255 of diffusers' from the same initial latents --------------------------------

PROMPTS = ["a red cat", "two dogs"]
STEPS = 3  # start/end fractions below switch nets on and off at every third of the schedule


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _tensor(image):
    return torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255


def _reference(ref, image, latents=None, **kwargs):
    image = [_tensor(i) for i in image] if isinstance(image, list) else _tensor(image)
    if latents is not None:
        kwargs["latents"] = nhwc_to_nchw(latents)
    with torch.no_grad():
        return ref(PROMPTS, image=image, output_type="np", num_inference_steps=STEPS, **kwargs).images


@pytest.fixture(scope="module")
def latents():
    return np.random.default_rng(0).standard_normal((2, 16, 16, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd-controlnet")
    ref = tiny.build_sd(folder, tiny.controlnet(tiny.SD_PIPE_CONTROLNET, 11))
    return ref, folder, eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def sd_multi(tmp_path_factory):
    """Two nets: the first reads bgr, the second pools its residuals (the first's global_pool_conditions would
    force guess mode; guess mode is asked for explicitly)."""
    folder = tmp_path_factory.mktemp("sd-multicontrolnet")
    nets = [tiny.controlnet(tiny.SD_PIPE_CONTROLNET, 12, controlnet_conditioning_channel_order="bgr"),
            tiny.controlnet(tiny.SD_PIPE_CONTROLNET, 13, global_pool_conditions=True)]
    ref = tiny.build_sd(folder, nets)
    return ref, folder, eqxdiff.load_pipeline(folder)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl-controlnet")
    ref = tiny.build_sdxl(folder, tiny.controlnet(tiny.SDXL_PIPE_CONTROLNET, 21))
    return ref, folder, eqxdiff.load_pipeline(folder)


def test_sd_controlnet_matches_diffusers(sd, latents):
    """One net: the size from the control image, the conditioning scale, start/end (off for the first and last
    third); one compiled loop serves all three calls (the scales are a traced table)."""
    ref, _, pipe = sd
    assert type(pipe) is StableDiffusionControlNetPipeline and isinstance(pipe.controlnet, ControlNetModel)
    image = tiny.control_images(1, 32, seed=3)
    outputs = {}
    for name, kw in {"plain": {}, "off": dict(controlnet_conditioning_scale=0.0),
                     "window": dict(controlnet_conditioning_scale=0.6, control_guidance_start=0.2,
                                    control_guidance_end=0.8)}.items():
        expected = _reference(ref, image, latents, guidance_scale=6.0, **kw)
        outputs[name] = pipe(PROMPTS, image=image, latents=latents, num_inference_steps=STEPS, guidance_scale=6.0,
                             progress=False, **kw)
        assert outputs[name].shape == (2, 32, 32, 3)
        assert _pixels_off(outputs[name], expected) <= 2, name
    # the net steers the images, and the window changes what it does
    assert _pixels_off(outputs["plain"], outputs["off"] / 255) > 10
    assert _pixels_off(outputs["window"], outputs["plain"] / 255) > 10


def test_sd_multicontrolnet_guess_mode_matches_diffusers(sd_multi, latents):
    """Two nets (bgr, pooled), one image each (one per prompt for the second), per-net scales and windows, guess
    mode with guidance (nets on the positive half only)."""
    ref, _, pipe = sd_multi
    assert isinstance(pipe.controlnet, MultiControlNetModel) and len(pipe.nets) == 2
    images = [tiny.control_images(1, 32, seed=4), tiny.control_images(2, 32, seed=5)]
    kw = dict(guess_mode=True, controlnet_conditioning_scale=[0.8, 1.3], control_guidance_start=[0.0, 0.3],
              control_guidance_end=[0.7, 1.0], guidance_scale=5.0)
    expected = _reference(ref, images, latents, **kw)
    ours = pipe(PROMPTS, image=images, latents=latents, num_inference_steps=STEPS, progress=False, **kw)
    assert _pixels_off(ours, expected) <= 2


def test_pooled_net_forces_guess_mode_as_diffusers(sd_multi, latents):
    """guess_mode not passed, guidance on: a lone net with global_pool_conditions runs in guess mode (on the
    positive half only), as diffusers forces it; two nets follow the first net's flag only (diffusers reads
    ``nets[0]``), so the pair whose second net pools runs without guess mode."""
    ref, _, multi = sd_multi
    pooled, ref_pooled = multi.nets[1], ref.controlnet.nets[1]
    assert pooled.config.global_pool_conditions and not multi.nets[0].config.global_pool_conditions
    single = StableDiffusionControlNetPipeline.from_pipe(multi, controlnet=pooled)
    ref_single = diffusers.StableDiffusionControlNetPipeline(**{**ref.components, "controlnet": ref_pooled})
    ref_single.set_progress_bar_config(disable=True)
    image = tiny.control_images(2, 32, seed=10)
    kw = dict(guidance_scale=5.0, controlnet_conditioning_scale=0.9)
    ours = single(PROMPTS, image=image, latents=latents, num_inference_steps=STEPS, progress=False, **kw)
    assert _pixels_off(ours, _reference(ref_single, image, latents, **kw)) <= 2

    images = [tiny.control_images(1, 32, seed=11), image]
    ours = multi(PROMPTS, image=images, latents=latents, num_inference_steps=STEPS, progress=False, **kw)
    assert _pixels_off(ours, _reference(ref, images, latents, **kw)) <= 2


def test_sd_controlnet_img2img_matches_diffusers(sd, monkeypatch):
    """Image-to-image: the picture's VAE sample and the noise are the draws our call makes from its key; the
    schedule starts part-way (strength), and the start/end window counts the steps actually run."""
    from diffusers.pipelines.controlnet import pipeline_controlnet_img2img as module

    from eqxdiff.pipelines._latents import noise_draws

    ref, folder, _ = sd
    ref_img2img = module.StableDiffusionControlNetImg2ImgPipeline(**ref.components)
    ref_img2img.set_progress_bar_config(disable=True)
    pipe = StableDiffusionControlNetImg2ImgPipeline.from_pretrained(folder)
    key = jax.random.key(7)
    draws = noise_draws(key, (2, 16, 16, 4))
    posterior, noise = iter([draws.image]), iter([draws.noise])
    monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: nhwc_to_nchw(next(noise)))
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None, sample_mode="sample":
                        out.latent_dist.mean + out.latent_dist.std * nhwc_to_nchw(next(posterior)))
    picture = np.random.default_rng(8).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    control = tiny.control_images(1, 32, seed=9)
    kw = dict(strength=0.7, guidance_scale=6.0, control_guidance_end=0.6)
    with torch.no_grad():
        expected = ref_img2img(PROMPTS, image=_tensor(picture), control_image=_tensor(control), output_type="np",
                               num_inference_steps=STEPS + 2, **kw).images
    ours = pipe(PROMPTS, image=picture, control_image=control, key=key, num_inference_steps=STEPS + 2,
                progress=False, **kw)
    assert _pixels_off(ours, expected) <= 2


def test_sdxl_controlnet_matches_diffusers(sdxl, latents):
    ref, _, pipe = sdxl
    assert type(pipe) is StableDiffusionXLControlNetPipeline
    image = tiny.control_images(1, 32, seed=6)
    outputs = {}
    for name, kw in {"plain": {}, "window": dict(control_guidance_start=0.4, controlnet_conditioning_scale=1.5)
                     }.items():
        expected = _reference(ref, image, latents, **kw)
        outputs[name] = pipe(PROMPTS, image=image, latents=latents, num_inference_steps=STEPS, progress=False, **kw)
        assert _pixels_off(outputs[name], expected) <= 2, name
    assert _pixels_off(outputs["window"], outputs["plain"] / 255) > 10


def test_sdxl_multicontrolnet_guess_mode_matches_diffusers(tmp_path, latents):
    ref = tiny.build_sdxl(tmp_path, [tiny.controlnet(tiny.SDXL_PIPE_CONTROLNET, 22),
                                     tiny.controlnet(tiny.SDXL_PIPE_CONTROLNET, 23)])
    pipe = eqxdiff.load_pipeline(tmp_path)
    images = [tiny.control_images(2, 32, seed=7), tiny.control_images(1, 32, seed=8)]
    kw = dict(guess_mode=True, controlnet_conditioning_scale=[0.7, 1.2], control_guidance_start=[0.0, 0.3],
              control_guidance_end=[0.7, 1.0])
    expected = _reference(ref, images, latents, **kw)
    ours = pipe(PROMPTS, image=images, latents=latents, num_inference_steps=STEPS, progress=False, **kw)
    assert _pixels_off(ours, expected) <= 2


def test_multicontrolnet_folders_round_trip(sd_multi, tmp_path):
    """A multi-ControlNet pipeline is saved as diffusers saves it (controlnet, controlnet_1; MultiControlNetModel in
    model_index.json), and diffusers loads the same nets back."""
    ref, _, pipe = sd_multi
    save_pipeline(pipe, tmp_path)
    assert json.loads((tmp_path / "model_index.json").read_text())["controlnet"] == ["diffusers",
                                                                                    "MultiControlNetModel"]
    again = diffusers.StableDiffusionControlNetPipeline.from_pretrained(tmp_path)
    assert len(again.controlnet.nets) == 2
    for theirs, expected in zip(again.controlnet.nets, ref.controlnet.nets):
        assert theirs.config.global_pool_conditions == expected.config.global_pool_conditions
        for name, t in expected.state_dict().items():
            torch.testing.assert_close(theirs.state_dict()[name], t, rtol=0, atol=0, msg=name)
    back = eqxdiff.load_pipeline(tmp_path)
    assert [n.config for n in back.nets] == [n.config for n in pipe.nets]


# -- control images and the per-step scales ----------------------------------------------------------------------

def test_control_images_are_prepared_as_diffusers_does():
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    processor = VaeImageProcessor(vae_scale_factor=8, do_convert_rgb=True, do_normalize=False)
    rng = np.random.default_rng(0)
    array = rng.integers(0, 256, (37, 53, 3)).astype(np.uint8)
    for size in [(None, None), (48, 40), (64, 96)]:
        h, w = size
        for given, theirs in [(Image.fromarray(array), Image.fromarray(array)),  # Lanczos
                              (Image.fromarray(array[..., 0]), Image.fromarray(array[..., 0])),  # grey -> RGB
                              (array.astype(np.float32) / 255, array[None].astype(np.float32) / 255)]:  # nearest
            expected = processor.preprocess(theirs, height=h, width=w).permute(0, 2, 3, 1).numpy()
            # PIL resizes for both (the same bytes), then one correctly rounded float32 division: exactly equal
            np.testing.assert_array_equal(prepare_control_image(given, height=h, width=w), expected)
    # uint8 arrays are read as 0-255; one image serves every output, or one per prompt is repeated per image
    control = ControlInput((array[None, :32, :32],), (1.0,), (0.0,), (1.0,), False, num_images_per_prompt=3)
    (prepared,) = control.prepared(batch=6, height=32, width=32, multiple=8)
    assert prepared.shape == (6, 32, 32, 3) and prepared.max() <= 1.0
    two = dataclasses.replace(control, images=(np.stack([array[:32, :32], array[:32, :32] // 2]),))
    (prepared,) = two.prepared(batch=6, height=32, width=32, multiple=8)
    np.testing.assert_array_equal(prepared[:3], np.repeat(prepared[:1], 3, axis=0))
    assert not np.array_equal(prepared[2], prepared[3])
    with pytest.raises(ValueError, match="2 images for 3 prompts"):
        two.prepared(batch=9, height=32, width=32, multiple=8)


def test_control_scales_switch_nets_by_step():
    table = control_scales([0.5, 2.0], [0.25, 0.0], [0.75, 0.5], 4)
    np.testing.assert_array_equal(table, [[0.0, 2.0], [0.5, 2.0], [0.5, 0.0], [0.0, 0.0]])


def test_bad_control_inputs_name_the_fix(sd, sd_multi):
    _, _, pipe = sd
    _, _, multi = sd_multi
    image = tiny.control_images(1, 32, seed=1)
    with pytest.raises(ValueError, match="needs its control image"):
        pipe(PROMPTS)
    with pytest.raises(ValueError, match="2 ControlNets need a list of 2 control images"):
        multi(PROMPTS, image=image)
    with pytest.raises(ValueError, match="controlnet_conditioning_scale has 3 entries for 2 ControlNets"):
        multi(PROMPTS, image=[image, image], controlnet_conditioning_scale=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="must satisfy 0 <= start < end <= 1"):
        pipe(PROMPTS, image=image, control_guidance_start=0.5, control_guidance_end=0.5)
    with pytest.raises(ValueError, match="has 1 channels; its ControlNet takes 3"):
        pipe(PROMPTS, image=image[..., :1], num_inference_steps=2, progress=False)
    with pytest.raises(ValueError, match=r"float control image must lie in \[0, 1\]"):
        pipe(PROMPTS, image=image.astype(np.float32), num_inference_steps=2, progress=False)
    with pytest.raises(ValueError, match="image="):
        StableDiffusionControlNetImg2ImgPipeline.from_pipe(pipe)(PROMPTS, control_image=image)
    with pytest.raises(TypeError, match="ControlNetModel"):
        StableDiffusionControlNetPipeline.from_pipe(pipe, controlnet=pipe.unet)
