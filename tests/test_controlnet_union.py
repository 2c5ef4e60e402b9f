"""ControlNet-Union: the model on the parity base (:mod:`tests._parity`) at two tiny configs (SDXL-style with
``text_time``, two token layers and four control types; SD-style without ``text_time``, a one-channel control image
downsampled 4x, other sinusoid flags, a class table, an unused encoder_hid_dim) against full-size layouts, each run
with one control image, with two at different scales (plain and guess mode) and as a member of a multi-net
(``from_multi``, guess mode); config and input errors. Then the SDXL pipeline against diffusers' (every pixel within
2/255 from the same initial latents).

The reference's token attention runs across the batch (see :mod:`eqxdiff.models.controlnet_union`): the inputs
use a batch of two different samples so that the quirk is exercised."""

import json

import diffusers
import equinox as eqx
import jax
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.models.controlnet_union import (
    ControlNetUnionConfig,
    ControlNetUnionModel,
    MultiControlNetUnionModel,
    control_type_vector,
)
from eqxdiff.pipelines import save_pipeline
from eqxdiff.pipelines.controlnet_union import (
    StableDiffusionXLControlNetUnionImg2ImgPipeline,
    StableDiffusionXLControlNetUnionInpaintPipeline,
    StableDiffusionXLControlNetUnionPipeline,
)

from . import _tiny_controlnet as tiny_cn
from . import _tiny_sdxl
from . import _tiny_controlnet_union as tiny
from ._parity import ModelParity, _public_config
from ._util import nhwc_to_nchw

# xinsir/controlnet-union-sdxl-1.0 (and its ProMax variant, 8 control types): diffusers/controlnet-canny-sdxl-1.0's
# encoder with the union's keys
UNION_SDXL = dict(addition_embed_type="text_time", addition_time_embed_dim=256, attention_head_dim=[5, 10, 20],
                  block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
                  down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
                  projection_class_embeddings_input_dim=2816, transformer_layers_per_block=[1, 2, 10],
                  use_linear_projection=True, conditioning_embedding_out_channels=[16, 32, 96, 256],
                  num_control_type=6, num_trans_channel=320, num_trans_head=8, num_trans_layer=1, num_proj_channel=320)
UNION_PROMAX = dict(UNION_SDXL, num_control_type=8)

# name -> (control images used, their modes, scales, from_multi, guess_mode)
VARIANTS = {
    "one": (1, (2,), (0.7,), False, False),
    "two": (2, (1, 0), (0.6, 1.3), False, False),
    "two_guess": (2, (1, 0), (0.6, 1.3), False, True),
    "multi_guess": (1, (0,), (0.8,), True, True),
}


