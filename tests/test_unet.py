"""UNet2DConditionModel: the parity base (:mod:`tests._parity`) at tiny SD1, SD2, SDXL and per-block-list configs,
each against its full-size SD 1.5 / 2.1 / SDXL / refiner / LCM layout; then what the base does not check: inputs
that must change the output, config errors and input errors."""

import json
import shutil

import diffusers
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.models.unet2d import UNet2DConditionConfig, UNet2DConditionModel

from ._parity import ModelParity
from ._util import assert_close_to_float64, nchw_to_nhwc, nhwc_to_nchw

# -- full-size configs of real checkpoints (config.json values) -------------------------------------------------
SD15 = dict(attention_head_dim=8, block_out_channels=[320, 640, 1280, 1280], cross_attention_dim=768,
            down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"], layers_per_block=2,
            up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, sample_size=64, mid_block_scale_factor=1)
SD21 = dict(SD15, attention_head_dim=[5, 10, 20, 20], cross_attention_dim=1024, use_linear_projection=True,
            upcast_attention=True, sample_size=96, dual_cross_attention=False, num_class_embeds=None)
SDXL = dict(addition_embed_type="text_time", addition_time_embed_dim=256, attention_head_dim=[5, 10, 20],
            block_out_channels=[320, 640, 1280], cross_attention_dim=2048,
            down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
            up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            projection_class_embeddings_input_dim=2816, transformer_layers_per_block=[1, 2, 10],
            use_linear_projection=True, upcast_attention=None, num_attention_heads=None, sample_size=128)
SDXL_REFINER = dict(SDXL, attention_head_dim=[6, 12, 24, 24], block_out_channels=[384, 768, 1536, 1536],
                    cross_attention_dim=1280, projection_class_embeddings_input_dim=2560,
                    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
                    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                    transformer_layers_per_block=4)
LCM_SD15 = dict(SD15, time_cond_proj_dim=256)  # SimianLuo/LCM_Dreamshaper_v7

_SMALL = dict(block_out_channels=(32, 64), norm_num_groups=8, in_channels=4, out_channels=4, sample_size=16)


