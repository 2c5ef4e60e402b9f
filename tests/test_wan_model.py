"""Wan 2.1 / 2.2: WanTransformer3DModel against diffusers (the parity base, :mod:`tests._parity`, at four tiny configs:
text-to-video, image-to-video with the image tokens prepended to the text, first-last-frame image-to-video through
the added k/v projections, TI2V with per-token timesteps), the cached cross-attention keys and values, the scanned
and rematerialised forms, 8 simulated devices, the original Wan checkpoints' names against diffusers' converter, and
the errors.

Every extra program is compiled at XLA -O0 (``run_jitted``), once, from module-scoped fixtures. A program that runs
the same model another way (cached keys and values, scanned, rematerialised, on a mesh) must be as accurate as the
plain run is against its float64 run (``ModelParity.actual64``)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from jax.sharding import PartitionSpec as P

import eqxdiff
from eqxdiff.core import ConfigError, leaf_specs
from eqxdiff.loading import (
    CheckpointFiles,
    convert_tensors,
    formats,
    inverse,
    state_dict,
    write_safetensors,
)
from eqxdiff.models.wan import CrossKV, WanTransformer3DConfig, WanTransformer3DModel
from eqxdiff.parallel import (
    MeshConfig,
    Plan,
    Remat,
    make_mesh,
    shard_batch,
    sharding_fn,
    with_plan,
)

from . import _tiny_wan as tiny
from ._parity import ModelParity, run_jitted
from ._util import (
    assert_close,
    assert_close_to_float64,
    assert_leaves_close_to_float64,
    nchw_to_nhwc,
    run_float64,
)

# -- parity with diffusers ------------------------------------------------------------------------------------------


class WanParity(ModelParity):
    model_class = WanTransformer3DModel
    reference_class = tiny.WanTransformer3DModel  # diffusers', loadable without accelerate
    video = (3, 4, 6)  # latent frames, height, width
    text = 7  # text tokens
    image: tuple[int, int] | None = None  # (images per sample, tokens per image): CLIP's image tokens
    per_token = False  # timesteps per video token (Wan 2.2 TI2V), first frame's at 0

    def inputs(self, reference):
        c = reference.config
        rng = np.random.default_rng(self.seed())
        b = 2
        out = dict(hidden_states=rng.standard_normal((b, *self.video, c.in_channels), np.float32),
                   encoder_hidden_states=rng.standard_normal((b, self.text, c.text_dim), np.float32))
        if self.per_token:
            grid = [v // p for v, p in zip(self.video, c.patch_size)]
            t = np.repeat(np.array([[999.0], [250.0]], np.float32), np.prod(grid), axis=1).reshape(b, *grid)
            t[:, 0] = 0.0  # the conditioning frame's tokens
            out["timestep"] = (t + rng.integers(0, 20, t.shape)).reshape(b, -1).astype(np.float32)
        else:
            out["timestep"] = np.array([999.0, 250.0], np.float32)
        if self.image is not None:
            n, tokens = self.image
            out["encoder_hidden_states_image"] = rng.standard_normal((n * b, tokens, c.image_dim), np.float32)
        return out

    def bf16_inputs(self, inputs):
        return {k: v if k == "timestep" else v.astype(jnp.bfloat16) for k, v in inputs.items()}

    def reference_outputs(self, reference, inputs):
        kwargs = {k: torch.from_numpy(v) for k, v in inputs.items()}
        kwargs["hidden_states"] = kwargs["hidden_states"].permute(0, 4, 1, 2, 3)
        return dict(sample=nchw_to_nhwc(reference(**kwargs).sample))

    @staticmethod
    def outputs(model, inputs):
        return dict(sample=model(inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"],
                                 inputs.get("encoder_hidden_states_image")))


class TestWanT2V(WanParity):
    """diffusers' tiny model-test config: text-to-video, 2 heads of 12, patch (1, 2, 2), cross-attention norm."""

    config = tiny.TRANSFORMER
    full_size = {"wan2.1-t2v-1.3b": tiny.WAN21_T2V_1_3B}


