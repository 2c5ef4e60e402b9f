"""Wan 2.1 / 2.2: AutoencoderKLWan against diffusers (the parity base, :mod:`tests._parity`: encode and decode of 1, 5
and 9 frames at diffusers' tiny 2.1 and 2.2 configs), the frame-chunked and tiled decodes, the tiled encode, latent
normalisation and the errors.

diffusers runs the VAE chunk by chunk (frame 0, then 4 frames; one latent frame at a time when decoding) with a
feature cache; eqxdiff's encoder and decoder make one causal pass over the whole sequence, so these parity tests are
the proof that the two agree. ``frame_chunk`` decodes in chunks again (a ``lax.scan``), tested against diffusers too.
"""

import inspect

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

import eqxdiff
from eqxdiff.core import ConfigError, leaf_specs
from eqxdiff.loading import (
    convert_tensors,
    formats,
    inverse,
    state_dict,
    write_safetensors,
)
from eqxdiff.models.wan_vae import (
    AutoencoderKLWan,
    AutoencoderKLWanConfig,
    WanLatentDistribution,
)
from eqxdiff.parallel import MeshConfig, Plan, make_mesh, shard_params, with_plan

from . import _tiny_wan as tiny
from ._parity import ModelParity, run_jitted
from ._util import assert_close, nchw_to_nhwc, nhwc_to_nchw, randomize_torch, rel_error

FRAMES = (1, 5, 9)  # videos of 1 + 4k frames: 1, 2 and 3 latent frames


