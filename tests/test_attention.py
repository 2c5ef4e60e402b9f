"""Every attention implementation against the float32 reference: forward values and gradients w.r.t. q, k, v
(and an additive logits bias, for the implementations that take one; the others must refuse it, saying why).

In float32 an implementation must be as accurate as the reference is, both measured against the same attention in
NumPy float64 (``_attention64``): the reference's distance from it is what float32 costs on this CPU (XLA blocks its
dot products by the vector width and contracts multiply-adds into FMAs where the CPU has them), so no fixed bound.

One base class (:class:`AttentionTestBase`) holds the cases; each backend is a subclass saying how to call it.
The Pallas kernels run in interpret mode and ring/Ulysses on the 8 simulated CPU devices of ``conftest.py``,
so everything here runs on a CPU. Shapes are small: interpret-mode Pallas is slow to compile. The reference
itself (with a bias) is checked against PyTorch's ``scaled_dot_product_attention``.
"""

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from eqxdiff.kernels import (
    IMPLEMENTATIONS,
    AttentionUnavailableError,
    BlockSizes,
    attention,
    explain_choice,
    reference_attention,
)
from eqxdiff.kernels._chunked import chunked_kernel
from eqxdiff.kernels._common import Kernel, attention_from_kernel
from eqxdiff.kernels._select import AttentionCall, choose

from ._util import assert_close, assert_close_to_float64

# bfloat16, max |error| / max |expected|: the output is rounded to bf16 (2^-8 relative) and flash feeds bf16
# probabilities to its matmuls, as flash kernels do: a few bf16 roundings. (float32: see _assert_as_accurate.)
BF16_TOLERANCE = 2e-2