class UNetParity(ModelParity):
    model_class = UNet2DConditionModel
    reference_class = diffusers.UNet2DConditionModel
    size = (16, 16)

    def inputs(self, reference):
        rng = np.random.default_rng(1)
        c, b = reference.config, 2
        cross = c.cross_attention_dim if isinstance(c.cross_attention_dim, int) else c.cross_attention_dim[0]
        cross = c.encoder_hid_dim or cross  # projected to cross_attention_dim first
        return dict(sample=rng.standard_normal((b, *self.size, c.in_channels), np.float32),
                    timestep=np.array([3, 817], np.int32),
                    encoder_hidden_states=rng.standard_normal((b, 7, cross), np.float32))

    def reference_outputs(self, reference, inputs):
        kw = dict(sample=nhwc_to_nchw(inputs["sample"]), timestep=_torch(inputs["timestep"]),
                  encoder_hidden_states=_torch(inputs["encoder_hidden_states"]))
        if "encoder_attention_mask" in inputs:
            kw["encoder_attention_mask"] = _torch(inputs["encoder_attention_mask"])
        if "text_embeds" in inputs:
            kw["added_cond_kwargs"] = dict(text_embeds=_torch(inputs["text_embeds"]),
                                           time_ids=_torch(inputs["time_ids"]))
        if "class_labels" in inputs:
            kw["class_labels"] = _torch(inputs["class_labels"])
        if "timestep_cond" in inputs:
            kw["timestep_cond"] = _torch(inputs["timestep_cond"])
        if "down_block_additional_residuals" in inputs:
            kw["down_block_additional_residuals"] = tuple(map(nhwc_to_nchw, inputs["down_block_additional_residuals"]))
            kw["mid_block_additional_residual"] = nhwc_to_nchw(inputs["mid_block_additional_residual"])
        return {"sample": nchw_to_nhwc(reference(**kw).sample)}

    @staticmethod
    def outputs(model, inputs):
        extra = {k: v for k, v in inputs.items() if k not in ("sample", "timestep", "encoder_hidden_states")}
        return {"sample": model(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"], **extra)}

    def bf16_inputs(self, inputs):
        return {**super().bf16_inputs(inputs), "timestep": inputs["timestep"]}  # schedulers give float32 timesteps


def _torch(x):
    return x if isinstance(x, int) else torch.from_numpy(np.asarray(x))


class TestUNetSD1(UNetParity):
    """SD 1.x: int attention_head_dim (= heads), 1x1-conv projections, int cross_attention_dim."""

    config = dict(_SMALL, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                  up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=2, attention_head_dim=4,
                  cross_attention_dim=24)
    full_size = {"sd15": SD15}


class TestUNetSD2(UNetParity):
    """SD 2.x: per-block heads, linear projections, upcast_attention, the other sinusoid; an encoder_attention_mask;
    a table of class embeddings (the x4 upscaler's noise-level classes)."""

    config = dict(_SMALL, down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                  attention_head_dim=(2, 4), cross_attention_dim=40, use_linear_projection=True,
                  upcast_attention=True, flip_sin_to_cos=False, freq_shift=1, num_class_embeds=5)
    full_size = {"sd21": SD21}

    def inputs(self, reference):
        mask = np.array([[True] * 7, [True, True, False, True, False, False, True]])
        return {**super().inputs(reference), "encoder_attention_mask": mask, "class_labels": np.array([4, 1])}


class TestUNetSDXL(UNetParity):
    """SDXL: text_time embedding, no attention in the first block, deeper transformers per block; a scalar timestep
    broadcast over the batch; text states of another width projected first (encoder_hid_dim)."""

    config = dict(_SMALL, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1, attention_head_dim=(2, 4),
                  transformer_layers_per_block=(1, 2), cross_attention_dim=32, use_linear_projection=True,
                  addition_embed_type="text_time", addition_time_embed_dim=8,
                  projection_class_embeddings_input_dim=20 + 6 * 8, encoder_hid_dim=12)
    full_size = {"sdxl": SDXL, "sdxl-refiner": SDXL_REFINER}

    def inputs(self, reference):
        rng = np.random.default_rng(2)
        return {**super().inputs(reference), "timestep": 421,
                "text_embeds": rng.standard_normal((2, 20), np.float32),
                "time_ids": np.array([[16., 16, 0, 0, 16, 16], [24, 20, 2, 1, 16, 16]], np.float32)}


class TestUNetLists(UNetParity):
    """Per-block lists, only_cross_attention, LCM's time_cond_proj_dim, the other time-embedding knobs (Gaussian
    Fourier timestep features, which the "timestep" class embedding takes too; the time embedding as the ResNets'
    scale and shift; the class embedding concatenated), no mid block,
    padding-0 downsampling, 1x1 conv_in, an odd-sized sample, float timesteps and ControlNet residuals."""

    config = dict(block_out_channels=(16, 32), norm_num_groups=8, in_channels=5, out_channels=3,
                  down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=(1, 2),
                  cross_attention_dim=(24, 24), only_cross_attention=(True, False), attention_head_dim=2,
                  transformer_layers_per_block=(2, 1), time_cond_proj_dim=6, timestep_post_act="silu",
                  time_embedding_act_fn="silu", time_embedding_dim=48, center_input_sample=True,
                  mid_block_type=None, downsample_padding=0, conv_in_kernel=1, mid_block_scale_factor=1.5,
                  resnet_time_scale_shift="scale_shift", class_embed_type="timestep", class_embeddings_concat=True,
                  time_embedding_type="fourier")
    full_size = {"lcm-sd15": LCM_SD15}
    size = (15, 13)

    def inputs(self, reference):
        rng = np.random.default_rng(3)
        inputs = {**super().inputs(reference), "timestep": np.array([0.5, 999.0], np.float32),
                  "timestep_cond": rng.standard_normal((2, 6), np.float32),
                  "class_labels": np.array([250.0, 3.5], np.float32)}
        # ControlNet residuals shaped like the skips, found by running diffusers' down path with a hook
        shapes = []
        hooks = [blk.register_forward_hook(lambda m, i, o: shapes.extend(r.shape for r in o[1]))
                 for blk in reference.down_blocks]
        with torch.no_grad():
            self.reference_outputs(reference, inputs)
        for hook in hooks:
            hook.remove()
        b, _, h, w = (2, 0, *self.size)
        shapes = [(b, reference.config.block_out_channels[0], h, w)] + [tuple(s) for s in shapes]
        nhwc = [(s[0], s[2], s[3], s[1]) for s in shapes]
        inputs["down_block_additional_residuals"] = tuple(rng.standard_normal(s, np.float32) for s in nhwc)
        # No mid block in this config: the mid residual is added to the last down block's output.
        inputs["mid_block_additional_residual"] = rng.standard_normal(nhwc[-1], np.float32)
        return inputs


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    return TestUNetSD1.build(tmp_path_factory)


@pytest.fixture(scope="module")
def sd2(tmp_path_factory):
    return TestUNetSD2.build(tmp_path_factory)


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    return TestUNetSDXL.build(tmp_path_factory)


def test_per_sample_timesteps_and_mask_matter(sd2):
    """Guards against a parity test that passes because the inputs are ignored: each changes the output."""
    ours = sd2.actual["sample"]
    ours64 = TestUNetSD2.actual64(sd2)["sample"]  # sample 0's inputs are the same below: so is its float64 value
    t = sd2.inputs["timestep"]
    same_t = TestUNetSD2.run(sd2.model, {**sd2.inputs, "timestep": np.full_like(t, t[0])})["sample"]
    assert_close_to_float64(same_t[0], ours[0], ours64[0], what="sample 0, the same timestep")
    assert float(jnp.max(jnp.abs(same_t[1] - ours[1]))) > 1e-3
    no_mask = TestUNetSD2.run(sd2.model, {**sd2.inputs, "encoder_attention_mask": np.ones((2, 7), bool)})["sample"]
    # sample 0 attends to every token anyway
    assert_close_to_float64(no_mask[0], ours[0], ours64[0], what="sample 0, no mask")
    assert float(jnp.max(jnp.abs(no_mask[1] - ours[1]))) > 1e-3


def test_freeu_is_diffusers_enable_freeu(sd1):
    """FreeU's (s1, s2, b1, b2) as diffusers' UNet runs them after enable_freeu (at 10x14 latents: maps of 5x7 and
    10x14, odd and not powers of 2; the pipeline test runs 8x8 and 16x16), and they change its output."""
    ref, model = sd1.reference, sd1.model
    inputs = {**sd1.inputs, "sample": np.random.default_rng(3).standard_normal((2, 10, 14, 4), np.float32)}
    values = (0.6, 0.3, 1.3, 1.5)
    ref.enable_freeu(*values)
    try:
        expected = TestUNetSD1().reference_outputs(ref, inputs)["sample"]
    finally:
        ref.disable_freeu()
    ours = TestUNetSD1.run(model, {**inputs, "freeu": np.tile(np.float32(values), (2, 1))})["sample"]
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert np.abs(TestUNetSD1().reference_outputs(ref, inputs)["sample"] - expected).max() > 1e-2


# -- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [
    ("resnet_time_scale_shift", "spatial"), ("class_embed_type", "projection"), ("addition_embed_type", "text"),
    ("mid_block_type", "UNetMidBlock2DSimpleCrossAttn"), ("encoder_hid_dim_type", "image_proj"),
    ("time_embedding_type", "learned"), ("down_block_types", ["AttnDownBlock2D", "DownBlock2D"]),
    ("norm_num_groups", 12), ("layers_per_block", [1, 2, 3]), ("act_fn", "tanh"),
])
def test_unsupported_config_values_raise(key, value):
    raw = {**TestUNetSD1.config, key: value}
    with pytest.raises(ConfigError, match=rf"\b{key}="):
        UNet2DConditionConfig.from_dict(raw)


