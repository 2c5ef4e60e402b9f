"""The blocks of :class:`~eqxdiff.models.flux.FluxTransformer2DModel`, with diffusers' names: the conditioning
embedder (``time_text_embed``), the double-stream block (``transformer_blocks.N``) and the single-stream block
(``single_transformer_blocks.N``), each built from :mod:`eqxdiff.nn` layers.

Both blocks can hold their projections fused (``fused=True``): the double block's attention then has one ``to_qkv``
and one ``to_added_qkv`` (diffusers' ``fuse_qkv_projections`` names), and the single block one ``to_qkv_mlp``
(queries, keys, values and the MLP's input in one matmul: Black Forest Labs' ``linear1``). The model declares how
those are concatenated from a checkpoint's separate tensors (``fused_tensors``), so the same files load either way.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import nn
from .._typing import Array, Float, PRNGKeyArray, typechecked

TIME_CHANNELS = 256  # the sinusoidal embedding's width (diffusers' Timesteps(num_channels=256))


def _clip_float16(x: Array) -> Array:
    """diffusers clips the residual streams to float16's range after each block when running in float16."""
    return jnp.clip(x, -65504, 65504) if x.dtype == jnp.float16 else x


class FluxTimeTextEmbedding(eqx.Module):
    """``time_text_embed``: the timestep's (and, for guidance-distilled models, the guidance scale's) sinusoidal
    embedding through an MLP, plus the pooled text embedding's projection (diffusers'
    ``CombinedTimestep[Guidance]TextProjEmbeddings``). Timestep and guidance arrive already multiplied by 1000 (in
    float32: the sinusoids are float32, cast to the activations' dtype for the MLPs)."""

    timestep_embedder: nn.TimestepEmbedding
    guidance_embedder: nn.TimestepEmbedding | None
    text_embedder: nn.TextProjection

    def __init__(self, dim: int, pooled_dim: int, *, guidance: bool, dtype, key: PRNGKeyArray):
        kt, kg, kp = jax.random.split(key, 3)
        self.timestep_embedder = nn.TimestepEmbedding(TIME_CHANNELS, dim, dtype=dtype, key=kt)
        self.guidance_embedder = nn.TimestepEmbedding(TIME_CHANNELS, dim, dtype=dtype, key=kg) if guidance else None
        self.text_embedder = nn.TextProjection(pooled_dim, dim, act_fn="silu", dtype=dtype, key=kp)

    @typechecked
    def __call__(self, timestep: Float[Array, " batch"], pooled: Float[Array, "batch pooled"],
                 guidance: Float[Array, " batch"] | None = None) -> Float[Array, "batch dim"]:
        def embed(embedder, t):
            sinusoid = nn.timestep_embedding(t, TIME_CHANNELS, flip_sin_to_cos=True, freq_shift=0)  # float32
            return embedder(sinusoid.astype(pooled.dtype))

        emb = embed(self.timestep_embedder, timestep)
        if self.guidance_embedder is not None:
            emb = emb + embed(self.guidance_embedder, guidance)
        return emb + self.text_embedder(pooled)


def _qk_norm(head_dim: int, dtype) -> nn.RMSNorm:
    """Flux's QK norm: RMSNorm over each head (diffusers' ``norm_q`` ... ``norm_added_k``), eps 1e-6."""
    return nn.RMSNorm(head_dim, eps=1e-6, dtype=dtype)