def _attention64(q, k, v, *, mask=None, bias=None, causal=False, scale=None, cotangent=None):
    """The reference's attention in NumPy float64 (a query with every key masked gives zeros), and with a
    ``cotangent`` its vector-Jacobian product: ``out`` or ``out, (dq, dk, dv, dbias)``."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    allowed = np.ones(logits.shape, bool)
    if mask is not None:
        allowed &= np.asarray(mask)[:, None, None, :]
    if causal:
        allowed &= np.arange(q.shape[1])[:, None] >= np.arange(k.shape[1])[None, :]
    logits = np.where(allowed, logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - np.where(np.isfinite(m), m, 0.0))
    denom = p.sum(axis=-1, keepdims=True)
    p = p / np.where(denom == 0, 1.0, denom)
    out = np.einsum("bhqk,bkhd->bqhd", p, v)
    if cotangent is None:
        return out
    do = np.asarray(cotangent, np.float64)
    dp = np.einsum("bqhd,bkhd->bhqk", do, v)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, do)
    dbias = None if bias is None else ds.sum(axis=tuple(i for i, n in enumerate(np.shape(bias)) if n == 1),
                                             keepdims=True)
    return out, (dq, dk, dv, dbias)


def _assert_as_accurate(got, reference, exact, what):
    """float32 ``got`` as accurate as the float32 ``reference`` against the float64 ``exact``."""
    assert_close_to_float64(got, reference, exact, what=what)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    batch: int
    q_len: int
    kv_len: int
    heads: int
    head_dim: int
    masked: bool = False
    causal: bool = False
    bias: str | None = None  # a logits bias: "heads" [1, H, q, k] (T5's), "full" [B, H, q, k], "keys" [B, 1, 1, k]

    @property
    def bias_shape(self) -> tuple[int, ...] | None:
        b, h, q, k = self.batch, self.heads, self.q_len, self.kv_len
        return {None: None, "heads": (1, h, q, k), "full": (b, h, q, k), "keys": (b, 1, 1, k)}[self.bias]

    def inputs(self, getkey, dtype):
        """``q, k, v, mask, bias, cotangent``; with a mask, batch row 0 keeps a third of its keys, row 1 all but
        one, and (causal cases) row 0 loses all of them, which must give zeros."""
        # numpy draws (seeded from getkey) cost no compilation per shape; the kernels' compiles are slow enough.
        rng = np.random.default_rng(np.asarray(jax.random.key_data(getkey())))
        normal = lambda s: jnp.asarray(rng.standard_normal((self.batch, s, self.heads, self.head_dim)), dtype)  # noqa: E731
        q, k, v, cotangent = normal(self.q_len), normal(self.kv_len), normal(self.kv_len), normal(self.q_len)
        mask = None
        if self.masked:
            keep = np.array([self.kv_len // 3, self.kv_len - 1][: self.batch])
            mask = np.arange(self.kv_len)[None, :] < keep[:, None]
            if self.causal:
                mask[0] = False
            mask = jnp.asarray(mask)
        # a bias of the logits' own size (~ +-2), so it changes which keys win
        bias = None if self.bias is None else jnp.asarray(2 * rng.standard_normal(self.bias_shape), dtype)
        return q, k, v, mask, bias, cotangent


CASES = (
    Case("self_odd_len", 1, 33, 33, 4, 64),
    Case("cross_masked", 2, 40, 77, 4, 64, masked=True),  # text cross-attention with padded tokens
    Case("causal_d128", 2, 29, 29, 4, 128, causal=True),
    Case("causal_masked", 2, 37, 37, 4, 64, masked=True, causal=True),
)
# T5's relative position bias (one per head, shared by the batch), a per-row one and a per-key one (an additive
# key mask); with a padding mask, causal, and query/key lengths that are no multiple of the chunks.
BIAS_CASES = (
    Case("t5_bias_masked", 2, 33, 33, 4, 64, masked=True, bias="heads"),
    Case("cross_full_bias", 2, 40, 77, 4, 32, bias="full"),
    Case("causal_masked_key_bias", 2, 37, 37, 4, 32, masked=True, causal=True, bias="keys"),
)
DTYPES = (jnp.float32, jnp.bfloat16)


def pytest_generate_tests(metafunc):
    """Parametrize each backend's test over its class's ``cases`` (and ``bias_cases`` if it takes a bias) x
    ``dtypes``."""
    if {"case", "dtype"} <= set(metafunc.fixturenames):
        cls = metafunc.cls
        cases = cls.cases + (cls.bias_cases if cls.takes_bias else ())
        params = [(c, d) for c in cases for d in cls.dtypes]
        metafunc.parametrize(("case", "dtype"), params,
                             ids=[f"{c.name}-{jnp.dtype(d).name}" for c, d in params])


def _mesh(shape, explicit: bool, axes=("data", "context")):
    if explicit:
        return jax.make_mesh(shape, axes)
    return Mesh(np.array(jax.devices()[: np.prod(shape)]).reshape(shape), axes)


class AttentionTestBase:
    """Forward and ``jax.vjp`` of ``attention(..., implementation=...)`` against :func:`reference_attention`.

    A class that ``takes_bias`` also runs ``bias_cases`` (gradients w.r.t. the bias included); the others must
    refuse a bias with an :class:`AttentionUnavailableError` that names it."""

    implementation: str
    cases = CASES
    bias_cases = BIAS_CASES
    takes_bias = False
    dtypes = DTYPES

    def options(self) -> dict:
        return {}

    def test_matches_reference(self, case, dtype, getkey):
        q, k, v, mask, bias, cotangent = case.inputs(getkey, dtype)
        options = self.options()
        args = (q, k, v) if bias is None else (q, k, v, bias)

        @jax.jit
        def run(args, cotangent):
            out, vjp = jax.vjp(lambda q, k, v, bias=None: attention(
                q, k, v, mask=mask, bias=bias, causal=case.causal, implementation=self.implementation, **options),
                *args)
            return out, vjp(cotangent)

        @jax.jit
        def run_reference(args, cotangent):
            out, vjp = jax.vjp(lambda q, k, v, bias=None: reference_attention(
                q, k, v, mask=mask, bias=bias, causal=case.causal), *args)
            return out, vjp(cotangent)

        out, grads = run(args, cotangent)
        expected, expected_grads = run_reference(args, cotangent)
        assert out.dtype == expected.dtype and all(g.dtype == dtype for g in grads)
        assert len(grads) == len(args)
        if jnp.dtype(dtype) == jnp.float32:
            out64, grads64 = _attention64(q, k, v, mask=mask, bias=bias, causal=case.causal, cotangent=cotangent)
            _assert_as_accurate(out, expected, out64, "output")
        else:
            assert_close(out, expected, BF16_TOLERANCE, "output")
        for i, (name, g, g_ref) in enumerate(zip(("dq", "dk", "dv", "dbias"), grads, expected_grads)):
            assert g.shape == g_ref.shape, name
            if jnp.dtype(dtype) == jnp.float32:
                _assert_as_accurate(g, g_ref, grads64[i], name)
            else:
                assert_close(g, g_ref, BF16_TOLERANCE, name)
        if case.masked and case.causal:
            assert not np.any(np.asarray(out[0], np.float32)), "a row with every key masked must give zeros"

    def test_bias_is_taken_or_refused(self):
        q, k, v = _qkv(batch=2)
        bias = jnp.zeros((1, 4, 8, 8))
        if self.takes_bias:
            choice = explain_choice(q, k, bias=True, implementation=self.implementation,
                                    **_choice_options(self.options()))
            assert choice.split(":")[0] in ("xla", "chunked"), choice
            out = attention(q, k, v, bias=bias + 1.0, implementation=self.implementation, **self.options())
            _assert_as_accurate(out, attention(q, k, v, implementation=self.implementation, **self.options()),
                                _attention64(q, k, v), "a constant bias changes nothing")
        else:
            with pytest.raises(AttentionUnavailableError,
                               match=rf"implementation='{self.implementation}' cannot serve this call: "
                                     rf"{self.implementation} takes no logits bias: .*; use 'chunked'"):
                attention(q, k, v, bias=bias, implementation=self.implementation, **self.options())


def _choice_options(options: dict) -> dict:
    """The options of :func:`attention` that :func:`explain_choice` takes too."""
    return {k: v for k, v in options.items() if k in ("mesh", "interpret")}


class TestChunked(AttentionTestBase):
    """Small chunks: several query and key chunks, padding and the online softmax."""

    implementation = "chunked"
    takes_bias = True

    def options(self):
        return dict(block_sizes=BlockSizes(block_q=16, block_kv=16))


class TestChunkedDefaultChunks(AttentionTestBase):
    """The CPU default chunks: one key chunk, so a plain softmax per query chunk."""

    implementation = "chunked"
    takes_bias = True
    dtypes = (jnp.float32,)


class TestFlashInterpret(AttentionTestBase):
    """The Pallas kernels (forward, dk/dv and dq) in interpret mode, with different forward and backward tiles."""

    implementation = "flash"

    def options(self):
        return dict(interpret=True, block_sizes=BlockSizes(block_q=16, block_kv=16, block_q_dkv=32, block_kv_dq=32))


ON_GPU = jax.default_backend() == "gpu"
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (runs on the device machine)")
needs_8_devices = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest simulates 8 on a CPU)")
GPU_CASES = CASES + (Case("long_masked_d128", 2, 1000, 1000, 4, 128, masked=True),
                     Case("image_x_text", 2, 4096, 77, 8, 64, masked=True))


@needs_gpu
class TestFlashGPU(AttentionTestBase):
    """The flash kernels as chosen on this GPU: on Hopper, the Mosaic GPU forward for the cases it serves
    (bf16, no mask, not causal), else Triton (default GPU blocks, shrunk for short sequences)."""

    implementation = "flash"
    cases = GPU_CASES + (Case("hopper_d128", 2, 1000, 1000, 4, 128), Case("hopper_x_text", 2, 1024, 77, 4, 64))


@needs_gpu
class TestFlashTritonGPU(AttentionTestBase):
    implementation = "flash"
    cases = TestFlashGPU.cases[-2:]

    def options(self):
        return dict(flash_backend="triton")


@needs_gpu
class TestCudnnGPU(AttentionTestBase):
    implementation = "cudnn"
    cases = tuple(c for c in GPU_CASES if not (c.masked and c.causal))  # cuDNN gives fully masked rows mean(v)
    dtypes = (jnp.bfloat16,)


@needs_8_devices
class TestFlashHopperInterpret(AttentionTestBase):
    """The Hopper (Mosaic GPU) forward in Pallas' GPU interpreter on the CPU, with the Triton-style backward:
    padded queries and a masked tail of padded keys (several key tiles, two in flight)."""

    implementation = "flash"
    cases = (Case("hopper_padded", 1, 100, 300, 1, 64),)
    dtypes = (jnp.bfloat16,)

    def options(self):
        return dict(interpret=True, flash_backend="mosaic_gpu", block_sizes=BlockSizes(block_q=32, block_kv=32))


class TestRing(AttentionTestBase):
    """Ring attention over a context axis of 4 (times 2 on the batch), chunked blocks per shard."""

    implementation = "ring"

    def options(self):
        return dict(mesh=_mesh((2, 4), explicit=True), block_sizes=BlockSizes(block_q=8, block_kv=8))


@needs_8_devices
class TestRingFlashLocal(AttentionTestBase):
    implementation = "ring"
    cases = (CASES[3],)
    dtypes = (jnp.float32,)

    def options(self):
        return dict(mesh=_mesh((1, 8), explicit=False), local_implementation="flash", interpret=True,
                    block_sizes=BlockSizes(block_q=8, block_kv=8))


@needs_8_devices
class TestRingDenseLocal(AttentionTestBase):
    """Dense blocks per shard; heads split over a "tensor" axis too."""

    implementation = "ring"
    cases = CASES[1:2]
    dtypes = (jnp.float32,)

    def options(self):
        return dict(mesh=_mesh((2, 2, 2), explicit=False, axes=("data", "context", "tensor")),
                    local_implementation="xla")


@needs_8_devices
class TestUlysses(AttentionTestBase):
    """Ulysses over a context axis of 4: 4 heads become one per device."""

    implementation = "ulysses"

    def options(self):
        return dict(mesh=_mesh((2, 4), explicit=False))


@needs_8_devices
class TestUlyssesTensorAxis(AttentionTestBase):
    """Heads split over "tensor" (2) first, then over "context" (2) by the all-to-all."""

    implementation = "ulysses"
    cases = CASES[3:]
    dtypes = (jnp.float32,)

    def options(self):
        return dict(mesh=_mesh((2, 2, 2), explicit=True, axes=("data", "context", "tensor")))


# Sizes where implementation=None does not pick "xla" (which would compare the reference with itself): on the CPU
# more than 256 x 256 logits per head give "chunked" (two query chunks of the default 256; 600 keys: two key chunks
# of 512); on a GPU, cuDNN serves bf16 and a biased call over 2048 x 2048 logits per head gets "chunked".
DEFAULT_CASES = (Case("self_masked_300", 2, 300, 300, 2, 16, masked=True), Case("causal_600", 1, 600, 600, 2, 16,
                                                                                   causal=True))
DEFAULT_BIAS_CASES = (Case("t5_bias_300", 2, 300, 300, 2, 16, masked=True, bias="heads"),)
if ON_GPU:
    DEFAULT_BIAS_CASES = (Case("t5_bias_2100", 1, 2100, 2100, 2, 64, masked=True, bias="heads"),)


class TestDefaultChoice(AttentionTestBase):
    """``implementation=None`` at sizes where the choice is not the reference: chunked on a CPU (cuDNN on a GPU),
    and chunked for a biased call."""

    implementation = None
    cases = DEFAULT_CASES
    bias_cases = DEFAULT_BIAS_CASES
    takes_bias = True
    dtypes = (jnp.bfloat16,) if ON_GPU else (jnp.float32,)

    def test_the_cases_do_not_choose_the_reference(self):
        for case in self.cases + self.bias_cases:
            q = jax.ShapeDtypeStruct((case.batch, case.q_len, case.heads, case.head_dim), self.dtypes[0])
            k = jax.ShapeDtypeStruct((case.batch, case.kv_len, case.heads, case.head_dim), self.dtypes[0])
            choice = explain_choice(q, k, causal=case.causal, bias=case.bias is not None)
            assert not choice.startswith("xla"), f"{case.name} would compare the reference with itself: {choice}"


def _qkv(batch=1, q_len=8, kv_len=8, heads=4, head_dim=16, dtype=jnp.float32):
    q = jnp.ones((batch, q_len, heads, head_dim), dtype)
    k = jnp.ones((batch, kv_len, heads, head_dim), dtype)
    return q, k, k


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda q, k, v: (q[0], k, v), r"q must be \[batch, seq, heads, head_dim\], got shape \(8, 4, 16\)"),
        (lambda q, k, v: (q, k[..., None], v), r"k must be \[batch, seq, heads, head_dim\]"),
        (lambda q, k, v: (q[:, :, :2], k, v), "q has 2 heads but k and v have 4"),
        (lambda q, k, v: (q, k, v[:, :5]), "k and v must have the same shape"),
        (lambda q, k, v: (q[..., :8], k, v), "must agree in batch and head_dim"),
        (lambda q, k, v: (q.astype(jnp.bfloat16), k, v), "must share a dtype"),
    ],
)
def test_bad_shapes_raise(change, match):
    with pytest.raises(ValueError, match=match):
        attention(*change(*_qkv()))


@needs_8_devices
def test_bad_mask_and_names_raise():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"mask must be \[batch, kv_seq\]"):
        attention(q, k, v, mask=jnp.ones((1, 9), bool))
    with pytest.raises(ValueError, match=r"unknown implementation 'flsh'; available: \['xla', 'chunked'"):
        attention(q, k, v, implementation="flsh")
    with pytest.raises(ValueError, match="local_implementation='ring' cannot run per shard"):
        attention(q, k, v, implementation="ring", mesh=_mesh((1, 8), explicit=False), local_implementation="ring")


@pytest.mark.skipif(ON_GPU or jax.device_count() < 8, reason="checks the CPU's messages on 8 simulated devices")
def test_unavailable_implementations_say_why():
    q, k, v = _qkv()
    with pytest.raises(AttentionUnavailableError, match="cudnn needs an NVIDIA GPU; the platform here is 'cpu'"):
        attention(q, k, v, implementation="cudnn")
    with pytest.raises(AttentionUnavailableError, match="pass interpret=True"):
        attention(q, k, v, implementation="flash")
    with pytest.raises(AttentionUnavailableError, match="ring attention needs mesh="):
        attention(q, k, v, implementation="ring")
    no_context = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
    with pytest.raises(AttentionUnavailableError, match=r"'context' mesh axis, but the mesh's axes are \('data', "):
        attention(q, k, v, implementation="ring", mesh=no_context)
    with pytest.raises(AttentionUnavailableError, match="heads=4 does not divide by 8; use 'ring'"):
        attention(q, k, v, implementation="ulysses", mesh=_mesh((1, 8), explicit=False))
    tensor = _mesh((1, 4, 2), explicit=False, axes=("data", "context", "tensor"))
    with pytest.raises(AttentionUnavailableError, match=r"heads=4 \(/2 over 'tensor'\) does not divide by 4"):
        attention(q, k, v, implementation="ulysses", mesh=tensor)
    q_long, k, v = _qkv(q_len=16)
    with pytest.raises(AttentionUnavailableError, match="causal ring attention needs q_seq == kv_seq, got 16 and 8"):
        attention(q_long, k, v, causal=True, implementation="ring", mesh=_mesh((1, 8), explicit=False))
    assert issubclass(AttentionUnavailableError, ValueError)


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="BlockSizes.block_q must be a positive int, got 0"):
        BlockSizes(block_q=0)
    with pytest.raises(ValueError, match="BlockSizes.block_q_dkv=48 must divide the largest q block 64"):
        BlockSizes(block_q=64, block_q_dkv=48)
    with pytest.raises(ValueError, match="block_kv_dq=24 must divide the largest kv block 32"):
        BlockSizes(block_q=64, block_kv=32, block_kv_dq=24)
    with pytest.raises(ValueError, match="BlockSizes.block_q=96: Triton needs a power of two >= 16 on GPU"):
        BlockSizes(block_q=96, block_kv=64).check_platform("gpu")
    with pytest.raises(ValueError, match="BlockSizes.block_kv=64 must be a multiple of 128 on TPU"):
        BlockSizes(block_q=128, block_kv=64).check_platform("tpu")
    assert BlockSizes(block_q=32, block_kv=16).block_q_dq == 32 and BlockSizes(32, 16).block_kv_dkv == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockSizes().block_q = 8


def test_block_sizes_shrink_for_short_sequences_with_one_log_line(caplog):
    blocks = BlockSizes.default("gpu")
    with caplog.at_level(logging.INFO, logger="eqxdiff.kernels"):
        fitted = blocks.fit(4096, 77, "gpu")
        assert blocks.fit(4096, 77, "gpu") == fitted
    assert fitted == blocks  # 77 keys still fill 64-key blocks: nothing to shrink
    with caplog.at_level(logging.INFO, logger="eqxdiff.kernels"):
        fitted = BlockSizes(block_q=128, block_kv=128).fit(10, 77, "gpu")
        BlockSizes(block_q=128, block_kv=128).fit(10, 77, "gpu")
    assert (fitted.block_q, fitted.block_q_dq, fitted.block_kv) == (16, 16, 128)
    lines = [r.getMessage() for r in caplog.records if "shrunk" in r.getMessage()]
    assert lines == ["flash attention: block sizes shrunk for q_seq=10, kv_seq=77: block_q 128->16, "
                     "block_q_dkv 128->16, block_q_dq 128->16"]
    assert BlockSizes(block_q=512, block_kv=512).fit(4096, 77, "tpu").block_kv == 128


@pytest.mark.skipif(ON_GPU or jax.device_count() < 8, reason="checks the CPU's choices on 8 simulated devices")
def test_explain_choice():
    shape = lambda s, h=8: jax.ShapeDtypeStruct((2, s, h, 64), jnp.float32)  # noqa: E731
    assert explain_choice(shape(4096), shape(4096)).startswith("chunked: cpu, float32, q_seq=4096 x kv_seq=4096")
    assert explain_choice(shape(4096), shape(77)).startswith("chunked: ")  # image tokens x text tokens
    assert explain_choice(shape(77), shape(77), causal=True).startswith("xla: cpu, float32, q_seq=77 x kv_seq=77")
    mesh = _mesh((2, 4), explicit=False)
    assert explain_choice(shape(4096), shape(4096), mesh=mesh).startswith("ulysses: the mesh's context axis has 4")
    assert explain_choice(shape(4096, 6), shape(4096, 6), mesh=mesh).startswith("ring: ")
    tensor = _mesh((1, 4, 2), explicit=False, axes=("data", "context", "tensor"))
    assert explain_choice(shape(4096), shape(4096), mesh=tensor).startswith(
        "ulysses: the mesh's context axis has 4 devices and 4 heads per device divide by it")
    assert explain_choice(shape(4096, 4), shape(4096, 4), mesh=tensor).startswith("ring: ")
    assert explain_choice(shape(64), shape(64), implementation="chunked") == "chunked: asked for by name"
    assert set(IMPLEMENTATIONS) == {"xla", "chunked", "cudnn", "flash", "ring", "ulysses"}


@pytest.mark.parametrize(("platform", "custom_call"), [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_flash_lowers_for_gpu_and_tpu(platform, custom_call):
    """The flash kernels (forward and both backward kernels) lower to Triton and to Mosaic, here on a CPU."""
    from eqxdiff.kernels._flash import flash_attention_fn

    fn = flash_attention_fn(None, False, platform)
    q = jax.ShapeDtypeStruct((2, 300, 4, 40), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 77, 4, 40), jnp.bfloat16)

    def loss(q, k, v, mask):
        return jax.grad(lambda q, k, v: fn(q, k, v, mask, None, 0.125, True).astype(jnp.float32).sum(),
                        argnums=(0, 1, 2))(q, k, v)

    text = (jax.jit(loss).trace(q, kv, kv, jax.ShapeDtypeStruct((2, 77), jnp.bool_))
            .lower(lowering_platforms=(platform,)).as_text())
    assert text.count(f"custom_call @{custom_call}") == 3


def test_gpu_blocks_fit_shared_memory():
    """Default Triton tiles shrink until the kernels fit an H100's shared memory (SD 1.x's head_dim 160 pads to 256
    and once asked for 448 KiB); tiles the caller chose that cannot fit raise, naming the size."""
    from eqxdiff.kernels._flash import GPU_SHARED_MEMORY, _Plan, triton_shared_memory

    # Triton's own figure for the forward kernel (128 + 3 stages x 2 x 128 rows of 256 bf16) was 448 KiB
    assert triton_shared_memory(BlockSizes(block_q=128, block_kv=128), 128, 2) == (2 * 128 + 6 * 128) * 128 * 2
    for head_dim in (40, 64, 80, 128, 160, 256):
        for dtype in (jnp.bfloat16, jnp.float32):
            q = jax.ShapeDtypeStruct((2, 8, 4096, head_dim), dtype)
            plan = _Plan(q, q, None, "gpu", False)
            assert triton_shared_memory(plan.blocks, plan.d_pad, jnp.dtype(dtype).itemsize) <= GPU_SHARED_MEMORY
            assert plan.blocks.block_q >= 32
    q = jax.ShapeDtypeStruct((2, 8, 4096, 128), jnp.bfloat16)
    assert _Plan(q, q, None, "gpu", False).blocks.block_kv == 128  # the tuned H100 tile where it fits
    q = jax.ShapeDtypeStruct((2, 8, 4096, 160), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"needs about 384 KiB of GPU shared memory .* use smaller blocks"):
        _Plan(q, q, BlockSizes(block_q=128, block_kv=128), "gpu", False)


@pytest.mark.parametrize("bias_shape", [(1, 3, 6, 9), (2, 3, 6, 9), (2, 1, 1, 9)])
def test_reference_with_a_bias_matches_torch(bias_shape):
    """The ground truth with a bias is PyTorch's SDPA with a float mask (bias, -inf where masked), values and
    gradients, the bias's included."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v, cotangent = (rng.standard_normal(s).astype(np.float32) for s in ((2, 6, 3, 8), (2, 9, 3, 8),
                                                                              (2, 9, 3, 8), (2, 6, 3, 8)))
    bias = (2 * rng.standard_normal(bias_shape)).astype(np.float32)
    mask = np.arange(9)[None] < np.array([[4], [9]])
    scale = 0.3

    @jax.jit
    def run(q, k, v, bias, cotangent):
        out, vjp = jax.vjp(lambda q, k, v, bias: reference_attention(q, k, v, mask=jnp.asarray(mask), bias=bias,
                                                                     scale=scale), q, k, v, bias)
        return out, vjp(cotangent)

    out, grads = run(q, k, v, bias, cotangent)

    tq, tk, tv, tb = (torch.tensor(x, requires_grad=True) for x in (q, k, v, bias))
    additive = tb + torch.where(torch.from_numpy(mask)[:, None, None, :], 0.0, -math.inf)
    t_out = torch.nn.functional.scaled_dot_product_attention(tq.transpose(1, 2), tk.transpose(1, 2),
                                                             tv.transpose(1, 2), attn_mask=additive, scale=scale)
    t_out = t_out.transpose(1, 2)
    t_out.backward(torch.from_numpy(cotangent))
    # PyTorch's SDPA in float64, values and gradients: what PyTorch's float32 rounding is measured against
    t64 = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v, bias)]
    additive64 = t64[3] + torch.where(torch.from_numpy(mask)[:, None, None, :], 0.0, -math.inf)
    out64 = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in t64[:3]),
                                                             attn_mask=additive64, scale=scale).transpose(1, 2)
    out64.backward(torch.from_numpy(cotangent).double())
    _assert_as_accurate(out, t_out.detach().numpy(), out64.detach().numpy(), "output")
    for name, g, t, t_64 in zip(("dq", "dk", "dv", "dbias"), grads, (tq, tk, tv, tb), t64):
        assert g.shape == t.shape, name
        _assert_as_accurate(g, t.grad.numpy(), t_64.grad.numpy(), name)


