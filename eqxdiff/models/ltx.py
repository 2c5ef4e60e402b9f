"""LTX-Video's transformer: diffusers' ``LTXVideoTransformer3DModel`` (0.9.x 2B and 13B) on channels-last video
latents.

>>> import eqxdiff
>>> model = eqxdiff.load("Lightricks/LTX-Video", subfolder="transformer", dtype="bfloat16")
>>> velocity = model(latents, prompt_embeds, t, prompt_attention_mask, rope_interpolation_scale=(8 / 25, 32, 32))

**Inputs** (:meth:`LTXVideoTransformer3DModel.__call__`): ``hidden_states`` the noisy latents ``[batch, frames,
height, width, channels]`` (``channels`` = ``in_channels / (patch_size_t * patch_size ** 2)``: the config counts
packed features); ``encoder_hidden_states`` T5's embeddings ``[batch, text_seq, caption_channels]`` and
``encoder_attention_mask`` their mask (1 = token, 0 = padding); ``timestep`` the raw timestep (sigma * 1000), one per
sample ``[batch]`` or one per token ``[batch, seq]`` (image-to-video: the conditioning frame's tokens at 0);
``rope_interpolation_scale`` ``(vae_temporal / frame_rate, vae_spatial, vae_spatial)`` or ``video_coords [batch, 3,
seq]`` position the tokens. The output is the predicted flow in the latents' layout.

**Structure.** The latents are packed into tokens (``patch_size_t x patch_size x patch_size`` patches, features in
diffusers' order ``(c, pt, ph, pw)``; :func:`pack_latents`) and projected by ``proj_in``; their rotary tables cover
the whole inner dimension (positions normalised by ``(20, 2048, 2048)``, computed with ``jnp``, so traced positions
cost no recompile). ``time_embed`` (AdaLN-single) embeds the timestep, ``caption_projection`` the text;
``transformer_blocks`` (stacked under ``scan_layers``, ``SCAN_FIELDS``) are checkpointed at their boundaries under a
plan's remat policy (``CHECKPOINT_NAMES``); ``norm_out`` modulated by ``scale_shift_table + embedded_timestep``
(shift, scale) and ``proj_out`` end it. Tokens are constrained to ``("batch", "seq", "embed")``: on a mesh with a
``context`` axis they are split over it and the self-attention runs the ring/Ulysses kernels.

:meth:`~LTXVideoTransformer3DModel.forward_tokens` runs the packed form (diffusers' own signature without the
grid): the condition pipeline prepends conditioning tokens that are not on the video's grid, positioned by their
``video_coords``.

Lightricks' original files name a few tensors otherwise (``patchify_proj``, ``adaln_single``, ``q_norm``/``k_norm``,
under ``model.diffusion_model.``): :func:`eqxdiff.loading.formats.ltx_transformer` holds them as conversion rules.
"""

import dataclasses
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from .. import nn
from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ..core import Plan, checkpoint_block, constrain
from ._base import PretrainedModel, TransformerConfig
from ._ltx_blocks import (
    TOKENS,
    LTXTimeEmbedding,
    LTXVideoTransformerBlock,
    attention_mask,
    broadcast_timestep,
    check_scale,
    coords_positions,
    grid_positions,
    rotary_tables,
)


