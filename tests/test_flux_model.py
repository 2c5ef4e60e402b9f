"""Flux.1: FluxTransformer2DModel against diffusers (the parity base, :mod:`tests._parity`, at three tiny configs), its
scanned, fused, rematerialised and sharded forms, Black Forest Labs' single files (float8 too) against diffusers'
own converter and ``from_single_file``, the Flux VAE settings, the packed token layout and the errors.

Every extra program (scan, fused, remat, meshes) is compiled at XLA -O0, once, from module-scoped fixtures. Each is
the same model run another way, so only float32 rounding differs from the plain run, and it must be as accurate as
the plain run is against its float64 run (``ModelParity.actual64``): the rounding itself depends on the CPU (FMA
contraction, vector-width blocking of XLA's dot products), so no fixed bound."""

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.loaders import single_file_model
from jax.sharding import PartitionSpec as P
from safetensors.torch import save_file

import eqxdiff
from eqxdiff.core import ConfigError
from eqxdiff.loading import CheckpointError, formats, inverse, state_dict, write_safetensors
from eqxdiff.models import flux
from eqxdiff.models.flux import FluxTransformer2DConfig, FluxTransformer2DModel
from eqxdiff.nn import with_attention_implementation
from eqxdiff.parallel import MeshConfig, Plan, Remat, make_mesh, param_spec, shard_batch, sharding_fn, with_plan

from . import _tiny_flux as tiny
from ._parity import ModelParity
from ._util import assert_close, assert_close_to_float64, assert_leaves_close_to_float64, nchw_to_nhwc, rel_error
from ._util import run_float64
from .test_vae import FLUX as FLUX_VAE
from .test_vae import VAEParity, _check_latents

_O0 = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _jit_O0(fn, *args):
    """``fn(*args)`` compiled at -O0 (static leaves closed over)."""
    dynamic, static = eqx.partition(args, eqx.is_array)
    return jax.jit(lambda d: fn(*eqx.combine(d, static)), compiler_options=_O0)(dynamic)


# -- parity with diffusers ------------------------------------------------------------------------------------------


class FluxParity(ModelParity):
    model_class = FluxTransformer2DModel
    reference_class = diffusers.FluxTransformer2DModel
    grid = (3, 4)  # packed image tokens: rows x columns
    text = 5  # text tokens
    image_offset = 0.0  # ids' first column for the image tokens (FLUX.1 Kontext marks reference images with 1)

    def ids(self):
        img = flux.image_ids(*self.grid)
        img[:, 0] = self.image_offset
        return img, flux.text_ids(self.text)

    def inputs(self, reference):
        c = reference.config
        rng = np.random.default_rng(self.seed())
        b, seq = 2, self.grid[0] * self.grid[1]
        out = dict(hidden_states=rng.standard_normal((b, seq, c.in_channels), np.float32),
                   encoder_hidden_states=rng.standard_normal((b, self.text, c.joint_attention_dim), np.float32),
                   pooled_projections=rng.standard_normal((b, c.pooled_projection_dim), np.float32),
                   timestep=np.array([0.25, 0.875], np.float32))
        if c.guidance_embeds:
            out["guidance"] = np.array([3.5, 1.0], np.float32)
        img, txt = self.ids()
        out["rope"] = eqxdiff.nn.flux_rope(np.concatenate([txt, img]), tuple(c.axes_dims_rope))
        return out

    def bf16_inputs(self, inputs):
        return {k: v if k == "rope" else v.astype(jnp.bfloat16) for k, v in inputs.items()}

    def reference_outputs(self, reference, inputs):
        img, txt = self.ids()
        kwargs = {k: torch.from_numpy(np.asarray(v)) for k, v in inputs.items() if k != "rope"}
        return dict(sample=reference(**kwargs, img_ids=torch.from_numpy(img), txt_ids=torch.from_numpy(txt)).sample)

    @staticmethod
    def outputs(model, inputs):
        kwargs = dict(inputs)
        x, ctx, pooled, t = (kwargs.pop(k) for k in ("hidden_states", "encoder_hidden_states",
                                                     "pooled_projections", "timestep"))
        return dict(sample=model(x, ctx, pooled, t, **kwargs))