def _torch(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def _nhwc(t) -> np.ndarray:
    return t.permute(0, 2, 3, 1).numpy()


class ControlNetUnionParity(ModelParity):
    model_class = ControlNetUnionModel
    reference_class = diffusers.ControlNetUnionModel

    def inputs(self, reference):
        rng = np.random.default_rng(1)
        c, b, size = reference.config, 2, 8
        f = 2 ** (len(c.conditioning_embedding_out_channels) - 1)
        out = dict(sample=rng.standard_normal((b, size, size, c.in_channels), np.float32),
                   timestep=np.array([3, 817], np.int32),
                   encoder_hidden_states=rng.standard_normal((b, 7, c.cross_attention_dim), np.float32),
                   images=[rng.random((b, size * f, size * f, c.conditioning_channels), np.float32)
                           for _ in range(2)])
        out["control_types"] = {name: np.broadcast_to(np.asarray(control_type_vector(modes, c.num_control_type)),
                                                      (b, c.num_control_type)).copy()
                                for name, (_, modes, *_) in VARIANTS.items()}
        if c.addition_embed_type == "text_time":
            text = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
            out["text_embeds"] = rng.standard_normal((b, text), np.float32)
            out["time_ids"] = np.array([[32, 32, 0, 0, 32, 32], [24, 20, 2, 1, 16, 16]], np.float32)
        if c.num_class_embeds is not None:
            out["class_labels"] = np.array([4, 1], np.int32)
        return out

    def reference_outputs(self, reference, inputs):
        kw = dict(sample=nhwc_to_nchw(inputs["sample"]), timestep=_torch(inputs["timestep"]),
                  encoder_hidden_states=_torch(inputs["encoder_hidden_states"]), return_dict=False)
        if "text_embeds" in inputs:
            kw["added_cond_kwargs"] = dict(text_embeds=_torch(inputs["text_embeds"]),
                                           time_ids=_torch(inputs["time_ids"]))
        if "class_labels" in inputs:
            kw["class_labels"] = _torch(inputs["class_labels"])
        out = {}
        for name, (n, modes, scales, multi, guess) in VARIANTS.items():
            down, mid = reference(**kw, controlnet_cond=[nhwc_to_nchw(im) for im in inputs["images"][:n]],
                                  control_type=_torch(inputs["control_types"][name]), control_type_idx=list(modes),
                                  conditioning_scale=list(scales), from_multi=multi, guess_mode=guess)
            out.update({f"{name}_down_{i}": _nhwc(r) for i, r in enumerate(down)})
            out[f"{name}_mid"] = _nhwc(mid)
        return out

    @staticmethod
    def outputs(model, inputs):
        x = dict(inputs)
        args = [x.pop(k) for k in ("sample", "timestep", "encoder_hidden_states")]
        images, types = x.pop("images"), x.pop("control_types")
        out = {}
        for name, (n, modes, scales, multi, guess) in VARIANTS.items():
            down, mid = model(*args, images[:n], types[name], modes, conditioning_scale=scales, from_multi=multi,
                              guess_mode=guess, **x)
            out.update({f"{name}_down_{i}": r for i, r in enumerate(down)})
            out[f"{name}_mid"] = mid
        return out


class TestControlNetUnionSDXL(ControlNetUnionParity):
    config = dict(block_out_channels=(32, 64), layers_per_block=1, in_channels=4, norm_num_groups=8,
                  down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), attention_head_dim=(2, 4),
                  use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                  transformer_layers_per_block=(1, 2), projection_class_embeddings_input_dim=80,
                  cross_attention_dim=64, conditioning_embedding_out_channels=(16, 32), num_control_type=4,
                  num_trans_channel=32, num_trans_head=4, num_trans_layer=2, num_proj_channel=32)
    full_size = {"union-sdxl": UNION_SDXL, "union-promax": UNION_PROMAX}


class TestControlNetUnionSmall(ControlNetUnionParity):
    """Also a class table (``class_labels``) and an ``encoder_hid_dim``, which diffusers' union keeps unused (no
    ``encoder_hid_proj``, no default ``encoder_hid_dim_type``)."""

    config = dict(block_out_channels=(16, 32), layers_per_block=1, in_channels=4, norm_num_groups=4,
                  down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), attention_head_dim=2,
                  cross_attention_dim=24, addition_time_embed_dim=4, conditioning_embedding_out_channels=(8, 8, 16),
                  conditioning_channels=1, flip_sin_to_cos=False, freq_shift=1, num_control_type=3,
                  num_trans_channel=16, num_trans_head=2, num_trans_layer=1, num_proj_channel=16, num_class_embeds=5,
                  encoder_hid_dim=20)
    full_size = {"union-sdxl": UNION_SDXL}


# -- what the parity base does not check -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sdxl_case(tmp_path_factory):
    return TestControlNetUnionSDXL.build(tmp_path_factory)


def test_every_input_steers_the_residuals(sdxl_case):
    """The variants differ (the parity could not see an ignored input otherwise): a second image and its scale,
    guess mode, and the first scale where it multiplies the residuals."""
    out = sdxl_case.actual
    for a, b in [("one", "two"), ("two", "two_guess"), ("one", "multi_guess")]:
        diff = np.max(np.abs(out[f"{a}_down_0"] - out[f"{b}_down_0"]))
        assert diff > 1e-3 * np.max(np.abs(out[f"{b}_down_0"])), (a, b)


