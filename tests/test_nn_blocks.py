"""The diffusion-transformer building blocks in ``eqxdiff.nn`` against diffusers' modules, layer by layer (float32,
every weight randomised, as accurate as diffusers' own float32 result; see ``_check``): QK norms, LayerNorm without
affine, adaptive-norm modulation, timestep/text embedders, the feed-forward, rotary tables (Flux, Wan, LTX) and
their application, Conv3d and the causal 3-D convolutions, and the attention with QK-norm, RoPE and joint / added
key-value projections. Each layer is loaded from the PyTorch module's own ``state_dict`` (so its checkpoint names
are checked too) and every parameter must declare logical axes.

The bound of a float32 comparison is measured, not fixed: PyTorch's layer also runs in float64, its float32 result's
distance from that is what float32 costs this layer on this CPU (oneDNN's and XLA's kernels block sums by the vector
width, XLA contracts multiply-adds into FMAs where the CPU has them), and ours must be as close. Where both programs
are the same in float64 (no constant rounded to float32 on purpose), ours runs in float64 too and must equal
PyTorch's float64 result to float64 rounding."""

import contextlib
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.models.attention import FeedForward as TFeedForward
from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoCausalConv3d
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d
from diffusers.models.embeddings import PixArtAlphaTextProjection, get_timestep_embedding
from diffusers.models.embeddings import TimestepEmbedding as TTimestepEmbedding
from diffusers.models.normalization import AdaLayerNormContinuous as TAdaContinuous
from diffusers.models.normalization import AdaLayerNormZero as TAdaZero
from diffusers.models.normalization import AdaLayerNormZeroSingle as TAdaZeroSingle
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.normalization import RMSNorm as TRMSNorm
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxPosEmbed
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoRotaryPosEmbed
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_apply_rotary_emb
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, WanRotaryPosEmbed

from eqxdiff import nn
from eqxdiff.core import leaf_specs
from eqxdiff.loading import fill_module

from ._util import assert_close, assert_close_to_float64, randomize_torch, run_float64, to_jax, torch_float64
from .test_nn import _Checkpoint


def _load(make, ref, seed=0):
    """``make()`` (built abstractly) filled from ``ref``'s randomised state dict (names and shapes must match both
    ways); every leaf of it declares logical axes of the right rank."""
    randomize_torch(ref, seed)
    module = fill_module(eqx.filter_eval_shape(make), _Checkpoint({k: v.numpy() for k, v in ref.state_dict().items()}))
    _, specs, _ = leaf_specs(module)
    assert specs, "no parameters"
    for leaf, spec in zip(jax.tree.leaves(module), specs):
        assert spec.axes is not None and len(spec.axes) == leaf.ndim, f"{spec.name}: axes {spec.axes}"
    return module


