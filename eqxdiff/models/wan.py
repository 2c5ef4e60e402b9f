"""Wan 2.1 / 2.2's video transformer: diffusers' ``WanTransformer3DModel`` (text-, image- and first-last-frame-to-video,
the 2.2 A14B experts and TI2V-5B) on channels-last video latents.

>>> import eqxdiff
>>> model = eqxdiff.load("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", subfolder="transformer", dtype="bfloat16")
>>> velocity = model(latents, t, text_embeds)            # latents [b, frames, h, w, c] -> the same shape
>>> kv = model.cross_attention_kv(text_embeds)           # once per prompt ...
>>> velocity = model(latents, t, cross_kv=kv)            # ... reused at every step: the same numbers

**Inputs** (:meth:`WanTransformer3DModel.__call__`): ``hidden_states`` the noisy latents ``[batch, frames, height,
width, in_channels]`` (image-to-video: the latents, mask and condition latents concatenated on channels, as the
pipelines build them); ``timestep`` the raw timestep (0-1000, the scheduler's, not divided by 1000), one per sample
``[batch]`` or one per video token ``[batch, seq]`` (Wan 2.2 TI2V's ``expand_timesteps``: first-frame tokens at
0); ``encoder_hidden_states`` UMT5's embeddings ``[batch, text_seq, text_dim]``; ``encoder_hidden_states_image``
CLIP's penultimate hidden states ``[batch, 257, image_dim]`` for 2.1 image-to-video. The output is the predicted
flow in the latents' layout ``[batch, frames, height, width, out_channels]``.

**Structure.** ``patch_embedding`` (a Conv3d, kernel = stride = ``patch_size``) makes the tokens, in (frame, row,
column) order; their rotary tables come from the patch grid (:func:`eqxdiff.nn.wan_rope`, float64 tables as
diffusers'). ``condition_embedder`` embeds the timestep, the text and the image; ``blocks`` (stacked under
``scan_layers``, ``SCAN_FIELDS``) are checkpointed at their boundaries under a plan's remat policy (names in
``CHECKPOINT_NAMES``); ``norm_out``, modulated by ``scale_shift_table + temb`` (shift, scale), and ``proj_out`` end
it, unpatchified to the latents' layout. The latents in and out are constrained to
:data:`~eqxdiff.core.VIDEO_AXES` (``("batch", "frames", "height", "width", "channels")``), the video tokens to
``("batch", "seq", "embed")``: on a mesh with a ``context`` axis the tokens are split over it and the attention runs
the ring/Ulysses kernels.

Image tokens reach the cross-attention in one of two ways. Wan 2.1 I2V (``added_kv_proj_dim``) attends to them
through each block's ``add_k_proj`` / ``add_v_proj`` beside the text attention (diffusers cuts them off the front of
its context and requires 512 text tokens; here they arrive separately and any text length works); a model with
``image_dim`` but no ``added_kv_proj_dim`` (diffusers' tiny I2V tests) prepends them to the text context.

**Cross-attention keys and values** depend only on the prompt: :meth:`~WanTransformer3DModel.cross_attention_kv`
computes every block's (a :class:`~eqxdiff.models._wan_blocks.CrossKV` with a leading layers axis) and
``model(..., cross_kv=kv)`` uses them instead of projecting the text again at every denoising step.

Original Wan checkpoints (``diffusion_pytorch_model*.safetensors`` of the Wan-AI repositories, ComfyUI's
repackagings under ``model.diffusion_model.``) name the tensors otherwise;
:func:`eqxdiff.loading.formats.wan_transformer` holds their names as conversion rules.
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
from ..core import VIDEO_AXES, Plan, checkpoint_block, constrain
from ._base import PretrainedModel, TransformerConfig
from ._wan_blocks import TOKENS, CrossKV, WanTimeTextImageEmbedding, WanTransformerBlock

ROPE_THETA = 10000.0


@dataclasses.dataclass(frozen=True)
class WanTransformer3DConfig(TransformerConfig):
    """diffusers' ``WanTransformer3DModel`` config.json (defaults: Wan 2.1 14B text-to-video).

    ``image_dim``: CLIP's width, builds the image embedder (2.1 I2V: 1280); ``added_kv_proj_dim``: the width the
    image tokens reach the blocks with (the model width: 5120 for 14B), builds each block's added k/v projections;
    ``pos_embed_seq_len``: the first-last-frame model's learned image-token positions (514 = 2 x 257);
    ``rope_max_seq_len``: the longest patch-grid axis the rotary tables cover. diffusers always normalises queries and
    keys with an RMSNorm across heads whatever ``qk_norm`` says (its blocks never read it, and its folders hold the
    norms' weights), and so does eqxdiff: any value is taken and kept for saving."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int | None = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self):
        super().__post_init__()
        self.check(all(p > 0 for p in self.patch_size), "patch_size", "must be three positive sizes (frames, "
                   "height, width)")
        for key in ("num_attention_heads", "attention_head_dim", "in_channels", "text_dim", "freq_dim", "ffn_dim",
                    "rope_max_seq_len"):
            self.check(getattr(self, key) > 0, key, "must be a positive integer")
        self.check(self.num_layers >= 0, "num_layers", "must be a non-negative integer")
        self.check(self.attention_head_dim % 2 == 0, "attention_head_dim",
                   "must be even (rotary channels pair up; below 6 the rows and columns get none, as in diffusers)")
        for key in ("out_channels", "image_dim", "pos_embed_seq_len"):
            self.check(getattr(self, key) is None or getattr(self, key) > 0, key, "must be a positive integer or null")
        self.check(self.added_kv_proj_dim is None or self.added_kv_proj_dim == self.inner_dim, "added_kv_proj_dim",
                   f"must be null or the model width num_attention_heads * attention_head_dim = {self.inner_dim} "
                   "(the embedded image tokens reach the added k/v projections at that width)")
        self.check(self.added_kv_proj_dim is None or self.image_dim is not None, "added_kv_proj_dim",
                   "needs image_dim (the image embedder that makes the tokens it projects)")
        self.check(self.pos_embed_seq_len is None or self.image_dim is not None, "pos_embed_seq_len",
                   "needs image_dim (it positions the image embedder's input tokens)")


TimestepLike = (int | float | Float[Array, ""] | Int[Array, ""] | Float[Array, " #batch"] | Int[Array, " #batch"]
                | Float[Array, "#batch seq"] | Int[Array, "#batch seq"])


def _layer_inputs(blocks, per_layer):
    """``blocks`` paired with per-layer inputs (leading axis: layers) so that ``nn.run_layers`` hands each layer its
    slice: scanned together for stacked blocks, indexed for a tuple."""
    if isinstance(blocks, nn.Stacked):
        return eqx.tree_at(lambda s: s.layers, blocks, (blocks.layers, per_layer))
    return tuple((block, jax.tree.map(lambda a, i=i: a[i], per_layer)) for i, block in enumerate(blocks))


class WanTransformer3DModel(PretrainedModel):
    """diffusers' ``WanTransformer3DModel`` on channels-last video latents; names are diffusers' state-dict names
    (see the module docstring for inputs, structure and the cached cross-attention keys and values)."""

    config_class: ClassVar[type] = WanTransformer3DConfig
    SCAN_FIELDS: ClassVar[tuple[str, ...]] = ("blocks",)
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("wan_block",)
    # Some checkpoints hold an unused ``norm_added_q`` in the image-to-video blocks (diffusers'
    # ``_keys_to_ignore_on_load_unexpected``).
    CHECKPOINT_IGNORE: ClassVar[tuple[str, ...]] = (r"blocks\.\d+\.attn2\.norm_added_q\.(weight|bias)",)
    # diffusers' _keep_in_fp32_modules: loaded in bfloat16 or float16, the time embedder, the modulation tables and
    # the norms' weights (the cross-attention norm2, the image embedder's norm1 / norm2) stay float32 ("rope" holds
    # no weights); they run in float32 whatever the activations' dtype
    KEEP_IN_FLOAT32: ClassVar[tuple[str, ...]] = (
        "rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")

    patch_embedding: nn.Conv3d
    condition_embedder: WanTimeTextImageEmbedding
    blocks: tuple[WanTransformerBlock, ...] | nn.Stacked[WanTransformerBlock]
    norm_out: nn.LayerNorm
    proj_out: nn.Linear
    scale_shift_table: nn.ScaleShiftTable
    config: WanTransformer3DConfig = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: WanTransformer3DConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        c = config
        kp, kc, kb, ko, kt = jax.random.split(key, 5)
        d = c.inner_dim
        self.patch_embedding = nn.Conv3d(c.in_channels, d, c.patch_size, stride=c.patch_size, dtype=dtype, key=kp)
        self.condition_embedder = WanTimeTextImageEmbedding(d, c.freq_dim, c.text_dim, c.image_dim,
                                                            c.pos_embed_seq_len, dtype=dtype, key=kc)
        self.blocks = tuple(
            WanTransformerBlock(d, c.ffn_dim, c.num_attention_heads, cross_attn_norm=c.cross_attn_norm, eps=c.eps,
                                added_kv_proj_dim=c.added_kv_proj_dim, dtype=dtype, key=k)
            for k in jax.random.split(kb, c.num_layers))
        self.norm_out = nn.LayerNorm(d, eps=c.eps, elementwise_affine=False, dtype=dtype)
        self.proj_out = nn.Linear(d, c.output_channels * math.prod(c.patch_size), dtype=dtype, key=ko)
        self.scale_shift_table = nn.ScaleShiftTable(2, d, shape=(1, 2, d), dtype=dtype, key=kt)
        self.config = config

    # -- positions and shapes ------------------------------------------------------------------------------------

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid ``(frames, rows, columns)`` of latents of that size (checked to divide by the patch)."""
        size, patch = (frames, height, width), self.config.patch_size
        if any(s % p for s, p in zip(size, patch)):
            raise ValueError(f"WanTransformer3DModel: latents of {frames} frames x {height} x {width} do not divide "
                             f"into patches of {patch} (frames, height, width); crop or pad them to multiples")
        grid = tuple(s // p for s, p in zip(size, patch))
        if max(grid) > self.config.rope_max_seq_len:
            raise ValueError(f"WanTransformer3DModel: a patch grid of {grid} is longer than rope_max_seq_len="
                             f"{self.config.rope_max_seq_len} on some axis (the rotary tables end there); use "
                             "smaller latents or a config with a larger rope_max_seq_len")
        return grid

    def rotary_embedding(self, grid: tuple[int, int, int]) -> nn.Rope:
        """The rotary tables ``[f * h * w, head_dim]`` of a patch grid (float64 maths, float32 tables)."""
        return nn.wan_rope(self.config.attention_head_dim, grid, ROPE_THETA)

    # -- conditioning ------------------------------------------------------------------------------------------------

    def _contexts(self, encoder_hidden_states, encoder_hidden_states_image, dtype):
        """The embedded text and image tokens: ``(context, image_context)``; without added k/v the image tokens are
        prepended to the context and ``image_context`` is ``None``."""
        c, embed = self.config, self.condition_embedder
        context = embed.text_embedder(jnp.asarray(encoder_hidden_states, dtype))
        if (encoder_hidden_states_image is None) != (embed.image_embedder is None):
            raise ValueError("WanTransformer3DModel: " + (
                "encoder_hidden_states_image= (CLIP's image tokens) is required by this image-to-video model "
                f"(image_dim={c.image_dim})" if encoder_hidden_states_image is None else
                "encoder_hidden_states_image= was given but this model has no image embedder (image_dim=null, a "
                "text-to-video or Wan 2.2 model); leave it out"))
        if encoder_hidden_states_image is None:
            return context, None
        image = embed.image_embedder(jnp.asarray(encoder_hidden_states_image, dtype))
        if image.shape[0] != context.shape[0]:
            raise ValueError(f"WanTransformer3DModel: {image.shape[0]} samples of image tokens for {context.shape[0]} "
                             "of text; give one image (or first-last pair) per sample")
        if c.added_kv_proj_dim is not None:
            return context, image
        return jnp.concatenate([image, context], axis=1), None

    def cross_attention_kv(self, encoder_hidden_states: Float[Array, "batch text_seq text_dim"],
                           encoder_hidden_states_image: Float[Array, "b img_seq image_dim"] | None = None, *,
                           dtype=None) -> CrossKV:
        """Every block's cross-attention keys and values for this prompt (and image), ``[layers, batch, ctx_seq,
        heads, head_dim]``: compute once, pass as ``cross_kv=`` at every step. ``dtype``: the activations' (default:
        the model's)."""
        dtype = dtype or self.proj_out.weight.dtype
        context, image = self._contexts(encoder_hidden_states, encoder_hidden_states_image, dtype)
        if isinstance(self.blocks, nn.Stacked):
            kv = eqx.filter_vmap(lambda block: block.cross_kv(context, image))(self.blocks.layers)
            return CrossKV(*kv)
        per_block = [block.cross_kv(context, image) for block in self.blocks]
        return CrossKV(*(None if parts[0] is None else jnp.stack(parts) for parts in zip(*per_block)))

    # -- forward -------------------------------------------------------------------------------------------------

    def _head(self, x, temb, grid, dtype):
        """Modulated ``norm_out``, ``proj_out`` and unpatchify: tokens -> ``[b, frames, height, width, out]``."""
        shift, scale = self.scale_shift_table(temb, shared=True)
        x = nn.modulate(self.norm_out(x.astype(jnp.float32)), shift, scale).astype(dtype)
        x = constrain(self.proj_out(x), self.plan, ("batch", "seq", None))
        (f, h, w), (pt, ph, pw) = grid, self.config.patch_size
        x = x.reshape(x.shape[0], f, h, w, pt, ph, pw, -1).transpose(0, 1, 4, 2, 5, 3, 6, 7)
        return constrain(x.reshape(x.shape[0], f * pt, h * ph, w * pw, -1), self.plan, VIDEO_AXES)

    @typechecked
    def __call__(self, hidden_states: Float[Array, "batch frames height width in_channels"], timestep: TimestepLike,
                 encoder_hidden_states: Float[Array, "batch text_seq text_dim"] | None = None,
                 encoder_hidden_states_image: Float[Array, "b img_seq image_dim"] | None = None, *,
                 cross_kv: CrossKV | None = None) -> Float[Array, "batch frames height width out_channels"]:
        """Predict the flow for video latents (see the module docstring for the inputs). Give the prompt either as
        ``encoder_hidden_states`` (and ``encoder_hidden_states_image``) or as ``cross_kv``
        (:meth:`cross_attention_kv`), not both. Returns the activations' dtype (that of ``hidden_states``)."""
        if (encoder_hidden_states is None) == (cross_kv is None):
            raise ValueError("WanTransformer3DModel: give the prompt as encoder_hidden_states= (and "
                             "encoder_hidden_states_image=) or as cross_kv=model.cross_attention_kv(...), not both "
                             "and not neither")
        if cross_kv is not None and encoder_hidden_states_image is not None:
            raise ValueError("WanTransformer3DModel: with cross_kv= the image tokens are in it already; leave "
                             "encoder_hidden_states_image out")
        b, frames, height, width, _ = hidden_states.shape
        dtype = hidden_states.dtype
        grid = self.grid(frames, height, width)
        rope = self.rotary_embedding(grid).as_arrays()  # one constant per table under jit
        x = self.patch_embedding(constrain(hidden_states, self.plan, VIDEO_AXES)).reshape(b, math.prod(grid), -1)
        x = constrain(x, self.plan, TOKENS)
        t = nn.token_timesteps(timestep, b, x.shape[1], who="WanTransformer3DModel", tokens="video tokens")
        temb, proj = self.condition_embedder.time(t, dtype)
        proj = proj.reshape(*proj.shape[:-1], 6, -1)
        context = image = None
        if cross_kv is None:
            context, image = self._contexts(encoder_hidden_states, encoder_hidden_states_image, dtype)

        def step(layer, x):
            block, kv = layer
            x = checkpoint_block(block, self.plan)(constrain(x, self.plan, TOKENS), proj, rope, context, image, kv=kv)
            return checkpoint_name(x, "wan_block")

        x, _ = nn.run_layers(_layer_inputs(self.blocks, cross_kv), step, x)
        return self._head(x, temb, grid, dtype)


__all__ = ["CrossKV", "WanTransformer3DConfig", "WanTransformer3DModel"]
