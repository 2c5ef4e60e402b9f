"""UNet2DConditionModel: parity with diffusers (1e-4, float32) at tiny SD1/SD2/SDXL-style configs, the full-size
SD/SDXL layouts against diffusers on the meta device, config errors, input errors and checkpoint round trips.

Each tiny config is built and compiled once (``_case``); tests share it.
"""

import functools
import json
import tempfile
from pathlib import Path

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.core import ConfigError, leaf_specs
from eqxdiff.loading import CheckpointError, SafetensorsFile, state_dict, write_safetensors
from eqxdiff.models.unet2d import UNet2DConditionConfig, UNet2DConditionModel

from ._util import assert_close, nchw_to_nhwc, randomize_torch, to_jax

_SMALL = dict(block_out_channels=(32, 64), norm_num_groups=8, in_channels=4, out_channels=4, sample_size=16)

CONFIGS = {
    # SD 1.x: int attention_head_dim (= heads), 1x1-conv projections, int cross_attention_dim.
    "sd1": dict(_SMALL, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=2, attention_head_dim=4,
                cross_attention_dim=24),
    # SD 2.x: per-block heads, linear projections, upcast_attention; run with an encoder_attention_mask.
    "sd2": dict(_SMALL, down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                attention_head_dim=(2, 4), cross_attention_dim=40, use_linear_projection=True,
                upcast_attention=True, flip_sin_to_cos=False, freq_shift=1),
    # SDXL: text_time embedding, no attention in the first block, deeper transformers per block.
    "sdxl": dict(_SMALL, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                 up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), layers_per_block=1, attention_head_dim=(2, 4),
                 transformer_layers_per_block=(1, 2), cross_attention_dim=32, use_linear_projection=True,
                 addition_embed_type="text_time", addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=20 + 6 * 8),
    # Per-block lists, only_cross_attention, LCM's time_cond_proj_dim, the other time-embedding knobs, no mid
    # block, padding-0 downsampling, 1x1 conv_in, an odd-sized sample and ControlNet residuals.
    "lists": dict(block_out_channels=(16, 32), norm_num_groups=8, in_channels=5, out_channels=3,
                  down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
                  up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=(1, 2),
                  cross_attention_dim=(24, 24), only_cross_attention=(True, False), attention_head_dim=2,
                  transformer_layers_per_block=(2, 1), time_cond_proj_dim=6, timestep_post_act="silu",
                  time_embedding_act_fn="silu", time_embedding_dim=48, center_input_sample=True,
                  mid_block_type=None, downsample_padding=0, conv_in_kernel=1, mid_block_scale_factor=1.5),
}


def _inputs(name: str, config: dict) -> dict:
    """torch inputs (diffusers' layout and names) for a config."""
    g = torch.Generator().manual_seed(1)
    b, (h, w) = 2, ((15, 13) if name == "lists" else (16, 16))
    cross = config["cross_attention_dim"]
    cross = cross[0] if isinstance(cross, tuple) else cross
    out = dict(sample=torch.randn(b, config["in_channels"], h, w, generator=g),
               timestep=torch.tensor([3, 817]), encoder_hidden_states=torch.randn(b, 7, cross, generator=g))
    if name == "sd2":
        out["encoder_attention_mask"] = torch.tensor([[True] * 7, [True, True, False, True, False, False, True]])
    if name == "sdxl":
        out["timestep"] = 421  # a Python scalar, broadcast over the batch
        out["added_cond_kwargs"] = dict(text_embeds=torch.randn(b, 20, generator=g),
                                        time_ids=torch.tensor([[16., 16, 0, 0, 16, 16], [24, 20, 2, 1, 16, 16]]))
    if name == "lists":
        out["timestep"] = torch.tensor([0.5, 999.0])
        out["timestep_cond"] = torch.randn(b, 6, generator=g)
    return out


def _to_eqx(kw: dict) -> tuple[tuple, dict]:
    """The same inputs for eqxdiff: channels-last, ControlNet residuals for 'lists' (shapes from diffusers)."""
    args = (nchw_to_nhwc(kw["sample"]),
            kw["timestep"] if isinstance(kw["timestep"], int) else to_jax(kw["timestep"]),
            to_jax(kw["encoder_hidden_states"]))
    extra = {}
    if "encoder_attention_mask" in kw:
        extra["encoder_attention_mask"] = to_jax(kw["encoder_attention_mask"])
    if "added_cond_kwargs" in kw:
        extra.update({k: to_jax(v) for k, v in kw["added_cond_kwargs"].items()})
    if "timestep_cond" in kw:
        extra["timestep_cond"] = to_jax(kw["timestep_cond"])
    if "down_block_additional_residuals" in kw:
        extra["down_block_additional_residuals"] = tuple(nchw_to_nhwc(r) for r in kw["down_block_additional_residuals"])
        extra["mid_block_additional_residual"] = nchw_to_nhwc(kw["mid_block_additional_residual"])
    return args, extra