class WanVAEParity(ModelParity):
    """Encode (mean, logvar) and decode at 1, 5 and 9 frames, in one program; the 5-frame videos in a batch of 2."""

    model_class = AutoencoderKLWan
    reference_class = diffusers.AutoencoderKLWan
    size = 16  # pixels: 2 x 2 latents
    pixels: tuple[int, int] | None = None  # the encoded videos' height and width, if not size x size
    # These tiny VAEs normalise 3-channel features to unit length (WanRMS_norm: x / ||x||), which turns the rounding
    # of small vectors into unit-size errors: diffusers' own bfloat16 decode differs from its float32 one by up to
    # 0.89 of the output range on these weights (rounding only the weights to bfloat16, in float32, already by 0.09).
    # So the bfloat16 run checks dtypes, finiteness and this bound only.
    bf16_tolerance = 1.0

    def inputs(self, reference):
        c = reference.config
        rng = np.random.default_rng(self.seed())
        channels, latent = c.in_channels // (c.patch_size or 1) ** 2, self.size // c.scale_factor_spatial
        out = {}
        for t in FRAMES:
            b = 2 if t == 5 else 1
            out[f"x{t}"] = rng.uniform(-1, 1, (b, t, *(self.pixels or (self.size,) * 2), channels)).astype(np.float32)
            out[f"z{t}"] = rng.standard_normal((b, 1 + (t - 1) // 4, latent, latent, c.z_dim)).astype(np.float32)
        return out

    def reference_outputs(self, reference, inputs):
        out = {}
        for t in FRAMES:
            post = reference.encode(nhwc_to_nchw(inputs[f"x{t}"])).latent_dist
            out[f"mean{t}"], out[f"logvar{t}"] = nchw_to_nhwc(post.mean), nchw_to_nhwc(post.logvar)
            out[f"decode{t}"] = nchw_to_nhwc(reference.decode(nhwc_to_nchw(inputs[f"z{t}"])).sample)
        return out

    @staticmethod
    def outputs(model, inputs):
        out = {}
        for t in FRAMES:
            post = model.encode(inputs[f"x{t}"])
            out[f"mean{t}"], out[f"logvar{t}"] = post.mean, post.logvar
            out[f"decode{t}"] = model.decode(inputs[f"z{t}"])
        return out


class TestWan21VAE(WanVAEParity):
    """diffusers' tiny Wan 2.1 VAE: base_dim 3, z 16, four levels (x8), time halved twice (x4)."""

    config = tiny.VAE_21
    full_size = {"wan2.1": tiny.WAN21_VAE}
    pixels = (21, 19)  # not multiples of 8: the latents round down to 2 x 2, as diffusers' (the random video fuzz)


class TestWan22VAE(WanVAEParity):
    """diffusers' tiny Wan 2.2 TI2V VAE: z 48, residual levels (AvgDown3D / DupUp3D shortcuts), 2x2 patchified
    pixels (12 channels), x16 spatially."""

    config = tiny.VAE_22
    full_size = {"wan2.2": tiny.WAN22_VAE}
    size = 32


@pytest.fixture(scope="module")
def vae21(tmp_path_factory):
    return TestWan21VAE.build(tmp_path_factory)


@pytest.fixture(scope="module")
def vae22(tmp_path_factory):
    return TestWan22VAE.build(tmp_path_factory)


# -- frame-chunked and tiled decodes ----------------------------------------------------------------------------------


def _chunked(vae, inputs):
    z, chunks = inputs
    return {n: vae.decode(z, frame_chunk=n) for n in chunks}


@pytest.mark.parametrize("which,chunks", [("vae21", (2,)), ("vae22", (1, 2))])
def test_frame_chunked_decode_equals_diffusers(which, chunks, request):
    """One latent frame at a time (diffusers' own order; the scan carries the caches twice), and 1 then 2: each
    equals diffusers' decode at the parity tolerance, as the whole decode does."""
    case = request.getfixturevalue(which)
    out = run_jitted(_chunked, case.model, (jnp.asarray(case.inputs["z9"]), chunks))
    for n, frames in out.items():
        assert frames.shape == case.expected["decode9"].shape
        assert_close(frames, case.expected["decode9"], 1e-4, f"frame_chunk={n} vs diffusers")


TILE, STRIDE = (4, 3)  # latents per tile and between tiles: two rows of tiles (heights 4 and 3), one column


def _tiled(vae, z):
    f = vae.config.downsample_factor
    return dict(tiled=vae.decode(z, tiled=True, frame_chunk=1, tile_sample_min=TILE * f, tile_sample_stride=STRIDE * f),
                whole=vae.decode(z))


def test_tiled_decode_equals_diffusers_tiling(vae22):
    """Latents of 6 x 3 in tiles of 4 every 3 (two tile shapes: one compile each), 2 latent frames, frame-chunked
    inside each tile: diffusers' ``tiled_decode``, blending in patchified pixels (Wan 2.2). Tiled and untiled decodes
    differ where tiles are cut and blended (the mid-block attention sees one tile): here by 0.095 on average over the
    [-1, 1] range (diffusers' tiling by as much: it is the same decode); the bound stated is 0.15."""
    ref, f = vae22.reference, vae22.model.config.downsample_factor
    z = torch.randn(1, ref.config.z_dim, 2, 6, 3, generator=torch.Generator().manual_seed(4))
    ref.enable_tiling(TILE * f, TILE * f, STRIDE * f, STRIDE * f)
    try:
        with torch.no_grad():
            expected = nchw_to_nhwc(ref.decode(z).sample)
    finally:
        ref.use_tiling = False
    out = run_jitted(_tiled, vae22.model, nchw_to_nhwc(z))
    assert out["tiled"].shape == (1, 5, 6 * f, 3 * f, 3)
    assert_close(out["tiled"], expected, 1e-4, "tiled vs diffusers")
    difference = np.abs(np.asarray(out["tiled"]) - np.asarray(out["whole"]))
    assert difference.max() > 1e-2 and difference.mean() <= 0.15, (difference.max(), difference.mean())


def test_tiled_encode_equals_diffusers_tiling(vae22):
    """diffusers' ``tiled_encode`` (under ``enable_tiling()``, which image-to-video's condition video goes through):
    the moments of overlapping tiles blended, the tiles measured in patchified pixels (Wan 2.2: a tile of 16 spans 32
    pixels). 48 x 16 pixels in tiles of 16 every 8 patches: rows of 16, 16 and 8 (two tile shapes), one column. The
    tiled latents differ from the whole video's (diffusers' by more than 1e-2), so ignoring ``tiled`` fails."""
    ref = vae22.reference
    x = np.random.default_rng(8).uniform(-1, 1, (1, 5, 48, 16, 3)).astype(np.float32)
    ref.enable_tiling(16, 16, 8, 8)
    try:
        with torch.no_grad():
            tiled = ref.encode(nhwc_to_nchw(x)).latent_dist
    finally:
        ref.use_tiling = False
    with torch.no_grad():
        whole = ref.encode(nhwc_to_nchw(x)).latent_dist.mean
    assert rel_error(nchw_to_nhwc(whole), nchw_to_nhwc(tiled.mean)) > 1e-2
    out = run_jitted(lambda vae, x: vae.encode(x, tiled=True, tile_sample_min=16, tile_sample_stride=8), vae22.model, x)
    assert out.mean.shape == (1, 2, 3, 1, 48)
    assert_close(out.mean, nchw_to_nhwc(tiled.mean), 1e-4, "tiled mean vs diffusers")
    assert_close(out.logvar, nchw_to_nhwc(tiled.logvar), 1e-4, "tiled logvar vs diffusers")


def _mesh_decodes(vaes, zs):
    (vae21, vae22), (z21, z22) = vaes, zs
    f = vae22.config.downsample_factor
    return dict(chunked=vae21.decode(z21, frame_chunk=2),
                tiled=vae22.decode(z22, tiled=True, tile_sample_min=TILE * f, tile_sample_stride=STRIDE * f))


def test_mesh_decodes_equal_one_device(vae21, vae22):
    """On 8 simulated devices (data 2 x FSDP 2 x context 2, the weights over fsdp, under the plan's constraints), one
    video (the batch is not split): the frame-chunked decode (a ``lax.scan`` over chunks of 2 latent frames, 2.1) and
    the tiled one (a ``lax.map`` over tiles, 2.2) equal one device's. Both loops' bodies fold frames into the batch
    (per-frame attention and resampling, ``nn.per_frame``); unconstrained at the fold and at the 2.1 time upsampler's
    channel split, XLA's Shardy partitioner computed the causal time convolutions after them wrongly in a loop body
    (up to 0.97 relative error before)."""
    rng = np.random.default_rng(5)
    zs = (rng.standard_normal((1, 5, 2, 2, 16)).astype(np.float32),
          rng.standard_normal((1, 2, 6, 3, 48)).astype(np.float32))
    one = run_jitted(_mesh_decodes, (vae21.model, vae22.model), zs)
    mesh = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_context_parallelism=2))
    vaes = tuple(with_plan(shard_params(c.model, mesh), Plan(mesh)) for c in (vae21, vae22))
    out = run_jitted(_mesh_decodes, vaes, zs)
    for name in one:
        assert_close(out[name], one[name], 1e-5, f"{name} decode on the mesh vs one device")