@eqx.filter_jit
def _jit(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` compiled as one program (``fn`` a module, its bound method or a function): far fewer
    compilations than running the layer op by op."""
    return fn(*args, **kwargs)


def _outputs(x) -> list:
    return list(x) if isinstance(x, (tuple, list)) else [x]


def _check(ours, ours_args, ref, ref_args, *, what="output", same_in_float64=True, ours_kwargs=None,
           ref_kwargs=None, layout=np.asarray, ours_kwargs64=None, ref_kwargs64=None):
    """``ours(*ours_args, **ours_kwargs)`` (jitted) against ``ref(*ref_args, **ref_kwargs)`` (a torch module or
    function of tensors), each output: ours as accurate as PyTorch's float32 result, measured against PyTorch's run
    in float64; with ``same_in_float64`` our layer in float64 equals that float64 result to float64 rounding.
    ``layout`` turns PyTorch's outputs into ours (e.g. NCTHW to NTHWC). ``*_kwargs64`` replace keywords in the
    float64 runs (a RoPE table: both float64 runs take PyTorch's float64 table, where the float32 runs each take
    their own)."""
    ours_kwargs, ref_kwargs = ours_kwargs or {}, ref_kwargs or {}
    got = _outputs(_jit(ours, *ours_args, **ours_kwargs))
    with torch.no_grad():
        expected = [layout(t.numpy()) for t in _outputs(ref(*ref_args, **ref_kwargs))]
    expected64 = [layout(t) for t in _outputs(torch_float64(ref, *ref_args, **ref_kwargs | (ref_kwargs64 or {})))]
    got64 = _outputs(run_float64(ours, *ours_args, **ours_kwargs | (ours_kwargs64 or {}))) if same_in_float64 else \
        [None] * len(got)
    assert len(got) == len(expected) == len(expected64) == len(got64), (len(got), len(expected))
    for i, (a, e, e64, a64) in enumerate(zip(got, expected, expected64, got64)):
        assert_close_to_float64(a, e, e64, what=f"{what} {i}" if len(got) > 1 else what, actual64=a64)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _key():
    return jax.random.key(0)


# -- norms ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("eps,affine", [(1e-6, True), (1e-5, True), (1e-6, False)])
def test_qk_rms_norms_per_head_and_across_heads(eps, affine):
    heads, dim_head = 3, 8
    x = _randn(2, 5, heads * dim_head) * 3
    across = torch.nn.RMSNorm(heads * dim_head, eps=eps, elementwise_affine=affine)
    per_head = torch.nn.RMSNorm(dim_head, eps=eps, elementwise_affine=affine)
    if affine:
        ours_across = _load(lambda: nn.AcrossHeads(nn.RMSNorm(heads * dim_head, eps=eps)), across, 1)
        ours_head = _load(lambda: nn.RMSNorm(dim_head, eps=eps), per_head, 2)
    else:
        ours_across = nn.AcrossHeads(nn.RMSNorm(heads * dim_head, eps=eps, elementwise_affine=False))
        ours_head = nn.RMSNorm(dim_head, eps=eps, elementwise_affine=False)
    # both take [..., heads, head_dim] queries or keys, as the attention layers hold them
    x4 = x.unflatten(-1, (heads, dim_head))
    _check(ours_across, (to_jax(x4),), across, (x,), what="across heads",
           layout=lambda a: a.reshape(*a.shape[:-1], heads, dim_head))
    _check(ours_head, (to_jax(x4),), per_head, (x4,), what="per head")
    # diffusers' own RMSNorm (LTX's norm1/norm2: no affine, eps 1e-6)
    _check(nn.RMSNorm(24, eps=eps, elementwise_affine=False), (to_jax(x),),
           TRMSNorm(24, eps=eps, elementwise_affine=False), (x,), what="diffusers RMSNorm")


@pytest.mark.parametrize("affine,bias,eps", [(False, True, 1e-6), (True, True, 1e-6), (True, False, 1e-5)])
def test_layernorm_without_affine_and_fp32_layernorm(affine, bias, eps):
    x = _randn(2, 7, 16) * 2 + 1
    ref = FP32LayerNorm(16, eps=eps, elementwise_affine=affine, bias=bias)
    ours = nn.LayerNorm(16, eps=eps, elementwise_affine=affine, use_bias=bias)
    ours = _load(lambda: ours, ref, 3) if affine else ours
    _check(ours, (to_jax(x),), ref, (x,))
    plain = torch.nn.LayerNorm(16, elementwise_affine=False, eps=1e-6)  # Flux's norm2, AdaLayerNormZero's norm
    _check(nn.LayerNorm(16, eps=1e-6, elementwise_affine=False), (to_jax(x),), plain, (x,), what="plain")
    # statistics in float32 for a bfloat16 input: the bf16 result is the float32 one rounded
    y = nn.LayerNorm(16, eps=eps, elementwise_affine=False)(to_jax(x).astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    assert_close(y.astype(jnp.float32), torch.nn.functional.layer_norm(x, (16,), eps=eps), 1e-2)


# -- modulation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("single", [False, True])
def test_ada_layer_norm_zero_matches_diffusers(single):
    dim = 12
    ref = TAdaZeroSingle(dim) if single else TAdaZero(dim)
    ours = _load(lambda: nn.AdaLayerNormZero(dim, num_chunks=3 if single else 6, key=_key()), ref, 4)
    x, emb = _randn(2, 5, dim, seed=1), _randn(2, dim, seed=2)
    assert len(_jit(ours, to_jax(x), to_jax(emb))) == (2 if single else 5)
    _check(ours, (to_jax(x), to_jax(emb)), ref, (x,), ref_kwargs={"emb": emb})


@pytest.mark.parametrize("affine,norm_type,eps", [(False, "layer_norm", 1e-6), (True, "rms_norm", 1e-5)])
def test_ada_layer_norm_continuous_is_scale_then_shift(affine, norm_type, eps):
    dim, cond = 12, 10
    ref = TAdaContinuous(dim, cond, elementwise_affine=affine, eps=eps, norm_type=norm_type)
    ours = _load(lambda: nn.AdaLayerNormContinuous(dim, cond, elementwise_affine=affine, eps=eps, norm_type=norm_type,
                                           key=_key()), ref, 5)
    x, emb = _randn(2, 6, dim, seed=1), _randn(2, cond, seed=2)
    _check(ours, (to_jax(x), to_jax(emb)), ref, (x, emb))


class _Table(eqx.Module):
    scale_shift_table: nn.ScaleShiftTable


class _TorchTable(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.scale_shift_table = torch.nn.Parameter(torch.zeros(shape))


def test_scale_shift_tables_of_wan_and_ltx():
    """The arithmetic of diffusers' Wan and LTX blocks and heads (their expressions) on randomised tables."""
    d, b, s = 8, 2, 3

    def table(shape, seed):
        ref = _TorchTable(shape)
        ours = _load(lambda: _Table(nn.ScaleShiftTable(shape[-2], d, shape=shape, key=_key())), ref, seed)
        return ours.scale_shift_table, ref.scale_shift_table.detach()

    def check(ours, temb, values, expression, **kwargs):
        """``expression(values, temb)``: diffusers' arithmetic on the table's values (run in float64 too)."""
        assert len(_jit(ours, to_jax(temb), **kwargs)) == len(expression(values, temb))
        _check(ours, (to_jax(temb),), expression, (values, temb), ours_kwargs=kwargs)

    # Wan blocks: temb [b, 6, d] (its chunks [b, 1, d], ours [b, d]: the same broadcast over tokens); per token
    # [b, s, 6, d]
    ours, wan = table((1, 6, d), 6)
    check(ours, _randn(b, 6, d, seed=7), wan, lambda wan, temb: [c.squeeze(1) for c in (wan + temb).chunk(6, dim=1)])
    check(ours, _randn(b, s, 6, d, seed=8), wan,
          lambda wan, temb: [c.squeeze(2) for c in (wan.unsqueeze(0) + temb).chunk(6, dim=2)])
    ours, ltx = table((6, d), 7)  # LTX blocks: temb [b, s', 6d]
    check(ours, _randn(b, 1, 6 * d, seed=9), ltx,
          lambda ltx, temb: (ltx[None, None] + temb.reshape(b, 1, 6, -1)).unbind(dim=2))
    # The heads: one embedding for both vectors (shared=True), per sample or per token; per token at 2 tokens too
    # (seq == num: by shape alone [b, 2, d] read as one embedding per vector, found by the random video fuzz)
    ours, wan = table((1, 2, d), 8)  # Wan's head: table + temb.unsqueeze(1), temb [b, d]; per token [b, s, d]
    check(ours, _randn(b, d, seed=10), wan,
          lambda wan, temb: [c.squeeze(1) for c in (wan + temb.unsqueeze(1)).chunk(2, dim=1)], shared=True)
    check(ours, _randn(b, 2, d, seed=12), wan,
          lambda wan, temb: [c.squeeze(2) for c in (wan.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)],
          shared=True)
    ours, ltx = table((2, d), 9)  # LTX's head: table[None, None] + embedded_timestep[:, :, None]
    for seq in (s, 2):
        check(ours, _randn(b, seq, d, seed=11), ltx,
              lambda ltx, temb: (ltx[None, None] + temb[:, :, None]).unbind(dim=2), shared=True)
    with pytest.raises(ValueError, match=r"temb of shape \(2, 5\) for a table of 2 x 8"):
        ours(jnp.zeros((2, 5)))
    with pytest.raises(ValueError, match=r"shape=\(6, 9\) must be"):
        nn.ScaleShiftTable(6, d, shape=(6, 9), key=_key())


def test_modulate_and_gate_broadcast_per_sample_and_per_token():
    x, shift, scale, gate, y = (_randn(*s, seed=i) for i, s in enumerate([(2, 4, 6), (2, 6), (2, 6), (2, 6),
                                                                         (2, 4, 6)]))
    _check(nn.modulate, (to_jax(x), to_jax(shift), to_jax(scale)),
           lambda x, shift, scale: x * (1 + scale[:, None]) + shift[:, None], (x, shift, scale), what="modulate")
    _check(nn.gated_residual, (to_jax(x), to_jax(y), to_jax(gate)), lambda x, y, gate: x + gate[:, None] * y,
           (x, y, gate), what="gated residual")
    per_token = _randn(2, 4, 6, seed=9)
    _check(nn.modulate, (to_jax(x), to_jax(per_token), to_jax(per_token)), lambda x, p: x * (1 + p) + p,
           (x, per_token), what="per token")


# -- embedders and feed-forward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim,flip,shift,scale", [(256, True, 0, 1.0), (32, False, 1, 1.0), (33, True, 1, 2.5)])
def test_timestep_embedding_matches_diffusers(dim, flip, shift, scale):
    t = torch.tensor([0.0, 1.0, 17.5, 99.0, 0.25])
    # (ours rounds the frequencies to float32 as PyTorch's float32 run does: not the same program in float64)
    _check(lambda t: nn.timestep_embedding(t, dim, flip_sin_to_cos=flip, freq_shift=shift, scale=scale), (to_jax(t),),
           lambda t: get_timestep_embedding(t, dim, flip_sin_to_cos=flip, downscale_freq_shift=shift, scale=scale),
           (t,), same_in_float64=False)
    # per-token timesteps [batch, seq] (Wan 2.2 TI2V) embed row by row: the same elementwise operations on the same
    # values, so exactly equal
    got = nn.timestep_embedding(to_jax(t), dim, flip_sin_to_cos=flip, freq_shift=shift, scale=scale)
    per_token = nn.timestep_embedding(to_jax(t).reshape(1, 5), dim, flip_sin_to_cos=flip, freq_shift=shift,
                                      scale=scale)
    np.testing.assert_array_equal(per_token[0], got)


@pytest.mark.parametrize("dim,shift", [(256, 0), (320, 1), (1280, 0)])
def test_timestep_frequencies_and_large_timesteps(dim, shift):
    """Near t = 1000 an angle's own float32 ulp is ~6e-5, so a frequency one ulp off (PyTorch's float32 exp is not
    correctly rounded everywhere; ours is, from float64) moves the embedding by more than 1e-5. So: the frequencies
    equal diffusers' up to that ulp, and the rest of the computation matches diffusers' formula on our frequencies.
    (PyTorch's float32 exp is its vectorised kernel for this CPU's instruction set: which entries it rounds
    correctly, so the share equal to ours, can differ on another CPU; the 1-ulp bound holds for any faithful exp.)"""
    half = dim // 2
    theirs = torch.exp(-math.log(10000) * torch.arange(0, half, dtype=torch.float32) / (half - shift)).numpy()
    ours = nn.timestep_frequencies(dim, freq_shift=shift)
    np.testing.assert_array_max_ulp(ours, theirs, maxulp=1)
    assert np.mean(ours == theirs) > 0.95
    t = torch.tensor([999.0, 500.5, 0.0, 981.25])

    def expected(t, freqs):
        args = t[:, None] * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    # the float32 product t * f rounds by up to half an ulp of ~1000 in both: that is this computation's rounding
    _check(lambda t: nn.timestep_embedding(t, dim, flip_sin_to_cos=True, freq_shift=shift), (to_jax(t),), expected,
           (t, torch.from_numpy(ours)))


@pytest.mark.parametrize("cond,out_dim", [(None, None), (6, 10)])
def test_timestep_embedding_module_and_text_projection(cond, out_dim):
    ref = TTimestepEmbedding(16, 12, cond_proj_dim=cond, out_dim=out_dim)
    ours = _load(lambda: nn.TimestepEmbedding(16, 12, cond_proj_dim=cond, out_dim=out_dim, key=_key()), ref, 11)
    x = _randn(3, 16, seed=1)
    c = _randn(3, cond, seed=2) if cond else None
    _check(ours, (to_jax(x), None if c is None else to_jax(c)), ref, (x, c))
    for act in ("gelu_tanh", "silu"):
        ref = PixArtAlphaTextProjection(16, 12, out_features=out_dim, act_fn=act)
        ours = _load(lambda: nn.TextProjection(16, 12, out_dim, act_fn=act, key=_key()), ref, 12)
        _check(ours, (to_jax(_randn(2, 5, 16)),), ref, (_randn(2, 5, 16),), what=act)
    with pytest.raises(ValueError, match="act_fn='relu'"):
        nn.TextProjection(16, 12, act_fn="relu", key=_key())


@pytest.mark.parametrize("activation,kwargs", [("gelu-approximate", {}), ("gelu", {"inner_dim": 20, "dim_out": 7}),
                                               ("geglu", {"mult": 2, "bias": False}), ("swiglu", {"inner_dim": 10}),
                                               ("geglu-approximate", {}), ("linear-silu", {"dim_out": 5})])
def test_feedforward_matches_diffusers(activation, kwargs):
    ref = TFeedForward(12, activation_fn=activation, **kwargs)
    ours = _load(lambda: nn.FeedForward(12, activation=activation, key=_key(), **kwargs), ref, 13)
    x = _randn(2, 5, 12)
    _check(ours, (to_jax(x),), ref, (x,))
    with pytest.raises(ValueError, match="activation='relu'"):
        nn.FeedForward(12, activation="relu", key=_key())


# -- rotary embeddings ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _float64_trigonometry():
    """PyTorch's ``cos``/``sin`` in float64 and ``Tensor.float`` keeping float64: a RoPE module built and run inside
    computes its angles as its program says (float32 where it says float32: LTX's) and their cosines and sines
    without float32 rounding, the float64 run of its table."""
    originals = {(owner, name): getattr(owner, name) for owner in (torch, torch.Tensor) for name in ("cos", "sin")}
    to_float32 = torch.Tensor.float
    for (owner, name), fn in originals.items():
        setattr(owner, name, lambda x, *a, _fn=fn, **k: _fn(x.double(), *a, **k))
    torch.Tensor.float = lambda x, *a, **k: x if x.dtype == torch.float64 else to_float32(x, *a, **k)
    try:
        yield
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
        torch.Tensor.float = to_float32


def _table64(make, *args, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """``make()(*args, **kwargs)``, a diffusers RoPE module's (cos, sin), in float64 (:func:`_float64_trigonometry`)."""
    with torch.no_grad(), _float64_trigonometry():
        cos, sin = make()(*args, **kwargs)
    assert cos.dtype == sin.dtype == torch.float64
    return cos.numpy(), sin.numpy()


def _tensors(table) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.from_numpy(np.asarray(t)) for t in table)


def _check_table(ours, expected, expected64):
    """Our float32 table (cos, sin) against PyTorch's, as accurate as it against its float64 run."""
    for name, a, e, e64 in zip(("cos", "sin"), ours, expected, expected64):
        assert_close_to_float64(a, np.asarray(e), e64, what=name)


def _flux_ids(text: int, h: int, w: int) -> np.ndarray:
    img = np.zeros((h, w, 3))
    img[..., 1] = np.arange(h)[:, None]
    img[..., 2] = np.arange(w)[None, :]
    return np.concatenate([np.zeros((text, 3)), img.reshape(-1, 3)])


@pytest.mark.parametrize("axes_dim,grid", [((4, 4, 8), (3, 5)), ((16, 56, 56), (40, 64))])
def test_flux_rope_tables(axes_dim, grid):
    ids = _flux_ids(4, *grid)
    cos, sin = FluxPosEmbed(10000, list(axes_dim))(torch.from_numpy(ids))
    ours = nn.flux_rope(ids, axes_dim)
    _check_table(ours, (cos, sin), _table64(lambda: FluxPosEmbed(10000, list(axes_dim)), torch.from_numpy(ids)))
    with pytest.raises(ValueError, match=r"ids of shape \(5, 2\)"):
        nn.flux_rope(np.zeros((5, 2)), axes_dim)


@pytest.mark.parametrize("head_dim,grid", [(12, (2, 3, 4)), (128, (9, 30, 52)), (10, (1, 3, 2)), (22, (5, 4, 1)),
                                           (4, (3, 2, 5)), (2, (2, 1, 3))])
def test_wan_rope_tables(head_dim, grid):
    """Channels split t / h / w as ``d - 4 * (d // 6)`` / ``2 * (d // 6)`` / ``2 * (d // 6)``: 10 -> 6/2/2, 22 ->
    10/6/6, and below 6 the rows and columns get none (diffusers builds such models)."""
    f, h, w = grid
    make = lambda: WanRotaryPosEmbed(head_dim, (1, 2, 2), max_seq_len=1024)  # noqa: E731
    cos, sin = make()(torch.zeros(1, 1, f, 2 * h, 2 * w))
    ours = nn.wan_rope(head_dim, grid)
    _check_table(ours, (cos[0, :, 0], sin[0, :, 0]),
                 [t[0, :, 0] for t in _table64(make, torch.zeros(1, 1, f, 2 * h, 2 * w))])


@pytest.mark.parametrize("dim,grid,scale", [(32, (2, 3, 4), (8 / 25, 32, 32)), (16, (3, 2, 2), (1 / 3, 8, 8)),
                                            (30, (2, 2, 3), None), (12, (1, 4, 4), (0.32, 32, 32))])
def test_ltx_rope_tables_with_front_padding(dim, grid, scale):
    """dim % 6 != 0 pads the front with cos 1, sin 0 (32: 2 channels, 16: 4); LTX's angles are float32's."""
    cos, sin = LTXVideoRotaryPosEmbed(dim)(torch.zeros(1, 1), *grid, rope_interpolation_scale=scale)
    ours = nn.ltx_rope(dim, grid=grid, interpolation_scale=scale)
    assert ours.cos.shape == (1, math.prod(grid), dim)
    _check_table(ours, (cos, sin), _table64(lambda: LTXVideoRotaryPosEmbed(dim), torch.zeros(1, 1), *grid,
                                            rope_interpolation_scale=scale))
    pad = dim % 6
    np.testing.assert_array_equal(ours.cos[..., :pad], 1)
    np.testing.assert_array_equal(ours.sin[..., :pad], 0)


@pytest.mark.parametrize("dim", [2048, 4096])
def test_ltx_rope_tables_at_full_size(dim):
    """At the real widths PyTorch's float32 linspace and power are not always correctly rounded: some of its
    frequencies are a few ulps off ours, which moves angles near 10^4 pi / 2 by ~1e-3. Every channel of a frequency
    PyTorch rounds as we do is as accurate as PyTorch's table against its float64 run; the others are within those
    ulps. (PyTorch's float32 power is its vectorised kernel for this CPU's instruction set: the share it rounds as we
    do can differ on another CPU.)"""
    grid, scale = (3, 5, 7), (8 / 25, 32, 32)
    n = dim // 6
    linspace = torch.linspace(math.log(1.0, 10000.0), math.log(10000.0, 10000.0), n, dtype=torch.float32)
    theirs = (10000.0 ** linspace * math.pi / 2.0).numpy()  # diffusers' expression
    ours = nn.ltx_rope_frequencies(dim)
    np.testing.assert_array_max_ulp(ours, theirs, maxulp=16)
    same = ours == theirs
    assert same.mean() > 0.85
    cos, sin = LTXVideoRotaryPosEmbed(dim)(torch.zeros(1, 1), *grid, rope_interpolation_scale=scale)
    cos64, sin64 = _table64(lambda: LTXVideoRotaryPosEmbed(dim), torch.zeros(1, 1), *grid,
                            rope_interpolation_scale=scale)
    table = nn.ltx_rope(dim, grid=grid, interpolation_scale=scale)
    pad = dim % 6
    channels = np.concatenate([np.ones(pad, bool), np.repeat(np.repeat(same, 3), 2)])  # (freq, axis) pairs
    _check_table(nn.Rope(table.cos[..., channels], table.sin[..., channels]),
                 (cos[..., channels], sin[..., channels]), (cos64[..., channels], sin64[..., channels]))


def test_ltx_rope_from_video_coords_and_errors():
    coords = _randn(2, 3, 10).abs() * torch.tensor([8.0, 300.0, 300.0])[None, :, None]
    cos, sin = LTXVideoRotaryPosEmbed(32)(torch.zeros(2, 1), video_coords=coords)
    ours = nn.ltx_rope(32, coords=coords.numpy())
    _check_table(ours, (cos, sin), _table64(lambda: LTXVideoRotaryPosEmbed(32), torch.zeros(2, 1),
                                            video_coords=coords))
    with pytest.raises(ValueError, match="either grid"):
        nn.ltx_rope(32, grid=(1, 2, 2), coords=coords.numpy())
    with pytest.raises(ValueError, match=r"coords of shape \(2, 10\)"):
        nn.ltx_rope(32, coords=np.zeros((2, 10)))


def test_apply_rope_matches_diffusers_rotations():
    from diffusers.models.embeddings import apply_rotary_emb

    b, s, heads, head_dim = 2, 6, 3, 8
    x = _randn(b, s, heads, head_dim)
    rope = nn.flux_rope(_flux_ids(2, 2, 2), (2, 2, 4))  # the tables are data here, the same on both sides
    _check(nn.apply_rope, (to_jax(x), rope), lambda x, cos, sin: apply_rotary_emb(x, (cos, sin), sequence_dim=1),
           (x, *_tensors(rope)), what="flux")
    # LTX: one table over heads * head_dim, rotated before the head split; with a batch axis
    table = nn.ltx_rope(heads * head_dim, coords=_randn(b, 3, s, seed=3).abs().numpy() * 100)
    _check(lambda x, table: nn.apply_rope(x, table).reshape(b, s, -1), (to_jax(x), table),
           lambda flat, cos, sin: ltx_apply_rotary_emb(flat, (cos, sin)), (x.flatten(2), *_tensors(table)), what="ltx")
    with pytest.raises(ValueError, match="tables with 5 channels"):
        _jit(nn.apply_rope, to_jax(x), nn.Rope(np.ones((s, 5)), np.ones((s, 5))))


# -- 3-D convolutions ----------------------------------------------------------------------------------------------


def _ncthw_to_jax(t):
    return jnp.moveaxis(to_jax(t), 1, -1)


def _channels_last(a):
    return np.moveaxis(np.asarray(a), 1, -1)


@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), ((1, 2, 2), (1, 2, 2), 0), ((3, 3, 1), 2, (1, 0, 2))])
def test_conv3d_matches_torch(kernel, stride, padding):
    ref = torch.nn.Conv3d(4, 6, kernel, stride=stride, padding=padding)
    ours = _load(lambda: nn.Conv3d(4, 6, kernel, stride=stride, padding=padding, key=_key()), ref, 14)
    x = _randn(2, 4, 5, 6, 7)
    _check(ours, (_ncthw_to_jax(x),), ref, (x,), layout=_channels_last)
    with pytest.raises(ValueError, match=r"cin=4\], got shape"):
        _jit(ours, jnp.zeros((1, 2, 3, 3, 5)))
    with pytest.raises(ValueError, match="kernel_size=.*three of them"):
        nn.Conv3d(4, 6, (3, 3), key=_key())


@pytest.mark.parametrize("kernel,stride,padding", [(3, 1, 1), ((3, 1, 1), 1, (1, 0, 0)), ((3, 1, 1), (2, 1, 1), 0),
                                                   (1, 1, 0)])
def test_causal_conv3d_matches_wan(kernel, stride, padding):
    ref = WanCausalConv3d(4, 6, kernel, stride=stride, padding=padding)
    ours = _load(lambda: nn.CausalConv3d(4, 6, kernel, stride=stride, padding=padding, key=_key()), ref, 15)
    x = _randn(1, 4, 5, 6, 6)
    _check(ours, (_ncthw_to_jax(x),), ref, (x,), layout=_channels_last)
    if ours.time_padding[0]:  # chunked: the previous chunk's last frames stand in for the front padding
        cache = _randn(1, 4, 1, 6, 6, seed=3)
        _check(ours, (_ncthw_to_jax(x),), ref, (x, cache), layout=_channels_last, what="with a cache",
               ours_kwargs={"cache": _ncthw_to_jax(cache)})


@pytest.mark.parametrize("kernel,stride,causal", [(3, 1, True), (3, 1, False), ((3, 3, 3), (2, 2, 2), True),
                                                 (1, 1, True)])
def test_causal_conv3d_matches_ltx(kernel, stride, causal):
    ref = LTXVideoCausalConv3d(4, 6, kernel, stride=stride, is_causal=causal)
    ours = _load(lambda: nn.CausalConv3d(4, 6, kernel, stride=stride, causal=causal, pad_mode="replicate",
                                         torch_prefix="conv", key=_key()), ref, 16)
    assert {s.name for s in leaf_specs(ours)[1]} == {"conv.weight", "conv.bias"}
    x = _randn(2, 4, 5, 6, 7)
    _check(ours, (_ncthw_to_jax(x),), ref, (x,), layout=_channels_last)
    with pytest.raises(ValueError, match="pad_mode='reflect'"):
        nn.CausalConv3d(4, 6, 3, pad_mode="reflect", key=_key())


# -- attention -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("heads,dim_head,axes_dim,text", [(2, 16, (4, 4, 8), 5), (3, 8, (2, 2, 4), 3)])
def test_flux_joint_attention_with_qk_norm_and_rope(heads, dim_head, axes_dim, text):
    dim = heads * dim_head
    ref = FluxAttention(dim, heads=heads, dim_head=dim_head, out_dim=dim, added_kv_proj_dim=dim,
                        context_pre_only=False, bias=True, eps=1e-6)
    ours = _load(lambda: nn.JointAttention(dim, dim, heads=heads, dim_head=dim_head, bias=True,
                                           qk_norm=nn.RMSNorm(dim_head, eps=1e-6), key=_key()), ref, 17)
    h, w = 2, 3
    x, ctx = _randn(2, h * w, dim, seed=1), _randn(2, text, dim, seed=2)
    ids = _flux_ids(text, h, w)
    make_rope = lambda: FluxPosEmbed(10000, list(axes_dim))  # noqa: E731
    rope64 = _table64(make_rope, torch.from_numpy(ids))
    _check(ours, (to_jax(x), to_jax(ctx)), ref, (x, ctx), what="image and text streams",
           ours_kwargs={"rope": nn.flux_rope(ids, axes_dim)},
           ref_kwargs={"image_rotary_emb": make_rope()(torch.from_numpy(ids))},
           ours_kwargs64={"rope": nn.Rope(*rope64)}, ref_kwargs64={"image_rotary_emb": _tensors(rope64)})


def test_flux_single_block_attention_is_pre_only():
    heads, dim_head = 2, 16
    dim = heads * dim_head
    ref = FluxAttention(dim, heads=heads, dim_head=dim_head, out_dim=dim, bias=True, eps=1e-6, pre_only=True)
    ours = _load(lambda: nn.SelfAttention(dim, heads=heads, dim_head=dim_head, bias=True, pre_only=True,
                                          qk_norm=nn.RMSNorm(dim_head, eps=1e-6), key=_key()), ref, 18)
    assert ours.to_out is None
    ids = _flux_ids(3, 2, 2)
    x = _randn(2, len(ids), dim)
    make_rope = lambda: FluxPosEmbed(10000, [4, 4, 8])  # noqa: E731
    rope64 = _table64(make_rope, torch.from_numpy(ids))
    _check(ours, (to_jax(x),), ref, (x,), ours_kwargs={"rope": nn.flux_rope(ids, (4, 4, 8))},
           ref_kwargs={"image_rotary_emb": make_rope()(torch.from_numpy(ids))},
           ours_kwargs64={"rope": nn.Rope(*rope64)}, ref_kwargs64={"image_rotary_emb": _tensors(rope64)})


def _wan_attention(dim, heads, *, cross=False, added_kv_dim=None, eps=1e-6):
    """Wan's attention layers: RMSNorm across heads (diffusers' ``qk_norm="rms_norm_across_heads"``)."""
    common = dict(heads=heads, dim_head=dim // heads, bias=True, qk_norm=nn.AcrossHeads(nn.RMSNorm(dim, eps=eps)),
                  key=_key())
    if added_kv_dim is not None:
        return nn.AddedKVAttention(dim, dim, added_kv_dim, **common)
    return nn.CrossAttention(dim, dim, **common) if cross else nn.SelfAttention(dim, **common)


@pytest.mark.parametrize("heads,dim_head,eps", [(2, 12, 1e-6), (3, 8, 1e-5)])
def test_wan_self_and_cross_attention(heads, dim_head, eps):
    dim, grid = heads * dim_head, (2, 2, 3)
    ref = WanAttention(dim, heads=heads, dim_head=dim_head, eps=eps, processor=WanAttnProcessor())
    ours = _load(lambda: _wan_attention(dim, heads, eps=eps), ref, 19)
    x = _randn(2, math.prod(grid), dim)
    make_rope = lambda: WanRotaryPosEmbed(dim_head, (1, 1, 1), max_seq_len=16)  # noqa: E731
    rope64 = _table64(make_rope, torch.zeros(1, 1, *grid))
    _check(ours, (to_jax(x),), ref, (x,), what="self", ours_kwargs={"rope": nn.wan_rope(dim_head, grid)},
           ref_kwargs={"rotary_emb": make_rope()(torch.zeros(1, 1, *grid))},
           ours_kwargs64={"rope": nn.Rope(*(t[0, :, 0] for t in rope64))},
           ref_kwargs64={"rotary_emb": _tensors(rope64)})
    ref = WanAttention(dim, heads=heads, dim_head=dim_head, eps=eps, cross_attention_dim_head=dim_head,
                       processor=WanAttnProcessor())
    ours = _load(lambda: _wan_attention(dim, heads, cross=True, eps=eps), ref, 20)
    ctx = _randn(2, 7, dim, seed=1)
    _check(ours, (to_jax(x), to_jax(ctx)), ref, (x, ctx), what="cross")


def test_wan_i2v_attention_adds_image_keys_and_values():
    heads, dim_head = 2, 12
    dim = heads * dim_head
    ref = WanAttention(dim, heads=heads, dim_head=dim_head, eps=1e-6, added_kv_proj_dim=dim,
                       cross_attention_dim_head=dim_head, processor=WanAttnProcessor())
    ours = _load(lambda: _wan_attention(dim, heads, cross=True, added_kv_dim=dim), ref, 21)
    x, image, text = _randn(2, 6, dim, seed=1), _randn(2, 5, dim, seed=2), _randn(2, 512, dim, seed=3)
    # diffusers splits off the last 512 context tokens as the text
    _check(ours, (to_jax(x), to_jax(text), to_jax(image)), ref, (x, torch.cat([image, text], dim=1)))
    with pytest.raises(TypeError, match="image_context"):  # the image tokens are not optional
        _jit(ours, to_jax(x), to_jax(text))


@pytest.mark.parametrize("heads,dim_head,scale", [(4, 8, (8 / 25, 32, 32)), (2, 8, (1 / 3, 8, 8))])
def test_ltx_attention_rope_across_heads(heads, dim_head, scale):
    dim, grid = heads * dim_head, (2, 2, 2)
    ref = LTXAttention(dim, heads=heads, kv_heads=heads, dim_head=dim_head, bias=True)
    ours = _load(lambda: nn.SelfAttention(dim, heads=heads, dim_head=dim_head, bias=True,
                                          qk_norm=nn.AcrossHeads(nn.RMSNorm(dim, eps=1e-5)), key=_key()), ref, 22)
    x = _randn(2, math.prod(grid), dim)
    make_rope = lambda: LTXVideoRotaryPosEmbed(dim)  # noqa: E731
    rope64 = _table64(make_rope, x, *grid, rope_interpolation_scale=scale)
    _check(ours, (to_jax(x),), ref, (x,), ours_kwargs={"rope": nn.ltx_rope(dim, grid=grid, interpolation_scale=scale)},
           ref_kwargs={"image_rotary_emb": make_rope()(x, *grid, rope_interpolation_scale=scale)},
           ours_kwargs64={"rope": nn.Rope(*rope64)}, ref_kwargs64={"image_rotary_emb": _tensors(rope64)})


def test_attention_options_are_checked():
    """A QK norm is a norm module that fits the heads (the old string modes get the fix); checkpoint names are a
    known family's."""
    with pytest.raises(ValueError, match=r"SelfAttention: qk_norm='rms_norm' is not a QK norm module: give "
                                         r"nn.RMSNorm\(dim_head=4\) .* nn.AcrossHeads\(nn.RMSNorm\(heads \* "
                                         r"dim_head=8\)\)"):
        nn.SelfAttention(8, heads=2, dim_head=4, qk_norm="rms_norm", key=_key())
    with pytest.raises(ValueError, match="JointAttention: qk_norm normalises 8 channels, not 4"):
        nn.JointAttention(8, 8, heads=2, dim_head=4, qk_norm=nn.RMSNorm(8), key=_key())
    with pytest.raises(ValueError, match="CrossAttention: qk_norm normalises 4 channels, not 8"):
        nn.CrossAttention(8, 6, heads=2, dim_head=4, qk_norm=nn.AcrossHeads(nn.RMSNorm(4)), key=_key())
    with pytest.raises(ValueError, match=r"ProjectedAttention: names='sd'; choose one of \['diffusers', 'clip', "):
        nn.ProjectedAttention(8, heads=2, dim_head=4, names="sd", key=_key())
    # modes that excluded each other are now different layers: a cross-attention has no positions to rotate
    cross = eqx.filter_eval_shape(lambda: nn.CrossAttention(8, 8, heads=2, dim_head=4, key=_key()))
    with pytest.raises(TypeError, match="rope"):
        cross(jnp.ones((1, 3, 8)), jnp.ones((1, 3, 8)), rope=nn.flux_rope(np.zeros((3, 1)), (4,)))


def test_every_new_parameter_declares_axes():
    """All the optional pieces at once; each leaf's axes have its rank and name the sharding rules know."""
    from eqxdiff.core import DEFAULT_RULES

    layers = eqx.filter_eval_shape(lambda: {
        "attention": nn.JointAttention(8, 6, heads=2, dim_head=4, bias=True, qk_norm=nn.RMSNorm(4), key=_key()),
        "fused": nn.FusedJointAttention(nn.JointAttention(8, 6, heads=2, dim_head=4, qk_norm=nn.RMSNorm(4),
                                                          key=_key())),
        "wan_i2v": nn.AddedKVAttention(8, 7, 5, heads=2, dim_head=4, qk_norm=nn.AcrossHeads(nn.RMSNorm(8)),
                                       key=_key()),
        "projected": nn.ProjectedAttention(8, heads=2, dim_head=4, qk_norm=nn.RMSNorm(4), names="clip", key=_key()),
        "conv3d": nn.Conv3d(2, 3, 3, key=_key()),
        "causal": nn.CausalConv3d(2, 3, 3, torch_prefix="conv", key=_key()),
        "ada": nn.AdaLayerNormZero(8, key=_key()),
        "ada_continuous": nn.AdaLayerNormContinuous(8, 4, key=_key()),
        "table": nn.ScaleShiftTable(6, 8, shape=(1, 6, 8), key=_key()),
        "ff": nn.FeedForward(8, activation="gelu-approximate", key=_key()),
        "timestep": nn.TimestepEmbedding(4, 8, key=_key()),
        "text": nn.TextProjection(4, 8, key=_key()),
    })
    known = dict(DEFAULT_RULES.params)
    leaves, specs, _ = leaf_specs(layers)
    assert len(specs) == len(leaves) > 30
    for leaf, spec in zip(leaves, specs):
        assert spec.axes is not None and len(spec.axes) == leaf.ndim, spec
        assert all(a is None or a in known for a in spec.axes), spec
    names = {s.name for s in specs}
    assert {"attention.norm_added_q.weight", "attention.add_q_proj.weight", "attention.to_add_out.bias",
            "fused.to_qkv.weight", "fused.to_added_qkv.bias", "fused.norm_added_k.weight", "fused.to_out.0.weight",
            "wan_i2v.norm_added_k.weight", "wan_i2v.norm_q.weight", "wan_i2v.add_v_proj.bias",
            "projected.out_proj.weight", "projected.norm_k.weight", "table",
            "ff.net.0.proj.weight", "ff.net.2.weight", "causal.conv.weight"} <= names


def test_fused_and_external_projections_equal_separate():
    """:class:`~eqxdiff.nn.FusedJointAttention` (one ``to_qkv`` / ``to_added_qkv``, diffusers'
    ``fuse_qkv_projections`` layout) and :class:`~eqxdiff.nn.ProjectedAttention` (the caller projects) give what the
    separate projections give."""
    from eqxdiff.loading import state_dict

    heads, dim_head = 2, 8
    dim = heads * dim_head
    ref = FluxAttention(dim, heads=heads, dim_head=dim_head, out_dim=dim, added_kv_proj_dim=dim,
                        context_pre_only=False, bias=True, eps=1e-6)
    common = dict(heads=heads, dim_head=dim_head, qk_norm=nn.RMSNorm(dim_head, eps=1e-6), key=_key())
    separate = _load(lambda: nn.JointAttention(dim, dim, bias=True, **common), ref, 23)
    sd = state_dict(separate)
    split = ("to_q.", "to_k.", "to_v.", "add_q_proj.", "add_k_proj.", "add_v_proj.")
    fused_sd = {k: v for k, v in sd.items() if not k.startswith(split)}
    for part in ("weight", "bias"):
        fused_sd[f"to_qkv.{part}"] = np.concatenate([sd[f"to_{c}.{part}"] for c in "qkv"])
        fused_sd[f"to_added_qkv.{part}"] = np.concatenate([sd[f"add_{c}_proj.{part}"] for c in "qkv"])
    abstract = eqx.filter_eval_shape(lambda: nn.FusedJointAttention(nn.JointAttention(dim, dim, bias=True, **common)))
    fused = fill_module(abstract, _Checkpoint(fused_sd))
    # fusing a loaded layer gives the layer a checkpoint's separate tensors load into: diffusers' layout
    assert eqx.tree_equal(nn.FusedJointAttention(separate), fused)
    x, ctx = to_jax(_randn(2, 6, dim, seed=1)), to_jax(_randn(2, 3, dim, seed=2))
    rope = nn.flux_rope(_flux_ids(3, 2, 3), (4, 4, 8))
    separate64 = run_float64(separate, x, ctx, rope=rope)
    for a, b, b64 in zip(_jit(fused, x, ctx, rope=rope), _jit(separate, x, ctx, rope=rope), separate64):
        assert_close_to_float64(a, b, b64, what="fused joint")

    single_rope = nn.flux_rope(_flux_ids(0, 2, 3), (4, 4, 8))
    plain = _load(lambda: nn.SelfAttention(dim, bias=True, pre_only=True, **common),
                  FluxAttention(dim, heads=heads, dim_head=dim_head, out_dim=dim, bias=True, eps=1e-6, pre_only=True),
                  24)
    external = fill_module(eqx.filter_eval_shape(lambda: nn.ProjectedAttention(dim, pre_only=True, **common)),
                           _Checkpoint({k: v for k, v in state_dict(plain).items() if k.startswith("norm_")}))
    q, k, v = (proj(x) for proj in (plain.to_q, plain.to_k, plain.to_v))
    assert_close_to_float64(_jit(external, q, k, v, rope=single_rope),
                            _jit(plain, x, rope=single_rope), run_float64(plain, x, rope=single_rope),
                            what="external projections")