def test_default_choice_never_picks_an_implementation_that_refuses_the_bias():
    """For every platform, dtype, size and mesh, a biased call's default is an implementation that serves it."""
    seen = set()
    for platform in ("cpu", "gpu", "tpu"):
        for dtype in ("float32", "bfloat16"):
            for length in (64, 300, 3000):
                for axes, context, shards in ((None, 1, 1), (("data", "context"), 4, 1),
                                              (("data", "context", "tensor"), 2, 2)):
                    call = AttentionCall(length, length, 8, 64, dtype, False, platform, axes, context, shards, False,
                                         has_bias=True)
                    name, reason = choose(call)
                    assert IMPLEMENTATIONS[name].unavailable(call) is None, (call, name)
                    assert "bias" in reason
                    seen.add(name)
                    unbiased = dataclasses.replace(call, has_bias=False)
                    if choose(unbiased)[0] not in ("xla", "chunked"):
                        assert "takes no logits bias" in IMPLEMENTATIONS[choose(unbiased)[0]].unavailable(call)
    assert seen == {"xla", "chunked"}


def test_the_bias_gradient_is_computed_only_when_the_bias_is_differentiated():
    flags = []
    inner = chunked_kernel(8, 8)

    def backward(*args, bias_grad=False, **kwargs):
        flags.append(bias_grad)
        return inner.backward(*args, bias_grad=bias_grad, **kwargs)

    attn = attention_from_kernel(Kernel(inner.forward, backward))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, n, 4, 16)), jnp.float32) for n in (12, 20, 20))
    bias = jnp.asarray(rng.standard_normal((1, 4, 12, 20)), jnp.float32)

    def loss(q, bias):
        return jnp.sum(attn(q, k, v, None, bias, 0.25, False) ** 2)

    dq = jax.jit(jax.grad(loss))(q, bias)
    dq_both, dbias = jax.jit(jax.grad(loss, argnums=(0, 1)))(q, bias)
    assert flags == [False, True]
    expected = jax.jit(jax.grad(lambda q, bias: jnp.sum(reference_attention(q, k, v, bias=bias, scale=0.25) ** 2),
                                argnums=(0, 1)))(q, bias)
    out64 = _attention64(q, k, v, bias=bias, scale=0.25)
    _, (dq64, _, _, dbias64) = _attention64(q, k, v, bias=bias, scale=0.25, cotangent=2 * out64)  # d sum(out^2)
    _assert_as_accurate(dq, expected[0], dq64, "dq")
    _assert_as_accurate(dq_both, expected[0], dq64, "dq")
    _assert_as_accurate(dbias, expected[1], dbias64, "dbias")