def _decode(vae, z):
    return vae.decode(z)


def test_mesh_decode_without_plan_equals_one_device(vae21):
    """Weights over fsdp (what ``load(..., sharding=sharding_fn(mesh))`` gives) and no plan, so nothing constrains
    the activations: one video of 2 latent frames on data 1 x FSDP 2 x context 2 x tensor 2 decodes as on one device.
    The 2.1 time upsampler's doubled channels come out of its fsdp-sharded convolution sharded; split into frames by
    a reshape, both XLA partitioners (jax 0.10.2) decoded wrongly (1.2 relative error before ``nn.unfold_channels``:
    this tiny VAE's 3 + 3 channels are the shape that shows it)."""
    z = np.random.default_rng(6).standard_normal((1, 2, 2, 2, 16)).astype(np.float32)
    one = run_jitted(_decode, vae21.model, z)
    mesh = make_mesh(MeshConfig(ici_fsdp_parallelism=2, ici_context_parallelism=2, ici_tensor_parallelism=2))
    assert_close(run_jitted(_decode, shard_params(vae21.model, mesh), z), one, 1e-5, "decode, sharded without a plan")


def test_decode_fits_in_one_tile_is_the_plain_decode(vae21):
    vae, z = vae21.model, jnp.asarray(vae21.inputs["z5"])
    trace = lambda **kw: str(jax.make_jaxpr(lambda z: vae.decode(z, **kw))(z))  # noqa: E731
    assert trace(tiled=True, tile_sample_min=16, tile_sample_stride=8) == trace()


# -- latents ----------------------------------------------------------------------------------------------------------


