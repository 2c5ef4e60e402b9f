"""The blocks of :class:`~eqxdiff.models.wan.WanTransformer3DModel`, with diffusers' names: the condition embedder
(``condition_embedder``: time, text and optional image embeddings), the image embedder of Wan 2.1 image-to-video
(``condition_embedder.image_embedder``) and the transformer block (``blocks.N``).

A block's cross-attention keys and values depend only on the prompt (and image), not on the video tokens or the
timestep: :meth:`WanTransformerBlock.cross_kv` computes them once (a :class:`CrossKV`), and the block's call takes
them instead of the context (``kv=``), as a denoising loop does across its steps.
"""

from typing import ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import nn
from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ..core import Plan, constrain

TOKENS = ("batch", "seq", "embed")  # video tokens: split over the mesh's context axis


class CrossKV(NamedTuple):
    """The cross-attention keys and values of a prompt (and image), ``[..., batch, ctx_seq, heads, head_dim]``:
    ``k`` (QK-normed) and ``v`` of the text (and, without added k/v, of the image tokens before it); ``k_img`` /
    ``v_img`` of the image tokens through the added k/v projections (Wan 2.1 image-to-video), else ``None``. A
    model's (:meth:`~eqxdiff.models.wan.WanTransformer3DModel.cross_attention_kv`) has a leading layers axis."""

    k: Array
    v: Array
    k_img: Array | None = None
    v_img: Array | None = None


class WanImageEmbedding(eqx.Module):
    """``image_embedder``: CLIP image tokens -> model width: ``norm1`` (LayerNorm, eps 1e-5), a GELU MLP (``ff``,
    hidden width = input width), ``norm2``; with ``pos_embed`` (first-last-frame models), a learned table
    ``[1, pos_embed_seq_len, image_dim]`` added first."""

    PARAM_AXES: ClassVar = {"pos_embed": (None, "position", "embed")}

    norm1: nn.LayerNorm
    ff: nn.FeedForward
    norm2: nn.LayerNorm
    pos_embed: Float[Array, "1 pos image_dim"] | None

    def __init__(self, in_features: int, out_features: int, pos_embed_seq_len: int | None = None, *, dtype,
                 key: PRNGKeyArray):
        kf, kp = jax.random.split(key)
        self.norm1 = nn.LayerNorm(in_features, eps=1e-5, dtype=dtype)
        self.ff = nn.FeedForward(in_features, out_features, mult=1, activation="gelu", dtype=dtype, key=kf)
        self.norm2 = nn.LayerNorm(out_features, eps=1e-5, dtype=dtype)
        self.pos_embed = (None if pos_embed_seq_len is None else
                          nn.init_normal(kp, (1, pos_embed_seq_len, in_features), dtype) * 0.02)

    @typechecked
    def __call__(self, image: Float[Array, "b img_seq image_dim"]) -> Float[Array, "batch seq dim"]:
        if self.pos_embed is not None:
            length, dim = self.pos_embed.shape[1:]
            if image.shape[1] != length:  # diffusers' view(-1, 2 * seq_len, dim): two images' tokens per sample
                if 2 * image.shape[1] != length or image.shape[0] % 2:
                    raise ValueError(f"WanImageEmbedding: image tokens of shape {image.shape} for a pos_embed of "
                                     f"{length} tokens; give [batch, {length}, {dim}] or, as diffusers' "
                                     f"first-last-frame pipeline, [2 * batch, {length // 2}, {dim}] (first and last "
                                     "frame of each sample in turn)")
                image = image.reshape(-1, length, dim)
            image = image + self.pos_embed.astype(image.dtype)
        return self.norm2(self.ff(self.norm1(image)))