def _largest_intermediate(jaxpr) -> int:
    """The most elements of any value a jaxpr (and the jaxprs inside it: loops, scans) makes."""
    most = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            most = max(most, math.prod(getattr(var.aval, "shape", ())))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    most = max(most, _largest_intermediate(getattr(inner, "jaxpr", inner)))
    return most


def test_chunked_never_broadcasts_a_per_head_bias_over_the_batch():
    """T5's [1, heads, q, k] bias with a batch of 8: no value in the forward or backward pass (bias gradient
    included) is as large as one [batch, heads, q, k] logits array, the size the bias broadcast over the batch
    would have."""
    batch, q_len, heads = 8, 64, 2
    q = jnp.zeros((batch, q_len, heads, 4))
    bias = jnp.zeros((1, heads, q_len, q_len))

    def loss(q, k, v, bias):
        return jnp.sum(attention(q, k, v, bias=bias, implementation="chunked",
                                 block_sizes=BlockSizes(block_q=16, block_kv=16)))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, q, q, bias).jaxpr
    largest = _largest_intermediate(jaxpr)
    assert heads * q_len * q_len <= largest < batch * heads * q_len * q_len


@pytest.mark.parametrize(
    ("shape", "dtype", "match"),
    [
        ((1, 4, 8), jnp.float32, (r"bias must broadcast to \[batch, heads, q_seq, kv_seq\] = \(2, 4, 8, 8\) \(each "
                                  r"axis that length or 1\), got shape \(1, 4, 8\)")),
        ((1, 3, 8, 8), jnp.float32, r"= \(2, 4, 8, 8\) .*got shape \(1, 3, 8, 8\)"),
        ((2, 4, 8, 7), jnp.float32, r"got shape \(2, 4, 8, 7\)"),
        ((1, 4, 8, 8), jnp.int32, r"bias must be a float array .*got int32; pass a boolean key mask as mask="),
    ],
)
def test_bad_bias_raises(shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        attention(*_qkv(batch=2), bias=jnp.zeros(shape, dtype))


def test_explain_choice_with_a_bias():
    shape = lambda s: jax.ShapeDtypeStruct((2, s, 8, 64), jnp.float32)  # noqa: E731
    assert explain_choice(shape(77), shape(77), bias=True).startswith(
        "xla: cpu, float32, q_seq=77 x kv_seq=77 with a logits bias (only xla and chunked take one)")
    assert explain_choice(shape(512), shape(512), bias=True).startswith("chunked: ")
    if jax.device_count() >= 8:  # a context axis does not bring in ring/ulysses for a biased call
        assert explain_choice(shape(512), shape(512), bias=True, mesh=_mesh((2, 4), explicit=False)).startswith(
            "chunked: ")
    with pytest.raises(AttentionUnavailableError, match="cudnn takes no logits bias"):
        explain_choice(shape(77), shape(77), bias=True, implementation="cudnn")