def test_latent_normalisation_and_posterior(vae21):
    """``scale_latents`` is the pipelines' ``(z - mean) * (1 / std)``, ``unscale_latents`` its inverse; the posterior
    samples around its mean with the key and has diffusers' KL."""
    vae, c = vae21.model, vae21.model.config
    z = jnp.asarray(vae21.inputs["z5"])
    mean, std = np.asarray(c.latents_mean, np.float32), np.asarray(c.latents_std, np.float32)
    defaults = inspect.signature(diffusers.AutoencoderKLWan).parameters  # Wan 2.1's statistics
    assert c.latents_mean == tuple(defaults["latents_mean"].default) and c.latents_std == tuple(
        defaults["latents_std"].default)
    post = WanLatentDistribution(vae21.actual["mean5"], vae21.actual["logvar5"])

    def latents(vae, inputs):
        z, post, key = inputs
        scaled = vae.scale_latents(z)
        return scaled, vae.unscale_latents(scaled), post.sample(key=key), post.kl()

    key = jax.random.key(0, impl="rbg")  # compiles far faster on CPU than the default threefry
    scaled, back, sample, kl = run_jitted(latents, vae, (z, post, key))
    assert rel_error(scaled, (np.asarray(z) - mean) / std) < 1e-6 and rel_error(back, z) < 1e-6
    assert sample.shape == post.mean.shape and 0 < float(jnp.max(jnp.abs(sample - post.mean)))
    expected = 0.5 * np.sum(np.square(vae21.expected["mean5"]) + np.exp(vae21.expected["logvar5"]) - 1
                            - vae21.expected["logvar5"], axis=(1, 2, 3, 4))
    assert rel_error(kl, expected) < 1e-4


# -- the original Wan 2.1 VAE -----------------------------------------------------------------------------------------


