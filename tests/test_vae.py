"""AutoencoderKL parity with diffusers (1e-4, float32) at small random configs, its memory savers and errors."""

import dataclasses

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.models.vae import AutoencoderKL, AutoencoderKLConfig, _batch_sliced

from ._util import assert_close, nchw_to_nhwc

CONFIGS = {
    # two levels (x2), one resnet per block, quant convs and mid-block attention on
    "two_level_attn": dict(block_out_channels=(16, 32), layers_per_block=1, latent_channels=4, norm_num_groups=8,
                           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                           sample_size=32),
    # three levels (x4), two resnets per block, no quant convs, no attention, other widths/groups/activation
    "three_level_plain": dict(block_out_channels=(8, 16, 16), layers_per_block=2, latent_channels=3,
                              norm_num_groups=4, in_channels=3, out_channels=2, act_fn="mish",
                              down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                              use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
                              sample_size=32),
}

# One jitted function each, shared by every test: a model and shape compiled once serve them all.
encode = eqx.filter_jit(lambda m, x, n=None: m.encode(x, batch_slice_size=n))
decode = eqx.filter_jit(lambda m, z, n=None: m.decode(z, batch_slice_size=n))
forward = eqx.filter_jit(lambda m, x, key=None, sample=False: m(x, key=key, sample_posterior=sample))


def _perturbed_diffusers_vae(config: dict, seed: int):
    """A diffusers VAE whose every parameter is random: norms get non-unit scales and non-zero shifts."""
    torch.manual_seed(seed)
    ref = diffusers.AutoencoderKL(**config).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.2 * torch.randn_like(p) if p.ndim == 1 else 0.1 * p * torch.randn_like(p))
    return ref


_BUILT: dict = {}


