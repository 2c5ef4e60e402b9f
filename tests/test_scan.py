"""scan_layers: stacked repeated layers run with lax.scan equal the unrolled model (outputs and gradients, as
accurate as the unrolled model's float32 run is against its float64 run: XLA rounds a loop body and the unrolled
layers alike only up to its CPU's FMA contraction and vector-width blocking), with remat too; checkpoints load
straight into the stacked layout (sharded as well) and write back the names transformers/diffusers load."""

import functools
import tempfile

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import eqxdiff
from eqxdiff import nn
from eqxdiff.core import leaf_specs
from eqxdiff.loading import CheckpointError, state_dict
from eqxdiff.parallel import MeshConfig, Plan, Remat, checkpoint_block, make_mesh, param_spec, sharding_fn, with_plan

from ._util import assert_close, assert_close_to_float64, nchw_to_nhwc, randomize_torch, rel_error, run_float64

CLIP = dict(vocab_size=99, hidden_size=32, intermediate_size=40, projection_dim=16, num_hidden_layers=3,
            num_attention_heads=4, max_position_embeddings=9, hidden_act="gelu", bos_token_id=0, eos_token_id=98,
            pad_token_id=0)
# SDXL-like: text_time embedding, no attention in the first block, two transformer blocks per attention in the
# lower block and in the mid block (diffusers takes the mid block's depth from the last entry).
UNET = dict(block_out_channels=(16, 32), norm_num_groups=8, in_channels=4, out_channels=4, sample_size=8,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1, attention_head_dim=(2, 4), transformer_layers_per_block=(1, 2), cross_attention_dim=24,
            use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=4,
            projection_class_embeddings_input_dim=12 + 6 * 4)


@functools.cache
def _clip_folder() -> str:
    ref = transformers.CLIPTextModel(transformers.CLIPTextConfig(**CLIP)).eval()
    randomize_torch(ref, 0)
    folder = tempfile.mkdtemp(prefix="scan-clip-")
    ref.save_pretrained(folder, safe_serialization=True)
    return folder


@functools.cache
def _unet_folder() -> str:
    torch.manual_seed(0)
    ref = diffusers.UNet2DConditionModel(**UNET).eval()
    randomize_torch(ref, 1)
    folder = tempfile.mkdtemp(prefix="scan-unet-")
    ref.save_pretrained(folder)
    return folder


def _clip_inputs():
    ids = np.array([[0, 5, 17, 98, 0, 0, 0], [0, 33, 7, 61, 12, 40, 98]])
    return jnp.asarray(ids, jnp.int32), jnp.asarray(ids != 0).at[:, 0].set(True)


def _unet_inputs():
    g = torch.Generator().manual_seed(2)
    torch_kw = dict(sample=torch.randn(1, 4, 8, 8, generator=g), timestep=torch.tensor([421]),
                    encoder_hidden_states=torch.randn(1, 5, 24, generator=g),
                    added_cond_kwargs=dict(text_embeds=torch.randn(1, 12, generator=g),
                                           time_ids=torch.tensor([[8., 8, 0, 0, 8, 8]])))
    args = (nchw_to_nhwc(torch_kw["sample"]), jnp.asarray(torch_kw["timestep"].numpy()),
            jnp.asarray(torch_kw["encoder_hidden_states"].numpy()))
    extra = {k: jnp.asarray(v.numpy()) for k, v in torch_kw["added_cond_kwargs"].items()}
    return torch_kw, args, extra


def _clip_out(model):
    ids, mask = _clip_inputs()
    out = model(ids, attention_mask=mask, output_hidden_states=True)
    return (*out.hidden_states, out.last_hidden_state, out.pooler_output)


def _like(model, tree):
    """``tree``'s float arrays in the dtype of ``model``'s weights (float64 for its float64 reference run)."""
    dtype = next(x.dtype for x in jax.tree.leaves(model) if jnp.issubdtype(x.dtype, jnp.floating))
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _unet_out(model):
    args, extra = _like(model, _unet_inputs()[1:])
    return (model(*args, **extra),)


