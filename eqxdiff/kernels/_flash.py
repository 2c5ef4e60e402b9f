"""Pallas flash attention: one forward kernel and two backward kernels (``dk, dv`` and ``dq``), written once.

The kernels only index refs with ``pl.ds`` on padded inputs and use 2-D values, so the same code lowers with
Triton on GPU and Mosaic on TPU, and runs anywhere with ``interpret=True`` (how the CPU tests run it).
Inputs are laid out ``[batch * heads, seq, head_dim]``; sequences are padded to whole blocks (padded keys are
masked through a key bias, padded queries are sliced off) and ``head_dim`` to what the platform's tiles want.
On Hopper GPUs the forward pass of the calls it serves runs in ``_flash_hopper.py`` (Mosaic GPU, warp-specialised)
instead; these backward kernels serve both.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._block_sizes import BlockSizes
from ._common import Kernel, attention_from_kernel, key_valid, lse_for_backward, pad_axis, platform_of, round_up

_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _mask_logits(s, bias_ref, k_start, q_start, causal):
    """Add the key bias (0 or -inf, padding included) and the causal mask to a ``[block_q, block_kv]`` tile."""
    block_q, block_kv = s.shape
    if bias_ref is not None:
        s = s + bias_ref[:, pl.ds(k_start, block_kv)]
    if causal:
        q_pos = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 0)
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 1)
        s = jnp.where(q_pos >= k_pos, s, -jnp.inf)
    return s


def _split(refs, n_in, has_bias):
    """``(inputs, bias_ref, outputs)`` from a kernel's refs, where the bias ref (if any) is input number 3."""
    ins = list(refs[:n_in])
    bias = ins.pop(3) if has_bias else None
    return ins, bias, refs[n_in:]


def _forward_kernel(*refs, scale, causal, block_kv, num_kv_blocks, has_bias):
    (q_ref, k_ref, v_ref), bias_ref, (o_ref, lse_ref) = _split(refs, 3 + has_bias, has_bias)
    block_q = q_ref.shape[0]
    q_start = pl.program_id(1) * block_q
    q = q_ref[...]

    def body(j, carry):
        m, denom, acc = carry
        k_start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(k_start, block_kv), :]
        v = v_ref[pl.ds(k_start, block_kv), :]
        s = _mask_logits(_dot(q, k, _NT) * scale, bias_ref, k_start, q_start, causal)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        rescale = jnp.exp(m - m_safe)
        acc = acc * rescale + _dot(p.astype(v.dtype), v)
        return m_new, denom * rescale + jnp.sum(p, axis=1, keepdims=True), acc

    if causal:  # key blocks past the diagonal are all masked: skip them
        num_kv_blocks = jnp.minimum(num_kv_blocks, lax.div(q_start + block_q + block_kv - 1, block_kv))
    init = (jnp.full((block_q, 1), -jnp.inf, jnp.float32), jnp.zeros((block_q, 1), jnp.float32),
            jnp.zeros(q.shape, jnp.float32))
    m, denom, acc = lax.fori_loop(0, num_kv_blocks, body, init)
    empty = denom == 0.0
    denom = jnp.where(empty, 1.0, denom)
    o_ref[...] = (acc / denom).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(denom))


def _tile_grads(q, k, v, do, lse, delta, bias_ref, k_start, q_start, scale, causal):
    """``(p, ds)`` for one ``[block_q, block_kv]`` tile, recomputed from the saved log-sum-exp."""
    s = _mask_logits(_dot(q, k, _NT) * scale, bias_ref, k_start, q_start, causal)
    p = jnp.exp(s - lse)
    ds = p * (_dot(do, v, _NT) - delta) * scale
    return p, ds


