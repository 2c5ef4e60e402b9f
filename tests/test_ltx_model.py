"""LTX-Video: LTXVideoTransformer3DModel against diffusers (the parity base, :mod:`tests._parity`, at two tiny configs:
one timestep per sample with patches of 1 and a padded rotary table; per-token timesteps with 2 x 2 x 2 patches and
affine block norms), explicit ``video_coords`` and conditioning tokens off the grid (the condition pipeline's form),
the scanned and rematerialised forms, 8 simulated devices, the original Lightricks names against diffusers'
converter, and the errors.

Every extra program is compiled at XLA -O0 (``run_jitted``), once. A program that runs the same model another way
(scanned, rematerialised, on a mesh) must be as accurate as the plain run is against its float64 run
(``ModelParity.actual64``)."""

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import LTXPipeline
from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers
from jax.sharding import PartitionSpec as P

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.loading import CheckpointFiles, convert_tensors, formats, inverse, state_dict, write_safetensors
from eqxdiff.models._ltx_blocks import grid_positions, rotary_tables
from eqxdiff.models.ltx import LTXVideoTransformer3DConfig, LTXVideoTransformer3DModel, pack_latents
from eqxdiff.parallel import MeshConfig, Plan, Remat, make_mesh, shard_batch, sharding_fn, with_plan

from . import _tiny_ltx as tiny
from ._parity import ModelParity, run_jitted
from ._util import assert_close, assert_close_to_float64, assert_leaves_close_to_float64, run_float64

SCALE = (8 / 25, 32, 32)  # the pipelines' rope_interpolation_scale at 25 fps: (vae_temporal / frame_rate, 32, 32)

# -- parity with diffusers ------------------------------------------------------------------------------------------


