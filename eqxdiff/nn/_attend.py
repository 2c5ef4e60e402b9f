"""The one attention computation every attention layer shares, :func:`attend`, and what it needs: the layers'
abstract base :class:`AbstractAttention` (heads, scale, checkpoint names, token axis, kernel, plan), the QK norm
over the whole inner dimension (:class:`AcrossHeads`) and :func:`with_attention_implementation`.

The layers (self-, cross-, joint and added key/value attention, and attention of projections made elsewhere) are
in ``_attention.py``; each projects its queries, keys and values its own way, then :func:`attend` runs:

    q, k, v [batch, seq, heads, head_dim] -> QK norm (optional) -> RoPE (optional)
      -> eqxdiff.kernels.attention, under the plan's sharding constraints -> output projection (optional)

A QK norm is a module acting on ``[..., heads, head_dim]``: ``RMSNorm(head_dim)`` normalises each head (Flux),
``AcrossHeads(RMSNorm(heads * head_dim))`` the whole inner dimension at once (Wan, LTX-Video). A layer holds the one
it was built with, or ``None``; nothing is inferred at run time.
"""

import abc
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import equinox as eqx

from .._typing import Array, Bool, Float, typechecked
from ..core import Plan, constrain, map_modules, replace_static
from ..core import has_field as _has_field
from ..kernels import CONTEXT_KERNELS, AttentionUnavailableError
from ..kernels import attention as attention_op
from ._layers import Linear, RMSNorm
from ._rope import Rope, apply_rope

# Field -> PyTorch name of the projections, per checkpoint family.
ATTENTION_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "diffusers": MappingProxyType({"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"}),
    "clip": MappingProxyType({"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"}),
    "t5": MappingProxyType({"to_q": "q", "to_k": "k", "to_v": "v", "to_out": "o"}),
})