class WanTimeTextImageEmbedding(eqx.Module):
    """``condition_embedder``: the timestep's sinusoid (``freq_dim`` channels of the raw timestep, cos first) through
    ``time_embedder`` gives ``temb``; ``time_proj(silu(temb))`` the blocks' six modulation vectors; ``text_embedder``
    (tanh-GELU MLP) projects the text, ``image_embedder`` (optional) the image tokens."""

    time_embedder: nn.TimestepEmbedding
    time_proj: nn.Linear
    text_embedder: nn.TextProjection
    image_embedder: WanImageEmbedding | None
    freq_dim: int = eqx.field(static=True)

    def __init__(self, dim: int, freq_dim: int, text_dim: int, image_dim: int | None = None,
                 pos_embed_seq_len: int | None = None, *, dtype, key: PRNGKeyArray):
        kt, kp, kx, ki = jax.random.split(key, 4)
        self.time_embedder = nn.TimestepEmbedding(freq_dim, dim, dtype=dtype, key=kt)
        self.time_proj = nn.Linear(dim, 6 * dim, axes=("modulation", "embed"), dtype=dtype, key=kp)
        self.text_embedder = nn.TextProjection(text_dim, dim, act_fn="gelu_tanh", dtype=dtype, key=kx)
        self.image_embedder = (None if image_dim is None else
                               WanImageEmbedding(image_dim, dim, pos_embed_seq_len, dtype=dtype, key=ki))
        self.freq_dim = freq_dim

    @typechecked
    def time(self, timestep: Float[Array, "batch *seq"] | Int[Array, "batch *seq"], dtype
             ) -> tuple[Float[Array, "batch *seq dim"], Float[Array, "batch *seq six_dim"]]:
        """``(temb, timestep_proj)`` of timesteps ``[batch]`` or per token ``[batch, seq]``, in ``dtype``."""
        sinusoid = nn.timestep_embedding(timestep, self.freq_dim, flip_sin_to_cos=True, freq_shift=0)
        temb = self.time_embedder(sinusoid.astype(self.time_embedder.linear_1.weight.dtype)).astype(dtype)
        return temb, self.time_proj(nn.silu(temb))


def _heads(attn: nn.AbstractAttention, y: Array) -> Array:
    return y.reshape(*y.shape[:2], attn.heads, -1)


def _qk_norm(dim: int, eps: float, dtype) -> nn.AcrossHeads:
    """Wan's QK norm: RMSNorm over the whole inner dimension (diffusers' ``rms_norm_across_heads``)."""
    return nn.AcrossHeads(nn.RMSNorm(dim, eps=eps, dtype=dtype))


