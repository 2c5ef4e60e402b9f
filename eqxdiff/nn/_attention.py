"""The attention layers: small modules with diffusers' (or transformers') parameter names, each projecting its
queries, keys and values its own way and sharing :func:`~eqxdiff.nn.attend` for the rest (QK norm, RoPE, the
kernel, the output projection).

- :class:`SelfAttention`: ``to_q``, ``to_k``, ``to_v`` of the same tokens (the UNet's ``attn1``, the VAE's, CLIP's,
  T5's, Flux's single block unfused (``pre_only``: no ``to_out``), Wan's and LTX-Video's ``attn1``).
- :class:`CrossAttention`: queries of the tokens, keys and values of a ``context`` (the UNet's ``attn2``, Wan's).
- :class:`AddedKVAttention`: a cross-attention whose queries also attend to image tokens through their own
  ``add_k_proj`` / ``add_v_proj`` (and ``norm_added_k``), the two attentions summed (Wan 2.1 image-to-video).
- :class:`JointAttention`, :class:`FusedJointAttention`: two streams attended together over ``[context, x]`` (Flux's
  double blocks), the text through ``add_q_proj``, ``add_k_proj``, ``add_v_proj`` and ``to_add_out``; fused
  (``FusedJointAttention(joint)``), one ``to_qkv`` and one ``to_added_qkv`` matmul (diffusers'
  ``fuse_qkv_projections`` names and ``[q; k; v]`` layout; a checkpoint's separate tensors are concatenated at load
  time by conversion rules). Fused projections mix q, k and v on their output axis, so they are replicated over a
  ``tensor`` mesh axis: tensor parallelism wants them separate.
- :class:`ProjectedAttention`: no q/k/v projections; the caller projects (Flux's single block fused with its MLP,
  ``torch.nn.MultiheadAttention``'s ``in_proj``).

QK norms (``qk_norm=``) are modules given at construction (see :mod:`eqxdiff.nn._attend`), or ``None``; a layer
holds the one it is given as ``norm_q``, ``norm_k`` (and ``norm_added_q``, ``norm_added_k``), each a parameter of
its own once built or loaded.
"""

import abc

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Bool, Float, PRNGKeyArray, typechecked
from ._attend import AbstractAttention, QKNorm, attend, check_qk_norm
from ._layers import Linear
from ._rope import Rope

_IN = ("heads", "embed")  # q/k/v projections: output over the heads
_OUT = ("embed", "heads")
_FUSED = (None, "embed")  # [q; k; v] on the output axis: not split over heads


def _linear(din: int, dout: int, bias: bool, axes, dtype, key) -> Linear:
    return Linear(din, dout, use_bias=bias, axes=axes, dtype=dtype, key=key)


def _qkv_layers(dim: int, context_dim: int, inner: int, *, bias: bool, out_bias: bool | None, dtype, key):
    """``to_q`` (of ``dim``), ``to_k``, ``to_v`` (of ``context_dim``) and ``to_out`` (none if ``out_bias`` is
    ``None``: ``pre_only``)."""
    kq, kk, kv, ko = jax.random.split(key, 4)
    to_out = None if out_bias is None else _linear(inner, dim, out_bias, _OUT, dtype, ko)
    return (_linear(dim, inner, bias, _IN, dtype, kq), _linear(context_dim, inner, bias, _IN, dtype, kk),
            _linear(context_dim, inner, bias, _IN, dtype, kv), to_out)


def _added_key(key: PRNGKeyArray):
    """The keys of the added (context-stream) projections: ``add_q_proj``, ``add_k_proj``, ``add_v_proj``,
    ``to_add_out``."""
    return jax.random.split(jax.random.fold_in(key, 1), 4)


def _norm(norm: QKNorm | None, x: Array) -> Array:
    return x if norm is None else norm(x)


def _fuse(parts: tuple[Linear, ...]) -> Linear:
    """One projection whose output is the ``parts``' outputs concatenated (their weights and biases concatenated on
    the output axis); its output mixes them, so it is not split over the heads."""
    first = parts[0]
    shape = eqx.filter_eval_shape(lambda: Linear(first.in_features, sum(p.out_features for p in parts),
                                                 use_bias=first.bias is not None, axes=_FUSED,
                                                 dtype=first.weight.dtype, key=jax.random.key(0)))
    weight = jnp.concatenate([p.weight for p in parts])
    if first.bias is None:
        return eqx.tree_at(lambda lin: lin.weight, shape, weight)
    return eqx.tree_at(lambda lin: (lin.weight, lin.bias), shape, (weight, jnp.concatenate([p.bias for p in parts])))