def _dkv_kernel(*refs, scale, causal, block_q, num_q_blocks, has_bias):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), bias_ref, (dk_ref, dv_ref) = _split(refs, 6 + has_bias,
                                                                                       has_bias)
    block_kv = k_ref.shape[0]
    k_start = pl.program_id(1) * block_kv
    k, v = k_ref[...], v_ref[...]  # this program's key block; its bias block starts at offset 0

    def body(i, carry):
        dk, dv = carry
        q_start = pl.multiple_of(i * block_q, block_q)
        rows = pl.ds(q_start, block_q)
        q, do = q_ref[rows, :], do_ref[rows, :]
        p, ds = _tile_grads(q, k, v, do, lse_ref[rows, :], delta_ref[rows, :], bias_ref, 0, q_start - k_start,
                            scale, causal)
        return dk + _dot(ds.astype(q.dtype), q, _TN), dv + _dot(p.astype(do.dtype), do, _TN)

    first = lax.div(k_start, block_q) if causal else 0  # query blocks wholly above the diagonal see none of these keys
    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(first, num_q_blocks, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(*refs, scale, causal, block_kv, num_kv_blocks, has_bias):
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), bias_ref, (dq_ref,) = _split(refs, 6 + has_bias, has_bias)
    block_q = q_ref.shape[0]
    q_start = pl.program_id(1) * block_q
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def body(j, dq):
        k_start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(k_start, block_kv), :]
        v = v_ref[pl.ds(k_start, block_kv), :]
        _, ds = _tile_grads(q, k, v, do, lse, delta, bias_ref, k_start, q_start, scale, causal)
        return dq + _dot(ds.astype(k.dtype), k)

    if causal:
        num_kv_blocks = jnp.minimum(num_kv_blocks, lax.div(q_start + block_q + block_kv - 1, block_kv))
    dq_ref[...] = lax.fori_loop(0, num_kv_blocks, body, jnp.zeros(q.shape, jnp.float32)).astype(dq_ref.dtype)


def _head_dim_padded(head_dim: int, platform: str) -> int:
    if platform == "gpu":  # Triton tiles are powers of two (dots need >= 16)
        return max(16, 1 << (head_dim - 1).bit_length())
    if platform == "tpu":  # the lane axis
        return round_up(head_dim, 128)
    return head_dim


GPU_SHARED_MEMORY = 232448  # bytes of shared memory one program may use on an H100 (227 KiB)


def _triton_stages(head_dim: int) -> int:
    # 3 pipeline stages: +10-35% over 2 on an H100 at 4k-32k tokens, head_dim 128 (benchmarks/RESULTS.md);
    # 256-wide rows (head_dim 129-256) fit in shared memory with 2 only
    return 3 if head_dim <= 128 else 2


def triton_shared_memory(blocks: BlockSizes, head_dim: int, itemsize: int) -> int:
    """Bytes of shared memory the largest of the three Triton kernels asks for: the tile it keeps plus ``stages``
    copies of the two tiles it streams. (The forward at 128x128 with 256-wide bf16 rows and 3 stages, before
    :func:`_triton_stages` gave such rows 2, makes 448 KiB: what Triton asked for on an H100.)"""
    stages = _triton_stages(head_dim)
    rows = max(blocks.block_q + stages * 2 * blocks.block_kv,
               2 * blocks.block_kv_dkv + stages * 2 * blocks.block_q_dkv,
               2 * blocks.block_q_dq + stages * 2 * blocks.block_kv_dq)
    return rows * head_dim * itemsize


def _fit_shared_memory(blocks: BlockSizes, chosen: bool, head_dim: int, itemsize: int) -> BlockSizes:
    """Default blocks halved until they fit :data:`GPU_SHARED_MEMORY`; blocks the caller chose that do not fit
    raise."""
    need = triton_shared_memory(blocks, head_dim, itemsize)
    if need <= GPU_SHARED_MEMORY:
        return blocks
    if chosen:
        raise ValueError(f"flash attention: {blocks} needs about {need // 1024} KiB of GPU shared memory per program "
                         f"at head_dim {head_dim} with {itemsize}-byte inputs; the limit is "
                         f"{GPU_SHARED_MEMORY // 1024} KiB: use smaller blocks")
    size = min(blocks.q_multiple, blocks.kv_multiple)
    while size > 16 and triton_shared_memory(BlockSizes(size, size), head_dim, itemsize) > GPU_SHARED_MEMORY:
        size //= 2
    return BlockSizes(block_q=size, block_kv=size)