def _build(name: str, tmp_path_factory):
    """(diffusers model, eqxdiff model loaded from its save_pretrained folder), built once per config."""
    if name not in _BUILT:
        ref = _perturbed_diffusers_vae(CONFIGS[name], seed=len(name))
        folder = tmp_path_factory.mktemp(name)
        ref.save_pretrained(folder)
        ours = eqxdiff.load(folder)
        assert isinstance(ours, AutoencoderKL)
        _BUILT[name] = ref, ours
    return _BUILT[name]


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """Every config: for parity with diffusers."""
    return _build(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def vae(tmp_path_factory):
    """One loaded model, for behaviour that does not depend on the config (slicing, sampling, fallbacks)."""
    return _build("two_level_attn", tmp_path_factory)[1]


def _image(vae: AutoencoderKL, batch=2, size=32, seed=0):
    """A torch NCHW image batch (the parity tests' shapes, so jitted functions are compiled once)."""
    return torch.randn(batch, vae.config.in_channels, size, size, generator=torch.Generator().manual_seed(seed))


def _latents(vae: AutoencoderKL, batch=2, seed=1):
    """Torch NCHW latents of a 32x32 image."""
    size = 32 // vae.config.downsample_factor
    return torch.randn(batch, vae.config.latent_channels, size, size, generator=torch.Generator().manual_seed(seed))


def test_encode_decode_forward_match_diffusers(pair):
    ref, ours = pair
    x, z = _image(ours), _latents(ours)
    with torch.no_grad():
        post = ref.encode(x).latent_dist
        dec = ref.decode(z).sample
        out = ref(x, sample_posterior=False).sample
    ours_post = encode(ours, nchw_to_nhwc(x))
    assert_close(ours_post.mean, nchw_to_nhwc(post.mean), what="posterior mean")
    assert_close(ours_post.logvar, nchw_to_nhwc(post.logvar), what="posterior logvar")
    assert_close(ours_post.kl(), post.kl().numpy(), what="kl")
    assert_close(decode(ours, nchw_to_nhwc(z)), nchw_to_nhwc(dec), what="decode")
    assert_close(forward(ours, nchw_to_nhwc(x)), nchw_to_nhwc(out), what="forward")


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


# Image sizes (height, width) for the tiling tests, with 16-pixel tiles (stride 12). Every distinct tile shape is
# one more compile, so only the first config's decode gets a full 2x2 grid (second row and column narrower: both
# blends on one tile, every crop); the other cases are a single row or column of tiles, covering each blend axis
# for encode and decode.
TILED_SIZES = {"two_level_attn": dict(decode=(24, 24), encode=(12, 24)),
               "three_level_plain": dict(decode=(12, 24), encode=(24, 12))}


def test_tiled_decode_and_encode_match_diffusers_tiling(pair, request):
    ref, ours = pair
    sizes = TILED_SIZES[request.node.callspec.params["pair"]]
    tile, factor = 16, ours.config.downsample_factor
    (h, w) = sizes["decode"]
    z = torch.randn(1, ours.config.latent_channels, h // factor, w // factor,
                    generator=torch.Generator().manual_seed(2))
    expected = _with_diffusers_tiling(ref, tile, lambda: ref.decode(z).sample)
    with torch.no_grad():  # tiling must change diffusers' result here, or this test proves nothing
        assert torch.max(torch.abs(expected - ref.decode(z).sample)) > 1e-3
    got = eqx.filter_jit(lambda m, z: m.decode_tiled(z, tile_sample_min_size=tile))(ours, nchw_to_nhwc(z))
    assert got.shape == (1, h, w, ours.config.out_channels)
    assert_close(got, nchw_to_nhwc(expected), what="tiled decode")

    (h, w) = sizes["encode"]
    x = torch.randn(1, ours.config.in_channels, h, w, generator=torch.Generator().manual_seed(3))
    post = _with_diffusers_tiling(ref, tile, lambda: ref.encode(x).latent_dist)
    with torch.no_grad():
        assert torch.max(torch.abs(post.mean - ref.encode(x).latent_dist.mean)) > 1e-3
    ours_post = eqx.filter_jit(lambda m, x: m.encode_tiled(x, tile_sample_min_size=tile))(ours, nchw_to_nhwc(x))
    assert ours_post.mean.shape == (1, h // factor, w // factor, ours.config.latent_channels)
    assert_close(ours_post.mean, nchw_to_nhwc(post.mean), what="tiled encode mean")
    assert_close(ours_post.logvar, nchw_to_nhwc(post.logvar), what="tiled encode logvar")


def test_tiling_falls_back_to_plain_when_one_tile_holds_the_input(vae):
    # diffusers tiles only inputs larger than a tile; the default tile is sample_size (32) pixels
    z, x = nchw_to_nhwc(_latents(vae, batch=1)), nchw_to_nhwc(_image(vae, batch=1))
    trace = lambda f, a: str(jax.make_jaxpr(f)(a))  # noqa: E731 - tracing is enough to compare programs
    assert trace(vae.decode_tiled, z) == trace(vae.decode, z)
    assert trace(vae.encode_tiled, x) == trace(vae.encode, x)
    bigger = jnp.zeros((1, z.shape[1] + 1, *z.shape[2:]))  # one latent row more than a tile: tiled for real
    assert trace(vae.decode_tiled, bigger) != trace(vae.decode, bigger)


def test_sliced_decode_and_encode_equal_plain(vae):
    x, z = nchw_to_nhwc(_image(vae)), nchw_to_nhwc(_latents(vae))
    assert_close(decode(vae, z, 1), decode(vae, z), 1e-5, what="decode sliced")
    assert_close(encode(vae, x, 1).mean, encode(vae, x).mean, 1e-5, what="encode sliced")


def test_batch_slicing_handles_remainders():
    fn = lambda x: jnp.tanh(x) * jnp.sum(x, axis=(1, 2), keepdims=True)  # noqa: E731 - per-sample, shape-keeping
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3, 2)), jnp.float32)
    for size in (1, 2, 5, 7):  # 2 leaves a remainder of 1; 5 and 7 take the whole batch at once
        np.testing.assert_allclose(_batch_sliced(fn, x, size), fn(x), rtol=1e-6, atol=1e-6, err_msg=f"{size=}")


