"""The spatial transformer of the Stable Diffusion UNets: diffusers' ``Transformer2DModel`` (continuous input,
``layer_norm``) built from ``BasicTransformerBlock`` s with a GEGLU feed-forward (``nn.FeedForward``).
Channels-last throughout."""

from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Bool, Float, PRNGKeyArray, typechecked
from ..core import Plan, constrain
from ..nn import (
    Conv2d,
    CrossAttention,
    FeedForward,
    GroupNorm,
    LayerNorm,
    Linear,
    SelfAttention,
    Stacked,
    run_layers,
)


class BasicTransformerBlock(eqx.Module):
    """Pre-norm self-attention, cross-attention and feed-forward, each added back to the residual stream.

    With ``only_cross_attention`` the first attention also attends to the context (and, as in diffusers, without
    the context mask, which diffusers routes only to the second attention).
    """

    norm1: LayerNorm
    attn1: SelfAttention | CrossAttention
    norm2: LayerNorm
    attn2: CrossAttention
    norm3: LayerNorm
    ff: FeedForward
    only_cross_attention: bool = eqx.field(static=True)

    def __init__(self, dim: int, *, heads: int, dim_head: int, cross_attention_dim: int,
                 only_cross_attention: bool = False, dtype=jnp.float32, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = LayerNorm(dim, dtype=dtype)
        attn = dict(heads=heads, dim_head=dim_head, dtype=dtype)
        self.attn1 = (CrossAttention(dim, cross_attention_dim, **attn, key=k1) if only_cross_attention
                      else SelfAttention(dim, **attn, key=k1))
        self.norm2 = LayerNorm(dim, dtype=dtype)
        self.attn2 = CrossAttention(dim, cross_attention_dim, **attn, key=k2)
        self.norm3 = LayerNorm(dim, dtype=dtype)
        self.ff = FeedForward(dim, dtype=dtype, key=k3)
        self.only_cross_attention = only_cross_attention

    @typechecked
    def __call__(self, x: Float[Array, "batch seq dim"], context: Float[Array, "batch ctx_seq ctx_dim"], *,
                 mask: Bool[Array, "batch ctx_seq"] | None = None,
                 cross_attention_kwargs: Mapping[str, Any] | None = None) -> Float[Array, "batch seq dim"]:
        """``cross_attention_kwargs`` go to the cross-attention (``attn2``), as diffusers hands them to its
        processor (an IP-Adapter's ``ip_adapter_masks``)."""
        h = self.norm1(x)
        x = x + (self.attn1(h, context) if self.only_cross_attention else self.attn1(h))
        x = x + self.attn2(self.norm2(x), context, mask=mask, **(cross_attention_kwargs or {}))
        return x + self.ff(self.norm3(x))


class Transformer2DModel(eqx.Module):
    """GroupNorm, ``proj_in``, transformer blocks over the ``height * width`` tokens, ``proj_out``, residual.

    ``proj_in`` / ``proj_out`` are 1x1 convolutions, or linear layers with ``use_linear_projection`` (SD 2.x, SDXL).
    With ``eqxdiff.nn.scan_layers`` the transformer blocks (``transformer_layers_per_block`` > 1) run as one scan.
    """

    SCAN_FIELDS: ClassVar[tuple[str, ...]] = ("transformer_blocks",)

    norm: GroupNorm
    proj_in: Conv2d | Linear
    transformer_blocks: tuple[BasicTransformerBlock, ...] | Stacked[BasicTransformerBlock]
    proj_out: Conv2d | Linear
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, channels: int, *, heads: int, dim_head: int, cross_attention_dim: int, num_layers: int = 1,
                 groups: int = 32, use_linear_projection: bool = False, only_cross_attention: bool = False,
                 dtype=jnp.float32, key: PRNGKeyArray):
        kin, kout, kblocks = jax.random.split(key, 3)
        inner = heads * dim_head
        self.norm = GroupNorm(groups, channels, eps=1e-6, dtype=dtype)
        if use_linear_projection:
            self.proj_in = Linear(channels, inner, dtype=dtype, key=kin)
            self.proj_out = Linear(inner, channels, dtype=dtype, key=kout)
        else:
            self.proj_in = Conv2d(channels, inner, 1, dtype=dtype, key=kin)
            self.proj_out = Conv2d(inner, channels, 1, dtype=dtype, key=kout)
        self.transformer_blocks = tuple(
            BasicTransformerBlock(inner, heads=heads, dim_head=dim_head, cross_attention_dim=cross_attention_dim,
                                  only_cross_attention=only_cross_attention, dtype=dtype, key=k)
            for k in jax.random.split(kblocks, num_layers))

    @typechecked
    def __call__(self, x: Float[Array, "batch height width channels"],
                 context: Float[Array, "batch ctx_seq ctx_dim"], *,
                 mask: Bool[Array, "batch ctx_seq"] | None = None,
                 cross_attention_kwargs: Mapping[str, Any] | None = None,
                 ) -> Float[Array, "batch height width channels"]:
        b, height, width, _ = x.shape
        image = ("batch", "height", "width", "channels")
        x = constrain(x, self.plan, image)
        h = self.norm(x)
        # A 1x1 convolution and a linear layer are the same map on channels-last tokens; only the order of the
        # reshape differs, and that is a no-op here.
        h = self.proj_in(h) if isinstance(self.proj_in, Conv2d) else self.proj_in(h.reshape(b, height * width, -1))
        h = h.reshape(b, height * width, -1)
        tokens = ("batch", "seq", "embed")

        def step(block, h):
            return constrain(block(constrain(h, self.plan, tokens), context, mask=mask,
                                   cross_attention_kwargs=cross_attention_kwargs), self.plan, tokens)

        h, _ = run_layers(self.transformer_blocks, step, h)
        if isinstance(self.proj_out, Conv2d):
            h = self.proj_out(constrain(h.reshape(b, height, width, -1), self.plan, image))
        else:
            h = self.proj_out(h).reshape(b, height, width, -1)
        return constrain(h + x, self.plan, image)