def _reference(reference, x, text, t, mask, **kwargs):
    """diffusers' transformer on our channels-last latents ``x``, packed and unpacked by diffusers' LTXPipeline."""
    c = reference.config
    p, pt = c.patch_size, c.patch_size_t
    b, f, h, w, _ = x.shape
    tokens = LTXPipeline._pack_latents(torch.from_numpy(x).permute(0, 4, 1, 2, 3), p, pt)
    out = reference(tokens, torch.from_numpy(text), torch.from_numpy(t), torch.from_numpy(mask),
                    num_frames=f // pt, height=h // p, width=w // p, **kwargs).sample
    return LTXPipeline._unpack_latents(out, f // pt, h // p, w // p, p, pt).permute(0, 2, 3, 4, 1).numpy()


class LTXParity(ModelParity):
    model_class = LTXVideoTransformer3DModel
    reference_class = tiny.LTXVideoTransformer3DModel
    full_size = {"ltx-video-2b": tiny.LTX_2B, "ltx-video-13b": tiny.LTX_13B}
    video = (2, 4, 6)  # latent frames, height, width
    text = 5
    per_token = False  # one timestep per token (image-to-video: the first frame's at 0)

    def inputs(self, reference):
        c = reference.config
        rng = np.random.default_rng(self.seed())
        b, channels = 2, c.in_channels // (c.patch_size_t * c.patch_size ** 2)
        # the second caption is all padding: diffusers' constant -10000 on every logit attends to every token
        mask = np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]], np.float32)
        if self.per_token:
            seq = np.prod([v // p for v, p in zip(self.video, (c.patch_size_t, c.patch_size, c.patch_size))])
            t = rng.uniform(0, 1000, (b, seq)).astype(np.float32)
            t[:, :seq // (self.video[0] // c.patch_size_t)] = 0.0  # the conditioning frame's tokens
        else:
            t = np.array([999.0, 250.0], np.float32)
        return dict(hidden_states=rng.standard_normal((b, *self.video, channels), np.float32),
                    encoder_hidden_states=rng.standard_normal((b, self.text, c.caption_channels), np.float32),
                    timestep=t, encoder_attention_mask=mask)

    def bf16_inputs(self, inputs):
        return {k: v.astype(jnp.bfloat16) if k in ("hidden_states", "encoder_hidden_states") else v
                for k, v in inputs.items()}

    def reference_outputs(self, reference, inputs):
        return dict(sample=_reference(reference, *(inputs[k] for k in ("hidden_states", "encoder_hidden_states",
                                                                       "timestep", "encoder_attention_mask")),
                                      rope_interpolation_scale=SCALE))

    @staticmethod
    def outputs(model, inputs):
        return dict(sample=model(inputs["hidden_states"], inputs["encoder_hidden_states"], inputs["timestep"],
                                 inputs["encoder_attention_mask"], rope_interpolation_scale=SCALE))


class TestLTXTiny(LTXParity):
    """4 heads of 8 (a width of 32: 2 rotary channels padded in front), patches of 1, one timestep per sample."""

    config = tiny.TRANSFORMER


class TestLTXPatchedPerToken(LTXParity):
    """3 heads of 8, patches of 2 x 2 x 2 (in/out 16 = 2 latent channels packed), affine block norms, one
    timestep per token (the first frame's tokens at 0)."""

    config = tiny.TRANSFORMER_PATCHED
    video, per_token = (4, 4, 6), True


@pytest.fixture(scope="module")
def tiny_case(tmp_path_factory):
    return TestLTXTiny.build(tmp_path_factory)


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    return TestLTXPatchedPerToken.build(tmp_path_factory)


# -- positions ------------------------------------------------------------------------------------------------------


def test_rotary_tables_equal_the_numpy_tables():
    """The tables from traced-capable positions (``jnp``) equal nn.ltx_rope's NumPy ones (float64 cosines of the same
    float32 angles) to a float32 cosine's rounding, padded in front where the width is not a multiple of 6."""
    for dim in (32, 24):
        for scale in (None, SCALE):
            ours = rotary_tables(grid_positions((2, 3, 4), scale), dim)
            ref = eqxdiff.nn.ltx_rope(dim, grid=(2, 3, 4), interpolation_scale=scale)
            np.testing.assert_allclose(ours.cos, ref.cos, atol=2e-6)
            np.testing.assert_allclose(ours.sin, ref.sin, atol=2e-6)
    padded = rotary_tables(grid_positions((1, 1, 2), SCALE), 32)
    np.testing.assert_array_equal(padded.cos[..., :2], 1.0)
    np.testing.assert_array_equal(padded.sin[..., :2], 0.0)


@pytest.mark.parametrize("heads, head_dim", [(2, 5), (3, 8)])
def test_rotary_application_pairs_the_inner_dimension_as_diffusers(heads, head_dim):
    """diffusers rotates channel pairs of the whole inner dimension before its head split: an odd head_dim's pairs
    straddle two heads (a width of 10 as 2 heads of 5 is a valid config). ``nn.apply_rope`` on ``[b, s, heads,
    head_dim]`` with LTX's table over the inner dimension rotates the same pairs; an odd width does not pair up."""
    from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

    rng = np.random.default_rng(heads)
    x = rng.standard_normal((2, 7, heads * head_dim), np.float32)
    table = rotary_tables(jnp.asarray(rng.uniform(0, 1, (2, 7, 3)), jnp.float32), heads * head_dim)
    expected = apply_rotary_emb(torch.from_numpy(x), tuple(torch.from_numpy(np.array(t)) for t in table)).numpy()
    got = eqxdiff.nn.apply_rope(jnp.asarray(x).reshape(2, 7, heads, head_dim), table)
    np.testing.assert_allclose(np.asarray(got).reshape(x.shape), expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="heads \\* head_dim = 15 channels do not pair up"):
        eqxdiff.nn.apply_rope(jnp.zeros((1, 6, 3, 5)), rotary_tables(grid_positions((1, 2, 3)), 15))


def _conditioned(model, inputs):
    """The condition pipeline's form: conditioning tokens prepended to the video's, every token positioned by
    ``video_coords`` (traced here), run through ``forward_tokens``; and the grid call positioned by coords."""
    c, coords, extra = model.config, inputs["coords"], inputs["extra"]
    tokens = pack_latents(inputs["hidden_states"], c.patch_size, c.patch_size_t)
    rope = model.rotary_embedding(video_coords=coords)
    t = jnp.concatenate([jnp.zeros((2, extra.shape[1])), jnp.broadcast_to(inputs["timestep"][:, None],
                                                                            (2, tokens.shape[1]))], axis=1)
    joined = model.forward_tokens(jnp.concatenate([extra, tokens], axis=1), inputs["encoder_hidden_states"], t,
                                  inputs["encoder_attention_mask"], rope)
    grid = model(inputs["hidden_states"], inputs["encoder_hidden_states"], inputs["timestep"],
                 inputs["encoder_attention_mask"], video_coords=coords[:, :, extra.shape[1]:])
    return joined, grid


def test_video_coords_and_tokens_off_the_grid(tiny_case):
    """``video_coords`` (LTXConditionPipeline's latent-pixel coordinates, traced) over 3 prepended conditioning tokens
    and the video's 48: ``forward_tokens`` equals diffusers given the same tokens and coords (per-token timesteps,
    the conditioning tokens at 0); the grid call with the video's coords equals diffusers' too."""
    model, inputs, ref = tiny_case.model, tiny_case.inputs, tiny_case.reference
    rng = np.random.default_rng(3)
    extra = rng.standard_normal((2, 3, 8), np.float32)
    grid = np.stack(np.meshgrid(np.arange(2), np.arange(4), np.arange(6), indexing="ij")).reshape(3, -1)
    coords = np.concatenate([np.array([[0, 0, 0], [0, 32, 64], [8, 96, 0]]).T,
                             grid * np.array([[8 / 25 * 20], [32], [32]])], axis=1)
    coords = np.broadcast_to(coords, (2, 3, 51)).astype(np.float32)
    joined, on_grid = run_jitted(_conditioned, model, dict(inputs, coords=coords, extra=extra))
    tokens = LTXPipeline._pack_latents(torch.from_numpy(inputs["hidden_states"]).permute(0, 4, 1, 2, 3), 1, 1)
    t = torch.cat([torch.zeros(2, 3), torch.from_numpy(inputs["timestep"])[:, None].expand(2, 48)], dim=1)
    with torch.no_grad():
        expected = ref(torch.cat([torch.from_numpy(extra), tokens], 1),
                       torch.from_numpy(inputs["encoder_hidden_states"]), t,
                       torch.from_numpy(inputs["encoder_attention_mask"]),
                       video_coords=torch.from_numpy(coords)).sample.numpy()
        expected_grid = _reference(ref, *(inputs[k] for k in ("hidden_states", "encoder_hidden_states", "timestep",
                                                               "encoder_attention_mask")),
                                   video_coords=torch.from_numpy(np.ascontiguousarray(coords[:, :, 3:])))
    assert_close(joined, expected, 1e-4, "conditioning tokens + video_coords vs diffusers")
    assert_close(on_grid, expected_grid, 1e-4, "grid call with video_coords vs diffusers")


# -- the same model, run other ways ---------------------------------------------------------------------------------


def test_scanned_equals_unrolled(patched):
    scanned = eqxdiff.nn.scan_layers(patched.model)
    assert isinstance(scanned.transformer_blocks, eqxdiff.nn.Stacked)
    assert scanned.transformer_blocks.layers.scale_shift_table.table.shape == (2, 6, 24)
    out = TestLTXPatchedPerToken.run(scanned, patched.inputs)["sample"]
    assert_close_to_float64(out, patched.actual["sample"], TestLTXPatchedPerToken.actual64(patched)["sample"],
                            what="scanned vs unrolled")


def _loss(model, inputs):
    return jnp.mean(LTXParity.outputs(model, inputs)["sample"] ** 2)


def test_remat_gives_the_same_gradients(tiny_case):
    """Remat at the block boundaries, saving only the attention outputs (NAMED), changes nothing but memory."""
    model, inputs = tiny_case.model, tiny_case.inputs
    named = with_plan(model, Plan(remat=Remat.NAMED, remat_names=("ltx_self_attention", "ltx_cross_attention")))
    assert "remat" not in str(jax.make_jaxpr(_loss)(model, inputs))
    for remat in (named, with_plan(model, Plan(remat=Remat.FULL))):
        assert str(jax.make_jaxpr(_loss)(remat, inputs)).count("remat") == 2  # one per block

    def grads(models, inputs):
        return [eqx.filter_grad(_loss)(m, inputs) for m in models]

    plain, got = run_jitted(grads, (model, named), inputs)
    (plain64,) = run_float64(grads, (model,), inputs)
    assert_leaves_close_to_float64(got, plain, plain64, what="remat gradient")
    with pytest.raises(ValueError, match="ltx_self_attention"):
        with_plan(model, Plan(remat=Remat.NAMED, remat_names=("attention",)))


def test_mesh_equals_single_device(patched):
    """On 8 devices (FSDP 2 x context 2 x tensor 2), loaded straight onto the mesh by the declared axes, scanned and
    fully rematerialised: the video tokens split over ``context`` (the self-attention runs a context-parallel kernel
    in a shard_map), the heads over ``tensor``; the output equals one device's."""
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=2,
                                ici_tensor_parallelism=2))
    model = eqxdiff.load(patched.folder, sharding=sharding_fn(mesh), scan_layers=True)
    model = with_plan(model, Plan(mesh, remat=Remat.FULL))
    q = model.transformer_blocks.layers.attn1.to_q.weight  # [layers, heads * head_dim, embed]
    assert q.sharding.spec == P(None, "tensor", "fsdp")
    inputs = shard_batch(patched.inputs, mesh)
    assert "shard_map" in str(jax.make_jaxpr(TestLTXPatchedPerToken.outputs)(model, inputs))
    out = TestLTXPatchedPerToken.run(model, inputs)["sample"]
    assert_close_to_float64(out, patched.actual["sample"], TestLTXPatchedPerToken.actual64(patched)["sample"],
                            what="mesh vs one device")


# -- Lightricks' original names -------------------------------------------------------------------------------------


def original_transformer(reference, prefix: str = "") -> dict[str, np.ndarray]:
    """The reference's weights in Lightricks' names (the rules' inverse), below ``prefix``."""
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    return {prefix + k: v for k, v in convert_tensors(state, inverse(formats.ltx_transformer())).items()}


def test_original_names_equal_diffusers_converter(patched, tmp_path):
    """The reference's weights in the original names read back by diffusers' ``convert_ltx_transformer_checkpoint_
    to_diffusers`` to the same tensors; a file of them below ``model.diffusion_model.`` (with a VAE tensor beside, as
    Lightricks' single files hold) loads through ``formats.ltx_transformer`` into exactly the reference's weights and
    writes back to the same tensors."""
    original = original_transformer(patched.reference, formats.LTX_DIFFUSION_MODEL)
    assert {"model.diffusion_model.patchify_proj.weight", "model.diffusion_model.adaln_single.linear.weight",
            "model.diffusion_model.transformer_blocks.1.attn2.k_norm.weight"} <= set(original)
    ref = {k: v.numpy() for k, v in patched.reference.state_dict().items()}
    converted = convert_ltx_transformer_checkpoint_to_diffusers({k: torch.from_numpy(v) for k, v in original.items()})
    assert set(converted) == set(ref)
    for name, t in converted.items():  # renamed, not computed: exactly equal
        np.testing.assert_array_equal(t.numpy(), ref[name], err_msg=name)

    path = tmp_path / "ltx-video-tiny.safetensors"
    write_safetensors({**original, "vae.decoder.conv_in.conv.bias": np.zeros(3, np.float32)}, path)
    rules = formats.ltx_transformer(prefix=formats.LTX_DIFFUSION_MODEL)
    got = state_dict(eqxdiff.load(path, config=patched.folder, conversion=rules))
    assert set(got) == set(ref)
    for name, t in ref.items():
        np.testing.assert_array_equal(got[name], t, err_msg=name)
    back = convert_tensors(got, inverse(rules))
    assert set(back) == set(original) == set(CheckpointFiles([path]).names()) - {"vae.decoder.conv_in.conv.bias"}
    for name, t in original.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)