def _compiler_params(platform: str, interpret: bool, head_dim: int, num_grid_dims: int = 2):
    if interpret:
        return None
    if platform == "gpu":
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=_triton_stages(head_dim))
    if platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.CompilerParams(dimension_semantics=("parallel",) * num_grid_dims)
    raise ValueError(f"flash attention: no Pallas lowering for platform {platform!r}; pass interpret=True")


class _Plan:
    """Shapes, padding and block sizes of one flash call, checked before any ``pallas_call``."""

    def __init__(self, q, k, block_sizes, platform, interpret):
        self.batch, self.heads, self.q_len, self.head_dim = q.shape
        self.kv_len = k.shape[2]
        self.groups = self.batch * self.heads
        self.platform = platform_of(platform)
        self.interpret = interpret
        self.d_pad = _head_dim_padded(self.head_dim, self.platform)
        blocks = block_sizes or BlockSizes.default(self.platform)
        if not interpret:
            blocks.check_platform(self.platform)
        self.blocks = blocks.fit(self.q_len, self.kv_len, self.platform)
        if self.platform == "gpu" and not interpret:
            self.blocks = _fit_shared_memory(self.blocks, block_sizes is not None, self.d_pad,
                                             jnp.dtype(q.dtype).itemsize)
        self.q_pad = round_up(self.q_len, self.blocks.q_multiple)
        self.kv_pad = round_up(self.kv_len, self.blocks.kv_multiple)
        for names, length in ((BlockSizes.q_fields, self.q_pad), (BlockSizes.kv_fields, self.kv_pad)):
            for n in names:
                if length % getattr(self.blocks, n):
                    raise ValueError(f"flash attention: padded length {length} must be a multiple of "
                                     f"{n}={getattr(self.blocks, n)}")

    def rows(self, x, length):
        """BHSD ``x`` as ``[batch * heads, length, d_pad]`` (zero padded)."""
        x = pad_axis(pad_axis(x, 2, length), 3, self.d_pad)
        return x.reshape(self.groups, length, self.d_pad)

    def unrows(self, x, length):
        return x.reshape(self.batch, self.heads, -1, self.d_pad)[:, :, :length, : self.head_dim]

    def stat(self, x):
        """A per-query statistic ``[b, h, q_len]`` as ``[batch * heads, q_pad, 1]`` float32."""
        return pad_axis(x.astype(jnp.float32), 2, self.q_pad).reshape(self.groups, self.q_pad, 1)

    def bias(self, valid):
        """The key bias ``[batch or 1, 1, kv_pad]`` (0 = attend, -inf = masked or padding), or ``None``."""
        valid = key_valid(valid, self.kv_len, self.kv_pad)
        return None if valid is None else jnp.where(valid, 0.0, -jnp.inf).astype(jnp.float32)[:, None, :]

    @staticmethod
    def tile(size, width):
        """Program ``(g, i)`` reads tile ``i`` (``size`` rows) of row group ``g``."""
        return pl.BlockSpec((None, size, width), lambda g, i: (g, i, 0))

    @staticmethod
    def whole(length, width):
        """Program ``(g, i)`` reads all ``length`` rows of row group ``g``."""
        return pl.BlockSpec((None, length, width), lambda g, i: (g, 0, 0))

    def f32(self, length, width):
        return jax.ShapeDtypeStruct((self.groups, length, width), jnp.float32)

    def call(self, kernel, grid, ins, in_specs, out_shapes, out_specs, bias, bias_tile, name):
        """``pallas_call`` with the key bias, if any, as input number 3: program ``(g, j)`` reads key tile ``j`` of
        ``bias_tile`` keys (the dk/dv kernel) or, with ``bias_tile=None``, the whole row."""
        if bias is not None:
            heads = self.heads
            row = (lambda g: lax.div(g, heads)) if bias.shape[0] > 1 else (lambda g: 0)
            if bias_tile is None:
                spec = pl.BlockSpec((None, 1, self.kv_pad), lambda g, i: (row(g), 0, 0))
            else:
                spec = pl.BlockSpec((None, 1, bias_tile), lambda g, j: (row(g), 0, j))
            ins, in_specs = (*ins[:3], bias, *ins[3:]), (*in_specs[:3], spec, *in_specs[3:])
        return pl.pallas_call(
            functools.partial(kernel, has_bias=bias is not None),
            grid=grid, in_specs=list(in_specs), out_specs=out_specs, out_shape=out_shapes,
            compiler_params=_compiler_params(self.platform, self.interpret, self.d_pad, len(grid)),
            interpret=self.interpret, name=name,
        )(*ins)


