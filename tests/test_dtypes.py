"""Reduced precision (bfloat16, float16) against PyTorch run in the same dtype.

PyTorch computes its activation kernels in float32 for half-precision tensors and rounds once: the activations here
must give those bits (where PyTorch's formula keeps its float32 accuracy), and the float32 results must not move."""

import diffusers
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

import eqxdiff
from eqxdiff import nn
from eqxdiff.core import family_names, leaf_specs, resolve_class
from eqxdiff.models import flux
from eqxdiff.models.flux import FluxTransformer2DConfig, FluxTransformer2DModel
from eqxdiff.pipelines import Guidance, combine_guidance
from eqxdiff.pipelines.flux import FluxDenoiser

from . import _tiny_flux, _tiny_wan
from ._util import randomize_torch
from .test_t5 import CONFIGS as t5_configs

HALF = {"bfloat16": (jnp.bfloat16, torch.bfloat16), "float16": (jnp.float16, torch.float16)}


def _inputs(dtype: str):
    """Random values (and every bfloat16 / float16 value of [-8, 8) would be too many): 20000 draws of spread 3."""
    x = (np.random.default_rng(0).standard_normal(20000) * 3).astype(np.float32)
    ours, theirs = HALF[dtype]
    return jnp.asarray(x).astype(ours), torch.tensor(x).to(theirs)


def _torch_result(values) -> np.ndarray:
    return values.float().numpy()


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("name, ours, theirs", [
    ("silu", nn.silu, torch.nn.functional.silu),
    ("mish", nn.activation("mish"), torch.nn.functional.mish),
    ("gelu", nn.gelu, torch.nn.functional.gelu),
    ("gelu_tanh", nn.gelu_tanh, lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
])
def test_activation_rounds_once_as_torch(dtype, name, ours, theirs):
    """Each activation in half precision is PyTorch's in that dtype: in bfloat16 bit for bit, in float16 (3 more
    mantissa bits, so a last-bit difference of the two float32 kernels shows more often) within one unit in under
    0.5% of the values; ``jax.nn``'s op-by-op rounding differed in about 40%. Below -3 PyTorch's erf and tanh GELU
    forms lose their float32 accuracy (results of a few 1e-4 at most) where XLA's erfc form keeps it: there the two
    may differ by a unit of the dtype."""
    x, xt = _inputs(dtype)
    out = ours(x)
    assert out.dtype == x.dtype
    got, want = np.asarray(out.astype(jnp.float32)), _torch_result(theirs(xt))
    tail = np.asarray(x.astype(jnp.float32)) < -3
    np.testing.assert_allclose(got[tail], want[tail], rtol=0, atol=1e-3)
    got, want = got[~tail], want[~tail]
    unit = np.spacing(np.abs(want).astype(np.float16)).astype(np.float32)  # float16's unit; bfloat16's is 8 times it
    assert np.all(np.abs(got - want) <= unit * (8 if dtype == "bfloat16" else 1)), f"{name} in {dtype}: off by more"
    off = got != want
    assert off.sum() == 0 if dtype == "bfloat16" else off.mean() < 5e-3, f"{name} in {dtype}: {off.sum()} differ"


@pytest.mark.parametrize("fn, reference", [
    (nn.silu, jax.nn.silu), (nn.gelu, lambda x: jax.nn.gelu(x, approximate=False)),
    (nn.gelu_tanh, lambda x: jax.nn.gelu(x, approximate=True)),
])
def test_activation_float32_unchanged(fn, reference):
    """Float32 inputs give ``jax.nn``'s bits unchanged (the float32 parity with diffusers stands as it was)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal(4096).astype(np.float32) * 4)
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x)), np.asarray(jax.jit(reference)(x)))


def test_layers_use_the_rounded_activations():
    """The layers that apply an activation (a feed-forward, a text projection, a modulation) give PyTorch's bfloat16
    activation: their half-precision output equals the same layer run on the activation computed in float32."""
    key = jax.random.key(0)
    ff = nn.FeedForward(8, activation="gelu-approximate", dtype=jnp.bfloat16, key=key)
    x = jax.random.normal(jax.random.key(1), (2, 5, 8)).astype(jnp.bfloat16)
    h = ff.proj_in(x)
    want = ff.proj_out(jax.nn.gelu(h.astype(jnp.float32), approximate=True).astype(jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(ff(x), np.float32), np.asarray(want, np.float32))


def test_guidance_combined_in_float32():
    """Classifier-free guidance of bfloat16 outputs is ``uncond + scale * (cond - uncond)`` computed in float32 and
    rounded once (each bfloat16 step rounded before: the scale 3.3 itself, the difference, the product and the sum),
    which is nearer the exact value than diffusers' bfloat16 arithmetic; float32 outputs keep their bits."""
    rng = np.random.default_rng(2)
    uncond, cond = (rng.standard_normal((2, 8, 8, 4)).astype(np.float32) for _ in range(2))
    u16, c16 = (jnp.asarray(a).astype(jnp.bfloat16) for a in (uncond, cond))
    guidance = Guidance(3.3)
    out = combine_guidance(u16, c16, guidance)
    assert out.dtype == jnp.bfloat16
    u32, c32 = (np.asarray(a, np.float32) for a in (u16, c16))
    once = jnp.asarray(u32 + np.float32(3.3) * (c32 - u32)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(once, np.float32))
    exact = u32.astype(np.float64) + 3.3 * (c32.astype(np.float64) - u32)
    ut, ct = (torch.from_numpy(a).bfloat16() for a in (u32, c32))
    theirs = (ut + 3.3 * (ct - ut)).float().numpy()  # diffusers' pipelines, in bfloat16
    ours_error, their_error = np.abs(np.asarray(out, np.float64) - exact), np.abs(theirs - exact)
    assert ours_error.max() <= their_error.max() and ours_error.mean() < their_error.mean()
    f32 = jax.jit(combine_guidance)(jnp.asarray(uncond), jnp.asarray(cond), guidance)
    before = jax.jit(lambda u, c, s: u + s * (c - u))(uncond, cond, guidance.scale)  # the float32 formula as it was
    np.testing.assert_array_equal(np.asarray(f32), np.asarray(before))


def test_flux_embeds_timestep_and_guidance_from_float32(monkeypatch):
    """Flux's sinusoids get ``1000 * sigma`` and ``1000 * guidance`` computed in float32 whatever the activations'
    dtype, from the pipeline's float32 timestep: bfloat16 spaces [512, 1024) 4 apart and [2048, 4096) 16 apart
    (diffusers' bfloat16 run embeds 876.3 as 876 and 3500 as 3504), which turns the fast channels by radians."""
    config = FluxTransformer2DConfig(**{**_tiny_flux.TRANSFORMER, "axes_dims_rope": (4, 4, 8), "guidance_embeds": True})
    abstract = eqx.filter_eval_shape(FluxTransformer2DModel, config, dtype=jnp.bfloat16, key=jax.random.key(0))
    model = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)  # weights are moot here: no random init
    seen = []

    class Embedded(Exception):
        pass

    def recording(t, *args, **kwargs):  # the timestep's and the guidance's sinusoids, then stop: the rest is moot
        seen.append(t)
        if len(seen) == 2:
            raise Embedded
        return embedding(t, *args, **kwargs)

    embedding = nn.timestep_embedding
    monkeypatch.setattr(nn, "timestep_embedding", recording)
    rope = model.rotary_embedding(flux.image_ids(2, 2), flux.text_ids(3))
    cond = {"embeds": jnp.ones((1, 3, 32), jnp.bfloat16), "pooled": jnp.ones((1, 32), jnp.bfloat16), "rope": rope,
            "guidance": jnp.full((1,), 3.5, jnp.float32)}
    # called eagerly (op by op: jnp rounds each bfloat16 product, as diffusers does; under jit XLA may keep excess
    # precision), so the sinusoid's inputs are concrete
    with pytest.raises(Embedded):
        FluxDenoiser(model)(jnp.ones((1, 4, 4), jnp.bfloat16), jnp.float32(876.3), cond, step=0)
    (t,), (g,) = seen
    assert t.dtype == g.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(t), [876.3], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(g), [3500.0])


