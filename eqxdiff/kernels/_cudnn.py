"""cuDNN fused attention through ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (NVIDIA GPUs).

The key-padding mask goes in as a ``[batch, 1, q_seq, kv_seq]`` boolean mask (cuDNN turns it into a bias and wants
its full query length), so any pattern of padded keys works, not only a padded tail; it costs ``q_seq * kv_seq``
per batch row, small for text cross-attention. Unlike the reference, a query row whose keys are all masked
gets the mean of ``v`` rather than zeros (the masked logits are large negative numbers, not ``-inf``).
"""

import jax
import jax.numpy as jnp

from ._common import AttentionUnavailableError, pad_axis, platform_of, round_up

_DTYPES = (jnp.bfloat16, jnp.float16)


def cudnn_unavailable_reason(platform: str, dtype, head_dim: int) -> str | None:
    """Why cuDNN cannot serve a call, or ``None`` if it can."""
    if platform != "gpu":
        return f"cudnn needs an NVIDIA GPU; the platform here is {platform!r} (use 'chunked', 'flash' or 'xla')"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _DTYPES]:
        return f"cudnn flash attention takes bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 256:
        return f"cudnn needs head_dim a multiple of 8 and <= 256 (128 before Hopper), got {head_dim}"
    return None


def cudnn_attention(q, k, v, mask, scale, causal):
    """Attention on ``[batch, seq, heads, head_dim]`` by cuDNN; differentiable (cuDNN's own backward)."""
    reason = cudnn_unavailable_reason(platform_of(), q.dtype, q.shape[-1])
    if reason:
        raise AttentionUnavailableError(reason)
    q_len, kv_len = q.shape[1], k.shape[1]
    if mask is not None or q_len % 2 or kv_len % 2:  # cuDNN's backward wants even lengths: pad, mask, slice
        if mask is None:
            mask = jnp.ones((q.shape[0], kv_len), bool)
        q_pad, kv_pad = round_up(q_len, 2), round_up(kv_len, 2)
        q = pad_axis(q, 1, q_pad)
        k, v = pad_axis(k, 1, kv_pad), pad_axis(v, 1, kv_pad)
        mask = jnp.broadcast_to(pad_axis(mask, 1, kv_pad, value=False)[:, None, None, :],
                                (q.shape[0], 1, q_pad, kv_pad))
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal, implementation="cudnn")
    return out[:, :q_len]