class TestWanI2VPrepended(WanParity):
    """Image-to-video without added k/v (diffusers' tiny I2V tests): CLIP tokens embedded and prepended to the text;
    3 layers, patch (2, 1, 2), in 9 / out 5 channels, no cross-attention norm, eps 1e-5, 3 heads of 10 (rotary
    channels 6/2/2: not a multiple of 6)."""

    config = dict(tiny.TRANSFORMER, in_channels=9, out_channels=5, image_dim=4, patch_size=(2, 1, 2), num_layers=3,
                  cross_attn_norm=False, eps=1e-5, num_attention_heads=3, attention_head_dim=10)
    full_size = {"wan2.1-t2v-14b": tiny.WAN21_T2V_14B}
    video, image = (4, 3, 4), (1, 5)


class TestWanFLF2VAddedKV(WanParity):
    """First-last-frame image-to-video (Wan 2.1 FLF2V): two images' CLIP tokens per sample, learned positions
    (``pos_embed``), attended through each block's ``add_k_proj`` / ``add_v_proj``. diffusers cuts the text off the
    end of its context at a hard-coded 512 tokens, so the text has 512."""

    config = dict(tiny.TRANSFORMER, image_dim=8, added_kv_proj_dim=24, pos_embed_seq_len=10)
    full_size = {"wan2.1-i2v-14b": tiny.WAN21_I2V_14B, "wan2.1-flf2v-14b": tiny.WAN21_FLF2V_14B}
    text, image = 512, (2, 5)


class TestWanTI2VPerToken(WanParity):
    """Wan 2.2 TI2V: one timestep per video token (``expand_timesteps``; the first frame's near 0), 3 heads of 8
    (rotary channels 4/2/2), in/out 12, an odd freq_dim (33: the sinusoid zero-padded, as diffusers')."""

    config = dict(tiny.TRANSFORMER, in_channels=12, out_channels=12, num_attention_heads=3, attention_head_dim=8,
                  ffn_dim=20, freq_dim=33)
    full_size = {"wan2.2-ti2v-5b": tiny.WAN22_TI2V_5B}
    per_token = True


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    return TestWanT2V.build(tmp_path_factory)


@pytest.fixture(scope="module")
def flf2v(tmp_path_factory):
    return TestWanFLF2VAddedKV.build(tmp_path_factory)


@pytest.fixture(scope="module")
def prepended(tmp_path_factory):
    return TestWanI2VPrepended.build(tmp_path_factory)


# -- the same model, run other ways ---------------------------------------------------------------------------------


def _other_ways(model, inputs):
    """The plain call's output three other ways: with the cross-attention keys and values computed first (as a
    denoising loop does once per prompt), scanned, and scanned with cached keys and values."""
    x, t, text, image = (inputs[k] for k in ("hidden_states", "timestep", "encoder_hidden_states",
                                             "encoder_hidden_states_image"))
    scanned = eqxdiff.nn.scan_layers(model)
    return dict(cached=model(x, t, cross_kv=model.cross_attention_kv(text, image)),
                scanned=scanned(x, t, text, image),
                scanned_cached=scanned(x, t, cross_kv=scanned.cross_attention_kv(text, image)))


def test_cached_cross_attention_and_scan_equal_the_plain_call(flf2v):
    """Added k/v, image embedder with positions: the cached keys and values (``[layers, batch, ctx, heads,
    head_dim]``, text and image apart) and the scanned blocks give the plain call's numbers."""
    model, inputs = flf2v.model, flf2v.inputs
    kv = eqx.filter_eval_shape(model.cross_attention_kv, *(jnp.asarray(inputs[k]) for k in (
        "encoder_hidden_states", "encoder_hidden_states_image")))
    assert isinstance(kv, CrossKV)
    assert kv.k.shape == (2, 2, 512, 2, 12) and kv.k_img.shape == (2, 2, 10, 2, 12)
    out = run_jitted(_other_ways, model, inputs)
    for name, value in out.items():
        assert_close_to_float64(value, flf2v.actual["sample"], TestWanFLF2VAddedKV.actual64(flf2v)["sample"],
                                what=f"{name} vs plain")