@pytest.mark.parametrize("key,value,match", [
    ("num_trans_channel", 16, "num_trans_channel=16 must equal block_out_channels"),
    ("num_proj_channel", 16, "num_proj_channel=16 must equal block_out_channels"),
    ("num_trans_head", 5, "num_trans_head=5 must divide num_trans_channel=32"),
    ("addition_time_embed_dim", None, "addition_time_embed_dim=None must be set"),
    ("controlnet_conditioning_channel_order", "bgr", "controlnet_conditioning_channel_order='bgr'"),
    ("num_control_type", 0, "num_control_type=0 must be at least 1"),
    ("encoder_hid_dim_type", "text_proj", "encoder_hid_dim_type='text_proj'"),  # diffusers' union refuses it
])
def test_bad_configs_raise(key, value, match):
    with pytest.raises(ConfigError, match=match):
        ControlNetUnionConfig.from_dict({**TestControlNetUnionSDXL.config, key: value})


def test_config_json_is_diffusers_union_only(sdxl_case):
    written = sdxl_case.model.checkpoint_config()
    assert written["_class_name"] == "ControlNetUnionModel"
    assert "mid_block_type" not in written and "up_block_types" not in written
    assert set(written) - {"_class_name"} <= set(dict(sdxl_case.reference.config))


def test_from_unet_is_diffusers_from_unet(tmp_path):
    """Config, names and shapes as diffusers' from_unet, but for the token widths, which follow the UNet's first
    width (diffusers writes 320, which only a UNet that wide runs); the encoder is the UNet's (add_embedding too,
    which diffusers' union leaves new), the zero layers zero; a UNet of another mid block is refused with its
    weights and built without them."""
    from eqxdiff.loading import state_dict

    from ._util import randomize_torch

    unet_ref = diffusers.UNet2DConditionModel(**tiny_cn.SDXL_UNET, class_embed_type="timestep")
    randomize_torch(unet_ref, seed=4)
    unet_ref.save_pretrained(tmp_path)
    ref = diffusers.ControlNetUnionModel.from_unet(unet_ref, conditioning_embedding_out_channels=(16, 32))
    unet = eqxdiff.load(tmp_path)
    ours = ControlNetUnionModel.from_unet(unet, conditioning_embedding_out_channels=(16, 32), key=jax.random.key(2))
    width = tiny_cn.SDXL_UNET["block_out_channels"][0]
    ref_config = {**ref.config, "num_trans_channel": width, "num_proj_channel": width}
    assert ours.config == ControlNetUnionConfig.from_dict(ref_config)
    with torch.device("meta"):
        shaped = diffusers.ControlNetUnionModel(**{k: v for k, v in ref_config.items() if not k.startswith("_")})
    tensors, unet_tensors = state_dict(ours), unet_ref.state_dict()
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {k: tuple(v.shape) for k, v in
                                                             shaped.state_dict().items()}
    for name, value in ref.state_dict().items():
        if name.startswith(("controlnet_down_blocks", "controlnet_mid_block", "controlnet_cond_embedding.conv_out",
                            "spatial_ch_projs")):
            assert not np.any(tensors[name]) and not value.any(), name
        elif name.startswith(("conv_in", "time_embedding", "class_embedding", "add_embedding", "down_blocks",
                              "mid_block")):
            np.testing.assert_array_equal(tensors[name], unet_tensors[name].numpy(), err_msg=name)
            if not name.startswith("add_embedding"):
                np.testing.assert_array_equal(tensors[name], value.numpy(), err_msg=name)
    three = eqx.filter_eval_shape(lambda: ControlNetUnionModel.from_unet(unet, num_control_type=3))
    assert three.task_embedding.shape == (3, width)
    other = type(unet.config)(**{**unet.config.__dict__, "mid_block_type": "UNetMidBlock2D"})
    plain = eqx.filter_eval_shape(type(unet), other, key=jax.random.key(0))
    with pytest.raises(ConfigError, match="mid block is UNetMidBlock2D, a union's is UNetMidBlock2DCrossAttn"):
        ControlNetUnionModel.from_unet(plain)
    built = eqx.filter_eval_shape(lambda: ControlNetUnionModel.from_unet(plain, load_weights_from_unet=False))
    assert built.config.mid_block_type == "UNetMidBlock2DCrossAttn"