class TestFluxTiny(FluxParity):
    """diffusers' own tiny config: patch 1, in_channels 4 (one latent channel packed 2x2), 1 + 1 blocks, no
    guidance embedder (schnell)."""

    config = tiny.TRANSFORMER
    full_size = {"flux-schnell": tiny.SCHNELL}


class TestFluxGuidanceDeep(FluxParity):
    """Guidance embedder (dev), 2 double + 3 single blocks, 3 heads of 8 (axes 2/2/4), patch 2 with out_channels."""

    config = dict(patch_size=2, in_channels=8, out_channels=3, num_layers=2, num_single_layers=3, attention_head_dim=8,
                  num_attention_heads=3, joint_attention_dim=12, pooled_projection_dim=10, axes_dims_rope=[2, 2, 4],
                  guidance_embeds=True)
    full_size = {"flux-dev": tiny.DEV}


class TestFluxWideRope(FluxParity):
    """in_channels 16 (four latent channels packed), 4 heads of 12 (axes 6/2/4), 2 + 2 blocks, image ids offset."""

    config = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=12,
                  num_attention_heads=4, joint_attention_dim=24, pooled_projection_dim=16, axes_dims_rope=[6, 2, 4])
    full_size = {"flux-fill": tiny.FILL}
    grid, text, image_offset = (4, 2), 4, 1.0


class TestFluxVAE(VAEParity):
    """The Flux VAE settings at diffusers' tiny Flux VAE config: no quant convs, a shift factor, 1 latent channel."""

    config = tiny.VAE
    full_size = {"flux": FLUX_VAE}


def test_flux_vae_latent_scaling(tmp_path_factory):
    """``(z - shift_factor) * scaling_factor`` and back, as the Flux pipelines and training scripts do."""
    vae = TestFluxVAE.build(tmp_path_factory).model
    z = jnp.linspace(-2, 2, 12).reshape(1, 2, 2, 3)[..., :1]
    c = vae.config
    assert (c.shift_factor, c.scaling_factor) == (tiny.VAE["shift_factor"], tiny.VAE["scaling_factor"])
    _check_latents(vae.scale_latents(z), lambda z: (z - c.shift_factor) * c.scaling_factor, z)
    _check_latents(vae.unscale_latents(vae.scale_latents(z)),
                   lambda z: (z - c.shift_factor) * c.scaling_factor / c.scaling_factor + c.shift_factor, z)
    assert vae.quant_conv is None and vae.post_quant_conv is None


@pytest.fixture(scope="module")
def tiny_case(tmp_path_factory):
    return TestFluxTiny.build(tmp_path_factory)


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    return TestFluxGuidanceDeep.build(tmp_path_factory)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return TestFluxWideRope.build(tmp_path_factory)


# -- the same model, run other ways ---------------------------------------------------------------------------------


def test_scanned_equals_unrolled(deep):
    scanned = eqxdiff.nn.scan_layers(deep.model)
    assert isinstance(scanned.single_transformer_blocks, eqxdiff.nn.Stacked)
    assert scanned.single_transformer_blocks.layers.proj_out.weight.shape[0] == 3
    out = _jit_O0(TestFluxGuidanceDeep.outputs, scanned, deep.inputs)
    assert_close_to_float64(out["sample"], deep.actual["sample"], TestFluxGuidanceDeep.actual64(deep)["sample"],
                            what="scanned vs unrolled")