def test_cached_kv_without_added_projections(prepended):
    """Image tokens prepended to the text: one set of keys and values over both, no image ones."""
    model, inputs = prepended.model, prepended.inputs

    def cached(m, i):
        kv = m.cross_attention_kv(i["encoder_hidden_states"], i["encoder_hidden_states_image"])
        return kv, m(i["hidden_states"], i["timestep"], cross_kv=kv)

    kv, out = run_jitted(cached, model, inputs)
    assert kv.k.shape == (3, 2, 5 + 7, 3, 10) and kv.k_img is None and kv.v_img is None
    assert_close(out, prepended.expected["sample"], 1e-4, "cached vs diffusers")


def test_per_token_timesteps_of_one_value_equal_one_per_sample(t2v):
    """A text-to-video batch through the per-token path (what the TI2V pipeline passes without an image: every
    token at the step's timestep) gives diffusers' per-sample output."""
    model, inputs = t2v.model, t2v.inputs
    seq = 3 * 2 * 3
    t = jnp.repeat(jnp.asarray(inputs["timestep"])[:, None], seq, axis=1)
    out = run_jitted(lambda m, i: m(i["hidden_states"], i["t"], i["encoder_hidden_states"]), model,
                     {**inputs, "t": t})
    assert_close(out, t2v.expected["sample"], 1e-4, "per-token timesteps vs per sample")


def _loss(model, inputs):
    return jnp.mean(WanParity.outputs(model, inputs)["sample"] ** 2)


def test_remat_gives_the_same_gradients(t2v):
    """Remat at the block boundaries, saving only the attention outputs (NAMED), changes nothing but memory."""
    model, inputs = t2v.model, t2v.inputs
    named = with_plan(model, Plan(remat=Remat.NAMED, remat_names=("wan_self_attention", "wan_cross_attention")))
    assert "remat" not in str(jax.make_jaxpr(_loss)(model, inputs))
    for remat in (named, with_plan(model, Plan(remat=Remat.FULL))):
        assert str(jax.make_jaxpr(_loss)(remat, inputs)).count("remat") == 2  # one per block

    def grads(models, inputs):
        return [eqx.filter_grad(_loss)(m, inputs) for m in models]

    plain, got = run_jitted(grads, (model, named), inputs)
    (plain64,) = run_float64(grads, (model,), inputs)
    assert_leaves_close_to_float64(got, plain, plain64, what="remat gradient")
    with pytest.raises(ValueError, match="wan_self_attention"):
        with_plan(model, Plan(remat=Remat.NAMED, remat_names=("attention",)))


def test_mesh_equals_single_device(flf2v):
    """On 8 devices (FSDP 2 x context 2 x tensor 2), loaded straight onto the mesh by the declared axes, scanned and
    fully rematerialised: the video tokens split over ``context`` (the attention runs a context-parallel kernel in a
    shard_map), the heads over ``tensor``; the output equals one device's."""
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=2,
                                ici_tensor_parallelism=2))
    model = eqxdiff.load(flf2v.folder, sharding=sharding_fn(mesh), scan_layers=True)
    model = with_plan(model, Plan(mesh, remat=Remat.FULL))
    q = model.blocks.layers.attn1.to_q.weight  # [layers, heads * head_dim, embed]
    assert q.sharding.spec == P(None, "tensor", "fsdp")
    inputs = shard_batch(flf2v.inputs, mesh)
    assert "shard_map" in str(jax.make_jaxpr(TestWanFLF2VAddedKV.outputs)(model, inputs))
    out = TestWanFLF2VAddedKV.run(model, inputs)["sample"]
    assert_close_to_float64(out, flf2v.actual["sample"], TestWanFLF2VAddedKV.actual64(flf2v)["sample"],
                            what="mesh vs one device")


