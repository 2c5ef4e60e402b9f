"""``attention(q, k, v, ...)``: the one call every model makes; a registry of implementations behind it."""

import dataclasses
import functools
import logging
from typing import Callable, NamedTuple

import jax.numpy as jnp
from jax.sharding import Mesh

from .._typing import Array, Bool, Float, typechecked
from ._block_sizes import BlockSizes
from ._chunked import chunked_attention_fn, chunked_kernel
from ._common import AttentionUnavailableError, attention_from_kernel
from ._context import context_problem, context_size, shard_over_context
from ._cudnn import cudnn_attention, cudnn_unavailable_reason
from ._flash import flash_attention_fn, flash_kernel
from ._flash_hopper import hopper_attention_fn, hopper_unavailable_reason
from ._reference import dense_kernel, reference_attention
from ._ring import ring_kernel
from ._select import AttentionCall, choose
from ._ulysses import ulysses_attention

logger = logging.getLogger("eqxdiff.kernels")


class _Options(NamedTuple):
    block_sizes: BlockSizes | None
    mesh: Mesh | None
    interpret: bool
    local_implementation: str | None
    flash_backend: str = "auto"


FLASH_BACKENDS = ("auto", "triton", "mosaic_gpu")

@dataclasses.dataclass(frozen=True)
class Implementation:
    """One entry of :data:`IMPLEMENTATIONS`: what it supports, when it cannot serve a call, and how to run it."""

    name: str
    summary: str
    unavailable: Callable[[AttentionCall], str | None]  # why it cannot serve the call, or None
    run: Callable  # (q, k, v, mask, bias, scale, causal, call, options) -> out; bias is None unless it takes one


def _always(call):
    return None


# Why each implementation that takes no additive logits bias cannot; its `unavailable` check says so first (no
# platform or mesh would change it).
_NO_BIAS = {
    "cudnn": "eqxdiff does not pass a logits bias to cuDNN (jax's cuDNN call takes one, but its broadcast shapes "
             "and bias gradient are not tested here)",
    "flash": "the Pallas flash kernels have no bias tile (they add only the key-padding mask)",
    "ring": "ring attention would have to send the bias's key blocks round the ring with k and v",
    "ulysses": "Ulysses would have to split the bias's heads over the context axis like q, k and v",
}


def _refusing_bias(name, check):
    """The ``unavailable`` check ``check`` of an implementation that takes no logits bias, refusing one first."""
    def unavailable(call):
        if call.has_bias:
            return f"{name} takes no logits bias: {_NO_BIAS[name]}; use 'chunked' (or 'xla') for a biased call"
        return check(call)

    return unavailable


def _chunk_sizes(call, opts):
    return opts.block_sizes or BlockSizes.default(call.platform, "chunked")


def _flash_unavailable(call):
    if call.platform not in ("gpu", "tpu") and not call.interpret:
        return (f"flash has Pallas lowerings for GPU (Triton) and TPU (Mosaic), not {call.platform!r}; pass "
                f"interpret=True to run it in interpret mode (slow: for tests)")
    return None


def _context_unavailable(what):
    def unavailable(call):
        problem = context_problem(call.mesh_axes, what)
        if problem:
            return problem
        if what == "ring" and call.causal and call.q_len != call.kv_len:
            return f"causal ring attention needs q_seq == kv_seq, got {call.q_len} and {call.kv_len}"
        if what == "ulysses" and call.local_heads % call.context:
            heads = f"heads={call.heads}" + (f" (/{call.head_shards} over 'tensor')" if call.head_shards > 1 else "")
            return (f"ulysses splits each device's heads over the {call.context} devices of the 'context' axis, "
                    f"but {heads} does not divide by {call.context}; use 'ring'")
        return None

    return unavailable


def _run_xla(q, k, v, mask, bias, scale, causal, call, opts):
    return reference_attention(q, k, v, mask=mask, bias=bias, scale=scale, causal=causal)


