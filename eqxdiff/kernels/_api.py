"""``attention(q, k, v, ...)``: the one call every model makes; a registry of implementations behind it."""

from .._typing import Array, Bool, Float, typechecked
from ._reference import reference_attention


def _check_inputs(q, k, v, mask):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise ValueError(f"attention: {name} must be [batch, seq, heads, head_dim], got shape {t.shape}")
    if k.shape != v.shape:
        raise ValueError(f"attention: k and v must have the same shape, got {k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"attention: q {q.shape} and k {k.shape} must agree in batch, heads and head_dim")
    if mask is not None and mask.shape != (k.shape[0], k.shape[1]):
        raise ValueError(f"attention: mask must be [batch, kv_seq] = {(k.shape[0], k.shape[1])}, got {mask.shape}")


@typechecked
def attention(
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq heads head_dim"],
    v: Float[Array, "batch kv_seq heads head_dim"],
    *,
    mask: Bool[Array, "batch kv_seq"] | None = None,
    scale: float | None = None,
    causal: bool = False,
    implementation: str | None = None,
) -> Float[Array, "batch q_seq heads head_dim"]:
    """Scaled dot-product attention over ``[batch, seq, heads, head_dim]`` tensors.

    ``mask`` is a key-padding mask (``True`` = attend); ``causal`` masks keys after each query. ``implementation`` picks a backend by name;
    ``None`` chooses one for the platform. Every backend matches ``"xla"``, the float32 reference.
    """
    _check_inputs(q, k, v, mask)
    if implementation not in (None, "xla"):
        raise ValueError(f"attention: unknown implementation {implementation!r}; available: ['xla']")
    return reference_attention(q, k, v, mask=mask, scale=scale, causal=causal)
