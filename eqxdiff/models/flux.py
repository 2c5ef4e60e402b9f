"""Flux.1's transformer: diffusers' ``FluxTransformer2DModel`` (FLUX.1-dev, FLUX.1-schnell and their relatives).

>>> import eqxdiff
>>> from eqxdiff.models import flux
>>> model = eqxdiff.load("black-forest-labs/FLUX.1-dev", subfolder="transformer", dtype="bfloat16")
>>> tokens = flux.pack_latents(latents)                    # [b, 2h, 2w, c] channels-last -> [b, h*w, 4c]
>>> velocity = model(tokens, t5_embeds, clip_pooled, sigma,
...                  img_ids=flux.image_ids(h, w), txt_ids=flux.text_ids(t5_embeds.shape[1]), guidance=g)
>>> latents = flux.unpack_latents(velocity, 2 * h, 2 * w)   # back to [b, 2h, 2w, c]

**Inputs** (see :meth:`FluxTransformer2DModel.__call__`): image tokens are the VAE latents packed in 2x2 patches,
channels-last (:func:`pack_latents`: token ``r * w + c`` holds patch ``(r, c)``, channel ``ch * 4 + dy * 2 + dx``:
diffusers' ``_pack_latents``); text tokens are T5's ``last_hidden_state``; ``pooled_projections`` CLIP's pooled
output; ``timestep`` the flow-matching sigma in [0, 1] (the model multiplies it by 1000), ``guidance`` the distilled
guidance scale as given (also times 1000 inside; only models with ``guidance_embeds``, i.e. dev). Positions are
``img_ids [img_seq, 3]`` / ``txt_ids [txt_seq, 3]`` (:func:`image_ids`, :func:`text_ids`), turned into rotary tables
in float64 with NumPy, so they must be concrete; under ``jit`` pass ``rope=model.rotary_embedding(img_ids, txt_ids)``
(a pytree of two arrays) instead. The output is the predicted velocity in the image tokens' layout.

**Structure.** ``x_embedder``/``context_embedder`` project both streams to the model width; ``time_text_embed`` makes
the conditioning vector; ``transformer_blocks`` (double-stream) and ``single_transformer_blocks`` (single-stream on
``[text, image]``) are stacked under ``scan_layers`` (``SCAN_FIELDS``) and checkpointed at their boundaries under a
plan's remat policy (names in ``CHECKPOINT_NAMES``; ``"flux_attention"`` tags the attention outputs inside the
blocks); ``norm_out`` (AdaLayerNormContinuous, ``(scale, shift)``) and ``proj_out`` end it. Tokens are constrained to
``("batch", "seq", "embed")``: on a mesh with a ``context`` axis both streams are split over it and the joint
attention runs the ring/Ulysses kernels.

**Fused projections** (``fused_projections=True``, an eqxdiff setting never written to config.json): the double
blocks hold one ``to_qkv`` / ``to_added_qkv`` each and the single blocks one ``to_qkv_mlp`` (BFL's ``linear1``),
concatenated at load time from the separate tensors of any checkpoint (``fused_tensors``) and split back by
``save_pretrained``: ``eqxdiff.load(folder, config_overrides={"fused_projections": True})``. Fewer, larger matmuls
for data, FSDP and context parallelism; under tensor parallelism the fused weights are replicated over ``tensor``
(their outputs mix queries, keys and values), so keep them separate there.

Black Forest Labs' single files (``flux1-dev.safetensors``, ``flux1-schnell.safetensors``, float8 variants) load
through :func:`eqxdiff.loading.formats.flux_bfl`, their config read from the file by
:func:`~eqxdiff.loading.formats.flux_bfl_config`:

>>> from eqxdiff.loading import formats
>>> model = eqxdiff.load("flux1-dev.safetensors", config=formats.flux_bfl_config("flux1-dev.safetensors"),
...                      conversion=formats.flux_bfl(), dtype="bfloat16")
"""

import dataclasses
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from .. import nn
from .._typing import Array, Float, PRNGKeyArray, typechecked
from ..core import Plan, checkpoint_block, constrain
from ._base import PretrainedModel, TransformerConfig
from ._flux_blocks import FluxSingleTransformerBlock, FluxTimeTextEmbedding, FluxTransformerBlock

ROPE_THETA = 10000.0
MLP_RATIO = 4.0  # diffusers' FluxSingleTransformerBlock default; FeedForward's mult=4 in the double blocks