# -- modules kept in float32 -------------------------------------------------------------------------------------


def _reference_class(name: str):
    return getattr(diffusers, name, None) or getattr(transformers, name, None)


BEYOND_THE_REFERENCE = {"UNet2DConditionModel": {"time_proj"}}  # kept in float32 where diffusers does not


@pytest.mark.parametrize("name", [n for n in family_names("model") if _reference_class(n) is not None])
def test_keep_in_float32_as_the_reference(name):
    """Each model keeps in float32 what its reference's loader keeps: diffusers' ``_keep_in_fp32_modules`` in
    bfloat16 and float16, transformers' in float16 only (and its ``_strict`` list in both); nothing in float32. One
    deliberate addition: a UNet's Gaussian Fourier timestep projection (``time_embedding_type='fourier'``), whose
    half-precision weights lose the phase of angles of thousands of radians (diffusers' bfloat16 run of the tests'
    Fourier UNet is 21% off its float32 one)."""
    ours, ref = resolve_class(name), _reference_class(name)
    loose = set(getattr(ref, "_keep_in_fp32_modules", None) or ()) | BEYOND_THE_REFERENCE.get(name, set())
    strict = set(getattr(ref, "_keep_in_fp32_modules_strict", None) or ())
    by_transformers = issubclass(ref, transformers.PreTrainedModel)
    assert set(ours.keep_in_float32(jnp.float16)) == loose | strict
    assert set(ours.keep_in_float32(jnp.bfloat16)) == (strict if by_transformers else loose)
    assert ours.keep_in_float32(jnp.float32) == ()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("scan_layers", [False, True])