class AcrossHeads(eqx.Module):
    """A QK norm over the whole inner dimension: ``norm`` (``RMSNorm(heads * head_dim)``) applied to queries or keys
    ``[..., heads, head_dim]`` with their heads flattened, as diffusers' ``qk_norm="rms_norm_across_heads"`` (Wan,
    LTX-Video) normalises the projections before the head split. Its checkpoint names are ``norm``'s
    (``norm_q.weight``). A per-head norm (Flux's ``RMSNorm(head_dim)``) needs no wrapper."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"norm": ""}

    norm: RMSNorm

    @typechecked
    def __call__(self, x: Float[Array, "*batch heads head_dim"]) -> Float[Array, "*batch heads head_dim"]:
        return self.norm(x.reshape(*x.shape[:-2], -1)).reshape(x.shape)


QKNorm = RMSNorm | AcrossHeads


def check_qk_norm(qk_norm, heads: int, dim_head: int, who: str) -> QKNorm | None:
    """``qk_norm`` if it is a QK norm that fits ``heads x dim_head`` queries, else a ``ValueError`` naming the fix."""
    fix = (f"give nn.RMSNorm(dim_head={dim_head}) to normalise each head (Flux), nn.AcrossHeads(nn.RMSNorm("
           f"heads * dim_head={heads * dim_head})) to normalise across heads (Wan, LTX-Video), or None")
    if qk_norm is None:
        return None
    if not isinstance(qk_norm, (RMSNorm, AcrossHeads)):
        raise ValueError(f"{who}: qk_norm={qk_norm!r} is not a QK norm module: {fix}")
    norm, size = (qk_norm.norm, heads * dim_head) if isinstance(qk_norm, AcrossHeads) else (qk_norm, dim_head)
    if norm.weight is not None and norm.weight.shape[-1] != size:
        raise ValueError(f"{who}: qk_norm normalises {norm.weight.shape[-1]} channels, not {size}: {fix}")
    return qk_norm


class AbstractAttention(eqx.Module):
    """What every attention layer holds besides its parameters, all static, and the steps they share.

    ``heads``; ``scale`` multiplies the logits (``None``: ``head_dim ** -0.5``; T5 uses 1); ``names`` picks the
    checkpoint names of ``to_q ... to_out`` (a key of :data:`ATTENTION_NAMES`: diffusers' ``to_q ... to_out.0``,
    transformers' CLIP ``q_proj ... out_proj``, T5's ``q ... o``); ``token_axis`` is the logical axis of the tokens
    under a plan (``"seq"`` splits them over the mesh's ``context`` axis and picks ring/Ulysses kernels there,
    ``None`` keeps them whole: short text sequences); ``implementation`` names the kernel
    (:func:`with_attention_implementation` swaps it everywhere); ``plan`` is set by ``with_plan``.

    These settings are declared here once rather than in each layer; a layer's ``__init__`` sets them with
    :meth:`_init_settings`, and its ``__call__`` ends in :func:`attend`.
    """

    heads: int = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    names: str = eqx.field(static=True)
    token_axis: str | None = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True)  # None until eqxdiff.parallel.with_plan sets it

    def _init_settings(self, *, heads: int, scale: float | None, names: str, token_axis: str | None,
                       implementation: str | None):
        if names not in ATTENTION_NAMES:
            raise ValueError(f"{type(self).__name__}: names={names!r}; choose one of {list(ATTENTION_NAMES)}")
        self.heads, self.scale, self.names = heads, scale, names
        self.token_axis, self.implementation, self.plan = token_axis, implementation, None

    @abc.abstractmethod
    def __call__(self, *args, **kwargs):
        raise NotImplementedError

    def torch_renames(self) -> Mapping[str, str]:
        return ATTENTION_NAMES[self.names]

    def _heads(self, y: Array) -> Array:
        """Projections ``[batch, seq, heads * head_dim]`` as ``[batch, seq, heads, head_dim]``."""
        return y.reshape(*y.shape[:2], self.heads, -1)

    def _output(self, proj: Linear | None, out: Array) -> Array:
        """``out`` (``[batch, seq, heads, head_dim]`` or merged) with its heads merged, through ``proj`` if any."""
        out = out.reshape(*out.shape[:2], -1)
        if proj is None:
            return out
        return constrain(proj(out), self.plan, ("batch", self.token_axis, "embed"))


@typechecked
def attend(layer: AbstractAttention, q: Float[Array, "batch seq heads head_dim"],
           k: Float[Array, "batch kv_seq heads head_dim"], v: Float[Array, "batch kv_seq heads head_dim"], *,
           norm_q: QKNorm | None = None, norm_k: QKNorm | None = None, rope: Rope | None = None,
           to_out: Linear | None = None, mask: Bool[Array, "batch kv_seq"] | None = None,
           bias: Float[Array, "#batch #heads seq kv_seq"] | None = None,
           causal: bool = False) -> Float[Array, "batch seq out"]:
    """Attention of projected queries, keys and values: ``norm_q`` / ``norm_k`` (QK norms), ``rope`` (rotates the
    queries and keys), the kernel with ``layer``'s settings (``mask``: ``True`` = attend to that key; ``bias`` added
    to the logits, T5's relative positions; ``causal``: token ``i`` sees ``j <= i``), the heads merged, ``to_out``.

    Queries, keys and values are constrained to ``layer.plan``'s shardings (keys and values over ``kv_seq``: whole,
    unless a ring/Ulysses kernel keeps them split); with a ``context`` mesh axis the kernel's default choice is
    ring/Ulysses over it, and a named local kernel (e.g. ``"xla"``) sees all-gathered keys and values instead. A layer
    named "ring" or "ulysses" that keeps its tokens whole (``token_axis=None``: a VAE's attention over one image, as
    ``load_pipeline(attention="ring", mesh=)`` sets every model's) has nothing to split and runs the default local
    kernel."""
    if norm_q is not None:
        q = norm_q(q)
    if norm_k is not None:
        k = norm_k(k)
    if rope is not None:
        q, k = apply_rope(q, rope), apply_rope(k, rope)
    plan, seq = layer.plan, layer.token_axis
    kv_seq = None if seq is None else "kv_seq"
    q = constrain(q, plan, ("batch", seq, "heads", "head_dim"))
    k, v = (constrain(t, plan, ("batch", kv_seq, "heads", "head_dim")) for t in (k, v))
    split = plan is not None and plan.context > 1 and seq is not None
    implementation = _implementation(layer, split)
    kwargs = {} if bias is None else {"bias": bias}
    out = attention_op(q, k, v, mask=mask, scale=layer.scale, causal=causal, implementation=implementation,
                       mesh=plan.mesh if split else None, **kwargs)
    out = constrain(out, plan, ("batch", seq, "heads", "head_dim"))
    return layer._output(to_out, out)


def _implementation(layer: AbstractAttention, split: bool) -> str | None:
    """``layer``'s kernel for this call: a context-parallel one (``CONTEXT_KERNELS``) only where the tokens are split
    over the plan's ``context`` axis (a layer that keeps them whole gets the default local choice); a clear error
    for a mesh whose ``context`` axis has one device."""
    plan, impl = layer.plan, layer.implementation
    if impl not in CONTEXT_KERNELS or split or plan is None or plan.mesh is None:
        return impl
    if layer.token_axis is None:
        return None
    raise AttentionUnavailableError(
        f"{type(layer).__name__}: implementation={impl!r} splits the tokens over the mesh's 'context' axis, but it has "
        f"{plan.context} device(s) (mesh {dict(plan.mesh.shape)}); give the mesh a context axis > 1 "
        f"(MeshConfig(ici_context_parallelism=...)) or choose a local kernel (implementation=None)")


def with_attention_implementation(model, implementation: str | None):
    """Return ``model`` with every attention layer inside it (any module with an ``implementation`` field: the
    :class:`AbstractAttention` layers, and any a model family defines) using ``implementation``."""
    return map_modules(lambda m: replace_static(m, implementation=implementation)
                       if _has_field(m, "implementation") else m, model)


__all__ = ["ATTENTION_NAMES", "AbstractAttention", "AcrossHeads", "QKNorm", "attend", "check_qk_norm",
           "with_attention_implementation"]