def test_a_transformer_file_without_the_prefix_loads_as_diffusers_reads_it(patched, tmp_path):
    """A transformer file in Lightricks' names without ``model.diffusion_model.`` (diffusers' from_single_file reads
    it: its LTX keys include the bare ``patchify_proj.weight``) is a layout too: eqxdiff.load(file, config=) reads it
    without conversion= (it used to report every tensor missing), bfloat16 tensors exactly as stored."""
    import ml_dtypes

    original = {k: v.astype(ml_dtypes.bfloat16) for k, v in original_transformer(patched.reference).items()}
    path = tmp_path / "ltx-transformer-bare.safetensors"
    write_safetensors(original, path)
    theirs = diffusers.LTXVideoTransformer3DModel.from_single_file(str(path), config=str(patched.folder),
                                                                   torch_dtype=torch.float32)
    got = state_dict(eqxdiff.load(path, config=patched.folder))
    expected = {k: v.numpy() for k, v in theirs.state_dict().items()}
    assert set(got) == set(expected)
    for name, t in expected.items():
        np.testing.assert_array_equal(got[name], t, err_msg=name)


# -- errors ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, match", [
    (dict(cross_attention_dim=16), "cross_attention_dim=16 must equal num_attention_heads \\* attention_head_dim = 32"),
    (dict(patch_size=3), "in_channels=8 must be a multiple of patch_size_t \\* patch_size \\*\\* 2 = 9"),
    (dict(out_channels=7, patch_size_t=2), "out_channels=7 must be a multiple of .* = 2"),
    (dict(qk_norm="rms_norm"), "unsupported config value qk_norm='rms_norm'"),
    (dict(activation_fn="relu"), "unsupported config value activation_fn='relu'"),
    (dict(num_attention_heads=1, attention_head_dim=4, cross_attention_dim=4), "attention_head_dim=4 must make"),
    (dict(num_attention_heads=3, attention_head_dim=5, cross_attention_dim=15), "attention_head_dim=5 must make .* "
                                                                                "\\(now 15\\) even"),
])
def test_config_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        LTXVideoTransformer3DConfig(**{**tiny.TRANSFORMER, **change})


