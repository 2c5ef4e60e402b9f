"""The blocks of :class:`~eqxdiff.models.ltx.LTXVideoTransformer3DModel`, with diffusers' names: the timestep
embedding (``time_embed``, diffusers' ``AdaLayerNormSingle``), the rotary tables of token positions, and the
transformer block (``transformer_blocks.N``).

The rotary tables are computed with ``jnp`` from positions that may be traced (the condition pipeline's
``video_coords``, a ``rope_interpolation_scale`` that follows the frame rate): the angles are formed with the float32
operations diffusers' ``LTXVideoRotaryPosEmbed`` uses, in its order, so they round as its do
(:func:`eqxdiff.nn.ltx_rope` is the NumPy form for concrete positions; the two agree to a float32 cosine's rounding).
"""

from collections.abc import Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import nn
from .._typing import Array, Bool, Float, Int, PRNGKeyArray, typechecked
from ..core import Plan, constrain

TOKENS = ("batch", "seq", "embed")  # video tokens: split over the mesh's context axis
ROPE_BASE = (20, 2048, 2048)  # diffusers' base_num_frames, base_height, base_width
ROPE_THETA = 10000.0

# -- positions and rotary tables --------------------------------------------------------------------------------------


def grid_positions(grid: tuple[int, int, int], rope_interpolation_scale=None, *, patch_size: int = 1,
                   patch_size_t: int = 1) -> Float[Array, "1 seq 3"]:
    """Token positions ``[1, f * h * w, 3]`` (frame, row, column; tokens in that order) of a token ``grid``:
    the raw indices, or with ``rope_interpolation_scale`` ``(t, s, s)`` (the pipelines' ``(vae_temporal / frame_rate,
    vae_spatial, vae_spatial)``; floats or traced scalars) ``index * scale * patch / base``, base ``(20, 2048,
    2048)``, in float32 as diffusers forms them."""
    f, h, w = grid
    mesh = jnp.meshgrid(*(jnp.arange(n, dtype=jnp.float32) for n in (f, h, w)), indexing="ij")
    pos = jnp.stack([m.reshape(-1) for m in mesh], axis=-1)[None]
    if rope_interpolation_scale is None:
        return pos
    scale = jnp.stack([jnp.asarray(s, jnp.float32).reshape(()) for s in rope_interpolation_scale])
    patch = jnp.asarray([patch_size_t, patch_size, patch_size], jnp.float32)
    return pos * scale * patch / jnp.asarray(ROPE_BASE, jnp.float32)


def coords_positions(video_coords: Float[Array, "batch 3 seq"] | Int[Array, "batch 3 seq"]
                     ) -> Float[Array, "batch seq 3"]:
    """Positions ``[batch, seq, 3]`` of explicit ``video_coords [batch, 3, seq]`` (the condition pipeline's, in
    latent-pixel units): each axis divided by the base ``(20, 2048, 2048)``."""
    coords = jnp.swapaxes(jnp.asarray(video_coords, jnp.float32), 1, 2)
    return coords / jnp.asarray(ROPE_BASE, jnp.float32)


def rotary_tables(positions: Float[Array, "#batch seq 3"], dim: int, theta: float = ROPE_THETA) -> nn.Rope:
    """LTX-Video's rotary tables ``[batch, seq, dim]`` (``dim`` = the model width: applied before the head split):
    ``dim // 6`` frequencies per axis times ``2 * position - 1``, interleaved (frequency, then axis), each angle
    twice, padded in front with ``cos = 1, sin = 0`` when ``dim % 6 != 0``."""
    freqs = jnp.asarray(nn.ltx_rope_frequencies(dim, theta))
    angles = freqs * (positions.astype(jnp.float32)[..., None] * 2.0 - 1.0)  # [b, seq, 3, dim // 6]
    angles = jnp.swapaxes(angles, -1, -2).reshape(*angles.shape[:2], -1)
    cos, sin = (jnp.repeat(fn(angles), 2, axis=-1) for fn in (jnp.cos, jnp.sin))
    pad = dim % 6
    if pad:
        cos = jnp.concatenate([jnp.ones((*cos.shape[:2], pad), jnp.float32), cos], axis=-1)
        sin = jnp.concatenate([jnp.zeros((*sin.shape[:2], pad), jnp.float32), sin], axis=-1)
    return nn.Rope(cos, sin)


# -- timestep embedding -----------------------------------------------------------------------------------------------


class LTXTimeEmbedding(eqx.Module):
    """``time_embed`` (diffusers' ``AdaLayerNormSingle`` without additional conditions): the raw timestep's 256-channel
    sinusoid (cos first) through ``emb.timestep_embedder`` gives ``embedded_timestep``; ``linear(silu(...))`` the
    blocks' six modulation vectors, flat ``[..., 6 * dim]``."""

    TORCH_RENAMES: ClassVar[dict[str, str]] = {"timestep_embedder": "emb.timestep_embedder"}
    FREQ_DIM: ClassVar[int] = 256

    timestep_embedder: nn.TimestepEmbedding
    linear: nn.Linear

    def __init__(self, dim: int, *, dtype, key: PRNGKeyArray):
        ke, kl = jax.random.split(key)
        self.timestep_embedder = nn.TimestepEmbedding(self.FREQ_DIM, dim, dtype=dtype, key=ke)
        self.linear = nn.Linear(dim, 6 * dim, axes=("modulation", "embed"), dtype=dtype, key=kl)

    @typechecked
    def __call__(self, timestep: Float[Array, "batch *seq"] | Int[Array, "batch *seq"], dtype
                 ) -> tuple[Float[Array, "batch *seq six_dim"], Float[Array, "batch *seq dim"]]:
        """``(temb, embedded_timestep)`` of timesteps ``[batch]`` or per token ``[batch, seq]``, in ``dtype``."""
        sinusoid = nn.timestep_embedding(timestep, self.FREQ_DIM, flip_sin_to_cos=True, freq_shift=0)
        embedded = self.timestep_embedder(sinusoid.astype(dtype))
        return self.linear(nn.silu(embedded)), embedded