class SelfAttention(AbstractAttention):
    """Self-attention on ``[batch, seq, dim]`` tokens: ``to_q``, ``to_k``, ``to_v``, :func:`attend`, ``to_out``
    (``pre_only``: none). ``bias`` (``bias=`` of the call: T5's relative positions; the constructor's ``bias``: of the
    q/k/v projections), ``causal`` (CLIP's text tower) and ``rope`` (the diffusion transformers) as :func:`attend`.
    Settings as :class:`~eqxdiff.nn.AbstractAttention`; ``qk_norm`` a QK norm module or ``None``."""

    to_q: Linear
    to_k: Linear
    to_v: Linear
    to_out: Linear | None
    norm_q: QKNorm | None
    norm_k: QKNorm | None

    def __init__(self, dim: int, *, heads: int, dim_head: int, bias: bool = False, out_bias: bool = True,
                 pre_only: bool = False, scale: float | None = None, qk_norm: QKNorm | None = None,
                 names: str = "diffusers", token_axis: str | None = "seq", implementation: str | None = None,
                 dtype=jnp.float32, key: PRNGKeyArray):
        self._init_settings(heads=heads, scale=scale, names=names, token_axis=token_axis,
                            implementation=implementation)
        self.to_q, self.to_k, self.to_v, self.to_out = _qkv_layers(
            dim, dim, heads * dim_head, bias=bias, out_bias=None if pre_only else out_bias, dtype=dtype, key=key)
        self.norm_q = self.norm_k = check_qk_norm(qk_norm, heads, dim_head, "SelfAttention")

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], *, mask: Bool[Array, "batch seq"] | None = None,
                 bias: Float[Array, "#batch #heads seq seq"] | None = None, causal: bool = False,
                 rope: Rope | None = None) -> Float[Array, "batch seq out"]:
        q, k, v = (self._heads(proj(x)) for proj in (self.to_q, self.to_k, self.to_v))
        return attend(self, q, k, v, norm_q=self.norm_q, norm_k=self.norm_k, rope=rope, to_out=self.to_out,
                      mask=mask, bias=bias, causal=causal)


class CrossAttention(AbstractAttention):
    """Cross-attention: queries of ``x`` (``to_q``), keys and values of ``context`` ``[batch, ctx_seq,
    context_dim]`` (``to_k``, ``to_v``), ``mask`` (``True`` = attend) over the context tokens, ``to_out``. The
    context tokens have no positions, so no RoPE. Settings as :class:`SelfAttention`."""

    to_q: Linear
    to_k: Linear
    to_v: Linear
    to_out: Linear
    norm_q: QKNorm | None
    norm_k: QKNorm | None

    def __init__(self, dim: int, context_dim: int, *, heads: int, dim_head: int, bias: bool = False,
                 out_bias: bool = True, scale: float | None = None, qk_norm: QKNorm | None = None,
                 names: str = "diffusers", token_axis: str | None = "seq", implementation: str | None = None,
                 dtype=jnp.float32, key: PRNGKeyArray):
        self._init_settings(heads=heads, scale=scale, names=names, token_axis=token_axis,
                            implementation=implementation)
        self.to_q, self.to_k, self.to_v, self.to_out = _qkv_layers(
            dim, context_dim, heads * dim_head, bias=bias, out_bias=out_bias, dtype=dtype, key=key)
        self.norm_q = self.norm_k = check_qk_norm(qk_norm, heads, dim_head, "CrossAttention")

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"], *,
                 mask: Bool[Array, "batch ctx_seq"] | None = None) -> Float[Array, "batch seq out"]:
        q, k, v = self._heads(self.to_q(x)), self._heads(self.to_k(context)), self._heads(self.to_v(context))
        return attend(self, q, k, v, norm_q=self.norm_q, norm_k=self.norm_k, to_out=self.to_out, mask=mask)