@dataclasses.dataclass(frozen=True)
class FluxTransformer2DConfig(TransformerConfig):
    """diffusers' ``FluxTransformer2DModel`` config.json (defaults: FLUX.1's sizes; dev sets ``guidance_embeds``).

    ``patch_size`` only widens ``proj_out`` (``patch_size ** 2 * out_channels``), as in diffusers: the pipeline
    packs 2x2 latent patches into the ``in_channels`` itself. ``axes_dims_rope`` splits each head's channels
    between the three position axes (they must sum to ``attention_head_dim``). ``fused_projections`` is
    eqxdiff's (see the module docstring) and is not written to config.json."""

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    fused_projections: bool = False

    def __post_init__(self):
        super().__post_init__()
        for key in ("patch_size", "in_channels", "attention_head_dim", "num_attention_heads", "joint_attention_dim",
                    "pooled_projection_dim"):
            self.check(getattr(self, key) > 0, key, "must be a positive integer")
        for key in ("num_layers", "num_single_layers"):
            self.check(getattr(self, key) >= 0, key, "must be a non-negative integer")
        self.check(self.out_channels is None or self.out_channels > 0, "out_channels",
                   "must be a positive integer (or null: in_channels)")
        self.check(len(self.axes_dims_rope) > 0 and all(d > 0 and d % 2 == 0 for d in self.axes_dims_rope),
                   "axes_dims_rope", "must be positive even sizes (channels rotate in pairs), one per position axis")
        self.check(sum(self.axes_dims_rope) == self.attention_head_dim, "axes_dims_rope",
                   f"must sum to attention_head_dim={self.attention_head_dim} (each head's channels are split "
                   "between the position axes)")

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * MLP_RATIO)

    @property
    def output_channels(self) -> int:
        """Channels per output token: ``patch_size ** 2 * (out_channels or in_channels)``."""
        return self.patch_size**2 * (self.out_channels or self.in_channels)


# -- the model's input layout -------------------------------------------------------------------------------------