def test_call_errors(tiny_case):
    model, i = tiny_case.model, {k: jnp.asarray(v) for k, v in tiny_case.inputs.items()}
    x, text, t, mask = i["hidden_states"], i["encoder_hidden_states"], i["timestep"], i["encoder_attention_mask"]

    def call(*args, **kwargs):
        return eqx.filter_eval_shape(lambda *a: model(*a, **kwargs), *args)

    with pytest.raises(ValueError, match=r"expects latents \[batch, frames, height, width, 8\]"):
        call(x[..., :4], text, t, mask)
    with pytest.raises(ValueError, match=r"per-token timesteps of shape \(2, 5\) for 48 tokens"):
        call(x, text, jnp.zeros((2, 5)), mask)
    with pytest.raises(ValueError, match=r"encoder_attention_mask of shape \(2, 4\) for 2 captions of 5 tokens"):
        call(x, text, t, mask[:, :4])
    with pytest.raises(ValueError, match="leave rope_interpolation_scale out"):
        call(x, text, t, mask, rope_interpolation_scale=SCALE, video_coords=jnp.zeros((2, 3, 48)))
    with pytest.raises(ValueError, match=r"video_coords of shape \(2, 3, 40\) for a grid of \(2, 4, 6\)"):
        call(x, text, t, mask, video_coords=jnp.zeros((2, 3, 40)))
    with pytest.raises(ValueError, match="rope_interpolation_scale=.*give three values"):
        call(x, text, t, mask, rope_interpolation_scale=(1.0, 32))
    with pytest.raises(ValueError, match="rotary tables of shape"):
        eqx.filter_eval_shape(model.forward_tokens, pack_latents(x), text, t, mask,
                              model.rotary_embedding((1, 4, 6)))
    with pytest.raises(ValueError, match=r"not both and not neither"):
        model.rotary_embedding()


