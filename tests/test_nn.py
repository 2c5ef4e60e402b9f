"""Layer parity with PyTorch and the state-dict mapping the loader relies on.

Parity is checked against PyTorch's layer run in float64: ours (float32) must be as accurate as PyTorch's own float32
result, whose distance from the float64 one is measured each run (it depends on the CPU: oneDNN's and XLA's kernels
block their sums by the vector width, and XLA contracts multiply-adds into FMAs where the CPU has them); and our layer
run in float64 must equal PyTorch's float64 result to float64 rounding, which no float32 noise can hide."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from eqxdiff import nn
from eqxdiff.core import leaf_specs
from eqxdiff.loading import CheckpointError, fill_module, state_dict

from ._util import assert_close_to_float64, nchw_to_nhwc, nhwc_to_nchw, run_float64, to_jax, torch_float64


class _Checkpoint(dict):
    def names(self):
        return list(self)

    def shape(self, name):
        return self[name].shape

    def get(self, name):
        return self[name]


def _load_torch(module, torch_module):
    sd = _Checkpoint({k: v.detach().numpy() for k, v in torch_module.state_dict().items()})
    return fill_module(eqx.filter_eval_shape(lambda: module), sd)


def _check(ours, ref, *args, image=False, what="output", ours_extra=(), ref_kwargs=None):
    """``ours(*args, *ours_extra)`` (jax arrays) against ``ref(*args, **ref_kwargs)`` (a torch module) on the same
    inputs, both also in float64. ``image``: NCHW torch, NHWC ours."""
    to_ours = (lambda t: None if t is None else nchw_to_nhwc(t) if t.ndim == 4 else to_jax(t)) if image else \
        (lambda t: None if t is None else to_jax(t))
    layout = (lambda a: np.moveaxis(np.asarray(a), 1, -1)) if image else np.asarray
    ours_args = [to_ours(a) for a in args] + list(ours_extra)
    ref_kwargs = ref_kwargs or {}
    with torch.no_grad():
        expected = layout(ref(*args, **ref_kwargs).numpy())
    assert_close_to_float64(ours(*ours_args), expected, layout(torch_float64(ref, *args, **ref_kwargs)), what=what,
                            actual64=run_float64(ours, *ours_args))


@pytest.mark.parametrize("stride,padding,k", [(1, 1, 3), (2, 1, 3), (1, 0, 1), (2, 0, 3)])
def test_conv2d_matches_torch(stride, padding, k):
    torch.manual_seed(0)
    ref = torch.nn.Conv2d(6, 10, k, stride=stride, padding=padding)
    ours = _load_torch(nn.Conv2d(6, 10, k, stride=stride, padding=padding, key=jax.random.key(0)), ref)
    _check(ours, ref, torch.randn(2, 6, 9, 11), image=True)


def test_linear_groupnorm_layernorm_match_torch():
    torch.manual_seed(0)
    lin = torch.nn.Linear(7, 5)
    gn = torch.nn.GroupNorm(4, 12, eps=1e-6)
    ln = torch.nn.LayerNorm(12, eps=1e-5)
    for p in list(gn.parameters()) + list(ln.parameters()):
        torch.nn.init.normal_(p)
    x = torch.randn(3, 4, 7)
    _check(_load_torch(nn.Linear(7, 5, key=jax.random.key(0)), lin), lin, x, what="linear")
    y = torch.randn(2, 12, 5, 6)
    _check(_load_torch(nn.GroupNorm(4, 12, eps=1e-6), gn), gn, y, image=True, what="group norm")
    z = torch.randn(2, 3, 12)
    _check(_load_torch(nn.LayerNorm(12), ln), ln, z, what="layer norm")


class _Block(eqx.Module):
    TORCH_RENAMES = {"proj": "to_out.0"}
    proj: nn.Linear
    convs: list

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.proj = nn.Linear(4, 3, key=k1)
        self.convs = [nn.Conv2d(3, 5, 3, key=k2), nn.Conv2d(5, 2, 1, use_bias=False, key=k3)]


def test_state_dict_names_permutations_and_round_trip():
    block = _Block(jax.random.key(0))
    _, specs, _ = leaf_specs(block)
    assert [s.name for s in specs] == ["to_out.0.weight", "to_out.0.bias", "convs.0.weight", "convs.0.bias",
                                        "convs.1.weight"]
    sd = state_dict(block)
    assert sd["convs.0.weight"].shape == (5, 3, 3, 3)  # PyTorch OIHW
    again = fill_module(eqx.filter_eval_shape(_Block, jax.random.key(1)), _Checkpoint(sd))
    for a, b in zip(jax.tree_util.tree_leaves(block), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(a, b)


def test_fill_reports_missing_unexpected_and_wrong_shapes():
    abstract = eqx.filter_eval_shape(_Block, jax.random.key(0))
    sd = state_dict(_Block(jax.random.key(0)))
    bad = _Checkpoint(sd)
    del bad["convs.1.weight"]
    bad["extra.weight"] = np.zeros(3)
    bad["to_out.0.bias"] = np.zeros(4, np.float32)
    with pytest.raises(CheckpointError) as info:
        fill_module(abstract, bad)
    msg = str(info.value)
    assert "missing" in msg and "convs.1.weight" in msg
    assert "unexpected" in msg and "extra.weight" in msg
    assert "'to_out.0.bias' has shape (4,)" in msg and "expects (3,)" in msg
    # ignored names may be present without being used
    ok = _Checkpoint(sd)
    ok["position_ids"] = np.arange(3)
    fill_module(abstract, ok, ignore=[r"position_ids"])


def test_fill_names_a_few_tensors_of_another_shape():
    """A checkpoint of another width (every tensor of another shape: a file with the config of another size) is
    one short line naming four and counting the rest, then the hint (it used to name every tensor: 9,000 characters
    for a tiny LTX transformer read with another head count, a whole line per tensor of a real one)."""
    abstract = eqx.filter_eval_shape(_Block, jax.random.key(0))
    wider = _Checkpoint({k: np.zeros(tuple(d + 1 for d in v.shape), np.float32)
                         for k, v in state_dict(_Block(jax.random.key(0))).items()})
    with pytest.raises(CheckpointError) as info:
        fill_module(abstract, wider, where="file 'x.safetensors'", hint="Pass the config of this file.")
    msg = str(info.value)
    assert msg.startswith("5 tensor(s) of another shape in the file 'x.safetensors': 'to_out.0.weight' has shape "
                          "(4, 5) where the model expects (3, 4), ") and msg.count("has shape") == 4
    assert msg.endswith(" ... and 1 more. Pass the config of this file.") and "\n" not in msg


def test_wrong_input_shape_is_rejected_readably():
    conv = nn.Conv2d(3, 4, 3, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"Conv2d expects channels-last input \[batch, height, width, cin=3\], "
                                         r"got shape \(1, 8, 8, 5\)"):
        conv(to_jax(np.zeros((1, 8, 8, 5), np.float32)))
    conv3 = nn.Conv3d(2, 4, 3, key=jax.random.key(1))
    with pytest.raises(ValueError, match=r"Conv3d expects channels-last input \[batch, frames, height, width, "
                                         r"cin=2\], got shape \(1, 3, 4, 4, 3\)"):
        conv3(to_jax(np.zeros((1, 3, 4, 4, 3), np.float32)))


def test_conv_nchw_helper_round_trip():
    x = np.random.randn(2, 3, 4, 5).astype(np.float32)
    np.testing.assert_array_equal(nhwc_to_nchw(nchw_to_nhwc(x)).numpy(), x)


@pytest.mark.parametrize("cin,cout,temb,padding", [(8, 8, 16, 1), (8, 16, None, 0)])
def test_resnet_and_sampling_blocks_match_diffusers(cin, cout, temb, padding):
    from diffusers.models.resnet import Downsample2D as TDown
    from diffusers.models.resnet import ResnetBlock2D as TRes
    from diffusers.models.resnet import Upsample2D as TUp

    torch.manual_seed(0)
    ref = TRes(in_channels=cin, out_channels=cout, temb_channels=temb, groups=4, eps=1e-6)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ours = _load_torch(nn.ResnetBlock2D(cin, cout, temb_channels=temb, groups=4, key=jax.random.key(0)), ref)
    x = torch.randn(2, cin, 6, 6)
    t = torch.randn(2, temb) if temb else None
    _check(ours, ref, x, t, image=True, what="resnet")

    down = TDown(cin, use_conv=True, out_channels=cout, padding=padding, name="op")
    ours_down = _load_torch(nn.Downsample2D(cin, cout, padding=padding, key=jax.random.key(0)), down)
    _check(ours_down, down, x, image=True, what="downsample")
    up = TUp(cin, use_conv=True, out_channels=cout)
    ours_up = _load_torch(nn.Upsample2D(cin, cout, key=jax.random.key(0)), up)
    _check(ours_up, up, x, image=True, what="upsample")
    _check(ours_up, up, x, image=True, what="upsample to size", ours_extra=((9, 11),),
           ref_kwargs={"output_size": (9, 11)})


def test_initialisers_draw_outside_build_abstract_and_only_shapes_inside():
    """Built directly, a layer's parameters are random draws of its key (PyTorch's default bounds); under
    ``nn.build_abstract`` the same constructor yields only shapes and dtypes, and the switch does not outlive the
    call, even one that raises."""
    k1, k2 = jax.random.split(jax.random.key(0))
    a, b = nn.Linear(8, 16, key=k1), nn.Linear(8, 16, key=k2)
    assert float(jnp.std(a.weight)) > 0.1 and not np.array_equal(np.asarray(a.weight), np.asarray(b.weight))
    assert float(jnp.max(jnp.abs(a.weight))) <= 1 / np.sqrt(8)
    table = nn.ScaleShiftTable(6, 4, key=k1)
    assert float(jnp.std(table.weight)) > 0.1
    shapes = nn.build_abstract(nn.Conv3d, 3, 5, 3, dtype=jnp.bfloat16, key=k1)
    assert shapes.weight == jax.ShapeDtypeStruct((3, 3, 3, 3, 5), jnp.bfloat16)
    with pytest.raises(ValueError, match="kernel_size"):
        nn.build_abstract(nn.Conv3d, 3, 5, 0, key=k1)
    again = nn.Conv3d(3, 5, 3, key=k1)
    assert float(jnp.std(again.weight)) > 0.01
