"""AutoencoderKL: the parity base (:mod:`tests._parity`: encode, decode and forward) at two small configs, each against
a full-size layout (SD / SDXL, Flux); then what the base does not check: diffusers' tiling, batch slicing, posterior
sampling, latent scaling, config and input errors."""

import dataclasses

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eqxdiff.core import ConfigError
from eqxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig, _batch_sliced

from ._parity import ModelParity, run_jitted
from ._util import assert_close, assert_close_to_float64, nchw_to_nhwc, nhwc_to_nchw, run_float64

# -- full-size configs of real checkpoints (config.json values) -------------------------------------------------
SD = dict(block_out_channels=[128, 256, 512, 512], down_block_types=["DownEncoderBlock2D"] * 4,
          up_block_types=["UpDecoderBlock2D"] * 4, layers_per_block=2, latent_channels=4, norm_num_groups=32,
          sample_size=512, scaling_factor=0.18215)  # runwayml/stable-diffusion-v1-5 vae, stabilityai/sd-vae-ft-mse
SDXL = dict(SD, sample_size=1024, scaling_factor=0.13025, force_upcast=True)
FLUX = dict(SD, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, sample_size=1024,
            scaling_factor=0.3611, shift_factor=0.1159)  # black-forest-labs/FLUX.1-dev vae

SIZE = 32  # image side of every parity input


class VAEParity(ModelParity):
    model_class = AutoencoderKL
    reference_class = diffusers.AutoencoderKL

    def inputs(self, reference):
        rng = np.random.default_rng(0)
        c = reference.config
        latent = SIZE // 2 ** (len(c.block_out_channels) - 1)
        return dict(x=rng.standard_normal((2, SIZE, SIZE, c.in_channels), np.float32),
                    z=rng.standard_normal((2, latent, latent, c.latent_channels), np.float32))

    def reference_outputs(self, reference, inputs):
        x, z = nhwc_to_nchw(inputs["x"]), nhwc_to_nchw(inputs["z"])
        post = reference.encode(x).latent_dist
        return dict(mean=nchw_to_nhwc(post.mean), logvar=nchw_to_nhwc(post.logvar), kl=post.kl().numpy(),
                    decode=nchw_to_nhwc(reference.decode(z).sample),
                    forward=nchw_to_nhwc(reference(x, sample_posterior=False).sample))

    @staticmethod
    def outputs(model, inputs):
        post = model.encode(inputs["x"])
        return dict(mean=post.mean, logvar=post.logvar, kl=post.kl(), decode=model.decode(inputs["z"]),
                    forward=model(inputs["x"]))


class TestVAETwoLevelAttention(VAEParity):
    """Two levels (x2), one resnet per block, quant convs and mid-block attention on."""

    config = dict(block_out_channels=(16, 32), layers_per_block=1, latent_channels=4, norm_num_groups=8,
                  down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                  sample_size=32)
    full_size = {"sd": SD, "sdxl": SDXL}


class TestVAEThreeLevelPlain(VAEParity):
    """Three levels (x4), two resnets per block, no quant convs, no attention, other widths/groups/activation."""

    config = dict(block_out_channels=(8, 16, 16), layers_per_block=2, latent_channels=3, norm_num_groups=4,
                  in_channels=3, out_channels=2, act_fn="mish", down_block_types=("DownEncoderBlock2D",) * 3,
                  up_block_types=("UpDecoderBlock2D",) * 3, use_quant_conv=False, use_post_quant_conv=False,
                  mid_block_add_attention=False, sample_size=32)
    full_size = {"flux": FLUX}