def test_patches_must_divide_the_latents(patched):
    i = {k: jnp.asarray(v) for k, v in patched.inputs.items()}
    with pytest.raises(ValueError, match=r"latents of 3 frames x 4 x 6 do not divide into patches of \(2, 2, 2\)"):
        eqx.filter_eval_shape(patched.model, i["hidden_states"][:, :3], i["encoder_hidden_states"], 1.0)


def test_every_diffusers_feedforward_activation(tmp_path):
    """diffusers' LTX transformer takes any of its FeedForward's ``activation_fn`` values; eqxdiff refused all but three
    (a clear error, for configs diffusers runs). One block with the gated SwiGLU equals diffusers'."""
    for name in ("swiglu", "geglu-approximate", "linear-silu", "geglu", "gelu"):
        LTXVideoTransformer3DConfig(**{**tiny.TRANSFORMER, "activation_fn": name})
    reference = tiny.transformer(dict(tiny.TRANSFORMER, activation_fn="swiglu", num_layers=1), seed=3)
    reference.save_pretrained(tmp_path)
    rng = np.random.default_rng(0)
    x, text = rng.standard_normal((2, 1, 2, 3, 8), np.float32), rng.standard_normal((2, 5, 16), np.float32)
    t, mask = np.array([999.0, 10.0], np.float32), np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], np.float32)
    inputs = dict(hidden_states=x, encoder_hidden_states=text, timestep=t, encoder_attention_mask=mask)
    with torch.no_grad():
        expected = _reference(reference, x, text, t, mask, rope_interpolation_scale=SCALE)
    got = run_jitted(LTXParity.outputs, eqxdiff.load(tmp_path), inputs)["sample"]
    assert_close(got, expected, 1e-4, "swiglu transformer vs diffusers")