def _controlnet_residuals(ref, kw):
    """Random residuals shaped like the skips, found by running diffusers' down path with a hook."""
    shapes = []
    hooks = [blk.register_forward_hook(lambda m, i, o: shapes.extend(r.shape for r in o[1])) for blk in ref.down_blocks]
    with torch.no_grad():
        ref(**kw)
    for hk in hooks:
        hk.remove()
    g = torch.Generator().manual_seed(2)
    b, _, h, w = kw["sample"].shape
    shapes = [(b, ref.config.block_out_channels[0], h, w)] + shapes
    down = tuple(torch.randn(s, generator=g) for s in shapes)
    # No mid block in this config: the mid residual is added to the last down block's output.
    return down, torch.randn(shapes[-1], generator=g)


@eqx.filter_jit
def _forward(unet, args, kwargs):
    return unet(*args, **kwargs)


@functools.cache
def _case(name: str):
    """Build diffusers' model, save it, load it with eqxdiff, run both: (ref, unet, folder, kwargs, expected, ours)."""
    config = CONFIGS[name]
    torch.manual_seed(0)
    ref = diffusers.UNet2DConditionModel(**config).eval()
    randomize_torch(ref, seed=sum(map(ord, name)))
    folder = tempfile.mkdtemp(prefix=f"unet-{name}-")
    ref.save_pretrained(folder)  # safetensors
    unet = eqxdiff.load(folder)
    kw = _inputs(name, config)
    if name == "lists":
        kw["down_block_additional_residuals"], kw["mid_block_additional_residual"] = _controlnet_residuals(ref, kw)
    with torch.no_grad():
        expected = nchw_to_nhwc(ref(**kw).sample)
    args, extra = _to_eqx(kw)
    return ref, unet, folder, kw, expected, _forward(unet, args, extra)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_diffusers(name):
    ref, unet, _, _, expected, ours = _case(name)
    assert ours.shape == expected.shape
    assert_close(ours, expected, 1e-4, what=f"{name} UNet output")
    assert set(state_dict(unet)) == set(ref.state_dict())


def test_per_sample_timesteps_and_mask_matter():
    """Guards against a test that passes because the inputs are ignored: each changes the output."""
    _, unet, _, kw, _, ours = _case("sd2")
    args, extra = _to_eqx(kw)
    same_t = _forward(unet, (args[0], jnp.full((2,), args[1][0]), args[2]), extra)
    assert_close(same_t[0], ours[0], 1e-6)
    assert float(jnp.max(jnp.abs(same_t[1] - ours[1]))) > 1e-3
    no_mask = _forward(unet, args, {**extra, "encoder_attention_mask": jnp.ones((2, 7), bool)})
    assert_close(no_mask[0], ours[0], 1e-6)  # sample 0 attends to every token anyway
    assert float(jnp.max(jnp.abs(no_mask[1] - ours[1]))) > 1e-3


