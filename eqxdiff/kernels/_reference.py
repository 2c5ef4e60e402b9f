"""The reference attention: plain ``jnp``, float32 softmax and accumulation. The ground truth for every test."""

import jax.numpy as jnp


def reference_attention(q, k, v, *, mask=None, scale=None, causal=False):
    """``softmax(q k^T * scale) v`` on ``[batch, seq, heads, head_dim]`` inputs.

    ``mask`` is a boolean key-padding mask ``[batch, kv_seq]`` (``True`` = attend); ``causal`` lets query ``i``
    see keys ``j <= i``. A query row whose keys are all masked returns zeros.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
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


__all__ = ["reference_attention"]