class WanTransformerBlock(eqx.Module):
    """A Wan block: modulated self-attention (RoPE, QK RMSNorm across heads) with a gated residual, cross-attention
    to the text (``norm2``: affine LayerNorm iff ``cross_attn_norm``; no gate), modulated tanh-GELU feed-forward with
    a gated residual. The six modulation vectors are ``scale_shift_table + timestep_proj`` in the order shift, scale,
    gate (self-attention), shift, scale, gate (feed-forward). ``attn2`` is an :class:`~eqxdiff.nn.AddedKVAttention`
    for image-to-video models with ``added_kv_proj_dim`` (the image tokens through ``add_k_proj`` / ``add_v_proj``),
    else a :class:`~eqxdiff.nn.CrossAttention`."""

    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("wan_self_attention", "wan_cross_attention")

    norm1: nn.LayerNorm
    attn1: nn.SelfAttention
    norm2: nn.LayerNorm | None
    attn2: nn.CrossAttention | nn.AddedKVAttention
    ffn: nn.FeedForward
    norm3: nn.LayerNorm
    scale_shift_table: nn.ScaleShiftTable
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, dim: int, ffn_dim: int, heads: int, *, cross_attn_norm: bool, eps: float,
                 added_kv_proj_dim: int | None, dtype, key: PRNGKeyArray):
        k1, k2, kf, kt = jax.random.split(key, 4)
        common = dict(heads=heads, dim_head=dim // heads, bias=True, qk_norm=_qk_norm(dim, eps, dtype), dtype=dtype)
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False, dtype=dtype)
        self.attn1 = nn.SelfAttention(dim, **common, key=k1)
        self.norm2 = nn.LayerNorm(dim, eps=eps, dtype=dtype) if cross_attn_norm else None
        self.attn2 = (nn.CrossAttention(dim, dim, **common, key=k2) if added_kv_proj_dim is None else
                      nn.AddedKVAttention(dim, dim, added_kv_proj_dim, **common, key=k2))
        self.ffn = nn.FeedForward(dim, inner_dim=ffn_dim, activation="gelu-approximate", dtype=dtype, key=kf)
        self.norm3 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False, dtype=dtype)
        self.scale_shift_table = nn.ScaleShiftTable(6, dim, shape=(1, 6, dim), dtype=dtype, key=kt)

    @property
    def added_kv(self) -> bool:
        return isinstance(self.attn2, nn.AddedKVAttention)

    def cross_kv(self, context: Float[Array, "batch ctx_seq dim"],
                 image_context: Float[Array, "batch img_seq dim"] | None = None) -> CrossKV:
        """The keys and values ``attn2`` computes from the (embedded) text ``context`` and image tokens."""
        a = self.attn2
        k, v = a.norm_k(_heads(a, a.to_k(context))), _heads(a, a.to_v(context))
        if not self.added_kv:
            return CrossKV(k, v)
        return CrossKV(k, v, a.norm_added_k(_heads(a, a.add_k_proj(image_context))),
                       _heads(a, a.add_v_proj(image_context)))

    def _cross_attention(self, x, context, image_context, kv: CrossKV | None):
        a = self.attn2
        if kv is None:
            return a(x, context, image_context) if self.added_kv else a(x, context)
        q = _heads(a, a.to_q(x))
        if not self.added_kv:
            return nn.attend(a, q, kv.k, kv.v, norm_q=a.norm_q, to_out=a.to_out)
        text = nn.attend(a, q, kv.k, kv.v, norm_q=a.norm_q)
        image = nn.attend(a, q, kv.k_img, kv.v_img, norm_q=a.norm_q)
        return constrain(a.to_out(text + image), self.plan, TOKENS)

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], timestep_proj: Float[Array, "batch *tseq six dim"],
                 rope: nn.Rope, context: Float[Array, "batch ctx_seq dim"] | None = None,
                 image_context: Float[Array, "batch img_seq dim"] | None = None, *,
                 kv: CrossKV | None = None) -> Float[Array, "batch seq dim"]:
        """``x``: video tokens; ``timestep_proj`` ``[batch, 6, dim]`` (or per token ``[batch, seq, 6, dim]``);
        ``rope``: the patch grid's tables; ``context`` (and, with added k/v, ``image_context``): the embedded text
        (image) tokens, or ``kv``: their keys and values from :meth:`cross_kv`."""
        shift, scale, gate, c_shift, c_scale, c_gate = self.scale_shift_table(timestep_proj)
        f32 = jnp.float32
        h = nn.modulate(self.norm1(x.astype(f32)), shift, scale).astype(x.dtype)
        attn = checkpoint_name(self.attn1(h, rope=rope), "wan_self_attention")
        x = constrain(nn.gated_residual(x, attn, gate), self.plan, TOKENS)

        h = x if self.norm2 is None else self.norm2(x.astype(f32)).astype(x.dtype)
        cross = checkpoint_name(self._cross_attention(h, context, image_context, kv), "wan_cross_attention")
        x = constrain(x + cross, self.plan, TOKENS)

        h = nn.modulate(self.norm3(x.astype(f32)), c_shift, c_scale).astype(x.dtype)
        return constrain(nn.gated_residual(x, self.ffn(h), c_gate), self.plan, TOKENS)


__all__ = ["CrossKV", "WanImageEmbedding", "WanTimeTextImageEmbedding", "WanTransformerBlock"]