class AddedKVAttention(AbstractAttention):
    """A cross-attention to ``context`` (text) whose queries also attend, separately, to ``image_context`` tokens
    ``[batch, img_seq, added_kv_dim]`` through ``add_k_proj`` / ``add_v_proj`` (keys normed by ``norm_added_k``);
    the two attentions are summed before ``to_out``: Wan 2.1 image-to-video's ``attn2``. ``added_proj_bias`` is the
    bias of the added projections; the rest as :class:`CrossAttention`."""

    to_q: Linear
    to_k: Linear
    to_v: Linear
    to_out: Linear
    add_k_proj: Linear
    add_v_proj: Linear
    norm_q: QKNorm | None
    norm_k: QKNorm | None
    norm_added_k: QKNorm | None

    def __init__(self, dim: int, context_dim: int, added_kv_dim: int, *, heads: int, dim_head: int,
                 bias: bool = False, out_bias: bool = True, added_proj_bias: bool = True, scale: float | None = None,
                 qk_norm: QKNorm | None = None, names: str = "diffusers", token_axis: str | None = "seq",
                 implementation: str | None = None, dtype=jnp.float32, key: PRNGKeyArray):
        self._init_settings(heads=heads, scale=scale, names=names, token_axis=token_axis,
                            implementation=implementation)
        inner = heads * dim_head
        self.to_q, self.to_k, self.to_v, self.to_out = _qkv_layers(
            dim, context_dim, inner, bias=bias, out_bias=out_bias, dtype=dtype, key=key)
        _, kak, kav, _ = _added_key(key)
        self.add_k_proj = _linear(added_kv_dim, inner, added_proj_bias, _IN, dtype, kak)
        self.add_v_proj = _linear(added_kv_dim, inner, added_proj_bias, _IN, dtype, kav)
        self.norm_q = self.norm_k = self.norm_added_k = check_qk_norm(qk_norm, heads, dim_head, "AddedKVAttention")

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"],
                 image_context: Float[Array, "batch img_seq img_dim"], *,
                 mask: Bool[Array, "batch ctx_seq"] | None = None) -> Float[Array, "batch seq out"]:
        q = self._heads(self.to_q(x))
        k, v = self._heads(self.to_k(context)), self._heads(self.to_v(context))
        k_img, v_img = self._heads(self.add_k_proj(image_context)), self._heads(self.add_v_proj(image_context))
        text = attend(self, q, k, v, norm_q=self.norm_q, norm_k=self.norm_k, mask=mask)
        image = attend(self, q, k_img, v_img, norm_q=self.norm_q, norm_k=self.norm_added_k)
        return self._output(self.to_out, text + image)


class AbstractJointAttention(AbstractAttention):
    """Flux's joint attention: the ``context`` (text) tokens through the added projections and ``x`` (image)
    tokens through ``to_q/k/v``, each stream QK-normed by its own norms, attend together over ``[context, x]``;
    ``rope`` covers that joint sequence and ``mask`` (``True`` = attend) its keys. Returns ``(x_out,
    context_out)`` through ``to_out`` and ``to_add_out`` (``context_pre_only``: none). The final classes differ only
    in how they project (:meth:`project`); the outputs and QK norms they share are declared here."""

    to_out: Linear
    to_add_out: Linear | None
    norm_q: QKNorm | None
    norm_k: QKNorm | None
    norm_added_q: QKNorm | None
    norm_added_k: QKNorm | None

    @abc.abstractmethod
    def project(self, x: Array, context: Array) -> tuple[tuple[Array, Array, Array], tuple[Array, Array, Array]]:
        """``((q, k, v) of context, (q, k, v) of x)``, each ``[batch, seq, heads * head_dim]``."""

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"], *,
                 rope: Rope | None = None, mask: Bool[Array, "batch joint_seq"] | None = None
                 ) -> tuple[Float[Array, "batch seq out"], Float[Array, "batch ctx_seq ctx_out"]]:
        (tq, tk, tv), (iq, ik, iv) = (tuple(map(self._heads, s)) for s in self.project(x, context))
        q = jnp.concatenate([_norm(self.norm_added_q, tq), _norm(self.norm_q, iq)], axis=1)
        k = jnp.concatenate([_norm(self.norm_added_k, tk), _norm(self.norm_k, ik)], axis=1)
        out = attend(self, q, k, jnp.concatenate([tv, iv], axis=1), rope=rope, mask=mask)
        n = context.shape[1]
        return self._output(self.to_out, out[:, n:]), self._output(self.to_add_out, out[:, :n])