def test_dual_cross_attention_is_refused_as_diffusers_cannot_run_it():
    """diffusers builds DualTransformer2DModel blocks but its forward fails; without attention blocks it is a no-op."""
    with pytest.raises(ConfigError, match=r"dual_cross_attention=True .*cannot run them"):
        UNet2DConditionConfig.from_dict({**TestUNetSD1.config, "dual_cross_attention": True})
    plain = dict(TestUNetSD1.config, down_block_types=["DownBlock2D"] * 2, up_block_types=["UpBlock2D"] * 2,
                 mid_block_type="UNetMidBlock2D")
    assert UNet2DConditionConfig.from_dict({**plain, "dual_cross_attention": True}).dual_cross_attention


def test_unsupported_config_raises_on_load(sd1, tmp_path):
    raw = json.loads((sd1.folder / "config.json").read_text())
    shutil.copy(sd1.folder / "diffusion_pytorch_model.safetensors", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "resnet_time_scale_shift": "spatial"}))
    with pytest.raises(ConfigError, match="resnet_time_scale_shift='spatial'"):
        eqxdiff.load(tmp_path)


def test_text_time_config_needs_its_sizes():
    raw = {k: v for k, v in TestUNetSDXL.config.items() if k != "addition_time_embed_dim"}
    with pytest.raises(ConfigError, match="addition_time_embed_dim=None"):
        UNet2DConditionConfig.from_dict(raw)