def pack_latents(latents: Float[Array, "batch height width channels"]) -> Float[Array, "batch seq packed"]:
    """Channels-last latents ``[b, H, W, C]`` (``H``, ``W`` even) as Flux's tokens ``[b, H/2 * W/2, 4C]``: 2x2 patches
    in row-major order, channel ``c * 4 + dy * 2 + dx`` (diffusers' ``FluxPipeline._pack_latents``)."""
    b, h, w, c = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"pack_latents: latents of shape {latents.shape}; height and width must be even (Flux packs "
                         "2x2 patches)")
    x = latents.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)
    return x.reshape(b, (h // 2) * (w // 2), 4 * c)


def unpack_latents(tokens: Float[Array, "batch seq packed"], height: int,
                   width: int) -> Float[Array, "batch height width channels"]:
    """The inverse of :func:`pack_latents`: tokens ``[b, H/2 * W/2, 4C]`` as latents ``[b, H, W, C]``."""
    b, seq, packed = tokens.shape
    if height % 2 or width % 2 or seq != (height // 2) * (width // 2) or packed % 4:
        raise ValueError(f"unpack_latents: tokens of shape {tokens.shape} are not the 2x2 patches of a latent of "
                         f"width {width}, height {height} (expected {(height // 2) * (width // 2)} tokens of 4*C "
                         "channels)")
    x = tokens.reshape(b, height // 2, width // 2, packed // 4, 2, 2).transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(b, height, width, packed // 4)


def image_ids(height: int, width: int) -> np.ndarray:
    """Positions ``[height * width, 3]`` of the packed image tokens (``height``, ``width``: the token grid, half the
    latent's): ``(0, row, col)``, as the pipelines' ``_prepare_latent_image_ids``."""
    ids = np.zeros((height, width, 3), np.float32)
    ids[..., 1] = np.arange(height)[:, None]
    ids[..., 2] = np.arange(width)[None, :]
    return ids.reshape(height * width, 3)


def text_ids(length: int) -> np.ndarray:
    """Positions ``[length, 3]`` of the text tokens: all zeros (their rotation is the identity)."""
    return np.zeros((length, 3), np.float32)


# -- the model ----------------------------------------------------------------------------------------------------

TimestepLike = float | Float[Array, ""] | Float[Array, " #batch"]


class FluxTransformer2DModel(PretrainedModel):
    """diffusers' ``FluxTransformer2DModel`` on channels-last packed tokens; names are diffusers' state-dict names
    (see the module docstring for inputs, structure and the fused layout)."""

    config_class: ClassVar[type] = FluxTransformer2DConfig
    SCAN_FIELDS: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("flux_double_block", "flux_single_block", "flux_attention")

    x_embedder: nn.Linear
    context_embedder: nn.Linear
    time_text_embed: FluxTimeTextEmbedding
    transformer_blocks: tuple[FluxTransformerBlock, ...] | nn.Stacked[FluxTransformerBlock]
    single_transformer_blocks: tuple[FluxSingleTransformerBlock, ...] | nn.Stacked[FluxSingleTransformerBlock]
    norm_out: nn.AdaLayerNormContinuous
    proj_out: nn.Linear
    config: FluxTransformer2DConfig = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: FluxTransformer2DConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        c = config
        kx, kc, kt, kd, ks, kn, ko = jax.random.split(key, 7)
        d, heads, head_dim, fused = c.inner_dim, c.num_attention_heads, c.attention_head_dim, c.fused_projections
        self.x_embedder = nn.Linear(c.in_channels, d, axes=("embed", None), dtype=dtype, key=kx)
        self.context_embedder = nn.Linear(c.joint_attention_dim, d, axes=("embed", None), dtype=dtype, key=kc)
        self.time_text_embed = FluxTimeTextEmbedding(d, c.pooled_projection_dim, guidance=c.guidance_embeds,
                                                     dtype=dtype, key=kt)
        self.transformer_blocks = tuple(FluxTransformerBlock(d, heads, head_dim, fused=fused, dtype=dtype, key=k)
                                        for k in jax.random.split(kd, c.num_layers))
        self.single_transformer_blocks = tuple(
            FluxSingleTransformerBlock(d, heads, head_dim, mlp_ratio=MLP_RATIO, fused=fused, dtype=dtype, key=k)
            for k in jax.random.split(ks, c.num_single_layers))
        self.norm_out = nn.AdaLayerNormContinuous(d, d, elementwise_affine=False, eps=1e-6, dtype=dtype, key=kn)
        self.proj_out = nn.Linear(d, c.output_channels, dtype=dtype, key=ko)
        self.config = config

    # -- checkpoints ---------------------------------------------------------------------------------------------

    @classmethod
    def with_input_width(cls, config: FluxTransformer2DConfig, layer: str, width: int
                         ) -> FluxTransformer2DConfig | None:
        """``x_embedder`` widened to ``width`` inputs is ``in_channels`` (a control LoRA's: FLUX.1-Canny-dev-lora
        reads the control latents beside the noisy ones); the output keeps its channels."""
        if layer != "x_embedder":
            return None
        return dataclasses.replace(config, in_channels=width, out_channels=config.out_channels or config.in_channels)

    def checkpoint_config(self) -> dict:
        out = super().checkpoint_config()
        del out["fused_projections"]  # eqxdiff's layout choice, not a diffusers key
        return out

    def fused_tensors(self):
        """With ``fused_projections``: the fused weights and biases, each the concatenation of diffusers' tensors."""
        if not self.config.fused_projections:
            return ()
        double, single, inner = "transformer_blocks.{i}.", "single_transformer_blocks.{i}.", self.config.inner_dim
        return (
            (tuple(f"{double}attn.to_{p}.{{w}}" for p in "qkv"), f"{double}attn.to_qkv.{{w}}", None),
            (tuple(f"{double}attn.add_{p}_proj.{{w}}" for p in "qkv"), f"{double}attn.to_added_qkv.{{w}}", None),
            ((*(f"{single}attn.to_{p}.{{w}}" for p in "qkv"), f"{single}proj_mlp.{{w}}"), f"{single}to_qkv_mlp.{{w}}",
             (inner, inner, inner, self.config.mlp_hidden_dim)),
        )

    # -- positions -----------------------------------------------------------------------------------------------

    def rotary_embedding(self, img_ids, txt_ids) -> nn.Rope:
        """The rotary tables ``[txt_seq + img_seq, head_dim]`` of the joint sequence ``[text, image]`` for
        ``img_ids [img_seq, 3]`` and ``txt_ids [txt_seq, 3]`` (concrete arrays: computed in float64 with NumPy,
        cast to float32, as diffusers' ``FluxPosEmbed``)."""
        try:
            ids = [np.asarray(i) for i in (txt_ids, img_ids)]
        except jax.errors.TracerArrayConversionError:
            raise ValueError("FluxTransformer2DModel: img_ids/txt_ids are traced here (passed into jit as arrays); "
                             "build the rotary tables outside jit with model.rotary_embedding(img_ids, txt_ids) and "
                             "pass rope=, or close over the ids") from None
        for name, i in zip(("txt_ids", "img_ids"), ids):
            if i.ndim != 2 or i.shape[1] != len(self.config.axes_dims_rope):
                raise ValueError(f"FluxTransformer2DModel: {name} of shape {i.shape}; expected [seq, "
                                 f"{len(self.config.axes_dims_rope)}] (one column per axes_dims_rope entry)")
        return nn.flux_rope(np.concatenate(ids, axis=0), self.config.axes_dims_rope, ROPE_THETA)

    # -- forward -------------------------------------------------------------------------------------------------

    @typechecked
    def __call__(self, hidden_states: Float[Array, "batch img_seq in_channels"],
                 encoder_hidden_states: Float[Array, "batch txt_seq joint_dim"],
                 pooled_projections: Float[Array, "batch pooled_dim"], timestep: TimestepLike, *,
                 img_ids=None, txt_ids=None, rope: nn.Rope | None = None,
                 guidance: TimestepLike | None = None) -> Float[Array, "batch img_seq out_channels"]:
        """Predict the flow (velocity) for packed image tokens.

        ``hidden_states``: the packed noisy latents ``[batch, img_seq, in_channels]`` (:func:`pack_latents`);
        ``encoder_hidden_states``: T5 embeddings ``[batch, txt_seq, joint_attention_dim]``;
        ``pooled_projections``: CLIP's pooled embedding ``[batch, pooled_projection_dim]``;
        ``timestep``: sigma in [0, 1] (a number or ``[batch]``; multiplied by 1000 here, as diffusers does);
        ``guidance``: the distilled guidance scale (number or ``[batch]``), required by (and only accepted by)
        models with ``guidance_embeds``; ``img_ids``/``txt_ids`` (concrete, see :meth:`rotary_embedding`) or
        ``rope``: the positions. Returns ``[batch, img_seq, patch_size**2 * out_channels]`` in the activations'
        dtype (that of ``hidden_states``).
        """
        c = self.config
        b, img_seq, _ = hidden_states.shape
        txt_seq = encoder_hidden_states.shape[1]
        if c.guidance_embeds and guidance is None:
            raise ValueError("FluxTransformer2DModel: this model has guidance_embeds (a guidance-distilled model such "
                             "as FLUX.1-dev); pass guidance= (the guidance scale, e.g. 3.5)")
        if guidance is not None and not c.guidance_embeds:
            raise ValueError("FluxTransformer2DModel: guidance= was given but this model has no guidance embedder "
                             "(guidance_embeds=False, e.g. FLUX.1-schnell); leave it out (use true CFG instead)")
        if rope is None:
            if img_ids is None or txt_ids is None:
                raise ValueError("FluxTransformer2DModel: give the positions, img_ids= and txt_ids= (see "
                                 "eqxdiff.models.flux.image_ids/text_ids), or rope=model.rotary_embedding(...)")
            rope = self.rotary_embedding(img_ids, txt_ids).as_arrays()
        elif img_ids is not None or txt_ids is not None:
            raise ValueError("FluxTransformer2DModel: give either rope= or img_ids=/txt_ids=, not both")
        if tuple(rope.cos.shape) != (txt_seq + img_seq, c.attention_head_dim):
            raise ValueError(f"FluxTransformer2DModel: rotary tables of shape {tuple(rope.cos.shape)} for {txt_seq} "
                             f"text + {img_seq} image tokens; expected ({txt_seq + img_seq}, {c.attention_head_dim}): "
                             "ids must list the text tokens' positions, then the image tokens'")

        dtype = hidden_states.dtype
        tokens = ("batch", "seq", "embed")
        x = constrain(self.x_embedder(hidden_states), self.plan, tokens)
        # 1000 * sigma and 1000 * guidance in float32, whatever the activations' dtype: diffusers multiplies in the
        # activations' dtype, and bfloat16 spaces values in [512, 1024) 4 apart and in [2048, 4096) 16 apart (sigma
        # 0.875 -> 876, guidance 3.5 -> 3504), which moves the sinusoid's fast channels by radians; the embedding is
        # then float32 sinusoids of these float32 values (diffusers' get_timestep_embedding casts to float32 too)
        t = jnp.broadcast_to(jnp.asarray(timestep, jnp.float32), (b,)) * 1000
        g = None if guidance is None else jnp.broadcast_to(jnp.asarray(guidance, jnp.float32), (b,)) * 1000
        temb = self.time_text_embed(t, pooled_projections.astype(dtype), g)
        context = constrain(self.context_embedder(encoder_hidden_states.astype(dtype)), self.plan, tokens)

        def double(block, carry):
            x, context = (constrain(a, self.plan, tokens) for a in carry)
            x, context = checkpoint_block(block, self.plan)(x, context, temb, rope)
            return checkpoint_name(x, "flux_double_block"), checkpoint_name(context, "flux_double_block")

        def single(block, h):
            h = checkpoint_block(block, self.plan)(constrain(h, self.plan, tokens), temb, rope)
            return checkpoint_name(h, "flux_single_block")

        (x, context), _ = nn.run_layers(self.transformer_blocks, double, (x, context))
        h, _ = nn.run_layers(self.single_transformer_blocks, single, jnp.concatenate([context, x], axis=1))
        x = constrain(h[:, txt_seq:], self.plan, tokens)
        return constrain(self.proj_out(self.norm_out(x, temb)), self.plan, ("batch", "seq", None))


__all__ = ["FluxTransformer2DConfig", "FluxTransformer2DModel", "image_ids", "pack_latents", "text_ids",
           "unpack_latents"]