class JointAttention(AbstractJointAttention):
    """Joint attention (:class:`AbstractJointAttention`) with separate projections: ``to_q``, ``to_k``, ``to_v`` of
    ``x`` ``[batch, seq, dim]``, ``add_q_proj``, ``add_k_proj``, ``add_v_proj`` of ``context`` ``[batch, ctx_seq,
    context_dim]`` (bias ``added_proj_bias``). Settings as :class:`SelfAttention`; :class:`FusedJointAttention`
    fuses it."""

    to_q: Linear
    to_k: Linear
    to_v: Linear
    add_q_proj: Linear
    add_k_proj: Linear
    add_v_proj: Linear

    def __init__(self, dim: int, context_dim: int, *, heads: int, dim_head: int, bias: bool = False,
                 out_bias: bool = True, added_proj_bias: bool = True, context_pre_only: bool = False,
                 scale: float | None = None, qk_norm: QKNorm | None = None, names: str = "diffusers",
                 token_axis: str | None = "seq", implementation: str | None = None, dtype=jnp.float32,
                 key: PRNGKeyArray):
        self._init_settings(heads=heads, scale=scale, names=names, token_axis=token_axis,
                            implementation=implementation)
        inner = heads * dim_head
        self.to_q, self.to_k, self.to_v, self.to_out = _qkv_layers(dim, dim, inner, bias=bias, out_bias=out_bias,
                                                                   dtype=dtype, key=key)
        kaq, kak, kav, kao = _added_key(key)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (
            _linear(context_dim, inner, added_proj_bias, _IN, dtype, k) for k in (kaq, kak, kav))
        self.to_add_out = None if context_pre_only else _linear(inner, dim, out_bias, _OUT, dtype, kao)
        norm = check_qk_norm(qk_norm, heads, dim_head, "JointAttention")
        self.norm_q = self.norm_k = self.norm_added_q = self.norm_added_k = norm

    def project(self, x: Array, context: Array):
        return ((self.add_q_proj(context), self.add_k_proj(context), self.add_v_proj(context)),
                (self.to_q(x), self.to_k(x), self.to_v(x)))


class FusedJointAttention(AbstractJointAttention):
    """Joint attention (:class:`AbstractJointAttention`) with fused projections: one ``to_qkv`` of ``x`` and one
    ``to_added_qkv`` of ``context``, each ``[q; k; v]`` on the output axis, as diffusers' ``fuse_qkv_projections``
    makes them: ``FusedJointAttention(joint)`` concatenates a :class:`JointAttention`'s projections (abstract ones
    too: a model built under ``eqx.filter_eval_shape`` loads a checkpoint's separate tensors into the fused ones by
    conversion rules) and keeps its outputs, QK norms and settings. The same numbers as ``joint``."""

    to_qkv: Linear
    to_added_qkv: Linear

    def __init__(self, joint: JointAttention):
        self._init_settings(heads=joint.heads, scale=joint.scale, names=joint.names, token_axis=joint.token_axis,
                            implementation=joint.implementation)
        self.to_qkv = _fuse((joint.to_q, joint.to_k, joint.to_v))
        self.to_added_qkv = _fuse((joint.add_q_proj, joint.add_k_proj, joint.add_v_proj))
        self.to_out, self.to_add_out = joint.to_out, joint.to_add_out
        self.norm_q, self.norm_k = joint.norm_q, joint.norm_k
        self.norm_added_q, self.norm_added_k = joint.norm_added_q, joint.norm_added_k

    def project(self, x: Array, context: Array):
        return tuple(jnp.split(self.to_added_qkv(context), 3, axis=-1)), tuple(jnp.split(self.to_qkv(x), 3, axis=-1))


class ProjectedAttention(AbstractAttention):
    """Attention of queries, keys and values the caller projected, ``[batch, seq, heads * head_dim]``: QK norm,
    ``rope``, the kernel and ``to_out`` (``pre_only``: none) by :func:`attend`. For projections fused with other
    work: Flux's single block (q, k, v and the MLP's input in one matmul), ``torch.nn.MultiheadAttention``'s
    ``in_proj``. Settings as :class:`SelfAttention`."""

    to_out: Linear | None
    norm_q: QKNorm | None
    norm_k: QKNorm | None

    def __init__(self, dim: int, *, heads: int, dim_head: int, out_bias: bool = True, pre_only: bool = False,
                 scale: float | None = None, qk_norm: QKNorm | None = None, names: str = "diffusers",
                 token_axis: str | None = "seq", implementation: str | None = None, dtype=jnp.float32,
                 key: PRNGKeyArray):
        self._init_settings(heads=heads, scale=scale, names=names, token_axis=token_axis,
                            implementation=implementation)
        ko = jax.random.split(key, 4)[3]
        self.to_out = None if pre_only else _linear(heads * dim_head, dim, out_bias, _OUT, dtype, ko)
        self.norm_q = self.norm_k = check_qk_norm(qk_norm, heads, dim_head, "ProjectedAttention")

    @typechecked
    def __call__(self, q: Float[Array, "batch seq inner"], k: Float[Array, "batch kv_seq inner"],
                 v: Float[Array, "batch kv_seq inner"], *, rope: Rope | None = None,
                 mask: Bool[Array, "batch kv_seq"] | None = None) -> Float[Array, "batch seq out"]:
        return attend(self, self._heads(q), self._heads(k), self._heads(v), norm_q=self.norm_q, norm_k=self.norm_k,
                      rope=rope, to_out=self.to_out, mask=mask)


__all__ = ["AbstractJointAttention", "AddedKVAttention", "CrossAttention", "FusedJointAttention", "JointAttention",
           "ProjectedAttention", "SelfAttention"]