@eqx.filter_jit
def _evaluate(model, run):
    """``run(model)``'s outputs and the gradient of a loss on them, in one compiled function per model layout."""
    def loss(m):
        outs = run(m)
        return sum(jnp.sum(jnp.sin(3.0 * y)) for y in outs), outs  # weights every element differently

    (_, outs), grads = eqx.filter_value_and_grad(loss, has_aux=True)(model)
    return outs, grads


def _reference(model, run, float64=False):
    """The unrolled model's outputs and gradients (PyTorch-named): the ground truth the scanned variants match; with
    ``float64``, the same program in float64 (its weights raised), which measures the float32 run's rounding."""
    outs, grads = run_float64(_evaluate, model, run) if float64 else _evaluate(model, run)
    return outs, state_dict(grads)


@functools.cache
def _clip_reference():
    """The unrolled CLIP, its outputs and gradients in float32, and the same in float64."""
    plain = eqxdiff.load(_clip_folder())
    return (plain, *_reference(plain, _clip_out), _reference(plain, _clip_out, float64=True))


def _assert_equal_to_unrolled(model, run, reference, what):
    _, outs, grads, (outs64, grads64) = reference
    got, got_grads = _reference(model, run)
    assert len(got) == len(outs) == len(outs64)
    for i, (a, b, b64) in enumerate(zip(got, outs, outs64)):
        assert_close_to_float64(a, b, b64, what=f"{what} output {i}")
    assert set(got_grads) == set(grads) == set(grads64)
    # Relative to the largest gradient: some are zero in exact arithmetic (attention is blind to the key bias) and
    # hold only rounding noise, which no per-tensor relative error can match.
    scale = max(float(np.max(np.abs(g))) for g in grads64.values())
    for name, g in grads.items():
        assert_close_to_float64(got_grads[name], g, grads64[name], what=f"{what}: gradient of {name}", scale=scale)


def _reversed(model):
    """``model`` with every stack's layers in reverse order: what a loader stacking them wrongly would give."""
    return _map_stacks(model, lambda a: a[::-1])


def _map_stacks(model, fn):
    stacks = _stacks(model)
    assert stacks, "no stacked layers in the model"
    return eqx.tree_at(lambda m: [s.layers for s in _stacks(m)], model,
                       [jax.tree.map(fn, s.layers) for s in stacks])


def _stacks(model):
    return [x for x in jax.tree.leaves(model, is_leaf=lambda x: isinstance(x, nn.Stacked))
            if isinstance(x, nn.Stacked)]


# -- the stacked module ---------------------------------------------------------------------------------------


def test_stacked_builds_the_layers_the_unrolled_loop_builds(getkey):
    key = getkey()
    make = functools.partial(nn.Linear, 3, 5)
    stacked = nn.Stacked(lambda k: make(key=k), 4, key=key)
    layers = [make(key=k) for k in jax.random.split(key, 4)]
    assert len(stacked) == 4 and stacked.layers.weight.shape == (4, 5, 3)
    for a, b in zip(stacked.unstack(), layers):
        np.testing.assert_array_equal(a.weight, b.weight)
        np.testing.assert_array_equal(a.bias, b.bias)
    again = nn.Stacked.from_layers(layers)
    np.testing.assert_array_equal(again.layers.weight, stacked.layers.weight)
    x = jax.random.normal(getkey(), (2, 5))

    def step(layer, h):
        return jnp.tanh(layer(h[:, :3]) + h)

    want, outs = nn.run_layers(layers, step, x, collect=True)
    want64, outs64 = run_float64(lambda layers, x: nn.run_layers(layers, step, x, collect=True), layers, x)
    got, ys = nn.run_layers(stacked, step, x, collect=True)
    assert_close_to_float64(got, want, want64)
    assert len(ys) == len(outs) == 4
    for a, b, b64 in zip(ys, outs, outs64):
        assert_close_to_float64(a, b, b64)
    backwards, _ = nn.run_layers(nn.Stacked.from_layers(layers[::-1]), step, x)
    assert rel_error(backwards, want) > 1e-3  # the order of the layers matters to the check above