def _run_chunked(q, k, v, mask, bias, scale, causal, call, opts):
    sizes = _chunk_sizes(call, opts)
    return chunked_attention_fn(sizes.block_q, sizes.block_kv)(q, k, v, mask, bias, scale, causal)


def _run_cudnn(q, k, v, mask, bias, scale, causal, call, opts):
    return cudnn_attention(q, k, v, mask, scale, causal)


def flash_backend_for(dtype, head_dim: int, has_mask: bool, causal: bool, platform: str, interpret: bool,
                      backend: str = "auto") -> tuple[str, str]:
    """``(backend, reason)``: which flash forward kernel serves a call, "mosaic_gpu" (Hopper) or "triton"/Mosaic TPU
    (``_flash.py``). "auto" takes the Hopper kernel on an H100/H200 whenever it can serve the call."""
    if backend not in FLASH_BACKENDS:
        raise ValueError(f"attention: flash_backend={backend!r}; choose from {FLASH_BACKENDS}")
    if backend == "triton":
        return "triton", "asked for by name"
    if platform != "gpu" and not (interpret and backend == "mosaic_gpu"):
        if backend == "mosaic_gpu":
            raise AttentionUnavailableError(f"attention: flash_backend='mosaic_gpu' needs a Hopper GPU (or "
                                            f"interpret=True); the platform here is {platform!r}")
        return "triton", f"not a GPU ({platform})"
    if backend == "auto" and interpret:
        return "triton", "interpret=True runs the Triton-style kernels unless flash_backend='mosaic_gpu'"
    reason = hopper_unavailable_reason(dtype, head_dim, has_mask, causal, interpret=interpret)
    if reason and backend == "mosaic_gpu":
        raise AttentionUnavailableError(f"attention: flash_backend='mosaic_gpu' cannot serve this call: {reason}")
    if reason:
        return "triton", f"the Hopper kernel cannot serve it: {reason}"
    return "mosaic_gpu", "the warp-specialised Hopper forward (Mosaic GPU) with the Triton backward"


def _run_flash(q, k, v, mask, bias, scale, causal, call, opts):
    backend, _ = flash_backend_for(q.dtype, q.shape[-1], mask is not None, causal, call.platform, opts.interpret,
                                   opts.flash_backend)
    if backend == "mosaic_gpu":
        return hopper_attention_fn(opts.block_sizes, opts.interpret)(q, k, v, mask, None, scale, causal)
    return flash_attention_fn(opts.block_sizes, opts.interpret)(q, k, v, mask, None, scale, causal)


_RING_LOCAL = ("chunked", "xla", "flash")  # the blockwise kernels: (out, lse) forward, backward from lse
_ULYSSES_LOCAL = ("chunked", "xla", "flash", "cudnn")


def _local_name(default, opts, allowed):
    name = opts.local_implementation or default
    if name not in allowed:
        raise ValueError(f"attention: local_implementation={name!r} cannot run per shard here; choose from {allowed}")
    return name


def _run_ring(q, k, v, mask, bias, scale, causal, call, opts):
    name = _local_name("chunked", opts, _RING_LOCAL)
    if name == "xla":
        local = dense_kernel
    elif name == "chunked":
        local = chunked_kernel(_chunk_sizes(call, opts).block_q, _chunk_sizes(call, opts).block_kv)
    else:
        local = flash_kernel(opts.block_sizes, interpret=opts.interpret)
    attn = attention_from_kernel(ring_kernel(local, context_size(opts.mesh, "ring")))
    return shard_over_context(lambda q, k, v, m: attn(q, k, v, m, None, scale, causal), opts.mesh, q, k, v, mask)


def _run_ulysses(q, k, v, mask, bias, scale, causal, call, opts):
    context_size(opts.mesh, "ulysses")
    local_call = call.per_device()
    local = IMPLEMENTATIONS[_local_name(choose(local_call)[0], opts, _ULYSSES_LOCAL)]
    _raise_if_unavailable(local, local_call)
    local_opts = opts._replace(mesh=None)

    def local_attention(q, k, v, m):
        return local.run(q, k, v, m, None, scale, causal, local_call, local_opts)

    return shard_over_context(functools.partial(ulysses_attention, local_attention), opts.mesh, q, k, v, mask)


IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl
    for impl in (
        Implementation("xla", "dense jnp reference, float32 softmax; any platform; mask, bias, causal, grad "
                       "(autodiff, the bias's too)", _always, _run_xla),
        Implementation("chunked", "query x key/value chunks with an online softmax in plain JAX, O(seq) memory; "
                       "any platform; mask, bias, causal, grad (custom_vjp; the bias's when it is differentiated)",
                       _always, _run_chunked),
        Implementation("cudnn", "cuDNN fused attention via jax.nn.dot_product_attention; NVIDIA GPU, bf16/fp16; "
                       "mask, causal, grad",
                       _refusing_bias("cudnn", lambda call: cudnn_unavailable_reason(call.platform, call.dtype,
                                                                                     call.head_dim)), _run_cudnn),
        Implementation("flash", "Pallas flash attention (Triton on GPU, Mosaic on TPU, interpret=True anywhere); "
                       "mask, causal, grad (Pallas backward kernels)", _refusing_bias("flash", _flash_unavailable),
                       _run_flash),
        Implementation("ring", "ring attention over the mesh's 'context' axis (ppermute, log-sum-exp merge); "
                       "mask, causal (q_seq == kv_seq), grad", _refusing_bias("ring", _context_unavailable("ring")),
                       _run_ring),
        Implementation("ulysses", "all-to-all from sequence to head sharding over 'context', any local "
                       "implementation inside; mask, causal, grad",
                       _refusing_bias("ulysses", _context_unavailable("ulysses")), _run_ulysses),
    )
}


def _raise_if_unavailable(impl: Implementation, call: AttentionCall) -> None:
    reason = impl.unavailable(call)
    if reason:
        raise AttentionUnavailableError(f"attention: implementation={impl.name!r} cannot serve this call: {reason}")


