"""Pieces every attention backend shares: the error type, padding, key masks and the custom-VJP wrapper.

Backends that compute attention block by block (the dense "xla" kernel, "chunked", "flash") expose the same
two functions, a :class:`Kernel`, on ``[batch, heads, seq, head_dim]`` ("BHSD") float inputs:

- ``forward(q, k, v, valid, *, scale, causal) -> (out, lse)``: ``out`` float32 ``[b, h, q_seq, d]``,
  ``lse`` float32 ``[b, h, q_seq]`` (the log-sum-exp of each row's logits; ``-inf`` for a row that sees no key).
- ``backward(q, k, v, valid, do, lse, delta, *, scale, causal) -> (dq, dk, dv)`` in float32, where ``lse`` and
  ``delta = sum(do * out, -1)`` may come from a larger attention (ring attention passes the merged ones).

``valid`` is a boolean key mask ``[batch, kv_seq]`` (``True`` = attend) or ``None``. ``causal`` lets query ``i``
see keys ``j <= i`` (top-left aligned, as in the reference).

A kernel that takes an additive logits bias (``chunked``) accepts ``bias=`` in both functions: a float array
broadcastable to ``[batch, heads, q_seq, kv_seq]`` (an axis of length 1 is never materialised at full length), added
to the scaled logits before masking. Its backward then also takes ``bias_grad: bool`` and returns
``(dq, dk, dv, dbias)``, ``dbias`` float32 in the bias's own (broadcast) shape, or ``None`` when ``bias_grad`` is
false.
"""

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero


class AttentionUnavailableError(ValueError):
    """An implementation cannot serve this call (platform, dtype, shape, missing mesh); the message says why."""


class Kernel(NamedTuple):
    """A blockwise attention kernel: see the module docstring for the two signatures. ``layout="bshd"``: the
    kernel takes and gives ``[batch, seq, heads, head_dim]`` arrays instead (no transposes around it), and its
    forward's ``out`` may be in the inputs' dtype."""

    forward: Callable
    backward: Callable
    layout: str = "bhsd"


def platform_of(platform: str | None = None) -> str:
    """"gpu", "tpu" or "cpu" for ``platform`` (default: JAX's default backend)."""
    platform = platform or jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_axis(x, axis: int, length: int, value=0):
    """``x`` padded with ``value`` at the end of ``axis`` up to ``length`` (returned as is when already there)."""
    extra = length - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def key_valid(mask, kv_len: int, padded_len: int):
    """The boolean key mask ``[batch, padded_len]`` for keys padded from ``kv_len``; ``None`` when every key counts."""
    if mask is None:
        if padded_len == kv_len:
            return None
        return jnp.broadcast_to(jnp.arange(padded_len) < kv_len, (1, padded_len))
    return pad_axis(mask, 1, padded_len, value=False)


def lse_for_backward(lse):
    """``lse`` with ``+inf`` for rows that saw no key, so ``exp(logits - lse)`` is 0 there, never ``nan``."""
    return jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def finish_softmax(acc, m, denom):
    """``(acc / denom, lse)`` from an (online) softmax's running max ``m`` and sum ``denom``; rows with no key give 0."""
    empty = denom == 0
    out = acc / jnp.where(empty, 1.0, denom)[..., None]
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, denom)))
    return out, lse


def safe_max(m):
    """A running max with ``-inf`` (a row with no key so far) replaced by 0, so ``exp(x - m)`` stays finite."""
    return jnp.where(jnp.isneginf(m), 0.0, m)


def to_bhsd(x):
    return jnp.swapaxes(x, 1, 2)


def attention_from_kernel(kernel: Kernel) -> Callable:
    """``attention(q, k, v, mask, bias, scale, causal)`` on ``[batch, seq, heads, head_dim]``, differentiated by
    ``kernel``. ``bias`` is ``None`` or an additive logits bias (only for kernels that take one).

    The forward pass keeps ``q, k, v`` (as BHSD), the float32 output and ``lse``; the backward pass recomputes
    the probabilities block by block, so memory stays linear in the sequence length. The bias gradient is computed
    only when the bias is differentiated (JAX's symbolic zeros say whether it is): a constant bias costs the
    backward pass nothing extra.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
    def attn(q, k, v, mask, bias, scale, causal):
        return _forward(q, k, v, mask, bias, scale, causal)[0]

    # the kernel's layout from and to [batch, seq, heads, head_dim]
    convert = to_bhsd if kernel.layout == "bhsd" else (lambda x: x)

    def _forward(q, k, v, mask, bias, scale, causal):
        qt, kt, vt = convert(q), convert(k), convert(v)
        extra = {} if bias is None else {"bias": bias}
        out, lse = kernel.forward(qt, kt, vt, mask, scale=scale, causal=causal, **extra)
        return convert(out).astype(q.dtype), (qt, kt, vt, mask, bias, out, lse)

    def _fwd(q, k, v, mask, bias, scale, causal):
        # symbolic_zeros=True: each array argument arrives as CustomVJPPrimal(value, perturbed)
        unwrap = [None if x is None else x.value for x in (q, k, v, mask, bias)]
        out, res = _forward(*unwrap, scale, causal)
        # the residuals' structure (not a traced value) carries whether the bias needs a gradient
        return out, (res, () if bias is not None and bias.perturbed else None)

    def _bwd(scale, causal, residuals, dout):
        (qt, kt, vt, mask, bias, out, lse), bias_grad = residuals
        if isinstance(dout, SymbolicZero):
            dout = jnp.zeros(dout.aval.shape, dout.aval.dtype)
        do = convert(dout).astype(jnp.float32)
        delta = jnp.sum(do * out.astype(jnp.float32), axis=-1)
        if kernel.layout == "bshd":
            delta = jnp.swapaxes(delta, 1, 2)  # [b, h, q_seq], like lse
        dbias = None
        if bias is None:
            dq, dk, dv = kernel.backward(qt, kt, vt, mask, do, lse, delta, scale=scale, causal=causal)
        else:
            dq, dk, dv, dbias = kernel.backward(qt, kt, vt, mask, do, lse, delta, scale=scale, causal=causal,
                                                bias=bias, bias_grad=bias_grad is not None)
            dbias = None if dbias is None else dbias.astype(bias.dtype)
        return (convert(dq).astype(qt.dtype), convert(dk).astype(kt.dtype), convert(dv).astype(vt.dtype), None,
                dbias)

    attn.defvjp(_fwd, _bwd, symbolic_zeros=True)
    return attn


def allowed_pairs(valid, q_pos, k_pos, causal: bool):
    """Boolean ``[batch or 1, 1, q, k]`` of the (query, key) pairs that may attend, or ``None`` for all of them.

    ``valid`` is a ``[batch or 1, k]`` key mask or ``None``; ``q_pos``/``k_pos`` are the positions of the block's rows.
    """
    ok = None if valid is None else valid[:, None, None, :]
    if causal:
        tri = q_pos[:, None] >= k_pos[None, :]
        ok = tri if ok is None else ok & tri
    return ok