# -- transformer block ------------------------------------------------------------------------------------------------


def _qk_norm(dim: int, dtype) -> nn.AcrossHeads:
    """LTX's QK norm: an affine RMSNorm over the whole inner dimension, eps 1e-5 (``rms_norm_across_heads``)."""
    return nn.AcrossHeads(nn.RMSNorm(dim, eps=1e-5, dtype=dtype))


class LTXVideoTransformerBlock(eqx.Module):
    """An LTX-Video block: RMS-normed (``norm1``, no affine unless configured) and modulated self-attention with RoPE
    and QK RMSNorm across heads, gated residual; cross-attention of the **un-normalised** tokens to the caption
    (QK-normed too; masked keys; no gate); ``norm2``, modulated tanh-GELU feed-forward, gated residual. The six
    vectors are ``scale_shift_table + temb`` in the order shift, scale, gate (attention), shift, scale, gate
    (feed-forward); ``temb`` is one per sample ``[batch, 1, 6 * dim]`` or one per token ``[batch, seq, 6 * dim]``."""

    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("ltx_self_attention", "ltx_cross_attention")

    norm1: nn.RMSNorm
    attn1: nn.SelfAttention
    norm2: nn.RMSNorm
    attn2: nn.CrossAttention
    ff: nn.FeedForward
    scale_shift_table: nn.ScaleShiftTable
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, dim: int, heads: int, head_dim: int, *, activation: str = "gelu-approximate",
                 bias: bool = True, out_bias: bool = True, eps: float = 1e-6, elementwise_affine: bool = False,
                 dtype, key: PRNGKeyArray):
        k1, k2, kf, kt = jax.random.split(key, 4)
        common = dict(heads=heads, dim_head=head_dim, bias=bias, out_bias=out_bias,
                      qk_norm=_qk_norm(heads * head_dim, dtype), dtype=dtype)
        self.norm1 = nn.RMSNorm(dim, eps=eps, elementwise_affine=elementwise_affine, dtype=dtype)
        self.attn1 = nn.SelfAttention(dim, **common, key=k1)
        self.norm2 = nn.RMSNorm(dim, eps=eps, elementwise_affine=elementwise_affine, dtype=dtype)
        self.attn2 = nn.CrossAttention(dim, dim, **common, key=k2)
        self.ff = nn.FeedForward(dim, activation=activation, dtype=dtype, key=kf)
        self.scale_shift_table = nn.ScaleShiftTable(6, dim, dtype=dtype, key=kt)

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq dim"],
                 temb: Float[Array, "batch tseq six_dim"], rope: nn.Rope,
                 mask: Bool[Array, "batch ctx_seq"] | None = None) -> Float[Array, "batch seq dim"]:
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.scale_shift_table(temb)
        h = nn.modulate(self.norm1(x), shift, scale)
        attn = checkpoint_name(self.attn1(h, rope=rope), "ltx_self_attention")
        x = constrain(nn.gated_residual(x, attn, gate), self.plan, TOKENS)
        cross = checkpoint_name(self.attn2(x, context, mask=mask), "ltx_cross_attention")
        x = constrain(x + cross, self.plan, TOKENS)
        h = nn.modulate(self.norm2(x), shift_mlp, scale_mlp)
        return constrain(nn.gated_residual(x, self.ff(h), gate_mlp), self.plan, TOKENS)


def attention_mask(mask: Array | None, batch: int, length: int) -> Bool[Array, "batch ctx_seq"] | None:
    """The caption's key mask (``True`` = attend) from diffusers' ``encoder_attention_mask`` ``[batch, ctx_seq]``
    (1 = a token, 0 = padding; diffusers adds ``(1 - mask) * -10000`` to the logits). A sample whose mask is all
    zeros attends to every token, as the constant ``-10000`` on every logit makes diffusers do."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.shape != (batch, length):
        raise ValueError(f"LTXVideoTransformer3DModel: encoder_attention_mask of shape {mask.shape} for {batch} "
                         f"captions of {length} tokens; give [batch, text_seq] = {(batch, length)} (1 = token, "
                         "0 = padding)")
    keep = mask != 0
    return keep | ~jnp.any(keep, axis=1, keepdims=True)


def broadcast_timestep(timestep, batch: int, seq: int) -> Array:
    """``timestep`` as ``[batch, 1]`` (one per sample) or ``[batch, seq]`` (one per token, in the packed order)."""
    t = nn.token_timesteps(timestep, batch, seq, who="LTXVideoTransformer3DModel")
    return t if t.ndim == 2 else t[:, None]


def check_scale(scale: Sequence | Array | None) -> None:
    if scale is not None and len(scale) != 3:
        raise ValueError(f"LTXVideoTransformer3DModel: rope_interpolation_scale={scale!r}; give three values "
                         "(frames, height, width): (vae_temporal_compression / frame_rate, vae_spatial_compression, "
                         "vae_spatial_compression)")


__all__ = ["LTXTimeEmbedding", "LTXVideoTransformerBlock", "coords_positions", "grid_positions", "rotary_tables"]
