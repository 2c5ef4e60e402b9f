"""The adapter slot of the projection layers, one layer at a time: each LyCORIS kind (LoCon with and without its
Tucker ``lora_mid``, ``dora_scale``, LoHa with and without ``hada_t1``/``hada_t2``, LoKr with a whole ``w1`` and a
low-rank or Tucker ``w2``, full ``diff``/``diff_b``) read from its file keys against LyCORIS' own modules
(``lycoris.create_lycoris_from_weights`` + ``merge_to``), at call time (unfused) and merged (``fuse``); PEFT's DoRA
at a strength other than 1 against PEFT's layer; strengths and switches; a scanned stack with a layer the file skips
and mixed ranks against the unrolled layers; adapters sharded like their weights on a mesh. Pipelines and file
namings are tests/test_lora_sd.py's and tests/test_lora_flux.py's."""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P

from eqxdiff import nn
from eqxdiff.core import leaf_specs
from eqxdiff.loading import lora
from eqxdiff.parallel import MeshConfig, make_mesh, shard_params

from . import _lora_files as files
from ._util import assert_close


def _ours(layer: torch.nn.Module):
    """The eqxdiff layer holding ``layer``'s weights."""
    w = layer.weight.detach().numpy()
    if isinstance(layer, torch.nn.Linear):
        ours = nn.Linear(w.shape[1], w.shape[0], axes=("heads", "embed"), key=jax.random.key(0))
        weight = jnp.asarray(w)
    else:
        ours = nn.Conv2d(w.shape[1], w.shape[0], w.shape[2], padding=layer.padding[0], key=jax.random.key(0))
        weight = jnp.asarray(np.transpose(w, (2, 3, 1, 0)))
    return eqx.tree_at(lambda m: (m.weight, m.bias), ours, (weight, jnp.asarray(layer.bias.detach().numpy())))


def _adapted(layer: torch.nn.Module, tensors: dict, scale: float = 1.0):
    """Our layer with the adapter the file tensors (keys ``m.<role>``) make."""
    records, unknown = lora.parse({k: v.numpy() for k, v in tensors.items()})
    assert not unknown and len(records) == 1
    ours = _ours(layer)
    site = nn.adapter_sites(ours)[0]
    adapter = lora.build_adapter(records[0], site.shape, site.axes, scale=lora.file_scale(records[0]),
                                 dtype=np.float32, where="m")
    stack = nn.Adapters((adapter,), np.full((1,), scale, np.float32))
    return nn.with_adapters(ours, {site.path: stack}), ours


@contextlib.contextmanager
def _lycoris_applied(layer: torch.nn.Module, tensors: dict, multiplier: float = 1.0):
    """``layer`` running LyCORIS' own module for ``tensors`` (keys ``m.<role>``) in its forward (``apply_to``; its
    ``merge_to`` scales LoHa and LoKr by alpha / rank twice in lycoris-lora 4.1, its forward once, as ComfyUI)."""
    from lycoris import create_lycoris_from_weights
    from lycoris.modules.lokr import LokrModule

    roles = {k.split(".", 1)[1]: v for k, v in tensors.items()}
    if "lokr_t2" in roles:  # LyCORIS' reader takes a Tucker LoKr's rank from the wrong axis: build it by hand
        module = LokrModule("lycoris_m", layer, multiplier, roles["lokr_t2"].shape[0], float(roles["alpha"]),
                            use_tucker=True, factor=roles["lokr_w1"].shape[0])
        with torch.no_grad():
            for role in ("lokr_w1", "lokr_w2_a", "lokr_w2_b", "lokr_t2"):
                getattr(module, role).copy_(roles[role])
        modules = [module]
    else:
        holder = torch.nn.ModuleDict({"m": layer})
        network, _ = create_lycoris_from_weights(multiplier, None, holder, {f"lycoris_m.{r}": v
                                                                             for r, v in roles.items()})
        modules = network.loras
    assert len(modules) == 1, "LyCORIS did not read the test's tensors"
    modules[0].apply_to()
    try:
        yield layer
    finally:
        modules[0].restore()


def _torch_out(layer, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        if isinstance(layer, torch.nn.Linear):
            return layer(torch.from_numpy(x)).numpy()
        return layer(torch.from_numpy(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1).numpy()


def _layers():
    torch.manual_seed(0)
    linear = torch.nn.Linear(12, 16)
    conv = torch.nn.Conv2d(8, 12, 3, padding=1)
    return linear, conv


def _inputs(layer):
    """Enough rows (patches) that the outputs pin the whole weight down."""
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, 8, 12) if isinstance(layer, torch.nn.Linear) else (2, 7, 7, 8)).astype(np.float32)