CASES = {"two_level_attn": TestVAETwoLevelAttention, "three_level_plain": TestVAEThreeLevelPlain}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """Every config's built models (shared with its parity class)."""
    return CASES[request.param].build(tmp_path_factory)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One config, for behaviour that does not depend on it (slicing, sampling, fallbacks)."""
    return TestVAETwoLevelAttention.build(tmp_path_factory)


def _with_diffusers_tiling(ref, tile_sample: int, fn):
    ref.enable_tiling()
    saved = ref.tile_sample_min_size, ref.tile_latent_min_size
    ref.tile_sample_min_size = tile_sample
    ref.tile_latent_min_size = tile_sample // (2 ** (len(ref.config.block_out_channels) - 1))
    try:
        with torch.no_grad():
            return fn()
    finally:
        ref.tile_sample_min_size, ref.tile_latent_min_size = saved
        ref.disable_tiling()


def _decode_tiled(vae, z):
    return vae.decode_tiled(z, tile_sample_min_size=TILE)


def _encode_tiled(vae, x):
    return vae.encode_tiled(x, tile_sample_min_size=TILE)


def _sliced(vae, inputs):
    return vae.encode(inputs["x"], batch_slice_size=1).mean, vae.decode(inputs["z"], batch_slice_size=1)


def _sampled(vae, inputs):
    x, key = inputs
    return vae(x, key=key, sample_posterior=True)


# Image sizes (height, width) for the tiling tests, with 16-pixel tiles (stride 12). Every distinct tile shape is
# one more compile, so only the first config's decode gets a full 2x2 grid (second row and column narrower: both
# blends on one tile, every crop); the other cases are a single row or column of tiles, covering each blend axis
# for encode and decode.
TILE = 16
TILED_SIZES = {"two_level_attn": dict(decode=(24, 24), encode=(12, 24)),
               "three_level_plain": dict(decode=(12, 24), encode=(24, 12))}


def test_tiled_decode_and_encode_match_diffusers_tiling(case, request):
    ref, ours = case.reference, case.model
    sizes = TILED_SIZES[request.node.callspec.params["case"]]
    tile, factor = TILE, ours.config.downsample_factor
    (h, w) = sizes["decode"]
    z = torch.randn(1, ours.config.latent_channels, h // factor, w // factor,
                    generator=torch.Generator().manual_seed(2))
    expected = _with_diffusers_tiling(ref, tile, lambda: ref.decode(z).sample)
    with torch.no_grad():  # tiling must change diffusers' result here, or this test proves nothing
        assert torch.max(torch.abs(expected - ref.decode(z).sample)) > 1e-3
    got = run_jitted(_decode_tiled, ours, nchw_to_nhwc(z))
    assert got.shape == (1, h, w, ours.config.out_channels)
    assert_close(got, nchw_to_nhwc(expected), what="tiled decode")

    (h, w) = sizes["encode"]
    x = torch.randn(1, ours.config.in_channels, h, w, generator=torch.Generator().manual_seed(3))
    post = _with_diffusers_tiling(ref, tile, lambda: ref.encode(x).latent_dist)
    with torch.no_grad():
        assert torch.max(torch.abs(post.mean - ref.encode(x).latent_dist.mean)) > 1e-3
    ours_post = run_jitted(_encode_tiled, ours, nchw_to_nhwc(x))
    assert ours_post.mean.shape == (1, h // factor, w // factor, ours.config.latent_channels)
    assert_close(ours_post.mean, nchw_to_nhwc(post.mean), what="tiled encode mean")
    assert_close(ours_post.logvar, nchw_to_nhwc(post.logvar), what="tiled encode logvar")


def test_tiling_falls_back_to_plain_when_one_tile_holds_the_input(built):
    # diffusers tiles only inputs larger than a tile; the default tile is sample_size (32) pixels
    vae, z, x = built.model, built.inputs["z"][:1], built.inputs["x"][:1]
    trace = lambda f, a: str(jax.make_jaxpr(f)(a))  # noqa: E731 - tracing is enough to compare programs
    assert trace(vae.decode_tiled, z) == trace(vae.decode, z)
    assert trace(vae.encode_tiled, x) == trace(vae.encode, x)
    bigger = jnp.zeros((1, z.shape[1] + 1, *z.shape[2:]))  # one latent row more than a tile: tiled for real
    assert trace(vae.decode_tiled, bigger) != trace(vae.decode, bigger)


def test_sliced_decode_and_encode_equal_plain(built):
    """Sample by sample, as accurate as the whole batch at once (both measured against its float64 run)."""
    mean, decoded = run_jitted(_sliced, built.model, built.inputs)
    actual64 = TestVAETwoLevelAttention.actual64(built)
    assert_close_to_float64(decoded, built.actual["decode"], actual64["decode"], what="decode sliced")
    assert_close_to_float64(mean, built.actual["mean"], actual64["mean"], what="encode sliced")


def test_batch_slicing_handles_remainders():
    fn = lambda x: jnp.tanh(x) * jnp.sum(x, axis=(1, 2), keepdims=True)  # noqa: E731 - per-sample, shape-keeping
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3, 2)), jnp.float32)
    x64 = np.asarray(x, np.float64)
    exact = np.tanh(x64) * np.sum(x64, axis=(1, 2), keepdims=True)
    for size in (1, 2, 5, 7):  # 2 leaves a remainder of 1; 5 and 7 take the whole batch at once
        assert_close_to_float64(_batch_sliced(fn, x, size), fn(x), exact, what=f"{size=}", elementwise=True)


def test_sample_posterior_uses_the_key(built):
    vae, x = built.model, jnp.asarray(built.inputs["x"])
    key = jax.random.key(3, impl="rbg")  # compiles far faster on CPU than the default threefry
    mean, std = built.actual["mean"], jnp.exp(0.5 * built.actual["logvar"])
    sampled = mean + std * jax.random.normal(key, mean.shape)
    expected = TestVAETwoLevelAttention.run(vae, {**built.inputs, "z": sampled})["decode"]  # the parity compile
    got = run_jitted(_sampled, vae, (x, key))
    # the sampling program in float64 with the same draws: the float64 posterior's mean + std * the same noise
    actual64 = TestVAETwoLevelAttention.actual64(built)
    sampled64 = actual64["mean"] + np.exp(0.5 * actual64["logvar"]) * np.asarray(sampled - mean, np.float64) / std
    expected64 = run_float64(TestVAETwoLevelAttention.outputs, vae, {**built.inputs, "z": sampled64})["decode"]
    assert_close_to_float64(got, expected, expected64, what="sampled decode")
    assert np.max(np.abs(np.asarray(expected - built.actual["forward"]))) > 1e-3  # the sample is not the mode
    with pytest.raises(ValueError, match="needs a PRNG key"):
        vae(x, sample_posterior=True)


def _abstract(config: AutoencoderKLConfig) -> AutoencoderKL:
    """A model with shape-only weights: enough for what reads only the config or checks inputs before any layer,
    and it skips compiling a random initialisation."""
    return eqx.filter_eval_shape(AutoencoderKL, config, key=jax.random.key(0))


def _tiny_config(**changes) -> AutoencoderKLConfig:
    return AutoencoderKLConfig.from_dict({"block_out_channels": (8,), "norm_num_groups": 4, **changes})


def test_scale_and_unscale_latents_with_shift_factor():
    vae = _abstract(_tiny_config(scaling_factor=0.3611, shift_factor=0.1159))
    z = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 6, 4)), jnp.float32)
    _check_latents(vae.scale_latents(z), lambda z: (z - 0.1159) * 0.3611, z)
    _check_latents(vae.unscale_latents(vae.scale_latents(z)), lambda z: (z - 0.1159) * 0.3611 / 0.3611 + 0.1159, z)
    _check_latents(vae.unscale_latents(z), lambda z: z / 0.3611 + 0.1159, z)
    no_shift = _abstract(_tiny_config(scaling_factor=0.5))
    _check_latents(no_shift.scale_latents(z), lambda z: z * 0.5, z)


def _check_latents(ours, formula, z):
    """``ours`` as accurate as the formula in NumPy float32 (each operation rounded once), value by value, against
    the formula in float64. (XLA may fuse a multiply and add into an FMA where the CPU has one: an ulp apart.)"""
    z = np.asarray(z)
    assert_close_to_float64(ours, formula(z).astype(np.float32), formula(z.astype(np.float64)), what="latents",
                            elementwise=True)


def test_scale_latents_with_latents_mean_and_std_follows_sdxl_pipelines():
    mean, std = (0.1, -0.2, 0.3, 0.0), (0.5, 1.5, 2.0, 1.0)
    vae = _abstract(_tiny_config(scaling_factor=0.5, latents_mean=mean, latents_std=std))
    z = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 6, 4)), jnp.float32)
    m, s = np.asarray(mean, np.float32), np.asarray(std, np.float32)  # the config's values, as float32 arrays
    _check_latents(vae.scale_latents(z), lambda z: (z - m.astype(z.dtype)) * 0.5 / s.astype(z.dtype), z)
    _check_latents(vae.unscale_latents(z), lambda z: z * s.astype(z.dtype) / 0.5 + m.astype(z.dtype), z)


@pytest.mark.parametrize("key,value,match", [
    ("down_block_types", ["AttnDownEncoderBlock2D"], r"down_block_types=\('AttnDownEncoderBlock2D',\)"),
    ("up_block_types", ["UpDecoderBlock2D", "UpDecoderBlock2D"], "one entry per block_out_channels"),
    ("act_fn", "tanh", "act_fn='tanh'"),
    ("norm_num_groups", 3, "norm_num_groups=3"),
    ("latents_mean", [0.0, 1.0], r"latents_mean=\(0\.0, 1\.0\)"),
])
def test_unsupported_config_values_raise(key, value, match):
    with pytest.raises(ConfigError, match=match):
        _tiny_config(**{key: value})


def test_config_round_trips_through_dict():
    config = _tiny_config(shift_factor=0.1, latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4, sample_size=[64, 64])
    assert AutoencoderKLConfig.from_dict(config.to_dict()) == config
    assert config.tile_sample_min_size == 64 and config.downsample_factor == 1
    deeper = dataclasses.replace(config, block_out_channels=(8, 8, 8), down_block_types=("DownEncoderBlock2D",) * 3,
                                 up_block_types=("UpDecoderBlock2D",) * 3)
    assert deeper.downsample_factor == 4


def test_wrong_inputs_raise_clear_errors():
    vae = _abstract(_tiny_config())
    with pytest.raises(ValueError, match=r"channels last.*moveaxis"):
        vae.encode(jnp.zeros((1, 3, 16, 16)))  # NCHW
    with pytest.raises(ValueError, match=r"decode expects latents of shape \[batch, height, width, 4\]"):
        vae.decode(jnp.zeros((1, 8, 8, 3)))
    with pytest.raises(TypeError):  # jaxtyping: not [batch, height, width, channels]
        vae.encode(jnp.zeros((16, 16, 3)))
    with pytest.raises(ValueError, match="batch_slice_size must be a positive int or None, got 0"):
        vae.decode(jnp.zeros((4, 2, 2, 4)), batch_slice_size=0)
    with pytest.raises(ValueError, match="tile_sample_min_size must be an int of at least downsample_factor=1, got 0"):
        vae.decode_tiled(jnp.zeros((1, 2, 2, 4)), tile_sample_min_size=0)