# -- the original Wan checkpoints -----------------------------------------------------------------------------------


def _original(reference, prefix=""):
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    return {prefix + k: v for k, v in convert_tensors(state, inverse(formats.wan_transformer())).items()}


@pytest.mark.parametrize("which", ["flf2v", "prepended"])
def test_original_names_equal_diffusers_converter(which, request, tmp_path):
    """The reference's weights in the original names (the rules' inverse) read back by diffusers'
    ``convert_wan_transformer_to_diffusers`` to the same tensors; a ComfyUI-prefixed file of them loads through
    ``formats.wan_transformer`` into exactly the reference's weights and writes back to the same file."""
    case = request.getfixturevalue(which)
    original = _original(case.reference)
    assert "blocks.0.self_attn.q.weight" in original and "head.modulation" in original
    added = which == "flf2v"
    assert ("blocks.1.cross_attn.k_img.weight" in original) == added
    assert ("blocks.1.norm3.weight" in original) == added  # the affine cross-attention norm (cross_attn_norm)
    ref = {k: v.numpy() for k, v in case.reference.state_dict().items()}
    # diffusers' single-file converter has no name for FLF2V's positions (its convert script maps img_emb.emb_pos)
    converted = convert_wan_transformer_to_diffusers({k: torch.from_numpy(v) for k, v in original.items()})
    if added:
        assert converted.pop("img_emb.emb_pos") is not None
        np.testing.assert_array_equal(original["img_emb.emb_pos"], ref.pop("condition_embedder.image_embedder."
                                                                            "pos_embed"))
    assert set(converted) == set(ref)
    for name, t in converted.items():  # renamed, not computed: exactly equal
        np.testing.assert_array_equal(t.numpy(), ref[name], err_msg=name)

    path = tmp_path / "wan_tiny.safetensors"
    write_safetensors(_original(case.reference, formats.WAN_DIFFUSION_MODEL), path)
    rules = formats.wan_transformer(prefix=formats.WAN_DIFFUSION_MODEL)
    ours = eqxdiff.load(path, config=case.folder, conversion=rules)
    got = state_dict(ours)
    assert set(got) == {k for k in case.reference.state_dict()}
    for name, t in case.reference.state_dict().items():
        np.testing.assert_array_equal(got[name], t.numpy(), err_msg=name)
    back = convert_tensors(got, inverse(rules))
    assert set(back) == set(CheckpointFiles([path]).names())
    for name, t in _original(case.reference, formats.WAN_DIFFUSION_MODEL).items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)


def test_unused_norm_added_q_is_ignored(flf2v, tmp_path):
    """Some image-to-video checkpoints hold an unused ``attn2.norm_added_q`` (diffusers'
    ``_keys_to_ignore_on_load_unexpected``): it loads as without it."""
    tensors = {k: v.numpy() for k, v in flf2v.reference.state_dict().items()}
    tensors["blocks.1.attn2.norm_added_q.weight"] = np.ones(24, np.float32)
    write_safetensors(tensors, tmp_path / "diffusion_pytorch_model.safetensors")
    (tmp_path / "config.json").write_text((flf2v.folder / "config.json").read_text())
    again = eqxdiff.load(tmp_path)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(flf2v.model), strict=True):
        np.testing.assert_array_equal(a, b)


# -- errors ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, match", [
    (dict(added_kv_proj_dim=16, image_dim=4), "added_kv_proj_dim=16 must be null or the model width .* 24"),
    (dict(added_kv_proj_dim=24), "added_kv_proj_dim=24 needs image_dim"),
    (dict(pos_embed_seq_len=10), "pos_embed_seq_len=10 needs image_dim"),
    (dict(patch_size=(1, 0, 2)), "patch_size=.* three positive"),
    (dict(attention_head_dim=5), "attention_head_dim=5 must be even"),
])
def test_config_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        WanTransformer3DConfig(**{**tiny.TRANSFORMER, **change})