def test_original_vae_names_equal_diffusers_converter(tmp_path):
    """The released layout (4 levels, 2 residual blocks; narrow): the weights in the original names (the rules'
    inverse) read back by diffusers' ``convert_wan_vae_to_diffusers`` to the same tensors (it hard-codes that layout's
    decoder indices); a file of them loads through ``formats.wan_vae`` into exactly those weights and writes back."""
    reference = diffusers.AutoencoderKLWan(base_dim=2, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                           latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    randomize_torch(reference, seed=5)
    ref = {k: v.numpy() for k, v in reference.state_dict().items()}
    rules = formats.wan_vae()
    original = convert_tensors(ref, inverse(rules))
    assert {"encoder.downsamples.0.residual.0.gamma", "decoder.upsamples.4.shortcut.weight",
            "decoder.upsamples.11.resample.1.weight", "decoder.middle.1.to_qkv.weight", "conv2.bias"} <= set(original)
    converted = convert_wan_vae_to_diffusers({k: torch.from_numpy(v) for k, v in original.items()})
    assert set(converted) == set(ref)
    for name, t in converted.items():  # renamed, not computed: exactly equal
        np.testing.assert_array_equal(t.numpy(), ref[name], err_msg=name)
    path = tmp_path / "wan_2.1_vae.safetensors"
    write_safetensors(original, path)
    reference.save_pretrained(tmp_path / "folder")
    ours = state_dict(eqxdiff.load(path, config=tmp_path / "folder", conversion=rules))
    assert set(ours) == set(ref)
    for name, t in ref.items():
        np.testing.assert_array_equal(ours[name], t, err_msg=name)
    back = convert_tensors(ours, inverse(rules))
    assert set(back) == set(original) and all(np.array_equal(back[k], original[k]) for k in original)


# -- errors -----------------------------------------------------------------------------------------------------------


def test_input_errors(vae21):
    vae = vae21.model
    with pytest.raises(ValueError, match=r"a video of 6 frames; the VAE takes 1 \+ 4k frames \(nearest: 5 or 9\)"):
        vae.encode(jnp.zeros((1, 6, 16, 16, 3)))
    with pytest.raises(ValueError, match="It looks channels-first"):
        vae.encode(jnp.zeros((1, 3, 5, 16, 16)))
    with pytest.raises(ValueError, match="must be multiples of 1 and at least 8"):
        vae.encode(jnp.zeros((1, 1, 7, 16, 3)))
    with pytest.raises(ValueError, match=r"must be multiples of 8 \(tiled\) and at least 8"):
        vae.encode(jnp.zeros((1, 1, 12, 16, 3)), tiled=True)
    z = jnp.zeros((1, 2, 2, 2, 16))
    with pytest.raises(ValueError, match="frame_chunk=0 must be a positive int"):
        vae.decode(z, frame_chunk=0)
    with pytest.raises(ValueError, match="strides no larger than the tiles"):
        vae.decode(z, tiled=True, tile_sample_min=16, tile_sample_stride=24)
    with pytest.raises(ValueError, match=r"AutoencoderKLWan.encode: tile_sample_min=\(4, 4\) .* at least 8"):
        vae.encode(jnp.zeros((1, 1, 16, 16, 3)), tiled=True, tile_sample_min=4, tile_sample_stride=4)


@pytest.mark.parametrize("temporal, frames, match", [
    ([False, False, True], 3, r"a video of 3 frames; the VAE takes 1 \+ 4k frames \(nearest: 1 or 5\)"),
    ([True, True, True], 9, "temporal_factor=8; diffusers' encoder reads 4 frames at a time"),
])
def test_encode_reads_frames_as_diffusers(temporal, frames, match):
    """diffusers' encoder reads the first frame, then 4 at a time, whatever the temporal factor: a VAE halving time
    once drops frames 2-3 of a 3-frame video there (one latent frame), so it is an error here too, not two latent
    frames; a VAE shortening time by 8 cannot encode 4 frames at all (one frame still encodes)."""
    config = AutoencoderKLWanConfig.from_dict({**tiny.VAE_21, "temperal_downsample": temporal,
                                               "scale_factor_temporal": 2 ** sum(temporal)})
    vae = eqx.filter_eval_shape(AutoencoderKLWan, config, key=jax.random.key(0))
    video = lambda n: jax.ShapeDtypeStruct((1, n, 16, 16, 3), jnp.float32)  # noqa: E731
    assert eqx.filter_eval_shape(vae.encode, video(1)).mean.shape == (1, 1, 2, 2, 16)
    with pytest.raises(ValueError, match=match):
        eqx.filter_eval_shape(vae.encode, video(frames))


@pytest.mark.parametrize("change, match", [
    (dict(temperal_downsample=[True]), "temperal_downsample=.* one entry per downsampling level"),
    (dict(dim_mult=[1, 2, 2], temperal_downsample=[True, True]),
     r"scale_factor_spatial=8 must be null or the layers' factor 2 \*\* \(len\(dim_mult\) - 1\) .* = 4"),
    (dict(temperal_downsample=[False, False, True]),
     r"scale_factor_temporal=4 must be null or the layers' factor 2 \*\* sum\(temperal_downsample\) = 2: diffusers "
     "builds this VAE, but its pipelines size latents by scale_factor_temporal .* videos of the wrong size"),
    (dict(latents_mean=[0.0] * 3), "latents_mean=.* must have z_dim=16 entries"),
    (dict(patch_size=2, in_channels=3), "in_channels=3 must be a multiple of patch_size"),
    (dict(dim_mult=[]), "dim_mult=.* non-empty"),
])
def test_config_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        AutoencoderKLWanConfig.from_dict({**tiny.VAE_21, **change})


@pytest.mark.parametrize("config", [tiny.VAE_21, tiny.VAE_22], ids=["2.1", "2.2"])
def test_no_resnets_per_level_builds_as_diffusers(config):
    """``num_res_blocks=0`` (diffusers builds it: no encoder resnets, one per decoder level, and runs it where the
    widths do not change) was refused; our abstract model holds diffusers' (meta-device) tensors, and encodes to the
    latents' shape. Numbers: matched diffusers in the random video fuzz (seed 0)."""
    with torch.device("meta"):
        reference = diffusers.AutoencoderKLWan(**{**config, "num_res_blocks": 0})
    model_config = AutoencoderKLWanConfig.from_dict({**config, "num_res_blocks": 0})
    abstract = eqx.filter_eval_shape(AutoencoderKLWan, model_config, key=jax.random.key(0))
    leaves, specs, _ = leaf_specs(abstract)
    assert {s.name: s.torch_shape(x.shape) for x, s in zip(leaves, specs)} == TestWan21VAE.reference_shapes(reference)
    size = model_config.downsample_factor
    video = jax.ShapeDtypeStruct((1, 5, size, size, 3), jnp.float32)
    assert eqx.filter_eval_shape(abstract.encode, video).mean.shape == (1, 2, 1, 1, model_config.z_dim)