def test_fused_projections_load_run_and_save(deep, tmp_path):
    """Fused at load time from diffusers' separate tensors (here stacked too); the same outputs; saved back as
    diffusers' tensors and config."""
    fused = eqxdiff.load(deep.folder, config_overrides={"fused_projections": True}, scan_layers=True)
    c = fused.config
    double, single = fused.transformer_blocks.layers, fused.single_transformer_blocks.layers
    assert isinstance(double.attn, eqxdiff.nn.FusedJointAttention) and single.proj_mlp is None
    assert isinstance(single.attn, eqxdiff.nn.ProjectedAttention)
    assert double.attn.to_qkv.weight.shape == (2, 3 * c.inner_dim, c.inner_dim)
    assert single.to_qkv_mlp.weight.shape == (3, 3 * c.inner_dim + c.mlp_hidden_dim, c.inner_dim)
    ref = deep.reference.state_dict()
    np.testing.assert_array_equal(single.to_qkv_mlp.bias[1], torch.cat(
        [ref[f"single_transformer_blocks.1.{n}.bias"] for n in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]))
    out = _jit_O0(TestFluxGuidanceDeep.outputs, fused, deep.inputs)["sample"]
    assert_close(out, deep.expected["sample"], 1e-4, "fused vs diffusers")
    assert_close_to_float64(out, deep.actual["sample"], TestFluxGuidanceDeep.actual64(deep)["sample"],
                            what="fused vs separate")

    eqxdiff.save_pretrained(fused, tmp_path)
    assert "fused_projections" not in eqxdiff.loading.read_config(tmp_path)
    again = diffusers.FluxTransformer2DModel.from_pretrained(tmp_path)
    assert set(again.state_dict()) == set(ref)
    for name, t in again.state_dict().items():
        torch.testing.assert_close(t, ref[name], rtol=0, atol=0, msg=name)  # split back, not computed: exact


def _loss(model, inputs):
    return jnp.mean(FluxParity.outputs(model, inputs)["sample"] ** 2)


def test_remat_gives_the_same_gradients(tiny_case):
    """Remat at the block boundaries, saving only the attention outputs (NAMED), changes nothing but memory: the
    programs hold remat blocks (FULL too), and the gradients equal the plain model's."""
    model, inputs = tiny_case.model, tiny_case.inputs
    named = with_plan(model, Plan(remat=Remat.NAMED, remat_names=("flux_attention",)))
    assert "remat" not in str(jax.make_jaxpr(_loss)(model, inputs))
    for remat in (named, with_plan(model, Plan(remat=Remat.FULL))):
        assert str(jax.make_jaxpr(_loss)(remat, inputs)).count("remat") == 2  # one per block

    def grads(inputs, *models):
        return [eqx.filter_grad(_loss)(m, inputs) for m in models]

    plain, got = _jit_O0(grads, inputs, model, named)
    (plain64,) = run_float64(grads, inputs, model)
    assert_leaves_close_to_float64(got, plain, plain64, what="remat gradient")
    with pytest.raises(ValueError, match="flux_attention"):
        with_plan(model, Plan(remat=Remat.NAMED, remat_names=("attention",)))


# Two small programs (and a one-device reference) cover the three strategies, each with a remat policy of its own:
# FSDP with tensor parallelism on the separate projections, and FSDP with context parallelism on the fused ones.
MESH_RUNS = {
    "fsdp+tensor": (MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_tensor_parallelism=4), Remat.FULL,
                    (), False),
    "fsdp+context-fused": (MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=4),
                           Remat.NAMED, ("flux_attention",), True),
}


@pytest.fixture(scope="module")
def reference_O0(wide):
    """One device: the float32 output (compiled at -O0, as the mesh runs are) and the float64 one."""
    float32 = _jit_O0(TestFluxWideRope.outputs, wide.model, wide.inputs)["sample"]
    return float32, TestFluxWideRope.actual64(wide)["sample"]


# The context-parallel run pins its kernel, each in turn (4 heads over 4 context devices: either could be chosen).
@pytest.mark.parametrize("strategy,attention", [("fsdp+tensor", None), ("fsdp+context-fused", "ring"),
                                                ("fsdp+context-fused", "ulysses")])
