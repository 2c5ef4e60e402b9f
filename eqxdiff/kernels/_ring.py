"""Ring attention: each device keeps its query shard while the key/value shards travel round the ring.

At step ``s`` device ``i`` holds the key/value shard of device ``i - s``; a local :class:`~._common.Kernel` gives
that block's output and log-sum-exp, and the partial results merge by log-sum-exp. The backward pass runs the
ring again, sending each shard's ``dk, dv`` accumulators along with it and home at the end, so nothing larger
than a shard is ever gathered. Causal attention needs equal query and key lengths: blocks from later devices are
skipped and the diagonal block is causal. Call inside ``shard_map`` (see :func:`~._context.shard_over_context`).
"""

import functools

import jax.numpy as jnp
from jax import lax

from ._common import Kernel, safe_max
from ._context import CONTEXT_AXIS


def _merge(out, lse, out_s, lse_s):
    """Two partial softmax results over disjoint key sets merged into one."""
    m = safe_max(jnp.maximum(lse, lse_s))
    w, w_s = jnp.exp(lse - m), jnp.exp(lse_s - m)
    total = w + w_s
    empty = total == 0
    total = jnp.where(empty, 1.0, total)
    out = (out * w[..., None] + out_s * w_s[..., None]) / total[..., None]
    return out, jnp.where(empty, -jnp.inf, m + jnp.log(total))


def _by_position(block, skip, src, causal, *operands):
    """``block(causal, *operands)`` for the key shard of device ``src``: whole, causal (own shard) or skipped."""
    if not causal:
        return block(False, *operands)
    me = lax.axis_index(CONTEXT_AXIS)
    branch = jnp.where(src < me, 0, jnp.where(src == me, 1, 2))
    return lax.switch(branch, [functools.partial(block, False), functools.partial(block, True), skip], *operands)


def _rotate(tree, size):
    return lax.ppermute(tree, CONTEXT_AXIS, [(i, (i + 1) % size) for i in range(size)])


def ring_forward(q, k, v, valid, *, scale, causal, local: Kernel, size: int):
    me = lax.axis_index(CONTEXT_AXIS)

    def block(block_causal, k, v, valid):
        return local.forward(q, k, v, valid, scale=scale, causal=block_causal)

    def skip(k, v, valid):
        return jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:-1], -jnp.inf, jnp.float32)

    def step(s, carry):
        out, lse, k, v, valid = carry
        k, v, valid = _rotate((k, v, valid), size)
        out_s, lse_s = _by_position(block, skip, (me - s) % size, causal, k, v, valid)
        return (*_merge(out, lse, out_s, lse_s), k, v, valid)

    out, lse = _by_position(block, skip, me, causal, k, v, valid)
    out, lse, *_ = lax.fori_loop(1, size, step, (out, lse, k, v, valid))
    return out, lse


def ring_backward(q, k, v, valid, do, lse, delta, *, scale, causal, local: Kernel, size: int):
    me = lax.axis_index(CONTEXT_AXIS)

    def block(block_causal, k, v, valid):
        return local.backward(q, k, v, valid, do, lse, delta, scale=scale, causal=block_causal)

    def skip(k, v, valid):
        return tuple(jnp.zeros(x.shape, jnp.float32) for x in (q, k, v))

    def step(s, carry):
        dq, dk, dv, k, v, valid = carry
        k, v, valid, dk, dv = _rotate((k, v, valid, dk, dv), size)
        dq_s, dk_s, dv_s = _by_position(block, skip, (me - s) % size, causal, k, v, valid)
        return dq + dq_s, dk + dk_s, dv + dv_s, k, v, valid

    dq, dk, dv = _by_position(block, skip, me, causal, k, v, valid)
    dq, dk, dv, *_ = lax.fori_loop(1, size, step, (dq, dk, dv, k, v, valid))
    dk, dv = _rotate((dk, dv), size)  # each shard's gradients go home
    return dq, dk, dv


def ring_kernel(local: Kernel, size: int) -> Kernel:
    """The ring :class:`~._common.Kernel` over a context axis of ``size`` devices, built on ``local``."""
    return Kernel(functools.partial(ring_forward, local=local, size=size),
                  functools.partial(ring_backward, local=local, size=size))
