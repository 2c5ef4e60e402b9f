"""The reference attention: plain ``jnp``, float32 softmax and accumulation. The ground truth for every test.

Also the dense :class:`~._common.Kernel` (``dense_kernel``): the same maths with an explicit backward pass, the
"xla" choice for the per-shard block of ring attention.
"""

import jax.numpy as jnp

from ._common import Kernel, allowed_pairs, finish_softmax, lse_for_backward, safe_max


def reference_attention(q, k, v, *, mask=None, bias=None, scale=None, causal=False):
    """``softmax(q k^T * scale + bias) v`` on ``[batch, seq, heads, head_dim]`` inputs.

    ``mask`` is a boolean key-padding mask ``[batch, kv_seq]`` (``True`` = attend); ``bias`` an additive logits bias
    broadcastable to ``[batch, heads, q_seq, kv_seq]`` (T5's relative position bias), added in float32 before the
    mask; ``causal`` lets query ``i`` see keys ``j <= i``. A query row whose keys are all masked returns zeros.
    Differentiable by JAX, with respect to the bias too.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    if causal:
        q_len, kv_len = q.shape[1], k.shape[1]
        allowed = jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :]
        logits = jnp.where(allowed, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    return out.astype(q.dtype)


def _dense_logits(q, k, valid, scale, causal):
    logits = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    ok = allowed_pairs(valid, jnp.arange(q.shape[2]), jnp.arange(k.shape[2]), causal)
    return logits if ok is None else jnp.where(ok, logits, -jnp.inf)


def dense_forward(q, k, v, valid, *, scale, causal):
    logits = _dense_logits(q, k, valid, scale, causal)
    m = safe_max(jnp.max(logits, axis=-1))
    p = jnp.exp(logits - m[..., None])
    acc = jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32))
    return finish_softmax(acc, m, jnp.sum(p, axis=-1))


def dense_backward(q, k, v, valid, do, lse, delta, *, scale, causal):
    q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
    p = jnp.exp(_dense_logits(q, k, valid, scale, causal) - lse_for_backward(lse)[..., None])
    dv = jnp.einsum("bhqk,bhqd->bhkd", p, do)
    ds = p * (jnp.einsum("bhqd,bhkd->bhqk", do, v.astype(jnp.float32)) - delta[..., None])
    dq = jnp.einsum("bhqk,bhkd->bhqd", ds, k32) * scale
    dk = jnp.einsum("bhqk,bhqd->bhkd", ds, q32) * scale
    return dq, dk, dv


dense_kernel = Kernel(dense_forward, dense_backward)

__all__ = ["reference_attention", "dense_kernel"]