def test_configs_diffusers_builds_are_accepted():
    """diffusers builds heads of 2 or 4 channels (all rotary channels on frames) and odd freq_dims (the sinusoid
    zero-padded); the config used to reject both (TestWanTI2VPerToken runs freq_dim 33 against diffusers)."""
    for d in (2, 4):
        assert WanTransformer3DConfig(**{**tiny.TRANSFORMER, "attention_head_dim": d}).inner_dim == 2 * d
    assert WanTransformer3DConfig(**{**tiny.TRANSFORMER, "freq_dim": 33}).freq_dim == 33
    # qk_norm: diffusers' blocks ignore it (queries and keys are RMS-normed across heads whatever it says): the same
    # parameters for any value
    import diffusers

    for value in (None, "rms_norm"):
        with torch.device("meta"):
            ref = diffusers.WanTransformer3DModel(**{**tiny.TRANSFORMER, "qk_norm": value})
        config = WanTransformer3DConfig(**{**tiny.TRANSFORMER, "qk_norm": value})
        ours = eqx.filter_eval_shape(WanTransformer3DModel, config, key=jax.random.key(0))
        assert sorted(ref.state_dict()) == sorted(n for spec in leaf_specs(ours)[1] for n in spec.names)


def test_call_errors(t2v, prepended):
    model, i = t2v.model, {k: jnp.asarray(v) for k, v in t2v.inputs.items()}
    x, t, text = i["hidden_states"], i["timestep"], i["encoder_hidden_states"]
    with pytest.raises(ValueError, match="not both and not neither"):
        model(x, t)
    with pytest.raises(ValueError, match="not both"):
        model(x, t, text, cross_kv=eqx.filter_eval_shape(model.cross_attention_kv, text))
    with pytest.raises(ValueError, match="has no image embedder"):
        model(x, t, text, jnp.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match=r"per-token timesteps of shape \(2, 5\) for 18 video tokens"):
        model(x, jnp.zeros((2, 5)), text)
    with pytest.raises(ValueError, match=r"do not divide into patches of \(1, 2, 2\)"):
        model(x[:, :, :3], t, text)
    with pytest.raises(ValueError, match="longer than rope_max_seq_len=32"):
        model(jnp.zeros((1, 33, 2, 2, 4)), t[:1], text[:1])
    i2v, p = prepended.model, {k: jnp.asarray(v) for k, v in prepended.inputs.items()}
    with pytest.raises(ValueError, match="is required by this image-to-video model"):
        i2v(p["hidden_states"], p["timestep"], p["encoder_hidden_states"])
    kv = eqx.filter_eval_shape(i2v.cross_attention_kv, p["encoder_hidden_states"], p["encoder_hidden_states_image"])
    with pytest.raises(ValueError, match="the image tokens are in it already"):
        i2v(p["hidden_states"], p["timestep"], cross_kv=kv,
            encoder_hidden_states_image=p["encoder_hidden_states_image"])


def test_flf2v_image_tokens_must_fit_the_positions(flf2v):
    image = jnp.asarray(flf2v.inputs["encoder_hidden_states_image"])
    with pytest.raises(ValueError, match=r"for a pos_embed of 10 tokens; give \[batch, 10, 8\]"):
        flf2v.model.cross_attention_kv(jnp.asarray(flf2v.inputs["encoder_hidden_states"]), image[:, :3])


def test_rotary_tables_are_one_constant_each(t2v):
    """Under jit the NumPy rotary tables become one constant each, whatever the number of blocks (one copy per block
    and use made a 40-block 14B at 720p carry 6 GB of constants)."""
    model, i = t2v.model, t2v.inputs
    traced = jax.make_jaxpr(lambda m, x, t, e: m(x, t, e))(
        model, *(jnp.asarray(i[k]) for k in ("hidden_states", "timestep", "encoder_hidden_states")))
    head_dim = model.config.attention_head_dim
    tables = [c for c in traced.consts if getattr(c, "ndim", 0) == 2 and c.shape[-1] == head_dim]
    assert model.config.num_layers >= 2 and len(tables) == 2