@dataclasses.dataclass(frozen=True)
class LTXVideoTransformer3DConfig(TransformerConfig):
    """diffusers' ``LTXVideoTransformer3DModel`` config.json (defaults: LTX-Video 2B 0.9.x; the 13B has 32 heads of
    128, ``cross_attention_dim`` 4096 and 48 layers). ``in_channels`` / ``out_channels`` count packed features:
    latent channels times ``patch_size_t * patch_size ** 2``. The caption projection outputs the model width, so
    ``cross_attention_dim`` must equal ``num_attention_heads * attention_head_dim``."""

    SUPPORTED_VALUES: ClassVar = {"qk_norm": ("rms_norm_across_heads",),
                                  "activation_fn": nn.FEEDFORWARD_ACTIVATIONS}

    in_channels: int = 128
    out_channels: int | None = 128
    patch_size: int = 1
    patch_size_t: int = 1
    num_attention_heads: int = 32
    attention_head_dim: int = 64
    cross_attention_dim: int = 2048
    num_layers: int = 28
    activation_fn: str = "gelu-approximate"
    qk_norm: str = "rms_norm_across_heads"
    norm_elementwise_affine: bool = False
    norm_eps: float = 1e-6
    caption_channels: int = 4096
    attention_bias: bool = True
    attention_out_bias: bool = True

    def __post_init__(self):
        super().__post_init__()
        for key in ("in_channels", "patch_size", "patch_size_t", "num_attention_heads", "attention_head_dim",
                    "cross_attention_dim", "caption_channels"):
            self.check(getattr(self, key) > 0, key, "must be a positive integer")
        self.check(self.num_layers >= 0, "num_layers", "must be a non-negative integer")
        self.check(self.out_channels is None or self.out_channels > 0, "out_channels",
                   "must be a positive integer or null (in_channels)")
        self.check(self.inner_dim >= 6 and self.inner_dim % 2 == 0, "attention_head_dim",
                   f"must make num_attention_heads * attention_head_dim (now {self.inner_dim}) even and at least 6 "
                   "(rotary channels pair up over frames, rows and columns; diffusers cannot run an odd width)")
        self.check(self.cross_attention_dim == self.inner_dim, "cross_attention_dim",
                   f"must equal num_attention_heads * attention_head_dim = {self.inner_dim} (the caption projection "
                   "outputs the model width)")
        for key in ("in_channels", "out_channels"):
            self.check((getattr(self, key) or self.in_channels) % self.patch_volume == 0, key,
                       f"must be a multiple of patch_size_t * patch_size ** 2 = {self.patch_volume} (it counts packed "
                       "latent features)")

    @property
    def patch_volume(self) -> int:
        return self.patch_size_t * self.patch_size ** 2

    @property
    def latent_channels(self) -> tuple[int, int]:
        """The latents' channels in and out (before packing): ``(in_channels, output_channels) / patch volume``."""
        return self.in_channels // self.patch_volume, self.output_channels // self.patch_volume


TimestepLike = (int | float | Float[Array, ""] | Int[Array, ""] | Float[Array, " #batch"] | Int[Array, " #batch"]
                | Float[Array, "#batch tokens"] | Int[Array, "#batch tokens"])  # checked against the tokens by the call


