"""Memory-efficient attention in plain JAX: query chunks times key/value chunks with an online softmax.

Memory is O(sequence): one ``[block_q, block_kv]`` logits tile per (batch, head) lives at a time, and the backward
pass (a :class:`~._common.Kernel`, so a ``custom_vjp``) recomputes the tiles from the saved log-sum-exp instead of
storing probabilities. Everything is computed in float32. Causal tiles above the diagonal are skipped.

An additive logits bias (T5's relative position bias) is read tile by tile from the array the caller gives: a
``[1, heads, q, kv]`` bias stays that size, never broadcast over the batch. Its gradient (``bias_grad=True``) is
each tile's ``dS`` summed over the axes the bias broadcasts over, so it costs one reduction per tile and memory
the size of the bias itself; ``attention_from_kernel`` asks for it only when the bias is differentiated.
"""

import functools

import jax.numpy as jnp
from jax import lax

from ._common import (
    Kernel,
    allowed_pairs,
    attention_from_kernel,
    finish_softmax,
    key_valid,
    lse_for_backward,
    pad_axis,
    round_up,
    safe_max,
)


def _layout(q, k, v, valid, block_q, block_kv):
    """Pad to whole chunks, cast to float32; return the pieces and sizes the loops need."""
    q_len, kv_len = q.shape[2], k.shape[2]
    bq, bk = min(block_q, q_len), min(block_kv, kv_len)
    q_pad, kv_pad = round_up(q_len, bq), round_up(kv_len, bk)
    q = pad_axis(q.astype(jnp.float32), 2, q_pad)
    k = pad_axis(k.astype(jnp.float32), 2, kv_pad)
    v = pad_axis(v.astype(jnp.float32), 2, kv_pad)
    return q, k, v, key_valid(valid, kv_len, kv_pad), bq, bk


def _tiles(x, size):
    """``[b, h, n * size, ...]`` -> ``[n, b, h, size, ...]`` (the leading axis is scanned over)."""
    b, h, s = x.shape[:3]
    return jnp.moveaxis(x.reshape(b, h, s // size, size, *x.shape[3:]), 2, 0)


def _untile(x, length):
    n, b, h, size = x.shape[:4]
    return jnp.moveaxis(x, 0, 2).reshape(b, h, n * size, *x.shape[4:])[:, :, :length]


def _kv_chunk(k, v, valid, j, bk):
    kj = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=2)
    vj = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=2)
    valid_j = None if valid is None else lax.dynamic_slice_in_dim(valid, j * bk, bk, axis=1)
    return kj, vj, valid_j, j * bk + jnp.arange(bk)


def _bias_layout(bias, q_pad, kv_pad):
    """The bias in float32, padded like the queries and keys along the axes it does not broadcast over."""
    if bias is None:
        return None
    bias = bias.astype(jnp.float32)
    if bias.shape[2] > 1:
        bias = pad_axis(bias, 2, q_pad)
    if bias.shape[3] > 1:
        bias = pad_axis(bias, 3, kv_pad)
    return bias


def _bias_block(bias, axis: int, start, size: int):
    """The block of ``bias`` from ``start`` along ``axis`` (2: queries, 3: keys); a broadcast axis (length 1) as is."""
    if bias is None or bias.shape[axis] == 1:
        return bias
    return lax.dynamic_slice_in_dim(bias, start, size, axis=axis)


def _sum_to(x, shape):
    """``x`` summed (keeping dims) over the axes where ``shape`` is 1: the gradient of a broadcast bias."""
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, x.shape)) if n == 1 and m != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _logits(qi, kj, valid_j, q_pos, k_pos, causal, bias_ij=None):
    s = jnp.einsum("bhqd,bhkd->bhqk", qi, kj)
    if bias_ij is not None:
        s = s + bias_ij
    ok = allowed_pairs(valid_j, q_pos, k_pos, causal)
    return s if ok is None else jnp.where(ok, s, -jnp.inf)