def test_bad_inputs_are_rejected_readably(sd1):
    unet = sd1.model
    ctx = jnp.zeros((1, 7, 24))
    with pytest.raises(ValueError, match=r"channels-last.*shape \(1, 4, 16, 16\).*moveaxis"):
        unet(jnp.zeros((1, 4, 16, 16)), 1, ctx)
    with pytest.raises(ValueError, match=r"encoder_hidden_states must be \[batch, seq, 24\]"):
        unet(jnp.zeros((1, 16, 16, 4)), 1, jnp.zeros((1, 7, 32)))
    with pytest.raises(ValueError, match="only used with addition_embed_type='text_time'"):
        unet(jnp.zeros((1, 16, 16, 4)), 1, ctx, text_embeds=jnp.zeros((1, 3)), time_ids=jnp.zeros((1, 6)))
    with pytest.raises(ValueError, match="pass down_block_additional_residuals and mid_block_additional_residual "
                                         "together"):
        unet(jnp.zeros((1, 16, 16, 4)), 1, ctx, mid_block_additional_residual=jnp.zeros((1, 8, 8, 64)))


def test_sdxl_inputs_are_required_and_sized(sdxl):
    unet = sdxl.model
    x, ctx = jnp.zeros((1, 16, 16, 4)), jnp.zeros((1, 7, 12))
    with pytest.raises(ValueError, match=r"encoder_hidden_states must be \[batch, seq, 12\]"):
        unet(x, 1, jnp.zeros((1, 7, 32)), text_embeds=jnp.zeros((1, 20)), time_ids=jnp.zeros((1, 6)))
    with pytest.raises(ValueError, match="needs text_embeds"):
        unet(x, 1, ctx, time_ids=jnp.zeros((1, 6)))
    with pytest.raises(ValueError, match=r"20 \+ 5 \* 8 = 60 features"):
        unet(x, 1, ctx, text_embeds=jnp.zeros((1, 20)), time_ids=jnp.zeros((1, 5)))


def test_class_labels_are_checked(sd1, sd2):
    x = jnp.zeros((1, 16, 16, 4))
    with pytest.raises(ValueError, match="class_labels given, but this model has no class embedding"):
        sd1.model(x, 1, jnp.zeros((1, 7, 24)), class_labels=jnp.array([1]))
    with pytest.raises(ValueError, match="num_class_embeds=5 needs class_labels"):
        sd2.model(x, 1, jnp.zeros((1, 7, 40)))