def flash_forward(q, k, v, valid, *, scale, causal, block_sizes=None, interpret=False, platform=None):
    p = _Plan(q, k, block_sizes, platform, interpret)
    bq, bk, d = p.blocks.block_q, p.blocks.block_kv, p.d_pad
    kernel = functools.partial(_forward_kernel, scale=scale, causal=causal, block_kv=bk,
                               num_kv_blocks=p.kv_pad // bk)
    out, lse = p.call(
        kernel, (p.groups, p.q_pad // bq),
        (p.rows(q, p.q_pad), p.rows(k, p.kv_pad), p.rows(v, p.kv_pad)),
        (p.tile(bq, d), p.whole(p.kv_pad, d), p.whole(p.kv_pad, d)),
        (p.f32(p.q_pad, d), p.f32(p.q_pad, 1)), (p.tile(bq, d), p.tile(bq, 1)),
        p.bias(valid), None, "flash_attention_forward",
    )
    return p.unrows(out, p.q_len), lse.reshape(p.batch, p.heads, p.q_pad)[:, :, : p.q_len]


def flash_backward(q, k, v, valid, do, lse, delta, *, scale, causal, block_sizes=None, interpret=False,
                   platform=None):
    p = _Plan(q, k, block_sizes, platform, interpret)
    d, blocks, bias = p.d_pad, p.blocks, p.bias(valid)
    ins = (p.rows(q, p.q_pad), p.rows(k, p.kv_pad), p.rows(v, p.kv_pad), p.rows(do.astype(q.dtype), p.q_pad),
           p.stat(lse_for_backward(lse)), p.stat(delta))

    bq, bk = blocks.block_q_dkv, blocks.block_kv_dkv
    dkv = functools.partial(_dkv_kernel, scale=scale, causal=causal, block_q=bq, num_q_blocks=p.q_pad // bq)
    dk, dv = p.call(
        dkv, (p.groups, p.kv_pad // bk), ins,
        (p.whole(p.q_pad, d), p.tile(bk, d), p.tile(bk, d), p.whole(p.q_pad, d), p.whole(p.q_pad, 1),
         p.whole(p.q_pad, 1)),
        (p.f32(p.kv_pad, d), p.f32(p.kv_pad, d)), (p.tile(bk, d), p.tile(bk, d)),
        bias, bk, "flash_attention_dkv",
    )

    bq, bk = blocks.block_q_dq, blocks.block_kv_dq
    dq_kernel = functools.partial(_dq_kernel, scale=scale, causal=causal, block_kv=bk, num_kv_blocks=p.kv_pad // bk)
    dq = p.call(
        dq_kernel, (p.groups, p.q_pad // bq), ins,
        (p.tile(bq, d), p.whole(p.kv_pad, d), p.whole(p.kv_pad, d), p.tile(bq, d), p.tile(bq, 1), p.tile(bq, 1)),
        p.f32(p.q_pad, d), p.tile(bq, d),
        bias, None, "flash_attention_dq",
    )
    return p.unrows(dq, p.q_len), p.unrows(dk, p.kv_len), p.unrows(dv, p.kv_len)


def flash_kernel(block_sizes: BlockSizes | None = None, *, interpret: bool = False,
                 platform: str | None = None) -> Kernel:
    """The flash :class:`~._common.Kernel`; ``interpret=True`` runs the Pallas kernels on any backend."""
    options = dict(block_sizes=block_sizes, interpret=interpret, platform=platform)
    return Kernel(functools.partial(flash_forward, **options), functools.partial(flash_backward, **options))


@functools.cache
def flash_attention_fn(block_sizes: BlockSizes | None = None, interpret: bool = False, platform: str | None = None):
    """``attention(q, k, v, mask, scale, causal)`` on ``[batch, seq, heads, head_dim]``, differentiable."""
    return attention_from_kernel(flash_kernel(block_sizes, interpret=interpret, platform=platform))
