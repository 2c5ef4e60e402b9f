"""eqxdiff.parallel on 8 simulated CPU devices: meshes, sharding rules, strategies equal to one device, remat."""

import dataclasses
import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxdiff
from eqxdiff.models.unet2d import UNet2DConditionConfig, UNet2DConditionModel
from eqxdiff.parallel import (DEFAULT_RULES, MeshConfig, MeshError, Plan, Remat, global_batch_size, make_mesh,
                              param_logical_axes, param_spec, shard_batch, shard_params, sharded_jit, sharding_fn,
                              with_plan)

from ._util import assert_close

TOL = 1e-5  # float32; only the order of cross-device sums differs from one device

STRATEGIES = {
    "data": MeshConfig(),
    "fsdp": MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1),
    "tensor": MeshConfig(ici_data_parallelism=2, ici_tensor_parallelism=4),
    "context": MeshConfig(ici_data_parallelism=2, ici_context_parallelism=4),
    "fsdp+context+tensor": MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_context_parallelism=2,
                                      ici_tensor_parallelism=2),
}


# -- mesh ---------------------------------------------------------------------------------------------------------

def test_mesh_fills_minus_one():
    mesh = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1))
    assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert dict(make_mesh().shape)["data"] == 8
    assert MeshConfig(ici_tensor_parallelism=-1, ici_data_parallelism=2).mesh_shape(8)["tensor"] == 4


@pytest.mark.parametrize("config, match", [
    (MeshConfig(ici_data_parallelism=3), "multiply to 3 but there are 8 device"),
    (MeshConfig(ici_data_parallelism=3, ici_fsdp_parallelism=-1), "does not divide"),
    (MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2), "multiply to 4"),
    (MeshConfig(dcn_data_parallelism=2), "1 slice"),
])
def test_bad_mesh_raises(config, match):
    with pytest.raises(MeshError, match=match):
        make_mesh(config)


def test_bad_mesh_config_raises():
    with pytest.raises(MeshError, match="only one ici_"):
        MeshConfig(ici_data_parallelism=-1, ici_fsdp_parallelism=-1)
    with pytest.raises(MeshError, match="ici_tensor_parallelism=0"):
        MeshConfig(ici_tensor_parallelism=0)


def test_fractional_batch():
    assert global_batch_size(0.25, 4) == 1
    assert global_batch_size(2, make_mesh()) == 16
    with pytest.raises(ValueError, match="whole number"):
        global_batch_size(0.3, 4)


def test_initialize_distributed_needs_all_three():
    from eqxdiff.parallel import initialize_distributed

    with pytest.raises(MeshError, match="give all three"):
        initialize_distributed(coordinator_address="localhost:1234")


# -- rules ----------------------------------------------------------------------------------------------------------

def test_param_logical_axes():
    assert param_logical_axes("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight", (64, 32)) == \
        ("heads", "embed")
    assert param_logical_axes("mid_block.attentions.0.transformer_blocks.0.attn1.to_out.0.weight", (32, 64)) == \
        ("embed", "heads")
    assert param_logical_axes("x.ff.net.0.proj.weight", (256, 32)) == ("mlp", "embed")
    assert param_logical_axes("text_model.encoder.layers.0.mlp.fc2.weight", (32, 64)) == ("embed", "mlp")
    assert param_logical_axes("conv_in.weight", (3, 3, 4, 32)) == ("kernel", "kernel", "conv_in", "conv_out")
    assert param_logical_axes("conv_in.bias", (32,)) == ("norm",)


def test_spec_falls_back_to_replication(caplog):
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=-1))
    with caplog.at_level(logging.DEBUG, logger="eqxdiff.parallel"):
        assert param_spec("conv_out.weight", (3, 3, 32, 4), mesh) == P()  # 4 output channels over fsdp=8
    assert "does not divide" in caplog.text
    assert param_spec("conv_in.weight", (3, 3, 4, 32), mesh) == P(None, None, None, "fsdp")
    mesh2 = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=2, ici_tensor_parallelism=2))
    assert param_spec("a.to_k.weight", (64, 32), mesh2) == P("tensor", "fsdp")
    rules = DEFAULT_RULES.replace(params={"heads": None})
    assert param_spec("a.to_k.weight", (64, 32), mesh2, rules) == P(None, "fsdp")


