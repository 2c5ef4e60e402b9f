"""Multi-head attention with diffusers' parameter names (``to_q``, ``to_k``, ``to_v``, ``to_out.0``)."""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Bool, Float, PRNGKeyArray, typechecked
from ..kernels import attention as attention_op
from ..parallel._plan import Plan, constrain
from ._layers import Linear


class Attention(eqx.Module):
    """Self- or cross-attention on ``[batch, seq, dim]`` tokens, computed by :func:`eqxdiff.kernels.attention`.

    ``implementation`` (static) names the kernel; :func:`with_attention_implementation` swaps it everywhere.
    """

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"to_out": "to_out.0"}

    to_q: Linear
    to_k: Linear
    to_v: Linear
    to_out: Linear
    heads: int = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, query_dim: int, *, cross_attention_dim: int | None = None, heads: int, dim_head: int,
                 bias: bool = False, out_bias: bool = True, implementation: str | None = None,
                 dtype=jnp.float32, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        inner = heads * dim_head
        context_dim = cross_attention_dim or query_dim
        self.to_q = Linear(query_dim, inner, use_bias=bias, dtype=dtype, key=kq)
        self.to_k = Linear(context_dim, inner, use_bias=bias, dtype=dtype, key=kk)
        self.to_v = Linear(context_dim, inner, use_bias=bias, dtype=dtype, key=kv)
        self.to_out = Linear(inner, query_dim, use_bias=out_bias, dtype=dtype, key=ko)
        self.heads = heads
        self.implementation = implementation

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"] | None = None,
                 *, mask: Bool[Array, "batch ctx_seq"] | None = None) -> Float[Array, "batch seq dim"]:
        context = x if context is None else context
        b, s, _ = x.shape
        q = self.to_q(x).reshape(b, s, self.heads, -1)
        k = self.to_k(context).reshape(b, context.shape[1], self.heads, -1)
        v = self.to_v(context).reshape(b, context.shape[1], self.heads, -1)
        q = constrain(q, self.plan, ("batch", "seq", "heads", "head_dim"))
        k, v = (constrain(t, self.plan, ("batch", "kv_seq", "heads", "head_dim")) for t in (k, v))
        # With a context axis, the kernel's default choice is ring/Ulysses over it; a named local kernel (e.g.
        # "xla") sees all-gathered keys/values instead.
        mesh = self.plan.mesh if self.plan is not None and self.plan.context > 1 else None
        out = attention_op(q, k, v, mask=mask, implementation=self.implementation, mesh=mesh)
        out = constrain(out, self.plan, ("batch", "seq", "heads", "head_dim"))
        return constrain(self.to_out(out.reshape(b, s, -1)), self.plan, ("batch", "seq", "embed"))


def with_attention_implementation(model, implementation: str | None):
    """Return ``model`` with every attention layer inside it (any module with an ``implementation`` field,
    :class:`Attention` and the model families' own) using ``implementation``."""

    def is_attn(m):
        return isinstance(m, eqx.Module) and any(f.name == "implementation" for f in dataclasses.fields(m))

    def where(m):
        return [x for x in jax.tree_util.tree_leaves(m, is_leaf=is_attn) if is_attn(x)]

    blocks = where(model)
    if not blocks:
        return model
    return eqx.tree_at(where, model, [replace_static(b, implementation=implementation) for b in blocks])


def replace_static(module: eqx.Module, **changes):
    """A copy of ``module`` with some (static) fields changed; ``eqx.tree_at`` only reaches array leaves."""
    new = object.__new__(type(module))
    for f in dataclasses.fields(module):
        object.__setattr__(new, f.name, changes.pop(f.name, getattr(module, f.name)))
    if changes:
        raise TypeError(f"{type(module).__name__} has no field(s) {sorted(changes)}")
    return new