def _random_unet(config: UNet2DConditionConfig, seed: int) -> UNet2DConditionModel:
    """An eqxdiff UNet with random weights as `_randomize` draws them, filled from NumPy (no eager JAX init)."""
    abstract = eqx.filter_eval_shape(lambda: UNet2DConditionModel(config, key=jax.random.key(0)))
    leaves, specs, tree = leaf_specs(abstract)
    rng = np.random.default_rng(seed)
    out = []
    for x, spec in zip(leaves, specs):
        if x.ndim == 1:
            value = (1.0 if spec.name.endswith("weight") else 0.0) + 0.3 * rng.standard_normal(x.shape)
        else:  # Linear [out, in]; Conv2d HWIO
            value = rng.standard_normal(x.shape) / np.sqrt(np.prod(x.shape[:-1]) if spec.perm else x.shape[1])
        out.append(jnp.asarray(value, x.dtype))
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.mark.parametrize("name", ["sdxl", "lists"])
def test_save_pretrained_round_trips_through_diffusers(name, tmp_path):
    _, loaded, _, kw, _, _ = _case(name)
    unet = _random_unet(loaded.config, seed=3)
    eqxdiff.save_pretrained(unet, tmp_path)
    ref = diffusers.UNet2DConditionModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        expected = nchw_to_nhwc(ref(**kw).sample)
    args, extra = _to_eqx(kw)
    assert_close(_forward(unet, args, extra), expected, 1e-4, what=f"{name} round trip")
    again = eqxdiff.load(tmp_path)
    assert again.config == unet.config
    for a, b in zip(jax.tree.leaves(unet), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_extra_or_missing_tensor_is_a_checkpoint_error(tmp_path):
    _, _, folder, _, _, _ = _case("sd1")
    f = SafetensorsFile(f"{folder}/diffusion_pytorch_model.safetensors")
    tensors = {n: np.array(f.get(n)) for n in f.names()}
    tensors["down_blocks.0.attentions.0.extra.weight"] = np.zeros(3, np.float32)
    del tensors["up_blocks.1.attentions.2.transformer_blocks.0.ff.net.2.bias"]
    write_safetensors(tensors, tmp_path / "diffusion_pytorch_model.safetensors")
    (tmp_path / "config.json").write_text((Path(folder) / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"down_blocks\.0\.attentions\.0\.extra\.weight") as info:
        eqxdiff.load(tmp_path)
    assert "up_blocks.1.attentions.2.transformer_blocks.0.ff.net.2.bias" in str(info.value)


# -- full-size layouts: every name and shape equals diffusers' (built on the meta device, nothing allocated) --

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


@pytest.mark.parametrize("raw", [SD15, SD21, SDXL, SDXL_REFINER], ids=["sd15", "sd21", "sdxl", "sdxl-refiner"])
def test_full_size_layouts_match_diffusers(raw):
    with torch.device("meta"):
        ref = diffusers.UNet2DConditionModel(**raw)
    config = UNet2DConditionConfig.from_dict(json.loads(json.dumps(dict(ref.config))))
    abstract = eqx.filter_eval_shape(lambda: UNet2DConditionModel(config, key=jax.random.key(0)))
    leaves, specs, _ = leaf_specs(abstract)
    ours = {s.name: tuple(x.shape[list(s.perm).index(i)] for i in range(x.ndim)) if s.perm else x.shape
            for x, s in zip(leaves, specs)}
    assert ours == {n: tuple(p.shape) for n, p in ref.state_dict().items()}


# -- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,value", [
    ("resnet_time_scale_shift", "scale_shift"), ("class_embed_type", "timestep"), ("addition_embed_type", "text"),
    ("mid_block_type", "UNetMidBlock2DSimpleCrossAttn"), ("encoder_hid_dim", 768), ("dual_cross_attention", True),
    ("time_embedding_type", "fourier"), ("down_block_types", ["AttnDownBlock2D", "DownBlock2D"]),
    ("norm_num_groups", 12), ("layers_per_block", [1, 2, 3]), ("act_fn", "tanh"),
])
def test_unsupported_config_values_raise(key, value):
    raw = {**CONFIGS["sd1"], key: value}
    with pytest.raises(ConfigError, match=rf"\b{key}="):
        UNet2DConditionConfig.from_dict(raw)


def test_unsupported_config_raises_on_load(tmp_path):
    _, _, folder, _, _, _ = _case("sd1")
    raw = json.loads((Path(folder) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "resnet_time_scale_shift": "scale_shift"}))
    with pytest.raises(ConfigError, match="resnet_time_scale_shift='scale_shift'"):
        eqxdiff.load(tmp_path)


def test_text_time_config_needs_its_sizes():
    raw = {k: v for k, v in CONFIGS["sdxl"].items() if k != "addition_time_embed_dim"}
    with pytest.raises(ConfigError, match="addition_time_embed_dim=None"):
        UNet2DConditionConfig.from_dict(raw)


def test_bad_inputs_are_rejected_readably():
    _, unet, _, _, _, _ = _case("sd1")
    ctx = jnp.zeros((1, 7, 24))
    with pytest.raises(ValueError, match=r"channels-last.*shape \(1, 4, 16, 16\).*moveaxis"):
        unet(jnp.zeros((1, 4, 16, 16)), 1, ctx)
    with pytest.raises(ValueError, match=r"encoder_hidden_states must be \[batch, seq, 24\]"):
        unet(jnp.zeros((1, 16, 16, 4)), 1, jnp.zeros((1, 7, 32)))
    with pytest.raises(ValueError, match="only used with addition_embed_type='text_time'"):
        unet(jnp.zeros((1, 16, 16, 4)), 1, ctx, text_embeds=jnp.zeros((1, 3)), time_ids=jnp.zeros((1, 6)))
    with pytest.raises(ValueError, match="together"):
        unet(jnp.zeros((1, 16, 16, 4)), 1, ctx, mid_block_additional_residual=jnp.zeros((1, 8, 8, 64)))


def test_sdxl_inputs_are_required_and_sized():
    _, unet, _, _, _, _ = _case("sdxl")
    x, ctx = jnp.zeros((1, 16, 16, 4)), jnp.zeros((1, 7, 32))
    with pytest.raises(ValueError, match="needs text_embeds"):
        unet(x, 1, ctx, time_ids=jnp.zeros((1, 6)))
    with pytest.raises(ValueError, match=r"20 \+ 5 \* 8 = 60 features"):
        unet(x, 1, ctx, text_embeds=jnp.zeros((1, 20)), time_ids=jnp.zeros((1, 5)))