# -- strategies -----------------------------------------------------------------------------------------------------

def _tiny_unet(key):
    # One level keeps compiles short on a shared CPU; the pipeline tests below run the two-level tiny SD UNet.
    config = UNet2DConditionConfig(
        sample_size=8, block_out_channels=(32,), layers_per_block=1, cross_attention_dim=32, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",), norm_num_groups=8)
    return UNet2DConditionModel(config, key=key)


def _loss(unet, x, t, context):
    return jnp.mean(unet(x, t, context) ** 2)


@eqx.filter_jit
def _forward_and_grad(unet, x, t, context):
    return unet(x, t, context), eqx.filter_grad(_loss)(unet, x, t, context)


@pytest.fixture(scope="module")
def unet_case():
    key = jax.random.key(1234)
    kunet, kx, kc = jax.random.split(key, 3)
    unet = _tiny_unet(kunet)
    x = jax.random.normal(kx, (8, 8, 8, 4))
    context = jax.random.normal(kc, (8, 7, 32))
    t = jnp.arange(8.0) * 111
    out, grads = _forward_and_grad(unet, x, t, context)
    return unet, (x, t, context), out, grads


def _assert_same(out, grads, ref_out, ref_grads):
    assert_close(out, ref_out, TOL, "UNet output")
    got, want = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_close(a, b, TOL, "gradient")


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_strategy_equals_single_device(unet_case, strategy):
    unet, inputs, ref_out, ref_grads = unet_case
    mesh = make_mesh(STRATEGIES[strategy])
    model = with_plan(shard_params(unet, mesh), Plan(mesh))
    out, grads = _forward_and_grad(model, *shard_batch(inputs, mesh))
    _assert_same(out, grads, ref_out, ref_grads)
    # Parameters carry exactly the shardings the rules give.
    leaves, specs, _ = eqxdiff.loading.leaf_specs(model)
    for leaf, spec in zip(leaves, specs):
        assert leaf.sharding.spec == param_spec(spec.name, leaf.shape, mesh), spec.name
    q = model.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight  # [heads*dim, embed] = [32, 32]
    expected = {"data": P(), "fsdp": P(None, "fsdp"), "tensor": P("tensor"), "context": P(),
                "fsdp+context+tensor": P("tensor", "fsdp")}[strategy]
    assert q.sharding.spec == expected
    if strategy == "fsdp":
        shard = q.addressable_shards[0].data
        assert shard.shape == (32, 4)


@pytest.mark.parametrize("remat, names", [(Remat.FULL, ()), (Remat.DOTS_NO_BATCH, ()),
                                          (Remat.NAMED, ("resnet", "transformer"))])
def test_remat_gives_equal_gradients(unet_case, remat, names):
    unet, inputs, ref_out, ref_grads = unet_case
    mesh = make_mesh(STRATEGIES["fsdp"])
    model = with_plan(shard_params(unet, mesh), Plan(mesh, remat=remat, remat_names=names))
    _assert_same(*_forward_and_grad(model, *shard_batch(inputs, mesh)), ref_out, ref_grads)


@pytest.mark.parametrize("remat, names", [(Remat.OFFLOAD_DOTS, ()), (Remat.OFFLOAD_NAMED, ("resnet",))])
def test_offload_remat_gives_equal_gradients(unet_case, remat, names):
    """Offloading saved values to pinned host memory (the CPU backend supports the memory kind)."""
    unet, inputs, ref_out, ref_grads = unet_case
    _assert_same(*_forward_and_grad(with_plan(unet, Plan(remat=remat, remat_names=names)), *inputs), ref_out,
                 ref_grads)


def test_remat_really_rematerialises(unet_case):
    unet, inputs, _, _ = unet_case
    plain = jax.make_jaxpr(eqx.filter_grad(_loss))(unet, *inputs)
    remat = jax.make_jaxpr(eqx.filter_grad(_loss))(with_plan(unet, Plan(remat=Remat.FULL)), *inputs)
    assert "remat" not in str(plain) and "remat" in str(remat)


def test_bad_remat_names():
    with pytest.raises(ValueError, match="needs remat_names"):
        Plan(remat=Remat.NAMED)
    with pytest.raises(ValueError, match="not checkpoint names"):
        Plan(remat=Remat.NAMED, remat_names=("nope",))


def test_sharded_jit_places_and_donates():
    mesh = make_mesh(STRATEGIES["fsdp"])
    sharding = jax.sharding.NamedSharding(mesh, P("fsdp"))
    step = sharded_jit(lambda w, x: (w - 0.1 * x, jnp.sum(x)), in_shardings=(sharding, sharding),
                       out_shardings=(sharding, None), donate="all")
    w = jax.device_put(jnp.arange(16.0), sharding)
    new_w, total = step(w, jnp.ones(16))
    assert new_w.sharding.spec == P("fsdp")
    np.testing.assert_allclose(new_w, np.arange(16.0) - 0.1)
    assert float(total) == 16.0
    assert w.is_deleted()


# -- pipeline and loading -------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_sd(tmp_path_factory):
    from ._tiny_sd import build_pipeline

    folder = tmp_path_factory.mktemp("tiny_sd")
    build_pipeline(folder, scheduler="ddim")
    return folder


def _float_images(pipe, monkeypatch):
    from eqxdiff.pipelines import stable_diffusion as sd

    monkeypatch.setattr(sd, "to_uint8", lambda x: np.asarray(x))  # compare float images, not 8-bit ones
    latents = np.random.default_rng(0).standard_normal((2, 16, 16, 4)).astype(np.float32)
    return pipe(["a red cat", "two dogs"], latents=latents, height=32, width=32, num_inference_steps=2,
                guidance_scale=5.0, progress=False)


@pytest.fixture(scope="module")
def tiny_sd_reference(tiny_sd):
    with pytest.MonkeyPatch.context() as mp:
        return _float_images(eqxdiff.load_pipeline(tiny_sd), mp)


@pytest.mark.parametrize("strategy, offload", [("fsdp", True), ("fsdp+context+tensor", False)])
def test_pipeline_on_mesh_equals_single_device(tiny_sd, tiny_sd_reference, monkeypatch, strategy, offload):
    mesh = make_mesh(STRATEGIES[strategy])
    pipe = eqxdiff.load_pipeline(tiny_sd, mesh=mesh, offload_encoders=offload)
    to_k = pipe.unet.up_blocks[1].attentions[0].transformer_blocks[0].attn2.to_k.weight  # [32, 32]
    assert to_k.sharding.spec == param_spec("x.to_k.weight", to_k.shape, mesh)
    assert to_k.addressable_shards[0].data.size < to_k.size  # really split, loaded slice by slice
    images = _float_images(pipe, monkeypatch)
    assert_close(images, tiny_sd_reference, TOL, f"pipeline images ({strategy})")
    if offload:  # the text encoder's weights live on the host, not on the devices
        assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(pipe.text_encoder))


def test_load_straight_onto_fsdp_mesh(tiny_sd):
    mesh = make_mesh(STRATEGIES["fsdp"])
    fn = sharding_fn(mesh)
    reads = []

    def spy(name, shape):
        reads.append(name)
        return fn(name, shape)

    clip = eqxdiff.load(tiny_sd, "text_encoder", sharding=spy)
    plain = eqxdiff.load(tiny_sd, "text_encoder")
    leaves, specs, _ = eqxdiff.loading.leaf_specs(clip)
    assert sorted(reads) == sorted(s.name for s in specs)
    for leaf, ref, spec in zip(leaves, jax.tree.leaves(plain), specs):
        assert leaf.sharding.spec == param_spec(spec.name, leaf.shape, mesh)
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))
    fc1 = clip.text_model.layers[0].mlp.fc1.weight  # [64, 32]: ("mlp", "embed") -> P(None, "fsdp")
    assert fc1.sharding.spec == P(None, "fsdp") and fc1.addressable_shards[0].data.shape == (64, 4)