def test_mesh_equals_single_device(wide, reference_O0, strategy, attention):
    """The WideRope model (4 heads, 4 text + 8 image tokens) on 8 devices: every parameter placed by its declared
    axes (read straight onto the mesh), the tokens split over ``context`` (the ring or the Ulysses kernel inside a
    shard_map, asked for by name), output equal to one device."""
    config, remat, names, fused = MESH_RUNS[strategy]
    mesh = make_mesh(config)
    model = eqxdiff.load(wide.folder, sharding=sharding_fn(mesh), config_overrides={"fused_projections": fused})
    model = with_plan(model, Plan(mesh, remat=remat, remat_names=names))
    if attention is not None:
        model = with_attention_implementation(model, attention)
    batch = {k: v for k, v in wide.inputs.items() if k != "rope"}
    inputs = {**shard_batch(batch, mesh), "rope": wide.inputs["rope"]}
    out = _jit_O0(TestFluxWideRope.outputs, model, inputs)["sample"]
    assert_close_to_float64(out, *reference_O0, what=f"{strategy} vs one device")
    leaves, specs, _ = eqxdiff.core.leaf_specs(model)
    for leaf, spec in zip(leaves, specs):
        assert leaf.sharding.spec == param_spec(spec.axes, leaf.shape, mesh), spec.name
    if not fused:
        q = model.transformer_blocks[0].attn.to_q.weight  # [heads * head_dim, embed] = [48, 48]
        mlp = model.single_transformer_blocks[1].proj_mlp.weight  # [mlp, embed] = [192, 48]
        assert q.sharding.spec == mlp.sharding.spec == P("tensor", "fsdp")
        assert q.addressable_shards[0].data.shape == (12, 24)
    else:
        qkv = model.single_transformer_blocks[1].to_qkv_mlp.weight  # [3 * 48 + 192, 48]: the embed axis over fsdp
        assert qkv.sharding.spec == P(None, "fsdp") and qkv.addressable_shards[0].data.shape == (336, 24)
        jaxpr = str(jax.make_jaxpr(lambda m, i: TestFluxWideRope.outputs(m, i))(model, inputs))
        assert "shard_map" in jaxpr  # the joint attention ran a context-parallel kernel, the one asked for:
        ring, ulysses = "ppermute" in jaxpr, "all_to_all" in jaxpr  # k/v shards passed on, or heads exchanged
        assert (ring, ulysses) == (attention == "ring", attention == "ulysses"), (ring, ulysses)


# -- Black Forest Labs' single files --------------------------------------------------------------------------------


def test_bfl_file_equals_diffusers_from_single_file(deep, tmp_path, monkeypatch):
    """A tiny BFL-layout file: diffusers' converter reads it back to the reference's tensors exactly, eqxdiff's
    rules load the same weights as diffusers' ``from_single_file`` and the same outputs; written back, it is the
    same file. Loaded fused, BFL's fused tensors arrive untouched."""
    width = deep.model.config.inner_dim
    tensors = tiny.bfl_tensors(deep.reference)
    assert "single_blocks.2.linear1.weight" in tensors and "guidance_in.in_layer.weight" in tensors
    converter = tiny.diffusers_bfl_converter(width)
    converted = converter({k: torch.from_numpy(v) for k, v in tensors.items()})
    ref = deep.reference.state_dict()
    assert set(converted) == set(ref)
    for name, t in converted.items():  # split and renamed, not computed: exactly equal
        torch.testing.assert_close(t, ref[name], rtol=0, atol=0, msg=name)

    path = tmp_path / "flux1-tiny.safetensors"
    write_safetensors(tensors, path)
    inferred = formats.flux_bfl_config(path, axes_dims_rope=(2, 2, 4))  # sizes read from the file's tensors
    stored = {k: v for k, v in deep.reference.config.items() if not k.startswith("_")}
    assert inferred == {"_class_name": "FluxTransformer2DModel", **stored, "patch_size": 1, "out_channels": 4 * 3}
    # the file holds proj_out's width, patch_size ** 2 * out_channels: the same model, the same tensors
    assert FluxTransformer2DConfig.from_dict(inferred).output_channels == deep.model.config.output_channels
    monkeypatch.setitem(single_file_model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"],
                        "checkpoint_mapping_fn", converter)
    theirs = diffusers.FluxTransformer2DModel.from_single_file(str(path), config=str(deep.folder),
                                                               torch_dtype=torch.float32).eval()
    ours = eqxdiff.load(path, model_class="FluxTransformer2DModel", config=deep.folder,
                        conversion=formats.flux_bfl())
    got = state_dict(ours)
    assert set(got) == set(theirs.state_dict())
    for name, t in theirs.state_dict().items():
        np.testing.assert_array_equal(got[name], t.numpy(), err_msg=name)
    with torch.no_grad():
        expected = TestFluxGuidanceDeep().reference_outputs(theirs, deep.inputs)["sample"]
    assert_close(TestFluxGuidanceDeep.run(ours, deep.inputs)["sample"], expected.numpy(), 1e-4, "BFL file")
    back = eqxdiff.loading.convert_tensors(got, inverse(formats.flux_bfl()))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        np.testing.assert_array_equal(back[name], t, err_msg=name)

    fused = eqxdiff.load(path, model_class="FluxTransformer2DModel", config=deep.folder,
                         conversion=formats.flux_bfl(), config_overrides={"fused_projections": True})
    np.testing.assert_array_equal(fused.single_transformer_blocks[1].to_qkv_mlp.weight,
                                  tensors["single_blocks.1.linear1.weight"])
    np.testing.assert_array_equal(fused.transformer_blocks[0].attn.to_added_qkv.bias,
                                  tensors["double_blocks.0.txt_attn.qkv.bias"])


