"""LTX-Video: AutoencoderKLLTXVideo against diffusers (the parity base, :mod:`tests._parity`, at the three VAE
generations: 0.9.0, 0.9.1 with decoder timestep conditioning, noise injection and residual upsampling, 0.9.5 with
the space-to-depth encoder), its latent statistics, tiled and frame-chunked decoding, the original Lightricks names
against diffusers' converter (one single file holding the transformer and the VAE), and the errors.

The injected noise is eqxdiff's (``jax.random.normal(fold_in(key, n))`` for the ``n``-th draw of a decode):
diffusers' reference is handed the same draws in place of its ``torch.randn``."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import LTXPipeline
from diffusers.loaders.single_file_utils import convert_ltx_vae_checkpoint_to_diffusers

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.loading import convert, convert_tensors, formats, inverse, state_dict, write_safetensors
from eqxdiff.models.ltx_vae import AutoencoderKLLTXVideo, AutoencoderKLLTXVideoConfig

from . import _tiny_ltx as tiny
from . import test_ltx_model
from ._parity import ModelParity, run_jitted
from ._util import assert_close, nchw_to_nhwc, nhwc_to_nchw, randomize_torch


@contextlib.contextmanager
def eqxdiff_noise(key):
    """diffusers' ``torch.randn`` inside the block returns eqxdiff's draws: the ``n``-th call
    ``jax.random.normal(fold_in(key, n), shape)``."""
    real, count = torch.randn, [0]

    def randn(*shape, generator=None, device=None, dtype=None, **kwargs):
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        draw = jax.random.normal(jax.random.fold_in(key, count[0]), shape, jnp.float32)
        count[0] += 1
        return torch.from_numpy(np.array(draw)).to(dtype or torch.float32)

    torch.randn = randn
    try:
        yield count
    finally:
        torch.randn = real


def _decode_reference(reference, z, timestep, key):
    with torch.no_grad(), eqxdiff_noise(jax.random.wrap_key_data(key)) as draws:
        out = reference.decode(nhwc_to_nchw(z), None if timestep is None else torch.from_numpy(timestep)).sample
    expected_draws = 2 * sum(isinstance(m.per_channel_scale1, torch.Tensor) for m in reference.modules()
                             if hasattr(m, "per_channel_scale1"))
    assert draws[0] == expected_draws, (draws[0], expected_draws)
    return nchw_to_nhwc(out)


# The bfloat16 sanity bound of timestep-conditioned decoders: the timestep multiplier (~1000) rounded to bfloat16 moves
# the time embedders' sinusoids. diffusers' own bfloat16 run differs from its float32 run by 0.11 (0.9.1) and 0.39
# (0.9.5) on these random weights (0.9.0's decoder: within the base's 0.05: 0.01).
TIMESTEP_BF16 = 0.5


class LTXVaeParity(ModelParity):
    model_class = AutoencoderKLLTXVideo
    reference_class = tiny.AutoencoderKLLTXVideo
    video = (9, 32, 32)  # the encoded videos' frames, height, width

    @classmethod
    def make_reference(cls, config):
        """diffusers' VAE with random latent statistics (buffers: the parameters' randomisation leaves them)."""
        reference = super().make_reference(config)
        g = torch.Generator().manual_seed(cls.seed())
        with torch.no_grad():
            reference.latents_mean.copy_(torch.randn(reference.latents_mean.shape, generator=g))
            reference.latents_std.copy_(0.5 + torch.rand(reference.latents_std.shape, generator=g))
        return reference

    def inputs(self, reference):
        rng = np.random.default_rng(self.seed())
        c = reference.config
        out = dict(video=rng.uniform(-1, 1, (2, *self.video, c.in_channels)).astype(np.float32),
                   latents=rng.standard_normal((2, 2, 2, 2, c.latent_channels), np.float32),
                   key=np.asarray(jax.random.key_data(jax.random.key(self.seed()))))
        if c.timestep_conditioning:
            out["timestep"] = np.array([0.05, 0.6], np.float32)
        return out

    def bf16_inputs(self, inputs):
        return {k: v.astype(jnp.bfloat16) if k in ("video", "latents") else v for k, v in inputs.items()}

    def reference_outputs(self, reference, inputs):
        with torch.no_grad():
            posterior = reference.encode(nhwc_to_nchw(inputs["video"])).latent_dist
            stats = (reference.latents_mean, reference.latents_std, reference.config.scaling_factor)
            scaled = LTXPipeline._normalize_latents(nhwc_to_nchw(inputs["latents"]), *stats)
            unscaled = LTXPipeline._denormalize_latents(nhwc_to_nchw(inputs["latents"]), *stats)
        return dict(mean=nchw_to_nhwc(posterior.mean), logvar=nchw_to_nhwc(posterior.logvar),
                    sample=_decode_reference(reference, inputs["latents"], inputs.get("timestep"), inputs["key"]),
                    scaled=nchw_to_nhwc(scaled), unscaled=nchw_to_nhwc(unscaled))

    @staticmethod
    def outputs(model, inputs):
        posterior = model.encode(inputs["video"])
        sample = model.decode(inputs["latents"], inputs.get("timestep"), key=jax.random.wrap_key_data(inputs["key"]))
        return dict(mean=posterior.mean, logvar=posterior.logvar, sample=sample,
                    scaled=model.scale_latents(inputs["latents"]), unscaled=model.unscale_latents(inputs["latents"]))


class TestLTXVae090(LTXVaeParity):
    """0.9.0: conv downsampling, width-changing ResNet blocks in the encoder (conv_out) and decoder (conv_in)."""

    config = tiny.VAE_090
    # strided convolutions only: any frame count and size (multiples of the patch), rounded up as diffusers' (found
    # by the random video fuzz)
    video = (6, 34, 18)
    full_size = {"ltx-video-0.9.0": tiny.REAL_VAE_090}


class TestLTXVae091(LTXVaeParity):
    """0.9.1: the decoder conditioned on the timestep, noise injected in three of its four stages, residual
    depth-to-space upsampling with upsample_factor 2."""

    config = tiny.VAE_091
    full_size = {"ltx-video-0.9.1": tiny.REAL_VAE_091}
    bf16_tolerance = TIMESTEP_BF16


class TestLTXVae095(LTXVaeParity):
    """0.9.5+: LTXVideo095DownBlock3D with spatial, temporal and spatiotemporal space-to-depth downsamplers."""

    config = tiny.VAE_095
    full_size = {"ltx-video-0.9.5": tiny.REAL_VAE_095}
    bf16_tolerance = TIMESTEP_BF16


@pytest.fixture(scope="module")
def vae090(tmp_path_factory):
    return TestLTXVae090.build(tmp_path_factory)


@pytest.fixture(scope="module")
def vae091(tmp_path_factory):
    return TestLTXVae091.build(tmp_path_factory)


# -- tiled and frame-chunked decoding -------------------------------------------------------------------------------


def _pieces(model, z):
    """The whole decode and two piecewise ones: tiles of 32 pixels (2 latents) every 16 down the rows (one tile
    across: stride 32), and windows of 3 latent frames every 1 (diffusers' framewise defaults: 16 and 8 frames)."""
    return dict(whole=model.decode(z), tiled=model.decode(z, tiled=True, tile_sample_min=32,
                                                           tile_sample_stride=(16, 32)),
                chunked=model.decode(z, frame_chunk=2))


def test_tiled_and_frame_chunked_decode_equal_diffusers(vae090):
    """``tiled=True`` and ``frame_chunk=`` decode the pieces diffusers' ``enable_tiling()`` and framewise decoding
    decode, blended as there: the same outputs (<= 1e-4). Against the whole decode, each piece's decoder sees less
    context: the tiny random decoder (whose receptive field spans the pieces) stays within a mean absolute
    difference of 0.4 (of outputs of mean magnitude 0.51; measured 0.25 tiled, 0.12 chunked)."""
    z = np.random.default_rng(0).standard_normal((1, 3, 4, 2, 8), np.float32)
    out = run_jitted(_pieces, vae090.model, z)
    reference = vae090.reference
    for name, tiled, framewise in (("tiled", True, False), ("chunked", False, True)):
        reference.use_tiling, reference.use_framewise_decoding = tiled, framewise
        reference.tile_sample_min_height = reference.tile_sample_min_width = reference.tile_sample_stride_width = 32
        reference.tile_sample_stride_height = 16
        reference.tile_sample_min_num_frames, reference.tile_sample_stride_num_frames = 16, 8
        with torch.no_grad():
            expected = nchw_to_nhwc(reference.decode(nhwc_to_nchw(z)).sample)
        reference.use_tiling = reference.use_framewise_decoding = False
        assert out[name].shape == expected.shape == (1, 17, 64, 32, 3)
        assert_close(out[name], expected, 1e-4, f"{name} vs diffusers")
        difference = float(jnp.mean(jnp.abs(out[name] - out["whole"])))
        assert 0 < difference < 0.4, (name, difference)


# -- Lightricks' original names -------------------------------------------------------------------------------------


def _original_vae(reference, prefix: str = "") -> dict[str, np.ndarray]:
    """The reference's weights in Lightricks' names (the rules' inverse), below ``prefix``."""
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    return {prefix + k: v for k, v in convert_tensors(state, inverse(formats.ltx_vae(reference.config))).items()}


class _Names:
    """A view of a state dict's names and shapes only (the meta device's full-size models)."""

    def __init__(self, state):
        self.state = state

    def names(self):
        return list(self.state)

    def shape(self, name):
        return tuple(self.state[name].shape)

    def dtype(self, name):
        return np.dtype(np.float32)

    def get(self, name):
        raise AssertionError("names only")


@pytest.mark.parametrize("config", ["REAL_VAE_090", "REAL_VAE_091", "REAL_VAE_095", "VAE_090", "VAE_091", "VAE_095"])
def test_original_vae_names_equal_diffusers_converter_at_full_size(config):
    """On the meta device, every released VAE layout (0.9.0, 0.9.1, 0.9.5 = 0.9.7 / 0.9.8) and the tiny ones: our rules'
    inverse gives original names that diffusers' ``convert_ltx_vae_checkpoint_to_diffusers`` maps back to exactly
    diffusers' names, each tensor in its shape. (The converter tells 0.9.5 by an encoder 2048 wide; the tiny 0.9.5's
    conv_out stands in at that width.)"""
    config = getattr(tiny, config)
    with torch.device("meta"):
        reference = tiny.AutoencoderKLLTXVideo(**config)
    state = reference.state_dict()
    view = convert(_Names(state), inverse(formats.ltx_vae(config, prefix=formats.LTX_VAE)))
    original = {n: torch.empty(view.shape(n), device="meta") for n in view.names()}
    assert "vae.per_channel_statistics.mean-of-means" in original
    if len(config["block_out_channels"]) == 5:  # 0.9.5
        assert "vae.encoder.down_blocks.8.res_blocks.0.conv1.conv.weight" in original
        out = original["vae.encoder.conv_out.conv.weight"].shape[0]
        original["vae.encoder.conv_out.conv.weight"] = torch.empty((out, 2048, 3, 3, 3), device="meta")
    converted = convert_ltx_vae_checkpoint_to_diffusers(dict(original))
    assert set(converted) == set(state)
    assert all(converted[n].shape == state[n].shape for n in state if n != "encoder.conv_out.conv.weight")



@pytest.mark.parametrize("transformer, vae", [("LTX_2B", "REAL_VAE_090"), ("LTX_2B", "REAL_VAE_091"),
                                              ("LTX_2B", "REAL_VAE_095"), ("LTX_13B", "REAL_VAE_095")])
def test_full_size_files_suggest_the_config_diffusers_fetches(transformer, vae):
    """A Lightricks file of each release (on the meta device: names and shapes) is told apart as diffusers'
    infer_diffusers_model_type tells it (0.9.7: 48 blocks; 0.9.5: an encoder 2048 wide; 0.9.1: a timestep-conditioned
    decoder; else 0.9.0), so the config= eqxdiff's messages suggest is the Hub folder diffusers' from_single_file
    fetches for it (they used to suggest Lightricks/LTX-Video for every release)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS, infer_diffusers_model_type

    from eqxdiff.core import single_file_layouts
    from eqxdiff.loading.single_file import detect_in

    tensors = {}
    with torch.device("meta"):
        for cls, config, prefix, rules in (
                (tiny.LTXVideoTransformer3DModel, tiny.LTX_2B if transformer == "LTX_2B" else tiny.LTX_13B,
                 formats.LTX_DIFFUSION_MODEL, formats.ltx_transformer),
                (tiny.AutoencoderKLLTXVideo, getattr(tiny, vae), formats.LTX_VAE, None)):
            state = cls(**config).state_dict()
            view = convert(_Names(state), inverse(rules(prefix=prefix) if rules else formats.ltx_vae(config,
                                                                                                     prefix=prefix)))
            tensors.update({n: torch.empty(view.shape(n), device="meta") for n in view.names()})
    expected = DIFFUSERS_DEFAULT_PIPELINE_PATHS[infer_diffusers_model_type(tensors)]["pretrained_model_name_or_path"]
    assert detect_in(_Names(tensors), "file", single_file_layouts()).hub_id == expected


@pytest.mark.parametrize("which", ["vae090", "vae091"])
def test_original_vae_file_loads_as_diffusers_converts_it(which, request, tmp_path_factory, tmp_path):
    """Lightricks' single file: the transformer below ``model.diffusion_model.`` and the VAE below ``vae.`` (with the
    statistics' unused ``channel`` / ``mean-of-stds`` / ``mean-of-stds_over_std-of-means`` entries, the buffers of
    Lightricks' per-channel statistics module; a file without them, as later checkpoints ship, loads the same) in one
    file.
    diffusers' converter reads the VAE back to exactly the reference's tensors (all three dropped); ``formats.ltx_vae``
    and ``formats.ltx_transformer`` load both models from the file into exactly the references' weights; written back,
    the same tensors."""
    case = request.getfixturevalue(which)
    transformer = test_ltx_model.TestLTXTiny.build(tmp_path_factory)
    vae = _original_vae(case.reference, formats.LTX_VAE)
    extras = {formats.LTX_VAE + formats.LTX_STATISTICS + n: np.full(8, i + 1, np.float32)
              for i, n in enumerate(formats.LTX_UNUSED_STATISTICS)}  # channel, mean-of-stds, their ratio: dropped
    ref = {k: v.numpy() for k, v in case.reference.state_dict().items()}
    converted = convert_ltx_vae_checkpoint_to_diffusers({k: torch.from_numpy(v) for k, v in {**vae, **extras}.items()})
    assert set(converted) == set(ref)
    for name, t in converted.items():  # renamed, not computed: exactly equal
        np.testing.assert_array_equal(t.numpy(), ref[name], err_msg=name)

    path = tmp_path / "ltx-video-tiny.safetensors"
    write_safetensors({**vae, **extras, **test_ltx_model.original_transformer(transformer.reference,
                                                                              formats.LTX_DIFFUSION_MODEL)}, path)
    rules = formats.ltx_vae(case.model.config, prefix=formats.LTX_VAE)
    got = state_dict(eqxdiff.load(path, config=case.folder, conversion=rules))
    assert set(got) == set(ref)
    for name, t in ref.items():
        np.testing.assert_array_equal(got[name], t, err_msg=name)
    bare = tmp_path / "ltx-video-tiny-two-statistics.safetensors"  # later files carry only the two read
    write_safetensors(vae, bare)
    got_bare = state_dict(eqxdiff.load(bare, config=case.folder, conversion=rules))
    assert set(got_bare) == set(ref)
    for name, t in ref.items():
        np.testing.assert_array_equal(got_bare[name], t, err_msg=name)
    back = convert_tensors(got, inverse(rules))
    assert set(back) == set(vae)
    for name, t in vae.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)
    loaded = eqxdiff.load(path, config=transformer.folder,
                          conversion=formats.ltx_transformer(prefix=formats.LTX_DIFFUSION_MODEL))
    for name, t in transformer.reference.state_dict().items():
        np.testing.assert_array_equal(state_dict(loaded)[name], t.numpy(), err_msg=name)


# -- errors ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base, change, match", [
    ("VAE_095", dict(downsample_type=("conv",) * 4), "downsample_type=.* must be a space-to-depth type for "
                                                     "LTXVideo095DownBlock3D 0 \\(8 -> 16 channels\\)"),
    ("VAE_091", dict(upsample_factor=(2, 2, 1)), "up block 1 widens 32 -> 16 channels but receives 64"),
    ("VAE_090", dict(decoder_inject_noise=(False, True, True, True, True)), "decoder_inject_noise=.* up block 2 "
                                                                            "changes the width"),
    ("VAE_090", dict(patch_size_t=2), "unsupported config value patch_size_t=2"),
    ("VAE_090", dict(layers_per_block=(1, 1, 1)), "layers_per_block=.* must have an entry for each of the 4 encoder"),
    ("VAE_091", dict(upsample_residual=(True, True)), "upsample_residual=.* at least 3 entries for 3 decoder blocks"),
    ("VAE_090", dict(timestep_conditioning=True), "timestep_conditioning=True up block 2 changes the width"),
    ("VAE_095", dict(block_out_channels=(8, 16, 24, 32, 64)), "block_out_channels=.* LTXVideo095DownBlock3D 1 a "
                                                               "temporal space-to-depth downsampler from 16 to 24"),
    ("VAE_095", dict(block_out_channels=(8, 16, 32, 48, 64)), "block_out_channels=.* LTXVideo095DownBlock3D 2 a "
                                                               "spatiotemporal .* from 32 to 48"),
    ("VAE_091", dict(decoder_block_out_channels=(3, 6, 12)), "upsample_residual=.* up block 0 adds a residual to its "
                                                               "upsampling of 12 channels with upsample_factor 2"),
    ("VAE_090", dict(down_block_types=("LTXVideoDownBlock3D",) * 3 + ("Other",)), "down_block_types=.* entries"),
    ("VAE_095", dict(spatial_compression_ratio=64), "spatial_compression_ratio=64 .* the encoder's factor, 16"),
    ("VAE_090", dict(temporal_compression_ratio=4), "temporal_compression_ratio=4 .* the encoder's factor, 8"),
])
def test_config_errors(base, change, match):
    with pytest.raises(ConfigError, match=match):
        AutoencoderKLLTXVideoConfig(**{**getattr(tiny, base), **change})


def test_call_errors(vae090, vae091):
    old, new = vae090.model, vae091.model
    z, key = jnp.zeros((1, 2, 2, 2, 8)), jax.random.key(0)

    def shape_of(fn, *args, **kwargs):
        return eqx.filter_eval_shape(lambda *a: fn(*a, **kwargs), *args)

    with pytest.raises(ValueError, match="takes no timestep .* leave timestep out"):
        shape_of(old.decode, z, 0.05)
    with pytest.raises(ValueError, match="pass timestep= .* e.g. 0.05"):
        shape_of(new.decode, z, key=key)
    with pytest.raises(ValueError, match="injects noise .* pass key="):
        shape_of(new.decode, z, 0.05)
    with pytest.raises(ValueError, match=r"timestep of shape \(3,\); give a scalar or one per video \[1\]"):
        shape_of(new.decode, z, jnp.zeros(3), key=key)
    with pytest.raises(ValueError, match="frame_chunk=0 and frame_stride=None must be positive ints"):
        shape_of(old.decode, z, frame_chunk=0)
    with pytest.raises(ValueError, match="frame_stride= needs frame_chunk="):
        shape_of(old.decode, z, frame_stride=1)
    with pytest.raises(ValueError, match="tile_sample_stride=\\(600, 600\\) must lie between"):
        shape_of(old.decode, z, tiled=True, tile_sample_stride=600)
    with pytest.raises(ValueError, match="looks channels-first"):
        shape_of(old.decode, jnp.zeros((1, 8, 2, 2, 2)))
    # space-to-depth (0.9.5): whole latents only; strided convolutions (0.9.0): any frames, multiples of the patch
    s2d = eqx.filter_eval_shape(AutoencoderKLLTXVideo, AutoencoderKLLTXVideoConfig.from_dict(tiny.VAE_095),
                                key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"a video of 8 frames; the VAE takes 1 \+ 8k frames \(nearest: 1 or 9\)"):
        shape_of(s2d.encode, jnp.zeros((1, 8, 16, 16, 3)))
    with pytest.raises(ValueError, match="frames of 16x24; height and width must be multiples of 16"):
        shape_of(s2d.encode, jnp.zeros((1, 9, 16, 24, 3)))
    assert shape_of(old.encode, jnp.zeros((1, 8, 16, 24, 3))).mean.shape == (1, 1, 1, 2, 8)
    with pytest.raises(ValueError, match="frames of 16x15; height and width must be multiples of 2"):
        shape_of(old.encode, jnp.zeros((1, 9, 16, 15, 3)))
    with pytest.raises(ValueError, match="sample_posterior=True needs a PRNG key"):
        shape_of(old, jnp.zeros((1, 9, 16, 16, 3)), sample_posterior=True)


def test_blocks_of_no_resnet_blocks_match_diffusers(tmp_path):
    """diffusers builds blocks of 0 ResNet blocks (``layers_per_block`` / ``decoder_layers_per_block`` entries of 0,
    the mid blocks' too): an encoder block of only its downsampler, an up block of only its upsampler, a noise-injecting
    mid block with nothing to inject into (no draws: the decode needs no key); and reads the encoder's mid block's
    count from the last entry, so one per block (4 here, the last block's 2 shared with the mid block) runs too.
    Encoded and decoded as diffusers."""
    config = dict(tiny.VAE_091, layers_per_block=(1, 0, 1, 2), decoder_layers_per_block=(1, 0, 1, 0),
                  decoder_inject_noise=(False, False, False, True))
    assert not AutoencoderKLLTXVideoConfig(**config).injects_noise
    reference = LTXVaeParity.make_reference(config).eval()
    randomize_torch(reference, seed=3)
    reference.save_pretrained(tmp_path)
    inputs = dict(LTXVaeParity().inputs(reference), video=np.random.default_rng(1).uniform(-1, 1, (1, 9, 32, 32, 3))
                  .astype(np.float32))
    expected = LTXVaeParity().reference_outputs(reference, inputs)
    got = run_jitted(LTXVaeParity.outputs, eqxdiff.load(tmp_path), inputs)
    for name in ("mean", "logvar", "sample"):
        assert_close(got[name], expected[name], 1e-4, name)