def pack_latents(latents: Float[Array, "batch frames height width channels"], patch_size: int = 1,
                 patch_size_t: int = 1) -> Float[Array, "batch seq features"]:
    """Channels-last latents as tokens ``[batch, f * h * w, c * pt * p * p]`` (tokens in frame, row, column order of
    the patch grid; features ``(c, pt, ph, pw)``): diffusers' ``LTXPipeline._pack_latents``."""
    b, f, h, w, c = latents.shape
    p, pt = patch_size, patch_size_t
    x = latents.reshape(b, f // pt, pt, h // p, p, w // p, p, c).transpose(0, 1, 3, 5, 7, 2, 4, 6)
    return x.reshape(b, (f // pt) * (h // p) * (w // p), c * pt * p * p)


def unpack_latents(tokens: Float[Array, "batch seq features"], grid: tuple[int, int, int], patch_size: int = 1,
                   patch_size_t: int = 1) -> Float[Array, "batch frames height width channels"]:
    """The inverse of :func:`pack_latents` for a token ``grid`` ``(f, h, w)``: diffusers' ``_unpack_latents``."""
    (f, h, w), p, pt = grid, patch_size, patch_size_t
    b = tokens.shape[0]
    x = tokens.reshape(b, f, h, w, -1, pt, p, p).transpose(0, 1, 5, 2, 6, 3, 7, 4)
    return x.reshape(b, f * pt, h * p, w * p, -1)


class LTXVideoTransformer3DModel(PretrainedModel):
    """diffusers' ``LTXVideoTransformer3DModel`` on channels-last video latents; names are diffusers' state-dict
    names (see the module docstring for inputs, structure and the packed form)."""

    config_class: ClassVar[type] = LTXVideoTransformer3DConfig
    SCAN_FIELDS: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("ltx_block",)

    proj_in: nn.Linear
    scale_shift_table: nn.ScaleShiftTable
    time_embed: LTXTimeEmbedding
    caption_projection: nn.TextProjection
    transformer_blocks: tuple[LTXVideoTransformerBlock, ...] | nn.Stacked[LTXVideoTransformerBlock]
    norm_out: nn.LayerNorm
    proj_out: nn.Linear
    config: LTXVideoTransformer3DConfig = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: LTXVideoTransformer3DConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        c = config
        kp, kt, ke, kc, kb, ko = jax.random.split(key, 6)
        d = c.inner_dim
        self.proj_in = nn.Linear(c.in_channels, d, axes=("embed", None), dtype=dtype, key=kp)
        self.scale_shift_table = nn.ScaleShiftTable(2, d, dtype=dtype, key=kt)
        self.time_embed = LTXTimeEmbedding(d, dtype=dtype, key=ke)
        self.caption_projection = nn.TextProjection(c.caption_channels, d, act_fn="gelu_tanh", dtype=dtype, key=kc)
        self.transformer_blocks = tuple(
            LTXVideoTransformerBlock(d, c.num_attention_heads, c.attention_head_dim, activation=c.activation_fn,
                                     bias=c.attention_bias, out_bias=c.attention_out_bias, eps=c.norm_eps,
                                     elementwise_affine=c.norm_elementwise_affine, dtype=dtype, key=k)
            for k in jax.random.split(kb, c.num_layers))
        self.norm_out = nn.LayerNorm(d, eps=1e-6, elementwise_affine=False, dtype=dtype)
        self.proj_out = nn.Linear(d, c.output_channels, dtype=dtype, key=ko)
        self.config = config

    # -- positions and shapes ----------------------------------------------------------------------------------------

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The token grid ``(frames, rows, columns)`` of latents of that size (checked to divide by the patch)."""
        c = self.config
        patch = (c.patch_size_t, c.patch_size, c.patch_size)
        if frames % patch[0] or height % patch[1] or width % patch[2]:
            raise ValueError(f"LTXVideoTransformer3DModel: latents of {frames} frames x {height} x {width} do not "
                             f"divide into patches of {patch} (frames, height, width); crop or pad them to multiples")
        return frames // patch[0], height // patch[1], width // patch[2]

    def rotary_embedding(self, grid: tuple[int, int, int] | None = None, rope_interpolation_scale=None, *,
                         video_coords: Float[Array, "batch 3 seq"] | Int[Array, "batch 3 seq"] | None = None
                         ) -> nn.Rope:
        """The rotary tables ``[batch (1 for a grid), seq, inner_dim]`` of a token ``grid`` (scaled by
        ``rope_interpolation_scale``; without it the raw indices, as diffusers) or of explicit ``video_coords``
        ``[batch, 3, seq]`` (latent-pixel units, the condition pipeline's). Positions may be traced."""
        c = self.config
        if (grid is None) == (video_coords is None):
            raise ValueError("LTXVideoTransformer3DModel.rotary_embedding: give a token grid (with "
                             "rope_interpolation_scale) or video_coords=[batch, 3, seq], not both and not neither")
        check_scale(rope_interpolation_scale)
        if video_coords is not None:
            positions = coords_positions(video_coords)
        else:
            positions = grid_positions(grid, rope_interpolation_scale, patch_size=c.patch_size,
                                       patch_size_t=c.patch_size_t)
        return rotary_tables(positions, c.inner_dim)

    # -- forward -----------------------------------------------------------------------------------------------------

    @typechecked
    def forward_tokens(self, tokens: Float[Array, "batch seq in_features"],
                       encoder_hidden_states: Float[Array, "batch text_seq caption"], timestep: TimestepLike,
                       encoder_attention_mask: Array | None, rope: nn.Rope
                       ) -> Float[Array, "batch seq out_features"]:
        """diffusers' forward on packed ``tokens`` ``[batch, seq, in_channels]`` with their rotary tables ``rope``
        (:meth:`rotary_embedding`, ``[#batch, seq, inner_dim]``): the predicted flow ``[batch, seq,
        out_channels]``. ``timestep``: ``[batch]`` or per token ``[batch, seq]``; ``encoder_attention_mask``:
        ``[batch, text_seq]`` (1 = token, 0 = padding) or ``None`` (attend to every text token)."""
        b, seq, _ = tokens.shape
        dtype = tokens.dtype
        if rope.cos.shape[-2] != seq or rope.cos.shape[0] not in (1, b):
            raise ValueError(f"LTXVideoTransformer3DModel: rotary tables of shape {rope.cos.shape} for {b} x {seq} "
                             "tokens; build them with model.rotary_embedding(...) for these tokens")
        mask = attention_mask(encoder_attention_mask, b, encoder_hidden_states.shape[1])
        x = constrain(self.proj_in(tokens), self.plan, TOKENS)
        temb, embedded = self.time_embed(broadcast_timestep(timestep, b, seq), dtype)
        context = self.caption_projection(encoder_hidden_states.astype(dtype))
        rope = nn.Rope(*(constrain(t, self.plan, ("batch", "seq", None)) for t in nn.Rope(*rope).as_arrays()))

        def step(block, x):
            x = checkpoint_block(block, self.plan)(constrain(x, self.plan, TOKENS), context, temb, rope, mask)
            return checkpoint_name(x, "ltx_block")

        x, _ = nn.run_layers(self.transformer_blocks, step, x)
        shift, scale = self.scale_shift_table(embedded, shared=True)
        x = nn.modulate(self.norm_out(x), shift, scale)
        return constrain(self.proj_out(x), self.plan, ("batch", "seq", None))

    @typechecked
    def __call__(self, hidden_states: Float[Array, "batch frames height width channels"],
                 encoder_hidden_states: Float[Array, "batch text_seq caption"], timestep: TimestepLike,
                 encoder_attention_mask: Array | None = None, *, rope_interpolation_scale=None,
                 video_coords: Float[Array, "batch 3 seq"] | Int[Array, "batch 3 seq"] | None = None
                 ) -> Float[Array, "batch frames height width out_channels"]:
        """Predict the flow for video latents (see the module docstring for the inputs): packed, positioned by
        ``rope_interpolation_scale`` (or ``video_coords`` over the grid's tokens), :meth:`forward_tokens`, unpacked.
        Returns the activations' dtype (that of ``hidden_states``)."""
        c = self.config
        if hidden_states.shape[-1] != c.latent_channels[0]:
            raise ValueError(f"LTXVideoTransformer3DModel expects latents [batch, frames, height, width, "
                             f"{c.latent_channels[0]}] (in_channels={c.in_channels} packed features over patches of "
                             f"{c.patch_volume}), got shape {hidden_states.shape}")
        grid = self.grid(*hidden_states.shape[1:4])
        if video_coords is not None and rope_interpolation_scale is not None:
            raise ValueError("LTXVideoTransformer3DModel: video_coords= position the tokens themselves; leave "
                             "rope_interpolation_scale out")
        if video_coords is not None and video_coords.shape[-1] != math.prod(grid):
            raise ValueError(f"LTXVideoTransformer3DModel: video_coords of shape {video_coords.shape} for a grid of "
                             f"{grid} = {math.prod(grid)} tokens; give [batch, 3, {math.prod(grid)}]")
        rope = (self.rotary_embedding(video_coords=video_coords) if video_coords is not None
                else self.rotary_embedding(grid, rope_interpolation_scale))
        tokens = pack_latents(hidden_states, c.patch_size, c.patch_size_t)
        out = self.forward_tokens(tokens, encoder_hidden_states, timestep, encoder_attention_mask, rope)
        return unpack_latents(out, grid, c.patch_size, c.patch_size_t)


__all__ = ["LTXVideoTransformer3DConfig", "LTXVideoTransformer3DModel", "pack_latents", "unpack_latents"]