def _case(kind: str, layer, rand):
    """File tensors of one adapter kind for ``layer`` (module key ``m``)."""
    mods = {"m": layer}
    if kind == "locon":
        return files.kohya(mods, "", rand, rank=3, alpha=1.5)
    if kind == "locon_mid":
        return files.kohya(mods, "", rand, rank=3, alpha=1.5, mid=True)
    if kind == "dora_scale":
        return files.kohya(mods, "", rand, rank=3, alpha=1.5, dora=True)
    if kind == "loha":
        return files.loha("m", layer, rand, rank=3, alpha=2.0)
    if kind == "loha_tucker":
        return files.loha("m", layer, rand, rank=3, tucker=True, alpha=2.0)
    if kind == "lokr":
        return files.lokr("m", layer, rand, rank=2, alpha=3.0)
    if kind == "lokr_tucker":
        return files.lokr("m", layer, rand, rank=2, tucker=True, alpha=3.0)
    return files.full("m", layer, rand)


KINDS = [("linear", k) for k in ("locon", "dora_scale", "loha", "lokr", "full")] + \
        [("conv", k) for k in ("locon", "locon_mid", "dora_scale", "loha", "loha_tucker", "lokr", "lokr_tucker",
                               "full")]  # a LoCon conv: kohya's 3x3 down, 1x1 up


@pytest.mark.parametrize("layer_kind,kind", KINDS)
def test_each_kind_matches_lycoris_unfused_and_fused(layer_kind, kind):
    linear, conv = _layers()
    layer = linear if layer_kind == "linear" else conv
    tensors = _case(kind, layer, files.Rand(sum(map(ord, kind))))
    if kind == "locon" and layer_kind == "conv":  # kohya's LoCon: a 3x3 down, 1x1 up, from a single ``lora_unet``
        assert tensors["m.lora_down.weight"].shape[2:] == (3, 3)
    ours, plain = _adapted(layer, tensors)
    x = _inputs(layer)
    base = _torch_out(layer, x)
    with _lycoris_applied(layer, tensors) as applied:
        expected = _torch_out(applied, x)
    assert not np.allclose(expected, base, atol=1e-3), "the reference adapter changed nothing"
    assert_close(ours(jnp.asarray(x)), expected, what=f"{kind} on a {layer_kind}, unfused")
    for how in ("host", "jit"):
        fused = nn.fuse_adapters(ours, how=how)
        assert fused.adapters is None and jax.tree.structure(fused) == jax.tree.structure(plain)
        assert_close(fused(jnp.asarray(x)), expected, what=f"{kind} on a {layer_kind}, fused ({how})")


OWN = [("linear", "LokrModule", dict(factor=16, decompose_both=True), "lokr_w1_a"),  # both factors low rank
       ("conv", "LokrModule", dict(factor=16, decompose_both=True, use_tucker=True), "lokr_t2"),
       ("linear", "LokrModule", dict(factor=-1, weight_decompose=True, wd_on_out=False), "dora_scale"),  # [1, in]
       ("conv", "LohaModule", dict(use_tucker=True, weight_decompose=True), "hada_t1"),
       ("conv", "LoConModule", dict(use_tucker=True, weight_decompose=True, wd_on_out=False), "lora_mid.weight")]