def test_float8_bfl_file_loads_and_casts(tiny_case, tmp_path, monkeypatch):
    """A float8 (F8_E4M3) BFL file below ComfyUI's ``model.diffusion_model.`` prefix, schnell-style (no guidance
    embedder): read and cast as diffusers' ``from_single_file`` casts it, to float32 or bfloat16."""
    width = tiny_case.model.config.inner_dim
    tensors = tiny.bfl_tensors(tiny_case.reference, prefix=formats.FLUX_DIFFUSION_MODEL)
    assert not any("guidance_in" in k for k in tensors)
    path = tmp_path / "flux1-tiny-fp8-e4m3fn.safetensors"
    save_file({k: torch.from_numpy(v).to(torch.float8_e4m3fn) for k, v in tensors.items()}, str(path))
    monkeypatch.setitem(single_file_model.SINGLE_FILE_LOADABLE_CLASSES["FluxTransformer2DModel"],
                        "checkpoint_mapping_fn", tiny.diffusers_bfl_converter(width))
    theirs = diffusers.FluxTransformer2DModel.from_single_file(str(path), config=str(tiny_case.folder),
                                                               torch_dtype=torch.float32).state_dict()
    rules = formats.flux_bfl(prefix=formats.FLUX_DIFFUSION_MODEL)
    with pytest.raises(CheckpointError, match="heads of 16 channels; say how they split"):
        formats.flux_bfl_config(path, prefix=formats.FLUX_DIFFUSION_MODEL)
    config = formats.flux_bfl_config(path, prefix=formats.FLUX_DIFFUSION_MODEL, axes_dims_rope=(4, 4, 8))
    ours = eqxdiff.load(path, config=config, conversion=rules)  # the file alone: config read from its tensors
    assert ours.config == tiny_case.model.config
    got = state_dict(ours)
    assert set(got) == set(theirs) and {v.dtype for v in got.values()} == {np.dtype(np.float32)}
    for name, t in theirs.items():
        np.testing.assert_array_equal(got[name], t.numpy(), err_msg=name)
    reference = tiny_case.reference.state_dict()["proj_out.weight"].numpy()
    assert 0 < rel_error(got["proj_out.weight"], reference) < 0.1  # really rounded to float8
    bf16 = eqxdiff.load(path, model_class="FluxTransformer2DModel", config=tiny_case.folder, conversion=rules,
                        dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(bf16)} == {jnp.dtype(jnp.bfloat16)}
    with pytest.raises(eqxdiff.loading.ConversionError,  # the prefix is not optional; the error shows it
                       match=r"matches 'time_in.in_layer.\{p\}'; the closest names are 'model.diffusion_model.time_in"):
        eqxdiff.load(path, model_class="FluxTransformer2DModel", config=tiny_case.folder,
                     conversion=formats.flux_bfl())


# -- the packed token layout ---------------------------------------------------------------------------------------


