"""Multi-head attention shared by every model: the UNet's and the VAE's, CLIP's, T5's and the diffusion
transformers'. The PyTorch names of its projections are declared per instance (``names``), so one class reads
diffusers' ``to_q ... to_out.0``, transformers' CLIP ``q_proj ... out_proj`` and T5's ``q ... o``."""

from collections.abc import Mapping
from types import MappingProxyType

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Bool, Float, PRNGKeyArray, typechecked
from ..core import Plan, constrain, map_modules, replace_static
from ..core import has_field as _has_field
from ..kernels import attention as attention_op
from ._layers import Linear

# Field -> PyTorch name of the projections, per checkpoint family.
ATTENTION_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "diffusers": MappingProxyType({"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"}),
    "clip": MappingProxyType({"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"}),
    "t5": MappingProxyType({"to_q": "q", "to_k": "k", "to_v": "v", "to_out": "o"}),
})


class Attention(eqx.Module):
    """Self- or cross-attention on ``[batch, seq, dim]`` tokens, computed by :func:`eqxdiff.kernels.attention`.

    ``names`` picks the projections' checkpoint names (a key of :data:`ATTENTION_NAMES`); ``scale`` (default
    ``dim_head ** -0.5``) multiplies the logits (T5 uses 1); ``pre_only`` drops the output projection.
    ``token_axis`` is the logical axis of the tokens under a plan: ``"seq"`` splits them over the mesh's
    ``context`` axis (and picks ring/Ulysses kernels there), ``None`` keeps them whole (short text sequences).
    ``implementation`` (static) names the kernel; :func:`with_attention_implementation` swaps it everywhere.
    """

    to_q: Linear
    to_k: Linear
    to_v: Linear
    to_out: Linear | None
    heads: int = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    names: str = eqx.field(static=True)
    token_axis: str | None = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, query_dim: int, *, cross_attention_dim: int | None = None, heads: int, dim_head: int,
                 bias: bool = False, out_bias: bool = True, pre_only: bool = False, scale: float | None = None,
                 names: str = "diffusers", token_axis: str | None = "seq", implementation: str | None = None,
                 dtype=jnp.float32, key: PRNGKeyArray):
        if names not in ATTENTION_NAMES:
            raise ValueError(f"Attention: names={names!r}; choose one of {list(ATTENTION_NAMES)}")
        kq, kk, kv, ko = jax.random.split(key, 4)
        inner = heads * dim_head
        context_dim = cross_attention_dim or query_dim
        proj = dict(use_bias=bias, axes=("heads", "embed"), dtype=dtype)
        self.to_q = Linear(query_dim, inner, key=kq, **proj)
        self.to_k = Linear(context_dim, inner, key=kk, **proj)
        self.to_v = Linear(context_dim, inner, key=kv, **proj)
        self.to_out = None if pre_only else Linear(inner, query_dim, use_bias=out_bias, axes=("embed", "heads"),
                                                   dtype=dtype, key=ko)
        self.heads = heads
        self.scale = scale
        self.names = names
        self.token_axis = token_axis
        self.implementation = implementation

    def torch_renames(self) -> Mapping[str, str]:
        return ATTENTION_NAMES[self.names]

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"] | None = None,
                 *, mask: Bool[Array, "batch ctx_seq"] | None = None,
                 bias: Float[Array, "#batch #heads seq ctx_seq"] | None = None,
                 causal: bool = False) -> Float[Array, "batch seq out"]:
        """``mask`` (``True`` = attend) masks context tokens; ``bias`` is added to the logits (T5's relative
        position bias); ``causal`` lets token ``i`` see tokens ``j <= i``."""
        context = x if context is None else context
        b, s, _ = x.shape
        q = self.to_q(x).reshape(b, s, self.heads, -1)
        k = self.to_k(context).reshape(b, context.shape[1], self.heads, -1)
        v = self.to_v(context).reshape(b, context.shape[1], self.heads, -1)
        out = self.attend(q, k, v, mask=mask, bias=bias, causal=causal).reshape(b, s, -1)
        if self.to_out is None:
            return out
        return constrain(self.to_out(out), self.plan, ("batch", self.token_axis, "embed"))

    def attend(self, q, k, v, *, mask=None, bias=None, causal: bool = False):
        """The kernel call on ``[batch, seq, heads, head_dim]`` projections, with the plan's constraints."""
        seq = self.token_axis
        kv_seq = None if seq is None else "kv_seq"
        q = constrain(q, self.plan, ("batch", seq, "heads", "head_dim"))
        k, v = (constrain(t, self.plan, ("batch", kv_seq, "heads", "head_dim")) for t in (k, v))
        # With a context axis, the kernel's default choice is ring/Ulysses over it; a named local kernel (e.g.
        # "xla") sees all-gathered keys/values instead.
        split = self.plan is not None and self.plan.context > 1 and seq is not None
        kwargs = {} if bias is None else {"bias": bias}
        out = attention_op(q, k, v, mask=mask, scale=self.scale, causal=causal, implementation=self.implementation,
                           mesh=self.plan.mesh if split else None, **kwargs)
        return constrain(out, self.plan, ("batch", seq, "heads", "head_dim"))


def with_attention_implementation(model, implementation: str | None):
    """Return ``model`` with every attention layer inside it (any module with an ``implementation`` field,
    :class:`Attention` and the model families' own) using ``implementation``."""
    return map_modules(lambda m: replace_static(m, implementation=implementation)
                       if _has_field(m, "implementation") else m, model)


__all__ = ["ATTENTION_NAMES", "Attention", "with_attention_implementation"]