def test_stacking_errors():
    with pytest.raises(ValueError, match="num_layers=0 must be a positive integer"):
        nn.Stacked(lambda k: nn.Linear(2, 2, key=k), 0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="layer 1 has a leaf of"):
        nn.Stacked.from_layers([nn.Linear(2, 2, key=jax.random.key(0)), nn.Linear(3, 2, key=jax.random.key(0))])
    with pytest.raises(ValueError, match="layer 1 differs in structure"):
        nn.Stacked.from_layers([nn.Linear(2, 2, key=jax.random.key(0)),
                                nn.Linear(2, 2, use_bias=False, key=jax.random.key(0))])
    with pytest.raises(ValueError, match="Linear has no repeated layers that scan_layers stacks"):
        nn.scan_layers(nn.Linear(2, 2, key=jax.random.key(0)))


def test_stacked_leaves_are_named_per_layer_and_never_sharded():
    model = eqxdiff.load(_clip_folder(), scan_layers=True)
    _, specs, _ = leaf_specs(model)
    fc1 = next(s for s in specs if s.name.endswith("fc1.weight"))
    assert fc1.name == "text_model.encoder.layers.*.mlp.fc1.weight" and fc1.layers == 3
    assert fc1.names[2] == "text_model.encoder.layers.2.mlp.fc1.weight"
    assert fc1.axes == ("layers", "mlp", "embed")
    norm = next(s for s in specs if s.name.endswith("layer_norm1.weight"))
    assert norm.name == "text_model.encoder.layers.*.layer_norm1.weight" and norm.axes == ("layers", "norm")
    plain = {s.name: s.axes for s in leaf_specs(eqxdiff.load(_clip_folder()))[1]}
    assert plain["text_model.encoder.layers.0.layer_norm1.weight"] == ("norm",)


# -- CLIP --------------------------------------------------------------------------------------------------------


def test_scanned_clip_loads_stacked_and_equals_unrolled():
    scanned = eqxdiff.load(_clip_folder(), scan_layers=True)
    assert isinstance(scanned.text_model.layers, nn.Stacked)
    assert scanned.text_model.layers.layers.self_attn.to_q.weight.shape == (3, 32, 32)
    _assert_equal_to_unrolled(scanned, _clip_out, _clip_reference(), "scanned CLIP")
    plain = _clip_reference()[0]
    assert len(_clip_reference()[1]) == CLIP["num_hidden_layers"] + 3  # embeddings, 3 layers, last, pooled
    wrong, _ = _evaluate(_reversed(scanned), _clip_out)
    assert rel_error(wrong[-2], _clip_reference()[1][-2]) > 1e-3  # a wrongly ordered stack would be caught


def test_scanned_clip_with_full_remat_equals_unrolled():
    scanned = with_plan(eqxdiff.load(_clip_folder(), scan_layers=True), Plan(remat=Remat.FULL))
    jaxpr = jax.make_jaxpr(_clip_out)(scanned).jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    assert "remat2" in {e.primitive.name for e in scan.params["jaxpr"].eqns}  # jax.checkpoint inside the scan body
    _assert_equal_to_unrolled(scanned, _clip_out, _clip_reference(), "scanned CLIP with Remat.FULL")