def _num_kv_chunks(i, bq, bk, nk, causal):
    """Key chunks that query chunk ``i`` can see: all of them, or those up to the diagonal when causal."""
    return jnp.minimum(nk, ((i + 1) * bq + bk - 1) // bk) if causal else nk


def chunked_forward(q, k, v, valid, *, scale, causal, block_q, block_kv, bias=None):
    q_len = q.shape[2]
    q, k, v, valid, bq, bk = _layout(q * scale, k, v, valid, block_q, block_kv)
    bias = _bias_layout(bias, q.shape[2], k.shape[2])
    nk = k.shape[2] // bk

    def one_q_chunk(args):
        i, qi = args
        q_pos = i * bq + jnp.arange(bq)
        bias_i = _bias_block(bias, 2, i * bq, bq)
        if nk == 1:  # one key chunk: a plain softmax, no rescaling
            s = _logits(qi, k, valid, q_pos, jnp.arange(bk), causal, bias_i)
            m = safe_max(jnp.max(s, axis=-1))
            p = jnp.exp(s - m[..., None])
            return finish_softmax(jnp.einsum("bhqk,bhkd->bhqd", p, v), m, jnp.sum(p, axis=-1))

        def one_kv_chunk(j, carry):
            m, denom, acc = carry
            kj, vj, valid_j, k_pos = _kv_chunk(k, v, valid, j, bk)
            s = _logits(qi, kj, valid_j, q_pos, k_pos, causal, _bias_block(bias_i, 3, j * bk, bk))
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = safe_max(m_new)
            p = jnp.exp(s - m_safe[..., None])
            rescale = jnp.exp(m - m_safe)
            acc = acc * rescale[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p, vj)
            return m_new, denom * rescale + jnp.sum(p, axis=-1), acc

        init = (jnp.full(qi.shape[:-1], -jnp.inf), jnp.zeros(qi.shape[:-1]), jnp.zeros(qi.shape))
        m, denom, acc = lax.fori_loop(0, _num_kv_chunks(i, bq, bk, nk, causal), one_kv_chunk, init)
        return finish_softmax(acc, safe_max(m), denom)

    out, lse = lax.map(one_q_chunk, (jnp.arange(q.shape[2] // bq), _tiles(q, bq)))
    return _untile(out, q_len), _untile(lse, q_len)


def chunked_backward(q, k, v, valid, do, lse, delta, *, scale, causal, block_q, block_kv, bias=None,
                     bias_grad=False):
    q_len, kv_len = q.shape[2], k.shape[2]
    q, k, v, valid, bq, bk = _layout(q * scale, k, v, valid, block_q, block_kv)
    q_pad, nk = q.shape[2], k.shape[2] // bk
    do = pad_axis(do, 2, q_pad)
    # padded query rows get lse = +inf: probabilities 0 there, whatever a query-broadcast bias adds
    lse = pad_axis(lse_for_backward(lse), 2, q_pad, value=jnp.inf)
    delta = pad_axis(delta, 2, q_pad)
    bias_shape = None if bias is None else bias.shape
    bias = _bias_layout(bias, q_pad, k.shape[2])
    want_dbias = bias is not None and bias_grad
    # dbias of one query chunk: [bias batch, bias heads, bq (or 1), kv (or 1)]
    dbias_shape = None if not want_dbias else (*bias.shape[:2], bq if bias.shape[2] > 1 else 1, bias.shape[3])

    def tile_grads(qi, doi, lse_i, delta_i, kj, vj, valid_j, q_pos, k_pos, bias_ij):
        # Work with transposed [kv, q] tiles so that dk and dv (the two grads per tile that sum over queries)
        # are plain matmuls; only dq contracts over the leading axis.
        s_t = jnp.einsum("bhkd,bhqd->bhkq", kj, qi)
        if bias_ij is not None:
            s_t = s_t + jnp.swapaxes(bias_ij, -1, -2)
        ok = allowed_pairs(valid_j, q_pos, k_pos, causal)
        if ok is not None:
            s_t = jnp.where(jnp.swapaxes(ok, -1, -2), s_t, -jnp.inf)
        p_t = jnp.exp(s_t - lse_i[:, :, None, :])
        ds_t = p_t * (jnp.einsum("bhkd,bhqd->bhkq", vj, doi) - delta_i[:, :, None, :])
        dqi = jnp.einsum("bhkq,bhkd->bhqd", ds_t, kj)
        # the logits' gradient, summed over the axes the bias broadcasts over
        dbias_ij = _sum_to(jnp.swapaxes(ds_t, -1, -2), bias_ij.shape) if want_dbias else None
        return dqi, jnp.einsum("bhkq,bhqd->bhkd", ds_t, qi), jnp.einsum("bhkq,bhqd->bhkd", p_t, doi), dbias_ij

    def add_block(acc, block, j):
        """``block`` (the bias gradient of key chunk ``j``) added into ``acc`` (a query chunk's)."""
        if block is None:
            return acc
        if acc.shape[3] == 1:
            return acc + block
        part = lax.dynamic_slice_in_dim(acc, j * bk, bk, 3) + block
        return lax.dynamic_update_slice_in_dim(acc, part, j * bk, 3)

    def one_q_chunk(carry, args):
        dk, dv, dbias_acc = carry
        i, qi, doi, lse_i, delta_i = args
        q_pos = i * bq + jnp.arange(bq)
        bias_i = _bias_block(bias, 2, i * bq, bq)
        if nk == 1:
            dqi, dk_i, dv_i, dbias_i = tile_grads(qi, doi, lse_i, delta_i, k, v, valid, q_pos, jnp.arange(bk), bias_i)
            dk, dv = dk + dk_i, dv + dv_i
        else:
            def one_kv_chunk(j, inner):
                dqi, dk, dv, dbias_i = inner
                kj, vj, valid_j, k_pos = _kv_chunk(k, v, valid, j, bk)
                dq_ij, dk_ij, dv_ij, dbias_ij = tile_grads(qi, doi, lse_i, delta_i, kj, vj, valid_j, q_pos, k_pos,
                                                           _bias_block(bias_i, 3, j * bk, bk))
                dk = lax.dynamic_update_slice_in_dim(dk, lax.dynamic_slice_in_dim(dk, j * bk, bk, 2) + dk_ij,
                                                     j * bk, 2)
                dv = lax.dynamic_update_slice_in_dim(dv, lax.dynamic_slice_in_dim(dv, j * bk, bk, 2) + dv_ij,
                                                     j * bk, 2)
                return dqi + dq_ij, dk, dv, add_block(dbias_i, dbias_ij, j)

            dbias_init = jnp.zeros(dbias_shape) if want_dbias else None
            dqi, dk, dv, dbias_i = lax.fori_loop(0, _num_kv_chunks(i, bq, bk, nk, causal), one_kv_chunk,
                                                 (jnp.zeros_like(qi), dk, dv, dbias_init))
        if want_dbias and bias.shape[2] == 1:  # a bias shared by every query: sum over the query chunks
            return (dk, dv, dbias_acc + dbias_i), (dqi, None)
        return (dk, dv, dbias_acc), (dqi, dbias_i)

    xs = (jnp.arange(q_pad // bq), _tiles(q, bq), _tiles(do, bq), _tiles(lse, bq), _tiles(delta, bq))
    dbias_acc = jnp.zeros(dbias_shape) if want_dbias and bias.shape[2] == 1 else None
    (dk, dv, dbias_acc), (dq, dbias_tiles) = lax.scan(one_q_chunk, (jnp.zeros_like(k), jnp.zeros_like(v), dbias_acc),
                                                      xs)
    # q was scaled on the way in, so dk already carries the scale; dq gets it here.
    grads = (_untile(dq, q_len) * scale, dk[:, :, :kv_len], dv[:, :, :kv_len])
    if bias is None:
        return grads
    if not want_dbias:
        return (*grads, None)
    dbias = dbias_acc if dbias_tiles is None else _untile(dbias_tiles, q_len)
    return (*grads, dbias[..., : bias_shape[3]])


def chunked_kernel(block_q: int, block_kv: int) -> Kernel:
    """The chunked :class:`~._common.Kernel` with the given query and key/value chunk lengths (takes a bias)."""
    return Kernel(functools.partial(chunked_forward, block_q=block_q, block_kv=block_kv),
                  functools.partial(chunked_backward, block_q=block_q, block_kv=block_kv))


@functools.cache
def chunked_attention_fn(block_q: int, block_kv: int):
    """``attention(q, k, v, mask, bias, scale, causal)`` on ``[batch, seq, heads, head_dim]``, differentiable."""
    return attention_from_kernel(chunked_kernel(block_q, block_kv))