def _check_inputs(q, k, v, mask, bias=None):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if getattr(t, "ndim", None) != 4:
            raise ValueError(f"attention: {name} must be [batch, seq, heads, head_dim], got shape "
                             f"{getattr(t, 'shape', None)}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"attention: q has {q.shape[2]} heads but k and v have {k.shape[2]} (q {q.shape}, "
                         f"k {k.shape}); grouped heads are not supported: repeat k and v first")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q {q.shape} and k {k.shape} must agree in batch and head_dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"attention: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None and mask.shape != (k.shape[0], k.shape[1]):
        raise ValueError(f"attention: mask must be [batch, kv_seq] = {(k.shape[0], k.shape[1])}, got {mask.shape}")
    if bias is not None:
        full = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        shape = tuple(getattr(bias, "shape", ()))
        if len(shape) != 4 or any(n not in (1, f) for n, f in zip(shape, full)):
            raise ValueError(f"attention: bias must broadcast to [batch, heads, q_seq, kv_seq] = {full} (each axis "
                             f"that length or 1), got shape {shape}")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise ValueError(f"attention: bias must be a float array (added to the logits), got {bias.dtype}; "
                             "pass a boolean key mask as mask=")


def _inputs_checked_first(fn):
    """Run :func:`_check_inputs` before the jaxtyping check, so shape mistakes get messages that name them."""

    @functools.wraps(fn)
    def checked(q, k, v, **kwargs):
        _check_inputs(q, k, v, kwargs.get("mask"), kwargs.get("bias"))
        return fn(q, k, v, **kwargs)

    return checked


def _resolve(q, k, *, causal, implementation, mesh, interpret,
             has_bias=False) -> tuple[Implementation, AttentionCall, str]:
    call = AttentionCall.of(q, k, causal=causal, mesh=mesh, interpret=interpret, has_bias=has_bias)
    if implementation is None:
        name, reason = choose(call)
    elif implementation in IMPLEMENTATIONS:
        name, reason = implementation, "asked for by name"
    else:
        raise ValueError(f"attention: unknown implementation {implementation!r}; available: {list(IMPLEMENTATIONS)}")
    impl = IMPLEMENTATIONS[name]
    _raise_if_unavailable(impl, call)
    return impl, call, reason


@_inputs_checked_first
@typechecked
def attention(
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq heads head_dim"],
    v: Float[Array, "batch kv_seq heads head_dim"],
    *,
    mask: Bool[Array, "batch kv_seq"] | None = None,
    bias: Float[Array, "#batch #heads #q_seq #kv_seq"] | None = None,
    scale: float | None = None,
    causal: bool = False,
    implementation: str | None = None,
    block_sizes: BlockSizes | None = None,
    mesh: Mesh | None = None,
    interpret: bool = False,
    local_implementation: str | None = None,
    flash_backend: str = "auto",
) -> Float[Array, "batch q_seq heads head_dim"]:
    """Scaled dot-product attention over ``[batch, seq, heads, head_dim]`` tensors.

    ``mask`` is a key-padding mask (``True`` = attend); ``bias`` an additive logits bias broadcastable to
    ``[batch, heads, q_seq, kv_seq]`` (T5's relative position bias: ``[1, heads, q_seq, kv_seq]``, never broadcast
    over the batch), added to ``scale * q k^T`` before the mask; ``causal`` masks keys after each query (query ``i``
    sees keys ``j <= i``). ``implementation`` names a backend in :data:`IMPLEMENTATIONS` ("xla", "chunked",
    "cudnn", "flash", "ring", "ulysses"); ``None`` chooses one (:func:`explain_choice` says which and why). One that
    cannot serve the call raises :class:`AttentionUnavailableError` saying why. Every backend matches "xla", the
    float32 reference, in value and gradient. Only "xla" and "chunked" take a bias, with its gradient (computed
    only when the bias is differentiated: T5's encoder trains its bias table through it); for a biased call
    ``None`` chooses between those two.

    ``block_sizes`` sets the tiles of "flash" and the chunks of "chunked" (per-platform defaults otherwise);
    ``interpret=True`` runs "flash" in Pallas interpret mode (any platform). "ring" and "ulysses" need ``mesh``, a
    ``jax.sharding.Mesh`` with a ``"context"`` axis, and run ``local_implementation`` on each shard.
    ``flash_backend`` picks the "flash" forward kernel: "auto" (the Mosaic GPU kernel on Hopper GPUs where it
    serves the call, else Triton), "triton", or "mosaic_gpu" (with ``interpret=True``: the GPU interpreter).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    impl, call, reason = _resolve(q, k, causal=causal, implementation=implementation, mesh=mesh,
                                  interpret=interpret, has_bias=bias is not None)
    if implementation is None:
        logger.debug("attention: chose %r: %s", impl.name, reason)
    return impl.run(q, k, v, mask, bias, scale, causal, call,
                    _Options(block_sizes, mesh, interpret, local_implementation, flash_backend))


def explain_choice(q, k, *, causal: bool = False, mesh: Mesh | None = None, interpret: bool = False,
                   implementation: str | None = None, bias: bool = False) -> str:
    """Which implementation :func:`attention` would use for these inputs, and why (shapes and dtypes suffice:
    ``jax.ShapeDtypeStruct`` works; ``bias=True`` for a call with a logits bias). Raises like :func:`attention`
    when the named implementation cannot serve."""
    impl, call, reason = _resolve(q, k, causal=causal, implementation=implementation, mesh=mesh,
                                  interpret=interpret, has_bias=bool(bias))
    if impl.name == "flash":
        backend, why = flash_backend_for(call.dtype, call.head_dim, False, causal, call.platform, interpret)
        reason += f"; forward kernel: {backend} ({why})"
    elif impl.name == "ring":
        reason += "; per shard: chunked"
    elif impl.name == "ulysses":
        reason += f"; per device: {choose(call.per_device())[0]}"
    return f"{impl.name}: {reason}"