def test_bad_inputs_are_rejected_readably(sdxl_case):
    import jax.numpy as jnp

    model = sdxl_case.model
    x = sdxl_case.inputs
    args = (jnp.asarray(x["sample"]), 1, jnp.asarray(x["encoder_hidden_states"]))
    images = [jnp.asarray(im) for im in x["images"]]
    kw = dict(text_embeds=jnp.asarray(x["text_embeds"]), time_ids=jnp.asarray(x["time_ids"]))
    ctype = jnp.asarray(x["control_types"]["two"])
    with pytest.raises(ValueError, match="control mode 4 is out of range; this net knows 4 control modes, 0 to 3"):
        model(*args, images, ctype, [1, 4], **kw)
    with pytest.raises(ValueError, match="2 control images need as many control modes in control_type_idx, got 1"):
        model(*args, images, ctype, [1], **kw)
    with pytest.raises(ValueError, match="conditioning_scale has 3 entries for 2 control images"):
        model(*args, images, ctype, [1, 0], conditioning_scale=[1.0, 1.0, 1.0], **kw)
    with pytest.raises(ValueError, match=r"control_type must be \[2, 4\]"):
        model(*args, images, ctype[:, :3], [1, 0], **kw)
    with pytest.raises(ValueError, match=r"controlnet_cond\[1\] must be \[2, 16, 16, 3\]"):
        model(*args, [images[0], images[1][:, ::2, ::2]], ctype, [1, 0], **kw)
    with pytest.raises(ValueError, match="control_mode 6 is out of range: this ControlNet-Union knows 6"):
        control_type_vector([0, 6], 6)


# -- the pipeline: every pixel within 2/255 of diffusers' from the same initial latents -----------------------------

PROMPTS = ["a red cat", "two dogs"]
STEPS = 3  # windows below switch images on and off by thirds of the schedule


def _pixels_off(ours_uint8, ref_float) -> int:
    return int(np.max(np.abs(ours_uint8.astype(int) - (np.asarray(ref_float) * 255).round().astype(int))))


def _tensor(image):
    return torch.from_numpy(image).permute(0, 3, 1, 2).float() / 255


def _reference(ref, images, latents, **kwargs):
    with torch.no_grad():
        return ref(PROMPTS, control_image=[_tensor(i) for i in images], latents=nhwc_to_nchw(latents),
                   output_type="np", num_inference_steps=STEPS, **kwargs).images


@pytest.fixture(scope="module")
def latents():
    return np.random.default_rng(0).standard_normal((2, 16, 16, 4)).astype(np.float32)


@pytest.fixture(scope="module")
def images():
    """Two control images: one for every output, and one per prompt."""
    return [tiny_cn.control_images(1, 32, seed=3), tiny_cn.control_images(2, 32, seed=4)]


