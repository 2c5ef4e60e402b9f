"""Multi-head attention shared by every model: the UNet's and the VAE's, CLIP's, T5's and the diffusion
transformers'. The PyTorch names of its projections are declared per instance (``names``), so one class reads
diffusers' ``to_q ... to_out.0``, transformers' CLIP ``q_proj ... out_proj`` and T5's ``q ... o``.

The diffusion transformers add, each optional and named as diffusers names them:

- QK-norm (``qk_norm``): an RMSNorm of the queries and keys, ``"rms_norm"`` per head over ``head_dim`` (Flux) or
  ``"rms_norm_across_heads"`` over the whole inner dimension before the head split (Wan, LTX): ``norm_q``,
  ``norm_k`` (and ``norm_added_q``, ``norm_added_k`` for the added projections).
- Rotary embeddings: ``rope=`` (an :class:`~eqxdiff.nn.Rope` of cos/sin tables) rotates queries and keys.
- Joint attention (``joint_dim``, Flux's double blocks): a second stream (the text) with its own projections
  ``add_q_proj``, ``add_k_proj``, ``add_v_proj`` and output ``to_add_out``; :meth:`Attention.joint` attends over
  ``[context, x]`` together and returns both streams.
- Added image keys/values (``added_kv_dim``, Wan's image-to-video cross-attention): ``add_k_proj``, ``add_v_proj``
  project an ``image_context`` the same queries attend to separately; the two attentions are summed.
- Fused projections (``qkv="fused"``): one ``to_qkv`` (and ``to_added_qkv``) matmul instead of three, diffusers'
  ``fuse_qkv_projections`` names and layout (``[q; k; v]`` on the output axis; a checkpoint's separate tensors
  are concatenated at load time by conversion rules). ``qkv="external"``: no q/k/v projections at all; the caller
  projects (Flux's single block fuses them with its MLP) and calls :meth:`Attention.attend_projected`.
"""

from collections.abc import Mapping
from types import MappingProxyType

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Bool, Float, PRNGKeyArray, typechecked
from ..core import Plan, constrain, map_modules, replace_static
from ..core import has_field as _has_field
from ..kernels import attention as attention_op
from ._layers import Linear, RMSNorm
from ._rope import Rope, apply_rope

# Field -> PyTorch name of the projections, per checkpoint family.
ATTENTION_NAMES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "diffusers": MappingProxyType({"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"}),
    "clip": MappingProxyType({"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"}),
    "t5": MappingProxyType({"to_q": "q", "to_k": "k", "to_v": "v", "to_out": "o"}),
})

QK_NORMS = ("rms_norm", "rms_norm_across_heads")
QKV_LAYOUTS = ("separate", "fused", "external")