def test_sample_posterior_uses_the_key(vae):
    x = nchw_to_nhwc(_image(vae))
    key = jax.random.key(3, impl="rbg")  # compiles far faster on CPU than the default threefry
    post = encode(vae, x)
    expected = decode(vae, post.mean + post.std * jax.random.normal(key, post.mean.shape))
    assert_close(forward(vae, x, key, True), expected, 1e-5)
    assert np.max(np.abs(np.asarray(expected - forward(vae, x)))) > 1e-3  # the sample is not the mode
    with pytest.raises(ValueError, match="needs a PRNG key"):
        vae(x, sample_posterior=True)


def test_save_pretrained_round_trips_into_diffusers(pair, tmp_path):
    ref, ours = pair
    eqxdiff.save_pretrained(ours, tmp_path)
    again = diffusers.AutoencoderKL.from_pretrained(tmp_path).eval()
    expected = ref.state_dict()
    got = again.state_dict()
    assert set(got) == set(expected)
    for name, t in expected.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)
    plain = lambda v: list(v) if isinstance(v, (list, tuple)) else v  # noqa: E731 - json gives lists
    for key in ("block_out_channels", "latent_channels", "use_quant_conv", "mid_block_add_attention", "act_fn"):
        assert plain(again.config[key]) == plain(ref.config[key]), key


def _abstract(config: AutoencoderKLConfig) -> AutoencoderKL:
    """A model with shape-only weights: enough for what reads only the config or checks inputs before any layer,
    and it skips compiling a random initialisation."""
    return eqx.filter_eval_shape(AutoencoderKL, config, key=jax.random.key(0))


def _tiny_config(**changes) -> AutoencoderKLConfig:
    return AutoencoderKLConfig.from_dict({"block_out_channels": (8,), "norm_num_groups": 4, **changes})


def test_scale_and_unscale_latents_with_shift_factor():
    vae = _abstract(_tiny_config(scaling_factor=0.3611, shift_factor=0.1159))
    z = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 6, 4)), jnp.float32)
    np.testing.assert_allclose(vae.scale_latents(z), (z - 0.1159) * 0.3611, rtol=1e-6)
    np.testing.assert_allclose(vae.unscale_latents(vae.scale_latents(z)), z, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(vae.unscale_latents(z), z / 0.3611 + 0.1159, rtol=1e-6)
    no_shift = _abstract(_tiny_config(scaling_factor=0.5))
    np.testing.assert_allclose(no_shift.scale_latents(z), z * 0.5, rtol=1e-6)


def test_scale_latents_with_latents_mean_and_std_follows_sdxl_pipelines():
    mean, std = (0.1, -0.2, 0.3, 0.0), (0.5, 1.5, 2.0, 1.0)
    vae = _abstract(_tiny_config(scaling_factor=0.5, latents_mean=mean, latents_std=std))
    z = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 6, 4)), jnp.float32)
    m, s = jnp.asarray(mean), jnp.asarray(std)
    np.testing.assert_allclose(vae.scale_latents(z), (z - m) * 0.5 / s, rtol=1e-6)
    np.testing.assert_allclose(vae.unscale_latents(z), z * s / 0.5 + m, rtol=1e-6)


@pytest.mark.parametrize("key,value,match", [
    ("down_block_types", ["AttnDownEncoderBlock2D"], "down_block_types"),
    ("up_block_types", ["UpDecoderBlock2D", "UpDecoderBlock2D"], "one entry per block_out_channels"),
    ("act_fn", "tanh", "act_fn='tanh'"),
    ("norm_num_groups", 3, "norm_num_groups=3"),
    ("latents_mean", [0.0, 1.0], "latents_mean"),
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
    with pytest.raises(ValueError, match="batch_slice_size"):
        vae.decode(jnp.zeros((4, 2, 2, 4)), batch_slice_size=0)
    with pytest.raises(ValueError, match="tile_sample_min_size"):
        vae.decode_tiled(jnp.zeros((1, 2, 2, 4)), tile_sample_min_size=0)