@pytest.fixture(scope="module")
def union(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sdxl-controlnet-union")
    ref = tiny.build_sdxl(folder, tiny.union_net(31))
    return ref, folder, eqxdiff.load_pipeline(folder)


def test_two_control_modes_match_diffusers(union, latents, images):
    """One net, two images of two modes at different scales, guided; then per-image windows, then other modes. One
    compiled loop serves the three calls (scales and modes are traced)."""
    ref, _, pipe = union
    assert type(pipe) is StableDiffusionXLControlNetUnionPipeline and type(pipe.controlnet) is ControlNetUnionModel
    calls = {"two": dict(control_mode=[1, 3], controlnet_conditioning_scale=[0.7, 1.2]),
             "window": dict(control_mode=[1, 3], controlnet_conditioning_scale=[0.7, 1.2],
                            control_guidance_start=[0.0, 0.4], control_guidance_end=[0.7, 1.0]),
             "modes": dict(control_mode=[0, 2], controlnet_conditioning_scale=[0.7, 1.2])}
    outputs = {}
    for name, kw in calls.items():
        expected = _reference(ref, images, latents, **kw)
        outputs[name] = pipe(PROMPTS, control_image=images, latents=latents, num_inference_steps=STEPS,
                             progress=False, **kw)
        assert outputs[name].shape == (2, 32, 32, 3)
        assert _pixels_off(outputs[name], expected) <= 2, name
    for name in ("window", "modes"):  # the window and the modes steer the images
        assert _pixels_off(outputs[name], outputs["two"] / 255) > 10, name


def test_one_image_in_guess_mode_matches_diffusers(union, latents, images, monkeypatch):
    """One image (its scale multiplies the residuals) in guess mode, without guidance, then with it: the net on
    the prompted half. diffusers 0.42 fails there (it passes the net the guided batch's control_type, twice the
    net's batch); its net is given the rows of its batch (all rows are the same one-hot) for the reference."""
    ref, _, pipe = union
    kw = dict(control_mode=2, controlnet_conditioning_scale=0.8, guess_mode=True, guidance_scale=1.0)
    expected = _reference(ref, images[:1], latents, **kw)
    ours = pipe(PROMPTS, control_image=images[0], latents=latents, num_inference_steps=STEPS, progress=False, **kw)
    assert _pixels_off(ours, expected) <= 2
    forward = ref.controlnet.forward
    monkeypatch.setattr(ref.controlnet, "forward", lambda sample, *a, control_type, **k:
                        forward(sample, *a, control_type=control_type[:sample.shape[0]], **k))
    kw["guidance_scale"] = 5.0
    expected = _reference(ref, images[:1], latents, **kw)
    ours = pipe(PROMPTS, control_image=images[0], latents=latents, num_inference_steps=STEPS, progress=False, **kw)
    assert _pixels_off(ours, expected) <= 2


def test_pooled_net_forces_guess_mode_as_diffusers(union, latents, images, tmp_path, monkeypatch):
    """guess_mode not passed, guidance on: a net with global_pool_conditions runs in guess mode (on the prompted
    half only), as diffusers 0.42's union pipeline forces it from the net's config (``nets[0]``'s for a
    MultiControlNetUnionModel, the rule the ControlNet pipelines' test covers for two nets). diffusers' net is given
    its batch's rows of control_type, as in the guess-mode test above."""
    ref, _, pipe = union
    net = tiny.union_net(34, global_pool_conditions=True)
    net.save_pretrained(tmp_path / "pooled", safe_serialization=True)
    pooled = StableDiffusionXLControlNetUnionPipeline.from_pipe(pipe, controlnet=eqxdiff.load(tmp_path / "pooled"))
    assert pooled.controlnet.config.global_pool_conditions
    reference = diffusers.StableDiffusionXLControlNetUnionPipeline(**{**ref.components, "controlnet": net})
    reference.set_progress_bar_config(disable=True)
    forward = net.forward
    monkeypatch.setattr(net, "forward", lambda sample, *a, control_type, **k:
                        forward(sample, *a, control_type=control_type[:sample.shape[0]], **k))
    kw = dict(control_mode=2, controlnet_conditioning_scale=0.8, guidance_scale=5.0)
    expected = _reference(reference, images[:1], latents, **kw)
    ours = pooled(PROMPTS, control_image=images[0], latents=latents, num_inference_steps=STEPS, progress=False, **kw)
    assert _pixels_off(ours, expected) <= 2


def test_two_union_nets_match_diffusers(tmp_path, latents, images):
    """MultiControlNetUnionModel: one image and mode per net (of different num_control_type), per-net scales and
    windows; saved as diffusers saves it (controlnet, controlnet_1)."""
    nets = [tiny.union_net(32), tiny.union_net(33, num_control_type=3)]
    ref = tiny.build_sdxl(tmp_path / "multi", nets)
    pipe = eqxdiff.load_pipeline(tmp_path / "multi")
    assert isinstance(pipe.controlnet, MultiControlNetUnionModel) and len(pipe.nets) == 2
    kw = dict(control_mode=[3, 2], controlnet_conditioning_scale=[0.7, 1.2], control_guidance_end=[1.0, 0.5])
    expected = _reference(ref, images, latents, **kw)
    ours = pipe(PROMPTS, control_image=images, latents=latents, num_inference_steps=STEPS, progress=False, **kw)
    assert _pixels_off(ours, expected) <= 2
    save_pipeline(pipe, tmp_path / "saved")
    written = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert written["controlnet"] == json.loads((tmp_path / "multi" / "model_index.json").read_text())["controlnet"]
    for i, net in enumerate(nets):
        again = diffusers.ControlNetUnionModel.from_pretrained(tmp_path / "saved" / f"controlnet{f'_{i}' if i else ''}")
        assert _public_config(again) == _public_config(net)
        for name, t in net.state_dict().items():
            torch.testing.assert_close(again.state_dict()[name], t, rtol=0, atol=0, msg=name)


def test_pipeline_folder_round_trips_through_diffusers(union, tmp_path):
    ref, _, pipe = union
    save_pipeline(pipe, tmp_path)
    again = diffusers.StableDiffusionXLControlNetUnionPipeline.from_pretrained(tmp_path)
    assert type(again.controlnet) is diffusers.ControlNetUnionModel
    for name, t in ref.controlnet.state_dict().items():
        torch.testing.assert_close(again.controlnet.state_dict()[name], t, rtol=0, atol=0, msg=name)
    assert eqxdiff.load_pipeline(tmp_path).controlnet.config == pipe.controlnet.config


def test_bad_control_inputs_name_the_fix(union, images):
    _, _, pipe = union
    with pytest.raises(ValueError, match="control_mode 4 is out of range: this ControlNet-Union knows 4"):
        pipe(PROMPTS, control_image=images, control_mode=[1, 4])
    with pytest.raises(ValueError, match=r"2 control image\(s\) and 1 control_mode\(s\) given"):
        pipe(PROMPTS, control_image=images, control_mode=1)
    with pytest.raises(ValueError, match="control_mode= is required"):
        pipe(PROMPTS, control_image=images)
    with pytest.raises(ValueError, match="needs control_image="):
        pipe(PROMPTS, control_mode=1)
    with pytest.raises(ValueError, match="controlnet_conditioning_scale has 3 entries for 2 control images"):
        pipe(PROMPTS, control_image=images, control_mode=[1, 2], controlnet_conditioning_scale=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="must satisfy 0 <= start < end <= 1"):
        pipe(PROMPTS, control_image=images, control_mode=[1, 2], control_guidance_start=0.5, control_guidance_end=0.5)
    with pytest.raises(ValueError, match="is text-to-image"):
        pipe(PROMPTS, control_image=images, control_mode=[1, 2], image=images[0])
    multi = StableDiffusionXLControlNetUnionPipeline.from_pipe(pipe, controlnet=[pipe.controlnet, pipe.controlnet])
    with pytest.raises(ValueError, match="2 ControlNet-Union nets take one control image and one control_mode each"):
        multi(PROMPTS, control_image=images[:1], control_mode=1)
    with pytest.raises(TypeError, match="ControlNetUnionModel"):
        StableDiffusionXLControlNetUnionPipeline.from_pipe(pipe, controlnet=pipe.unet)


# -- eqxdiff-generate -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_folders(union, images, tmp_path_factory):
    """The union pipeline's SDXL base and its net in folders of their own (the same configs as ``union``'s: the
    command's programs are the ones the pipeline tests compiled), and the control images as PNG files."""
    from PIL import Image

    ref, _, _ = union
    root = tmp_path_factory.mktemp("cli")
    base = diffusers.StableDiffusionXLPipeline(**{k: v for k, v in ref.components.items() if k != "controlnet"},
                                               add_watermarker=False)
    _tiny_sdxl.save(base, root / "base")
    ref.controlnet.save_pretrained(root / "union", safe_serialization=True)
    files = []
    for i, image in enumerate(images):
        Image.fromarray(image[0]).save(root / f"control_{i}.png")
        files.append(root / f"control_{i}.png")
    return root, files


def test_generate_runs_a_union_net_on_an_sdxl_base(union, cli_folders, tmp_path):
    """--controlnet FOLDER holding a ControlNetUnionModel runs the union pipeline, with --control-image and
    --control-mode repeated (one mode per image) and a scale per image: diffusers' union pipeline of the same
    components from the same initial noise."""
    from PIL import Image

    from eqxdiff.cli import generate
    from eqxdiff.pipelines import read_parameters, seed_key
    from eqxdiff.pipelines._latents import noise_draws

    ref, _, _ = union
    root, files = cli_folders
    argv = ["--model", str(root / "base"), "--controlnet", str(root / "union"), "--control-image", str(files[0]),
            "--control-mode", "1", "--control-image", str(files[1]), "--control-mode", "3", "--controlnet-scale",
            "0.7", "--controlnet-scale", "1.2", "--prompt", PROMPTS[0], "--num-images-per-prompt", "2", "--steps",
            str(STEPS), "--seed", "5", "--no-progress", "--output-dir", str(tmp_path)]
    paths = generate.main(argv)
    ours = np.stack([np.asarray(Image.open(p)) for p in paths])
    noise = nhwc_to_nchw(noise_draws(seed_key(5), (2, 16, 16, 4)).noise)
    with torch.no_grad():
        expected = ref(PROMPTS[0], control_image=[Image.open(f) for f in files], control_mode=[1, 3],
                       controlnet_conditioning_scale=[0.7, 1.2], num_images_per_prompt=2, latents=noise,
                       num_inference_steps=STEPS, output_type="np").images
    assert _pixels_off(ours, expected) <= 2
    params = read_parameters(paths[0])
    assert params["pipeline"] == "StableDiffusionXLControlNetUnionPipeline"
    assert params["control_mode"] == [1, 3] and params["controlnet_conditioning_scale"] == [0.7, 1.2]


def test_generate_checks_control_modes_before_loading(union, cli_folders):
    from eqxdiff.cli import generate
    from eqxdiff.pipelines import InputError

    _, folder, _ = union
    root, files = cli_folders
    images = ["--control-image", str(files[0]), "--control-image", str(files[1])]
    checked = generate.validate(["--model", str(folder), *images, "--control-mode", "2", "--control-mode", "0"])
    assert checked.family.pipeline_class is StableDiffusionXLControlNetUnionPipeline
    assert checked.kwargs["control_mode"] == [2, 0] and len(checked.kwargs["control_image"]) == 2
    with pytest.raises(InputError, match="--control-mode given 1 time for 2 --control-image"):
        generate.validate(["--model", str(root / "base"), "--controlnet", str(root / "union"), *images,
                           "--control-mode", "2"])
    picture = ["--image", str(files[0])]  # image-to-image, inpainting: the union's image classes
    for extra, cls in [(picture, StableDiffusionXLControlNetUnionImg2ImgPipeline),
                       ([*picture, "--mask", str(files[1])], StableDiffusionXLControlNetUnionInpaintPipeline)]:
        checked = generate.validate(["--model", str(folder), *images, "--control-mode", "2", "--control-mode", "0",
                                     *extra])
        assert checked.family.pipeline_class is cls