class Attention(eqx.Module):
    """Self- or cross-attention on ``[batch, seq, dim]`` tokens, computed by :func:`eqxdiff.kernels.attention`.

    ``names`` picks the projections' checkpoint names (a key of :data:`ATTENTION_NAMES`); ``scale`` (default
    ``dim_head ** -0.5``) multiplies the logits (T5 uses 1); ``pre_only`` drops the output projection.
    ``token_axis`` is the logical axis of the tokens under a plan: ``"seq"`` splits them over the mesh's
    ``context`` axis (and picks ring/Ulysses kernels there), ``None`` keeps them whole (short text sequences).
    ``implementation`` (static) names the kernel; :func:`with_attention_implementation` swaps it everywhere.

    ``qk_norm`` (``None``, ``"rms_norm"``, ``"rms_norm_across_heads"``; ``qk_norm_eps``, ``qk_norm_affine``),
    ``joint_dim`` (with ``context_pre_only``: no ``to_add_out``) and ``added_kv_dim`` add the diffusion
    transformers' pieces (see the module docstring); ``added_proj_bias`` is the bias of the added projections.
    ``qkv`` (``"separate"``, ``"fused"``, ``"external"``) is how queries, keys and values are projected (see the
    module docstring); fused projections are replicated over a ``tensor`` mesh axis (their output mixes q, k
    and v), so tensor parallelism wants them separate.
    """

    to_q: Linear | None
    to_k: Linear | None
    to_v: Linear | None
    to_qkv: Linear | None
    to_out: Linear | None
    norm_q: RMSNorm | None
    norm_k: RMSNorm | None
    add_q_proj: Linear | None
    add_k_proj: Linear | None
    add_v_proj: Linear | None
    to_add_out: Linear | None
    norm_added_q: RMSNorm | None
    norm_added_k: RMSNorm | None
    to_added_qkv: Linear | None
    heads: int = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    qk_norm: str | None = eqx.field(static=True)
    qkv: str = eqx.field(static=True)
    names: str = eqx.field(static=True)
    token_axis: str | None = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, query_dim: int, *, cross_attention_dim: int | None = None, heads: int, dim_head: int,
                 bias: bool = False, out_bias: bool = True, pre_only: bool = False, scale: float | None = None,
                 qk_norm: str | None = None, qk_norm_eps: float = 1e-6, qk_norm_affine: bool = True,
                 joint_dim: int | None = None, context_pre_only: bool = False, added_kv_dim: int | None = None,
                 added_proj_bias: bool = True, qkv: str = "separate", names: str = "diffusers",
                 token_axis: str | None = "seq", implementation: str | None = None, dtype=jnp.float32,
                 key: PRNGKeyArray):
        if names not in ATTENTION_NAMES:
            raise ValueError(f"Attention: names={names!r}; choose one of {list(ATTENTION_NAMES)}")
        if qk_norm is not None and qk_norm not in QK_NORMS:
            raise ValueError(f"Attention: qk_norm={qk_norm!r}; choose None or one of {QK_NORMS}")
        if joint_dim is not None and added_kv_dim is not None:
            raise ValueError("Attention: joint_dim (Flux's joint text stream) and added_kv_dim (Wan's image "
                             "keys/values) are exclusive; give one")
        if qkv not in QKV_LAYOUTS:
            raise ValueError(f"Attention: qkv={qkv!r}; choose one of {QKV_LAYOUTS}")
        if qkv != "separate" and (cross_attention_dim is not None or added_kv_dim is not None):
            raise ValueError(f"Attention: qkv={qkv!r} serves self- and joint attention; a cross-attention "
                             "(cross_attention_dim, added_kv_dim) projects its keys from another input: use "
                             "qkv='separate'")
        kq, kk, kv, ko = jax.random.split(key, 4)
        kaq, kak, kav, kao = jax.random.split(jax.random.fold_in(key, 1), 4)
        inner = heads * dim_head
        context_dim = cross_attention_dim or query_dim
        proj = dict(use_bias=bias, axes=("heads", "embed"), dtype=dtype)
        separate, fused = qkv == "separate", qkv == "fused"
        self.to_q = Linear(query_dim, inner, key=kq, **proj) if separate else None
        self.to_k = Linear(context_dim, inner, key=kk, **proj) if separate else None
        self.to_v = Linear(context_dim, inner, key=kv, **proj) if separate else None
        self.to_qkv = (Linear(query_dim, 3 * inner, use_bias=bias, axes=(None, "embed"), dtype=dtype, key=kq)
                       if fused else None)
        self.to_out = None if pre_only else Linear(inner, query_dim, use_bias=out_bias, axes=("embed", "heads"),
                                                   dtype=dtype, key=ko)

        def norm():
            if qk_norm is None:
                return None
            return RMSNorm(dim_head if qk_norm == "rms_norm" else inner, eps=qk_norm_eps,
                           elementwise_affine=qk_norm_affine, dtype=dtype)

        added = dict(use_bias=added_proj_bias, axes=("heads", "embed"), dtype=dtype)
        extra_dim = joint_dim or added_kv_dim
        self.norm_q, self.norm_k = norm(), norm()
        self.add_q_proj = Linear(joint_dim, inner, key=kaq, **added) if joint_dim and separate else None
        self.add_k_proj = Linear(extra_dim, inner, key=kak, **added) if extra_dim and separate else None
        self.add_v_proj = Linear(extra_dim, inner, key=kav, **added) if extra_dim and separate else None
        self.to_added_qkv = (Linear(joint_dim, 3 * inner, use_bias=added_proj_bias, axes=(None, "embed"),
                                    dtype=dtype, key=kaq) if joint_dim and fused else None)
        self.to_add_out = (Linear(inner, query_dim, use_bias=out_bias, axes=("embed", "heads"), dtype=dtype, key=kao)
                           if joint_dim and not context_pre_only else None)
        self.norm_added_q = norm() if joint_dim else None
        self.norm_added_k = norm() if extra_dim else None
        self.heads = heads
        self.scale = scale
        self.qk_norm = qk_norm
        self.qkv = qkv
        self.names = names
        self.token_axis = token_axis
        self.implementation = implementation

    def torch_renames(self) -> Mapping[str, str]:
        return ATTENTION_NAMES[self.names]

    def _heads(self, proj: Linear, norm: RMSNorm | None, x: Array) -> Array:
        """``proj(x)`` as ``[batch, seq, heads, head_dim]``, QK-normed before or after the split."""
        return self._split(proj(x), norm)

    def _split(self, y: Array, norm: RMSNorm | None) -> Array:
        """Projections ``[batch, seq, heads * head_dim]`` as ``[batch, seq, heads, head_dim]``, QK-normed."""
        if norm is not None and self.qk_norm == "rms_norm_across_heads":
            y = norm(y)
        y = y.reshape(*y.shape[:2], self.heads, -1)
        if norm is not None and self.qk_norm == "rms_norm":
            y = norm(y)
        return y

    def _project(self, fused: Linear | None, separate: tuple, norms: tuple, x: Array, ctx: Array):
        """Queries of ``x``, keys and values of ``ctx`` as ``[batch, seq, heads, head_dim]``, from one fused
        projection or three."""
        if self.qkv == "external":
            raise ValueError("Attention: built with qkv='external', it has no q/k/v projections; project them "
                             "yourself and call attend_projected(q, k, v)")
        if fused is not None:
            q, k, v = jnp.split(fused(x), 3, axis=-1)
        else:
            q, k, v = separate[0](x), separate[1](ctx), separate[2](ctx)
        return self._split(q, norms[0]), self._split(k, norms[1]), self._split(v, None)

    def _out(self, proj: Linear | None, out: Array) -> Array:
        out = out.reshape(*out.shape[:2], -1)
        if proj is None:
            return out
        return constrain(proj(out), self.plan, ("batch", self.token_axis, "embed"))

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"] | None = None,
                 *, mask: Bool[Array, "batch ctx_seq"] | None = None,
                 bias: Float[Array, "#batch #heads seq ctx_seq"] | None = None, causal: bool = False,
                 rope: Rope | None = None,
                 image_context: Float[Array, "batch img_seq img_dim"] | None = None) -> Float[Array, "batch seq out"]:
        """``mask`` (``True`` = attend) masks context tokens; ``bias`` is added to the logits (T5's relative
        position bias); ``causal`` lets token ``i`` see tokens ``j <= i``; ``rope`` rotates the queries and keys
        of a self-attention; ``image_context`` (with ``added_kv_dim``) is attended separately by the same queries
        through ``add_k_proj``/``add_v_proj`` and the result added (Wan I2V)."""
        if rope is not None and context is not None:
            raise ValueError("Attention: rope= rotates the queries and keys of a self-attention; this call has a "
                             "context (cross-attention), whose keys have no positions")
        added_kv = self.add_k_proj is not None and self.add_q_proj is None
        if image_context is not None and not added_kv:
            raise ValueError("Attention: image_context= needs an attention built with added_kv_dim (Wan I2V's "
                             "add_k_proj/add_v_proj)")
        if image_context is None and added_kv:
            raise ValueError("Attention: built with added_kv_dim, it needs image_context= (the image tokens its "
                             "add_k_proj/add_v_proj project)")
        if self.qkv == "fused" and context is not None:
            raise ValueError("Attention: qkv='fused' projects keys and values from x itself; a cross-attention "
                             "(context=) needs qkv='separate'")
        ctx = x if context is None else context
        q, k, v = self._project(self.to_qkv, (self.to_q, self.to_k, self.to_v), (self.norm_q, self.norm_k), x, ctx)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.attend(q, k, v, mask=mask, bias=bias, causal=causal)
        if image_context is not None:
            k_img = self._heads(self.add_k_proj, self.norm_added_k, image_context)
            v_img = self._heads(self.add_v_proj, None, image_context)
            out = out + self.attend(q, k_img, v_img)
        return self._out(self.to_out, out)

    @typechecked
    def joint(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"], *,
              rope: Rope | None = None, mask: Bool[Array, "batch joint_seq"] | None = None
              ) -> tuple[Float[Array, "batch seq out"], Float[Array, "batch ctx_seq ctx_out"]]:
        """Flux's joint attention: the ``context`` (text) tokens through the added projections and ``x`` (image)
        through ``to_q/k/v`` attend together over ``[context, x]``; ``rope`` covers that joint sequence and ``mask``
        (``True`` = attend) its keys. Returns ``(x_out, context_out)``, through ``to_out`` and ``to_add_out`` (each
        skipped if absent)."""
        if self.qkv != "external" and self.add_q_proj is None and self.to_added_qkv is None:
            raise ValueError("Attention.joint needs the joint projections: build the attention with joint_dim")
        n = context.shape[1]
        text = self._project(self.to_added_qkv, (self.add_q_proj, self.add_k_proj, self.add_v_proj),
                             (self.norm_added_q, self.norm_added_k), context, context)
        image = self._project(self.to_qkv, (self.to_q, self.to_k, self.to_v), (self.norm_q, self.norm_k), x, x)
        q, k, v = (jnp.concatenate([a, b], axis=1) for a, b in zip(text, image))
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.attend(q, k, v, mask=mask)
        return self._out(self.to_out, out[:, n:]), self._out(self.to_add_out, out[:, :n])

    @typechecked
    def attend_projected(self, q: Float[Array, "batch seq inner"], k: Float[Array, "batch ctx_seq inner"],
                         v: Float[Array, "batch ctx_seq inner"], *, rope: Rope | None = None,
                         mask: Bool[Array, "batch ctx_seq"] | None = None) -> Float[Array, "batch seq out"]:
        """Attention of queries, keys and values the caller projected (``[batch, seq, heads * head_dim]``): QK-norm,
        ``rope``, the kernel and ``to_out`` (if any), as :meth:`__call__` after its projections."""
        q, k, v = self._split(q, self.norm_q), self._split(k, self.norm_k), self._split(v, None)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        return self._out(self.to_out, self.attend(q, k, v, mask=mask))

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


__all__ = ["ATTENTION_NAMES", "QKV_LAYOUTS", "QK_NORMS", "Attention", "with_attention_implementation"]