def test_scanned_clip_round_trips_into_transformers(tmp_path):
    scanned = _reversed(eqxdiff.load(_clip_folder(), scan_layers=True))  # new weights: the layers in another order
    eqxdiff.save_pretrained(scanned, tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(state_dict(_clip_reference()[0]))
    ref, info = transformers.CLIPTextModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids, mask = _clip_inputs()
    with torch.no_grad():
        want = ref.eval()(input_ids=torch.from_numpy(np.asarray(ids)).long(),
                          attention_mask=torch.from_numpy(np.asarray(mask)).long()).last_hidden_state
    got = scanned(ids, attention_mask=mask).last_hidden_state
    assert_close(got, want.numpy(), 1e-4, what="transformers on the written folder")
    plain_again = eqxdiff.load(tmp_path)  # the unrolled model reads the layers in the written order
    np.testing.assert_array_equal(plain_again.text_model.layers[0].mlp.fc1.weight,
                                  scanned.text_model.layers.layers.mlp.fc1.weight[0])


def test_scanned_load_errors_name_the_pytorch_keys(tmp_path):
    tensors = load_file(f"{_clip_folder()}/model.safetensors")
    (tmp_path / "config.json").write_text(open(f"{_clip_folder()}/config.json").read())
    missing = {k: v for k, v in tensors.items() if not k.endswith("encoder.layers.2.mlp.fc2.bias")}
    save_file(missing, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing .*text_model\.encoder\.layers\.2\.mlp\.fc2\.bias"):
        eqxdiff.load(tmp_path, scan_layers=True)
    bad = {k: np.zeros((41, 32), np.float32) if k.endswith("encoder.layers.2.mlp.fc1.weight") else v
           for k, v in tensors.items()}
    save_file(bad, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'text_model\.encoder\.layers\.2\.mlp\.fc1\.weight' has shape "
                                              r"\(41, 32\) .* expects \(40, 32\)"):
        eqxdiff.load(tmp_path, scan_layers=True)


def test_scanned_load_onto_a_mesh_reads_each_devices_slices():
    mesh = make_mesh(MeshConfig(ici_data_parallelism=2, ici_fsdp_parallelism=-1))
    scanned = eqxdiff.load(_clip_folder(), scan_layers=True, sharding=sharding_fn(mesh))
    plain = _clip_reference()[0]
    fc1 = scanned.text_model.layers.layers.mlp.fc1.weight  # [3, 40, 32]: ("layers", "mlp", "embed")
    assert fc1.sharding.spec == P(None, None, "fsdp")
    assert fc1.addressable_shards[0].data.shape == (3, 40, 8)
    leaves, specs, _ = leaf_specs(scanned)
    assert sum(s.layers is not None for s in specs) == 16  # 4 Linear (q, k, v, out) + 2 MLP + 2 norms, 2 each
    for leaf, spec in zip(leaves, specs):  # a stacked leaf: one layer's sharding, the layers axis unsharded
        want = param_spec(spec.axes, leaf.shape, mesh) if spec.layers is None else \
            P(None, *param_spec(spec.axes[1:], leaf.shape[1:], mesh))
        assert tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec)) == \
            tuple(want) + (None,) * (leaf.ndim - len(want)), spec.name
    stacked = scanned.text_model.layers.layers
    for i, layer in enumerate(plain.text_model.layers):
        for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(layer)):
            np.testing.assert_array_equal(np.asarray(a)[i], np.asarray(b))
    # A sharding that splits the layers themselves (the rules never do): each device reads its own layer.
    layer_mesh = Mesh(np.array(jax.devices()[:3]), ("layers",))
    by_layer = eqxdiff.load(_clip_folder(), scan_layers=True,
                            sharding=lambda leaf, _: NamedSharding(layer_mesh, P("layers" if "*" in leaf.name else None)))
    q = by_layer.text_model.layers.layers.self_attn.to_q.weight
    assert q.addressable_shards[1].data.shape == (1, 32, 32)
    np.testing.assert_array_equal(q.addressable_shards[1].data[0], plain.text_model.layers[1].self_attn.to_q.weight)
    for a, b in zip(jax.tree.leaves(by_layer), jax.tree.leaves(scanned)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- UNet (spatial transformers) -------------------------------------------------------------------------------


@functools.cache
def _unet_outputs():
    """The unrolled and the scanned UNet loaded from diffusers' folder, and the unrolled one's output (float32 and
    float64)."""
    plain, scanned = eqxdiff.load(_unet_folder()), eqxdiff.load(_unet_folder(), scan_layers=True)
    return plain, scanned, _jit_unet_out(plain), run_float64(_jit_unet_out, plain)


_jit_unet_out = eqx.filter_jit(_unet_out)


def _transformer_inputs():
    k1, k2 = jax.random.split(jax.random.key(3))
    return (jax.random.normal(k1, (2, 3, 4, 32), jnp.float32), jax.random.normal(k2, (2, 5, 24), jnp.float32),
            jnp.array([[True] * 5, [True, False, True, True, False]]))


def _transformer_out(transformer, remat=Remat.NONE):
    x, context, mask = _like(transformer, _transformer_inputs())
    return (checkpoint_block(transformer, Plan(remat=remat))(x, context, mask=mask),)


@functools.cache
def _transformer_reference():
    """The unrolled UNet's mid-block transformer (depth 2), its outputs and gradients."""
    plain = _unet_outputs()[0].mid_block.attentions[0]
    return (plain, *_reference(plain, _transformer_out), _reference(plain, _transformer_out, float64=True))


def test_scanned_unet_loads_stacked_and_equals_unrolled():
    plain, scanned, want, want64 = _unet_outputs()
    down = scanned.down_blocks[1].attentions[0].transformer_blocks
    mid = scanned.mid_block.attentions[0].transformer_blocks
    assert isinstance(down, nn.Stacked) and len(down) == 2 and isinstance(mid, nn.Stacked) and len(mid) == 2
    assert down.layers.attn1.to_q.weight.shape == (2, 32, 32)
    assert len(_stacks(scanned)) == 4  # 1 down, 1 mid, 2 up attentions of depth 2; those of depth 1 stay unrolled
    assert isinstance(plain.mid_block.attentions[0].transformer_blocks, tuple)
    assert_close_to_float64(_jit_unet_out(scanned)[0], want[0], want64[0], what="scanned UNet")
    assert rel_error(_jit_unet_out(_reversed(scanned))[0], want[0]) > 1e-3  # a wrong order would be caught


@pytest.mark.parametrize("remat", [Remat.NONE, Remat.FULL])
def test_scanned_spatial_transformer_equals_unrolled(remat):
    """The UNet's mid-block transformer (depth 2), outputs and gradients; with remat around it as the UNet's
    blocks apply it (the scan inside a jax.checkpoint)."""
    scanned = _unet_outputs()[1].mid_block.attentions[0]
    run = functools.partial(_transformer_out, remat=remat)
    reference = _transformer_reference()
    _assert_equal_to_unrolled(scanned, run, reference, f"scanned spatial transformer, {remat}")
    if remat is Remat.FULL:
        assert "remat2" in str(jax.make_jaxpr(run)(scanned))
    assert rel_error(_evaluate(_reversed(scanned), run)[0][0], reference[1][0]) > 1e-3


def test_scanned_unet_round_trips_into_diffusers(tmp_path):
    _, scanned, want, _ = _unet_outputs()
    rolled = _map_stacks(scanned, lambda a: jnp.roll(a, 1, axis=0))  # new weights: the layers in another order
    eqxdiff.save_pretrained(rolled, tmp_path)
    ref = diffusers.UNet2DConditionModel.from_pretrained(tmp_path).eval()
    torch_kw, _, _ = _unet_inputs()
    with torch.no_grad():
        expected = nchw_to_nhwc(ref(**torch_kw).sample)
    got = _jit_unet_out(rolled)[0]
    assert_close(got, expected, 1e-4, what="diffusers on the written folder")
    assert rel_error(got, want[0]) > 1e-3