def test_wan_keeps_diffusers_float32_modules(tmp_path_factory, dtype, scan_layers):
    """Wan loaded in half precision: the leaves of diffusers' ``_keep_in_fp32_modules`` (time embedder, modulation
    tables, the norms' weights, here the image embedder's too) are float32 and hold the checkpoint's values, every
    other floating leaf is in ``dtype``: the names diffusers' own loader keeps (its rule run on our names)."""
    folder = _wan_folder(tmp_path_factory)
    model = eqxdiff.load(folder, dtype=dtype, scan_layers=scan_layers)
    keep = diffusers.WanTransformer3DModel._keep_in_fp32_modules
    weights = safetensors.numpy.load_file(folder / "diffusion_pytorch_model.safetensors")
    leaves, specs, _ = leaf_specs(model)
    kept = [s.name for x, s in zip(leaves, specs) if x.dtype == jnp.float32]
    assert kept and len(kept) < len(leaves)
    for leaf, spec in zip(leaves, specs):
        in_reference = any(m in spec.name.split(".") for m in keep)  # diffusers' load_model_dict_into_meta
        assert leaf.dtype == (jnp.float32 if in_reference else dtype), spec.name
        if in_reference:
            stored = np.stack([weights[n] for n in spec.names]) if spec.layers else weights[spec.name]
            np.testing.assert_array_equal(np.asarray(leaf).reshape(stored.shape), stored)
    assert any(".image_embedder.norm1." in n for n in kept) and any(n.endswith("scale_shift_table") for n in kept)


_WAN: dict = {}


def _wan_folder(tmp_path_factory):
    """A tiny first-last-frame Wan transformer (an image embedder with norms), saved by diffusers once."""
    if "folder" not in _WAN:
        folder = tmp_path_factory.mktemp("wan")
        _tiny_wan.build_transformer(dict(_tiny_wan.TRANSFORMER, image_dim=8, added_kv_proj_dim=24,
                                         pos_embed_seq_len=10)).save_pretrained(folder)
        _WAN["folder"] = folder
    return _WAN["folder"]


@pytest.mark.parametrize("name, scan_layers", [("gated-gelu", False), ("umt5", True)])
def test_t5_in_float16_keeps_wo_and_the_stream_in_float32(tmp_path, name, scan_layers):
    """T5 / UMT5 loaded in float16: ``wo`` float32 (transformers' ``_keep_in_fp32_modules``), the rest float16, and
    the residual stream float32 as transformers' turns it: feed-forward outputs beyond float16's range (here
    ``wo`` scaled so they pass 1e5, as T5 v1.1 XXL's do) stay finite, as transformers' float16 run does, and
    near the float32 result (float16 overflowed to inf and NaN before)."""
    config = dict(t5_configs[name])
    reference_class = transformers.UMT5EncoderModel if name.startswith("umt5") else transformers.T5EncoderModel
    torch.manual_seed(0)
    reference = reference_class(reference_class.config_class(**config)).eval()
    randomize_torch(reference, seed=3)
    with torch.no_grad():
        for key, p in reference.named_parameters():
            if key.endswith("wo.weight"):
                p.mul_(1e5)
    reference.save_pretrained(tmp_path)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 9)).astype(np.int32)
    with torch.no_grad():
        want = reference(input_ids=torch.from_numpy(ids).long()).last_hidden_state.numpy()
        stream = reference(input_ids=torch.from_numpy(ids).long(), output_hidden_states=True).hidden_states[1]
    assert np.abs(stream.numpy()).max() > 65504  # the float32 run's residual stream is beyond float16's range
    model = eqxdiff.load(tmp_path, dtype=jnp.float16, scan_layers=scan_layers)
    leaves, specs, _ = leaf_specs(model)
    assert {(s.name, x.dtype) for x, s in zip(leaves, specs)} == {
        (s.name, jnp.dtype(jnp.float32 if s.name.endswith(".wo.weight") else jnp.float16)) for s in specs}
    got = model(jnp.asarray(ids)).last_hidden_state
    assert got.dtype == jnp.float16
    got = np.asarray(got, np.float32)
    assert np.all(np.isfinite(got))
    assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
    # wo in float16 too (a model cast whole): a float16 stream, clipped into range after each layer as transformers'
    # T5Block does (its all-float16 run is finite too, and as far from float32), not inf, then NaN from the norms
    cast = jax.tree.map(lambda x: x.astype(jnp.float16) if x.dtype == jnp.float32 else x, model)
    assert np.all(np.isfinite(np.asarray(cast(jnp.asarray(ids)).last_hidden_state, np.float32)))