def test_pack_unpack_and_ids_match_the_pipeline():
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 3, 6, 4), np.float32)  # NCHW: 3 channels, 6 x 4 latent
    packed = diffusers.FluxPipeline._pack_latents(torch.from_numpy(latents), 2, 3, 6, 4).numpy()
    ours = flux.pack_latents(nchw_to_nhwc(latents))
    np.testing.assert_array_equal(ours, packed)
    np.testing.assert_array_equal(flux.unpack_latents(ours, 6, 4), nchw_to_nhwc(latents))
    ids = diffusers.FluxPipeline._prepare_latent_image_ids(2, 3, 2, "cpu", torch.float32).numpy()
    np.testing.assert_array_equal(flux.image_ids(3, 2), ids)
    assert flux.text_ids(5).shape == (5, 3) and not flux.text_ids(5).any()
    with pytest.raises(ValueError, match="must be even"):
        flux.pack_latents(jnp.zeros((1, 3, 4, 2)))
    with pytest.raises(ValueError, match="not the 2x2 patches of a latent of width 6, height 6"):
        flux.unpack_latents(ours, 6, 6)


# -- errors ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, match", [
    (dict(axes_dims_rope=(4, 4, 7)), "axes_dims_rope=.* even"),
    (dict(axes_dims_rope=(4, 4, 4)), "must sum to attention_head_dim=16"),
    (dict(num_attention_heads=0), "num_attention_heads=0 must be a positive"),
    (dict(guidance_embeds=1), "guidance_embeds=1 has the wrong type"),
])
def test_config_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        FluxTransformer2DConfig(**{**tiny.TRANSFORMER, "axes_dims_rope": (4, 4, 8), **change})


def test_call_errors(tiny_case, deep):
    model, inputs = tiny_case.model, {k: jnp.asarray(v) for k, v in tiny_case.inputs.items() if k != "rope"}
    args = [inputs[k] for k in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")]
    img, txt = TestFluxTiny().ids()
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        model(*args, img_ids=img, txt_ids=txt, guidance=jnp.ones(2))
    with pytest.raises(ValueError, match="give the positions"):
        model(*args, img_ids=img)
    with pytest.raises(ValueError, match="not both"):
        model(*args, img_ids=img, txt_ids=txt, rope=tiny_case.inputs["rope"])
    with pytest.raises(ValueError, match="expected .17, 16.: ids must list the text"):
        model(*args, img_ids=img, txt_ids=flux.text_ids(tiny_case.inputs["encoder_hidden_states"].shape[1] + 1))
    with pytest.raises(ValueError, match=r"img_ids of shape \(12, 2\)"):
        model(*args, img_ids=img[:, :2], txt_ids=txt)
    with pytest.raises(ValueError, match="traced here"):
        jax.jit(lambda i: model(*args, img_ids=i, txt_ids=txt))(img)
    guided = [jnp.asarray(deep.inputs[k]) for k in ("hidden_states", "encoder_hidden_states", "pooled_projections",
                                                     "timestep")]
    with pytest.raises(ValueError, match="pass guidance="):
        deep.model(*guided, rope=deep.inputs["rope"])


def test_ids_give_the_tables_of_rope(tiny_case):
    """``img_ids``/``txt_ids`` (concrete) build the same tables the parity inputs pass as ``rope``."""
    img, txt = TestFluxTiny().ids()
    rope = tiny_case.model.rotary_embedding(img, txt)
    np.testing.assert_array_equal(rope.cos, tiny_case.inputs["rope"].cos)
    np.testing.assert_array_equal(rope.sin, tiny_case.inputs["rope"].sin)


def test_bfl_rules_name_what_a_file_lacks(deep, tmp_path):
    tensors = tiny.bfl_tensors(deep.reference)
    del tensors["single_blocks.0.linear2.weight"]
    write_safetensors(tensors, tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointError, match="single_transformer_blocks.0.proj_out.weight"):
        eqxdiff.load(tmp_path / "broken.safetensors", model_class="FluxTransformer2DModel", config=deep.folder,
                     conversion=formats.flux_bfl())