@pytest.mark.parametrize("layer_kind,module,options,role", OWN)
def test_lycoris_own_modules_read_back(layer_kind, module, options, role):
    """Files as LyCORIS itself lays them out (its module built with each option, randomised, ``custom_state_dict``),
    where the hand-made tensors above do not reach: LoKr with both factors low rank (``decompose_both``) and its
    Tucker core on a 3x3 convolution (LyCORIS' reader mis-ranks that file, so the module is built, not read),
    ``dora_scale`` over input columns (``wd_on_out=False``) and on LoHa / LoKr / Tucker LoCon; against the module's
    own forward, unfused and fused."""
    import lycoris.modules

    torch.manual_seed(3)
    layer = torch.nn.Linear(256, 128) if layer_kind == "linear" else torch.nn.Conv2d(256, 128, 3, padding=1)
    lyco = getattr(lycoris.modules, module)("m", layer, 1.0, 4, 2.0, **options)
    with torch.no_grad():
        for name, p in lyco.named_parameters():
            if not name.startswith("org_"):
                p.normal_(0, 0.2)
    tensors = {f"m.{k}": v.detach().clone() for k, v in lyco.custom_state_dict().items()}
    assert f"m.{role}" in tensors, sorted(tensors)
    ours, _ = _adapted(layer, tensors)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 4, 256) if layer_kind == "linear" else (1, 6, 6, 256)).astype(np.float32)
    lyco.apply_to()
    try:
        expected = _torch_out(layer, x)
    finally:
        lyco.restore()
    assert not np.allclose(expected, _torch_out(layer, x), atol=1e-3), "the reference adapter changed nothing"
    assert_close(ours(jnp.asarray(x)), expected, what=f"LyCORIS {module} {options}, unfused")
    assert_close(nn.fuse_adapters(ours)(jnp.asarray(x)), expected, what=f"LyCORIS {module} {options}, fused")


def test_strengths_and_switches_are_values():
    """A strength scales a LoRA's change, a switch removes it; LyCORIS' DoRA at strength s is ``W + s (W' - W)``
    (ComfyUI's ``weight_decompose`` in comfy/weight_adapter/base.py: ``weight += strength * (weight_calc -
    weight)``), LyCORIS' own merge at 1."""
    linear, _ = _layers()
    x = jnp.asarray(_inputs(linear))
    rand = files.Rand(3)
    for kind in ("locon", "dora_scale"):
        ours, plain = _adapted(linear, _case(kind, linear, rand))
        full = np.asarray(ours(x))
        base = np.asarray(plain(x))
        half = nn.with_adapters(ours, {(): nn.Adapters(ours.adapters.entries, np.full((1,), 0.5, np.float32))})
        off = nn.with_adapters(ours, {(): nn.Adapters(ours.adapters.entries, None, np.zeros((1,), np.float32))})
        assert_close(half(x), base + 0.5 * (full - base), what=f"{kind} at 0.5")
        np.testing.assert_array_equal(np.asarray(off(x)), base)


def test_peft_dora_at_a_strength_matches_peft():
    """PEFT's DoRA (``lora_magnitude_vector``): the strength enters the weight it normalises (``scaling`` in PEFT's
    ``DoraLinearLayer``), so half a DoRA adapter is not half its change."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(1)
    holder = torch.nn.ModuleDict({"m": torch.nn.Linear(12, 16)})
    plain_layer = holder["m"]
    tensors = files.peft({"m": plain_layer}, "", files.Rand(5), rank=4, dora=True)
    ours, _ = _adapted(plain_layer, tensors, scale=0.5)
    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["m"], use_dora=True), holder)
    peft_layer = model["m"]
    with torch.no_grad():
        peft_layer.lora_A["default"].weight.copy_(tensors["m.lora_A.weight"])
        peft_layer.lora_B["default"].weight.copy_(tensors["m.lora_B.weight"])
        peft_layer.lora_magnitude_vector["default"].weight.copy_(tensors["m.lora_magnitude_vector"])
    peft_layer.set_scale("default", 0.5)
    x = _inputs(plain_layer)
    with torch.no_grad():
        expected = peft_layer(torch.from_numpy(x)).numpy()
    assert_close(ours(jnp.asarray(x)), expected, what="DoRA at 0.5")


def test_peft_dora_after_a_lora_rescales_it_as_peft():
    """Two PEFT adapters on one layer, a LoRA then a DoRA (diffusers' ``set_adapters([a, b], [0.7, -0.3])``): PEFT's
    DoRA multiplies the output so far, the LoRA's change included, by its factor (``base_result = result`` in
    ``lora.Linear.forward``). Unfused and fused as PEFT's layer; a switched-off DoRA leaves the LoRA alone."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(2)
    holder = torch.nn.ModuleDict({"m": torch.nn.Linear(12, 16)})
    layer = holder["m"]
    lora_file = files.peft({"m": layer}, "", files.Rand(6), rank=3, bias=True)
    dora_file = files.peft({"m": layer}, "", files.Rand(7), rank=2, dora=True)
    adapters = []
    for tensors in (lora_file, dora_file):
        adapted, plain = _adapted(layer, tensors)
        adapters.append(adapted.adapters.entries[0])
    model = inject_adapter_in_model(LoraConfig(r=3, lora_alpha=3, target_modules=["m"], lora_bias=True), holder, "a")
    model = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["m"], use_dora=True), model, "b")
    peft_layer = model["m"]
    with torch.no_grad():
        for name, tensors in (("a", lora_file), ("b", dora_file)):
            peft_layer.lora_A[name].weight.copy_(tensors["m.lora_A.weight"])
            peft_layer.lora_B[name].weight.copy_(tensors["m.lora_B.weight"])
        peft_layer.lora_B["a"].bias.copy_(lora_file["m.lora_B.bias"])
        peft_layer.lora_magnitude_vector["b"].weight.copy_(dora_file["m.lora_magnitude_vector"])
    x = _inputs(layer)
    site = nn.adapter_sites(plain)[0]
    for scales, enabled in (((0.7, -0.3), (1, 1)), ((1.0, 1.0), (1, 1)), ((0.7, -0.3), (1, 0))):
        peft_layer.set_adapter(["a", "b"] if enabled[1] else ["a"])
        for name, scale in zip("ab", scales):
            peft_layer.set_scale(name, scale)
        with torch.no_grad():
            expected = peft_layer(torch.from_numpy(x)).numpy()
        ours = nn.with_adapters(plain, {site.path: nn.Adapters(tuple(adapters), np.array(scales, np.float32),
                                                               np.array(enabled, np.float32))})
        assert_close(ours(jnp.asarray(x)), expected, what=f"LoRA then DoRA at {scales}, on {enabled}")
        assert_close(nn.fuse_adapters(ours)(jnp.asarray(x)), expected, what=f"fused, at {scales}, on {enabled}")