class FluxTransformerBlock(eqx.Module):
    """A double-stream block: image tokens ``x`` and text tokens ``context`` keep their own modulation
    (``norm1`` / ``norm1_context``: shift, scale, gate of the attention, then of the MLP), projections and MLPs,
    and attend jointly over ``[context, x]`` with rotary embeddings on both."""

    norm1: nn.AdaLayerNormZero
    norm1_context: nn.AdaLayerNormZero
    attn: nn.AbstractJointAttention  # JointAttention, or FusedJointAttention (fused=True)
    norm2: nn.LayerNorm
    ff: nn.FeedForward
    norm2_context: nn.LayerNorm
    ff_context: nn.FeedForward

    def __init__(self, dim: int, heads: int, head_dim: int, *, fused: bool = False, dtype=jnp.float32,
                 key: PRNGKeyArray):
        k1, k2, ka, kf, kfc = jax.random.split(key, 5)
        self.norm1 = nn.AdaLayerNormZero(dim, dtype=dtype, key=k1)
        self.norm1_context = nn.AdaLayerNormZero(dim, dtype=dtype, key=k2)
        attn = nn.JointAttention(dim, dim, heads=heads, dim_head=head_dim, bias=True, qk_norm=_qk_norm(head_dim, dtype),
                                 dtype=dtype, key=ka)
        self.attn = nn.FusedJointAttention(attn) if fused else attn
        self.norm2 = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.ff = nn.FeedForward(dim, activation="gelu-approximate", dtype=dtype, key=kf)
        self.norm2_context = nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.ff_context = nn.FeedForward(dim, activation="gelu-approximate", dtype=dtype, key=kfc)

    @typechecked
    def __call__(self, x: Float[Array, "batch img_seq dim"], context: Float[Array, "batch txt_seq dim"],
                 temb: Float[Array, "batch dim"], rope: nn.Rope
                 ) -> tuple[Float[Array, "batch img_seq dim"], Float[Array, "batch txt_seq dim"]]:
        h, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, temb)
        hc, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(context, temb)
        attn, attn_context = self.attn(h, hc, rope=rope)
        attn, attn_context = checkpoint_name(attn, "flux_attention"), checkpoint_name(attn_context, "flux_attention")

        x = nn.gated_residual(x, attn, gate)
        x = nn.gated_residual(x, self.ff(nn.modulate(self.norm2(x), shift_mlp, scale_mlp)), gate_mlp)
        context = nn.gated_residual(context, attn_context, c_gate)
        mlp = self.ff_context(nn.modulate(self.norm2_context(context), c_shift_mlp, c_scale_mlp))
        context = nn.gated_residual(context, mlp, c_gate_mlp)
        return _clip_float16(x), _clip_float16(context)


class FluxSingleTransformerBlock(eqx.Module):
    """A single-stream block on the joint tokens ``[text, image]``: one modulation (shift, scale, gate), attention
    and a tanh-GELU MLP side by side on the same normalised tokens, ``proj_out`` of both concatenated, gated back.

    Unfused it holds diffusers' ``attn.to_q/k/v`` and ``proj_mlp``; fused (``fused=True``) one ``to_qkv_mlp``
    whose output is ``[q; k; v; mlp]`` (Black Forest Labs' ``linear1``) and an attention of those projections
    (:class:`~eqxdiff.nn.ProjectedAttention`)."""

    norm: nn.AdaLayerNormZero
    to_qkv_mlp: nn.Linear | None
    proj_mlp: nn.Linear | None
    attn: nn.SelfAttention | nn.ProjectedAttention
    proj_out: nn.Linear

    def __init__(self, dim: int, heads: int, head_dim: int, *, mlp_ratio: float = 4.0, fused: bool = False,
                 dtype=jnp.float32, key: PRNGKeyArray):
        kn, km, ka, ko = jax.random.split(key, 4)
        mlp = int(dim * mlp_ratio)
        inner = heads * head_dim
        self.norm = nn.AdaLayerNormZero(dim, num_chunks=3, dtype=dtype, key=kn)
        self.to_qkv_mlp = (nn.Linear(dim, 3 * inner + mlp, axes=(None, "embed"), dtype=dtype, key=km)
                           if fused else None)
        self.proj_mlp = None if fused else nn.Linear(dim, mlp, axes=("mlp", "embed"), dtype=dtype, key=km)
        common = dict(heads=heads, dim_head=head_dim, pre_only=True, qk_norm=_qk_norm(head_dim, dtype), dtype=dtype,
                      key=ka)
        self.attn = nn.ProjectedAttention(dim, **common) if fused else nn.SelfAttention(dim, bias=True, **common)
        self.proj_out = nn.Linear(inner + mlp, dim, axes=("embed", "mlp"), dtype=dtype, key=ko)

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], temb: Float[Array, "batch dim"],
                 rope: nn.Rope) -> Float[Array, "batch seq dim"]:
        h, gate = self.norm(x, temb)
        if self.to_qkv_mlp is not None:
            inner = (self.to_qkv_mlp.out_features - self.proj_out.in_features) // 2  # 3i + mlp vs i + mlp
            projected = self.to_qkv_mlp(h)
            q, k, v = (projected[..., i * inner:(i + 1) * inner] for i in range(3))
            mlp = projected[..., 3 * inner:]
            attn = self.attn(q, k, v, rope=rope)
        else:
            mlp = self.proj_mlp(h)
            attn = self.attn(h, rope=rope)
        attn = checkpoint_name(attn, "flux_attention")
        mlp = nn.gelu_tanh(mlp)
        return _clip_float16(nn.gated_residual(x, self.proj_out(jnp.concatenate([attn, mlp], axis=-1)), gate))


__all__ = ["FluxSingleTransformerBlock", "FluxTimeTextEmbedding", "FluxTransformerBlock"]
