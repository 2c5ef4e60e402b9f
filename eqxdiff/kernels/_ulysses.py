"""Ulysses (DeepSpeed) sequence parallelism: all-to-all from sequence shards to head shards, attend, and back.

Each device starts with ``[batch, seq / n, heads, head_dim]``; one all-to-all gives it
``[batch, seq, heads / n, head_dim]``, so any single-device implementation (causal and masks included) runs on
whole sequences, and a second all-to-all restores the sequence sharding. The heads must divide by ``n``.
Differentiable by JAX (the transpose of an all-to-all is an all-to-all). Call inside ``shard_map``.
"""

from jax import lax

from ._context import CONTEXT_AXIS


def ulysses_attention(local_attention, q, k, v, mask):
    """``local_attention(q, k, v, mask)`` on whole sequences and a slice of the heads, for one device's shard."""
    def to_heads(x):
        return lax.all_to_all(x, CONTEXT_AXIS, split_axis=2, concat_axis=1, tiled=True)

    if mask is not None:
        mask = lax.all_gather(mask, CONTEXT_AXIS, axis=1, tiled=True)
    out = local_attention(to_heads(q), to_heads(k), to_heads(v), mask)
    return lax.all_to_all(out, CONTEXT_AXIS, split_axis=1, concat_axis=2, tiled=True)