def test_scanned_stack_pads_ranks_and_skipped_layers():
    """Layers of a stack get one structure: a rank-2 and a rank-5 LoRA padded to 5, a layer without one zeros; the
    scan equals the unrolled layers each holding its own adapter."""
    torch.manual_seed(2)
    layers = [torch.nn.Linear(12, 12) for _ in range(3)]
    rand = files.Rand(7)
    adapters = {0: files.kohya({"m": layers[0]}, "", rand, rank=2), 2: files.kohya({"m": layers[2]}, "", rand, rank=5)}
    unrolled, built = [], []
    for i, layer in enumerate(layers):
        if i in adapters:
            ours, _ = _adapted(layer, adapters[i])
            built.append(ours.adapters.entries[0])
        else:
            ours = _ours(layer)
            built.append(None)
        unrolled.append(ours)
    stacked = nn.Stacked.from_layers([_ours(layer) for layer in layers])
    adapter = nn.stack_adapter_layers(built)
    assert adapter.rank == 5 and np.asarray(adapter.up).shape == (3, 12, 5)
    site = nn.adapter_sites(stacked)[0]
    assert site.layers == 3
    stack = nn.Adapters((adapter,), np.ones((3, 1), np.float32), np.ones((3, 1), np.float32))
    stacked = nn.with_adapters(stacked, {site.path: stack})
    x = jnp.asarray(_inputs(layers[0]))
    out, _ = stacked.scan(lambda layer, h: layer(h), x)
    want = x
    for layer in unrolled:
        want = layer(want)
    assert_close(out, want, what="scanned stack with padded adapters")


def test_adapters_shard_like_their_weight():
    """An adapter's arrays declare the logical axes of the weight they change: on an FSDP x tensor mesh a
    query projection's ``up`` splits its rows over ``tensor`` as the weight does, ``down`` its inputs over ``fsdp``,
    and the stack's strengths are replicated; the adapted layer computes the same numbers sharded."""
    linear, _ = _layers()
    ours, _ = _adapted(linear, _case("locon", linear, files.Rand(11)))
    _, specs, _ = leaf_specs(ours)
    axes = {s.name: s.axes for s in specs}
    assert axes["adapters.entries.0.up"] == ("heads", None) and axes["adapters.entries.0.down"] == (None, "embed")
    mesh = make_mesh(MeshConfig(ici_data_parallelism=1, ici_fsdp_parallelism=2, ici_tensor_parallelism=4))
    sharded = shard_params(ours, mesh)
    assert sharded.weight.sharding.spec == P("tensor", "fsdp")
    assert sharded.adapters.entries[0].up.sharding.spec == P("tensor")
    assert sharded.adapters.entries[0].down.sharding.spec == P(None, "fsdp")
    x = jnp.asarray(_inputs(linear))
    assert_close(jax.jit(lambda m, v: m(v))(sharded, x), ours(x), what="sharded adapted layer")
