"""``UNet2DConditionModel``: the denoiser of Stable Diffusion 1.x, 2.x and SDXL, loadable from diffusers folders.

>>> unet = eqxdiff.load("path/to/sd15", subfolder="unet")
>>> eps = unet(latents, t, text_states)            # latents [batch, 64, 64, 4], channels-last
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Bool, Float, Int, PRNGKeyArray, typechecked
from ..core import ConfigError, ModelConfig, Plan, checkpoint_block, constrain
from ..nn import Conv2d, Embedding, GaussianFourierProjection, GroupNorm, Linear, TimestepEmbedding, activation
from ._base import PretrainedModel
from ._unet_blocks import (
    AttentionSpec,
    DownBlock,
    DownBlockSpec,
    MidBlock,
    MidBlockSpec,
    ResnetSpec,
    UpBlock,
    UpBlockSpec,
    add_residuals,
)
from ._unet_encoder import (
    IMAGE,
    build_class_embedding,
    build_encoder,
    check_conditioning,
    embed_class,
    embed_time,
    run_encoder,
)

DOWN_BLOCK_TYPES = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCK_TYPES = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCK_TYPES = ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D", None)  # UNetMidBlock2D: one ResNet
CLASS_EMBED_TYPES = (None, "timestep", "identity", "projection", "simple_projection")
_ACTIVATIONS = ("silu", "swish", "mish", "gelu", "relu")  # what diffusers' get_activation knows


@dataclasses.dataclass(frozen=True)
class UNet2DConditionConfig(ModelConfig):
    """diffusers' ``UNet2DConditionModel`` config.json. Per-block settings may be one value or one per down block
    (the up path uses them reversed). As in diffusers, ``attention_head_dim`` holds the number of heads unless
    ``num_attention_heads`` is set; the head size is ``channels // heads``. Keys that only matter for block types
    eqxdiff does not build (``resnet_skip_time_act``, ``resnet_out_scale_factor``, ``cross_attention_norm``,
    ``mid_block_only_cross_attention``, ``addition_embed_type_num_heads``) are kept but have no effect, as in
    diffusers for these blocks; ``dropout`` is ignored (inference). A class embedding (``num_class_embeds``: a
    table, e.g. the x4 upscaler's noise level; ``class_embed_type``: ``"timestep"`` sinusoid + MLP, ``"identity"``,
    ``"projection"`` MLP or ``"simple_projection"`` linear of ``projection_class_embeddings_input_dim`` features)
    is added to the time embedding (concatenated with ``class_embeddings_concat``) from ``class_labels``.
    ``encoder_hid_dim`` (``encoder_hid_dim_type="text_proj"``, its default then, as in diffusers): the text states
    of that width are first projected to ``cross_attention_dim`` (``encoder_hid_proj``). ``time_embedding_type=
    "fourier"``: the timestep's features are Gaussian Fourier ones (``time_proj.weight``; ``time_embed_dim``
    defaults to twice the first block's width then)."""

    HID_DIM_DEFAULT_TYPE: ClassVar = "text_proj"  # encoder_hid_dim_type when only encoder_hid_dim is set
    SUPPORTED_VALUES: ClassVar = {
        "resnet_time_scale_shift": ("default", "scale_shift"),
        "time_embedding_type": ("positional", "fourier"),
        "class_embed_type": CLASS_EMBED_TYPES,
        "encoder_hid_dim_type": (None, "text_proj"),
        "addition_embed_type": (None, "text_time"),
        "attention_type": ("default",),
        "mid_block_type": MID_BLOCK_TYPES,
    }

    sample_size: int | tuple[int, int] | None = None
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: float = 0
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int | tuple[int, ...] = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    dropout: float = 0.0
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int | tuple[int, ...] = 1280
    transformer_layers_per_block: int | tuple = 1
    reverse_transformer_layers_per_block: tuple | None = None
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    attention_head_dim: int | tuple[int | None, ...] = 8
    num_attention_heads: int | tuple[int | None, ...] | None = None
    dual_cross_attention: bool = False
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool | None = False  # attention always computes its softmax in float32
    resnet_time_scale_shift: str = "default"
    resnet_skip_time_act: bool = False
    resnet_out_scale_factor: float = 1.0
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None
    time_embedding_act_fn: str | None = None
    timestep_post_act: str | None = None
    time_cond_proj_dim: int | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    projection_class_embeddings_input_dim: int | None = None
    attention_type: str = "default"
    class_embeddings_concat: bool = False
    mid_block_only_cross_attention: bool | None = None
    cross_attention_norm: str | None = None
    addition_embed_type_num_heads: int = 64

    def __post_init__(self):
        if self.encoder_hid_dim is not None and self.encoder_hid_dim_type is None:  # diffusers' default, written back
            object.__setattr__(self, "encoder_hid_dim_type", self.HID_DIM_DEFAULT_TYPE)
        super().__post_init__()
        n = self.num_blocks
        self.check(self.encoder_hid_dim_type is None or self.encoder_hid_dim is not None, "encoder_hid_dim",
                   f"must be set when encoder_hid_dim_type={self.encoder_hid_dim_type!r}")
        self.check(self.encoder_hid_dim is None or isinstance(self.cross_attention_dim, int), "cross_attention_dim",
                   "must be one number with encoder_hid_dim (diffusers projects the text states to it)")
        for key, names, allowed in (("down_block_types", self.down_block_types, DOWN_BLOCK_TYPES),
                                    ("up_block_types", self.up_block_types, UP_BLOCK_TYPES)):
            for name in names:
                self.check(name in allowed, key, f"contains {name!r}; eqxdiff builds {list(allowed)}")
        self.check(len(self.up_block_types) == n, "up_block_types", f"must have as many entries as "
                   f"down_block_types ({n})")
        self.check(len(self.block_out_channels) == n, "block_out_channels", f"must have one entry per down "
                   f"block ({n})")
        for key in ("only_cross_attention", "layers_per_block", "cross_attention_dim", "attention_head_dim",
                    "num_attention_heads", "transformer_layers_per_block"):
            self._per_block(key)
        self.check(isinstance(self.norm_num_groups, int) and all(c % self.norm_num_groups == 0
                                                                 for c in self.block_out_channels),
                   "norm_num_groups", f"must be an int dividing every block_out_channels {self.block_out_channels}")
        for key in ("act_fn", "time_embedding_act_fn", "timestep_post_act"):
            value = getattr(self, key)
            self.check(value is None and key != "act_fn" or value in _ACTIVATIONS, key,
                       f"is not an activation eqxdiff knows; use one of {list(_ACTIVATIONS)}")
        self.check(not self.fourier or self.time_embed_dim % 2 == 0, "time_embedding_dim", "must be even with "
                   "time_embedding_type='fourier' (half sines, half cosines)")
        for key in ("conv_in_kernel", "conv_out_kernel"):
            self.check(getattr(self, key) % 2 == 1, key, "must be odd (the convolution keeps the spatial size)")
        nested = any(isinstance(t, tuple) for t in self._per_block("transformer_layers_per_block"))
        self.check(not nested or self.reverse_transformer_layers_per_block is not None,
                   "reverse_transformer_layers_per_block", "must be given when transformer_layers_per_block "
                   "lists per-layer counts (an asymmetric UNet)")
        lpb = self._per_block("layers_per_block")
        for key, counts, layers in (
                ("transformer_layers_per_block", self._per_block("transformer_layers_per_block"), lpb),
                ("reverse_transformer_layers_per_block",
                 self._per_block("reverse_transformer_layers_per_block")
                 if self.reverse_transformer_layers_per_block is not None else (),
                 [k + 1 for k in lpb[::-1]])):
            for i, t in enumerate(counts):
                self.check(not isinstance(t, tuple) or len(t) >= layers[i], key,
                           f"gives {len(t) if isinstance(t, tuple) else t} transformer depths for block {i}, which "
                           f"has {layers[i]} layers")
        if self.class_embed_type in ("projection", "simple_projection") and self.has_class_embedding:
            self.check(self.projection_class_embeddings_input_dim is not None, "projection_class_embeddings_input_dim",
                       f"must be set when class_embed_type={self.class_embed_type!r}")
        if self.addition_embed_type == "text_time":
            for key in ("addition_time_embed_dim", "projection_class_embeddings_input_dim"):
                self.check(getattr(self, key) is not None, key, "must be set when addition_embed_type='text_time'")
        self.check(not (self.dual_cross_attention and self.attention_specs), "dual_cross_attention", "is not "
                   "supported: diffusers builds DualTransformer2DModel blocks for it but cannot run them (its blocks "
                   "pass encoder_attention_mask, which DualTransformer2DModel.forward does not take: TypeError)")
        for spec in self.attention_specs:
            self.check(spec.heads is not None and spec.heads > 0, "attention_head_dim",
                       "must give a number of heads for every block with attention")
        dims = {s.cross_attention_dim for s in self.attention_specs}
        self.check(len(dims) <= 1, "cross_attention_dim", "must be the same for every block with attention: they "
                   "all attend to the same encoder_hidden_states")

    # -- per-block settings ------------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.down_block_types)

    def _per_block(self, key: str) -> tuple:
        value = getattr(self, key)
        if isinstance(value, tuple):
            self.check(len(value) == self.num_blocks, key, f"has {len(value)} entries; give one value or one per "
                       f"down block ({self.num_blocks})")
            return value
        return (value,) * self.num_blocks

    @property
    def heads(self) -> tuple[int | None, ...]:
        """Attention heads per down block: ``num_attention_heads or attention_head_dim`` (diffusers' naming quirk)."""
        return self._per_block("num_attention_heads") if self.num_attention_heads else \
            self._per_block("attention_head_dim")

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or (2 if self.fourier else 4) * self.block_out_channels[0]

    @property
    def fourier(self) -> bool:
        return self.time_embedding_type == "fourier"

    @property
    def timestep_input_dim(self) -> int:
        """The width of a timestep's features (sinusoids, or Gaussian Fourier ones) fed to ``time_embedding``."""
        return self.time_embed_dim if self.fourier else self.block_out_channels[0]

    @property
    def has_class_embedding(self) -> bool:
        return self.class_embed_type is not None or self.num_class_embeds is not None

    @property
    def context_dim(self) -> int | None:
        """The last axis of ``encoder_hidden_states`` (``None`` for a UNet without any attention)."""
        if self.encoder_hid_dim is not None:  # projected to cross_attention_dim first
            return self.encoder_hid_dim
        dims = [s.cross_attention_dim for s in self.attention_specs]
        return dims[0] if dims else None

    @property
    def downscale_factor(self) -> int:
        return 2 ** (self.num_blocks - 1)

    @property
    def resnet_spec(self) -> ResnetSpec:
        # diffusers widens the blocks' time embedding for class_embeddings_concat, class embedding or not
        temb = self.time_embed_dim * (2 if self.class_embeddings_concat else 1)
        return ResnetSpec(temb, self.norm_num_groups, self.norm_eps, self.act_fn,
                          time_embedding_norm=self.resnet_time_scale_shift)

    def _attention(self, i: int, has_attention: bool, layers) -> AttentionSpec | None:
        if not has_attention:
            return None
        return AttentionSpec(heads=self.heads[i], cross_attention_dim=self._per_block("cross_attention_dim")[i],
                             layers=tuple(layers), use_linear_projection=self.use_linear_projection,
                             only_cross_attention=bool(self._per_block("only_cross_attention")[i]))

    @property
    def down_blocks(self) -> tuple[DownBlockSpec, ...]:
        out, lpb, tl = self.block_out_channels, self._per_block("layers_per_block"), \
            self._per_block("transformer_layers_per_block")
        return tuple(DownBlockSpec(
            in_channels=out[max(i - 1, 0)], out_channels=out[i], num_layers=lpb[i],
            attention=self._attention(i, kind == "CrossAttnDownBlock2D",
                                      tl[i][:lpb[i]] if isinstance(tl[i], tuple) else (tl[i],) * lpb[i]),
            downsample=i < self.num_blocks - 1, downsample_padding=self.downsample_padding)
            for i, kind in enumerate(self.down_block_types))

    @property
    def mid_block(self) -> MidBlockSpec | None:
        if self.mid_block_type is None:
            return None
        if self.mid_block_type == "UNetMidBlock2D":
            return MidBlockSpec(self.block_out_channels[-1], None)
        tl = self._per_block("transformer_layers_per_block")[-1]
        attn = self._attention(self.num_blocks - 1, True, tl[:1] if isinstance(tl, tuple) else (tl,))
        # diffusers' UNetMidBlock2DCrossAttn takes no only_cross_attention: the mid block always self-attends.
        return MidBlockSpec(self.block_out_channels[-1], dataclasses.replace(attn, only_cross_attention=False))

    @property
    def up_blocks(self) -> tuple[UpBlockSpec, ...]:
        n, out = self.num_blocks, self.block_out_channels[::-1]
        lpb = self._per_block("layers_per_block")[::-1]
        tl = self.reverse_transformer_layers_per_block or self._per_block("transformer_layers_per_block")[::-1]
        specs = []
        for i, kind in enumerate(self.up_block_types):
            layers = lpb[i] + 1
            skips = (out[i],) * (layers - 1) + (out[min(i + 1, n - 1)],)
            per_layer = tl[i][:layers] if isinstance(tl[i], tuple) else (tl[i],) * layers
            specs.append(UpBlockSpec(prev_channels=out[max(i - 1, 0)], out_channels=out[i], skip_channels=skips,
                                     attention=self._attention(n - 1 - i, kind == "CrossAttnUpBlock2D", per_layer),
                                     upsample=i < n - 1))
        return tuple(specs)

    @property
    def attention_specs(self) -> tuple[AttentionSpec, ...]:
        specs = [b.attention for b in self.down_blocks + self.up_blocks if b.attention is not None]
        return tuple(specs + ([self.mid_block.attention] if self.mid_block and self.mid_block.attention else []))


TimestepLike = int | float | Float[Array, ""] | Int[Array, ""] | Float[Array, " #batch"] | Int[Array, " #batch"]


class UNet2DConditionModel(PretrainedModel):
    """The conditional UNet on channels-last latents; parameter names are diffusers' state-dict names."""

    config_class: ClassVar[type] = UNet2DConditionConfig
    # time_embedding_type="fourier": the angles t * w * 2 pi reach thousands of radians, and a bfloat16 w (8 bits)
    # loses their phase: diffusers' bfloat16 run of tests/test_unet.py's TestUNetLists is 21% off its float32 one.
    # These few weights stay float32 (diffusers keeps none of the UNet's; its float32 is the reference).
    KEEP_IN_FLOAT32: ClassVar[tuple[str, ...]] = ("time_proj",)

    conv_in: Conv2d
    time_proj: GaussianFourierProjection | None  # time_embedding_type="fourier" (sinusoids otherwise: no weights)
    time_embedding: TimestepEmbedding
    add_embedding: TimestepEmbedding | None
    class_embedding: TimestepEmbedding | Embedding | Linear | None
    encoder_hid_proj: Linear | None
    down_blocks: list[DownBlock]
    mid_block: MidBlock | None
    up_blocks: list[UpBlock]
    conv_norm_out: GroupNorm
    conv_out: Conv2d
    config: UNet2DConditionConfig = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: UNet2DConditionConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        c = config
        kin, kt, ka, kd, km, ku, kout = jax.random.split(key, 7)
        ch0 = c.block_out_channels[0]
        self.conv_in, self.time_embedding, self.add_embedding, self.down_blocks, self.mid_block = build_encoder(
            c, dtype=dtype, keys=(kin, kt, ka, kd, km))
        self.up_blocks = [UpBlock(s, c.resnet_spec, dtype=dtype, key=k)
                          for s, k in zip(c.up_blocks, jax.random.split(ku, c.num_blocks))]
        self.time_proj = GaussianFourierProjection(c.time_embed_dim // 2, flip_sin_to_cos=c.flip_sin_to_cos,
                                                   dtype=dtype, key=jax.random.fold_in(key, 9)) if c.fourier else None
        self.class_embedding = build_class_embedding(c, dtype, jax.random.fold_in(key, 7))
        self.encoder_hid_proj = None if c.encoder_hid_dim is None else Linear(
            c.encoder_hid_dim, c.cross_attention_dim, dtype=dtype, key=jax.random.fold_in(key, 8))
        self.conv_norm_out = GroupNorm(c.norm_num_groups, ch0, eps=c.norm_eps, dtype=dtype)
        self.conv_out = Conv2d(ch0, c.out_channels, c.conv_out_kernel, padding=c.conv_out_kernel // 2, dtype=dtype,
                               key=kout)
        self.config = config

    @typechecked
    def __call__(
        self,
        sample: Float[Array, "batch height width channels"],
        timestep: TimestepLike,
        encoder_hidden_states: Float[Array, "batch seq cross_dim"],
        *,
        text_embeds: Float[Array, "batch text_embed"] | None = None,
        time_ids: Float[Array, "batch num_time_ids"] | Int[Array, "batch num_time_ids"] | None = None,
        timestep_cond: Float[Array, "batch cond_dim"] | None = None,
        class_labels: Float[Array, "..."] | Int[Array, "..."] | None = None,
        encoder_attention_mask: Bool[Array, "batch seq"] | None = None,
        down_block_additional_residuals: tuple[Float[Array, "batch _ _ _"], ...] | None = None,
        mid_block_additional_residual: Float[Array, "batch _ _ _"] | None = None,
        freeu: Float[Array, "batch 4"] | None = None,
        cross_attention_kwargs: Mapping[str, Any] | None = None,
    ) -> Float[Array, "batch height width out_channels"]:
        """Predict the model output (noise, v or sample, as trained) for ``sample`` at ``timestep``.

        ``timestep`` is a number or a ``[batch]`` (or ``[1]``) array. SDXL-style models (``text_time``) also need
        the pooled ``text_embeds`` and the ``time_ids`` (original size, crop, target size); a model with a class
        embedding its ``class_labels`` (``[batch]`` ids or timesteps, or ``[batch, features]``).
        ``encoder_attention_mask`` (``True`` = attend) masks text tokens in cross-attention. ControlNet residuals,
        channels-last, are added to the skips (one per skip, in the order the down path makes them) and to the
        mid-block output. ``freeu``: FreeU's ``(s1, s2, b1, b2)`` per row, for the first two up blocks.
        ``cross_attention_kwargs`` go to every cross-attention, as diffusers hands them to its attention processors
        (``{"ip_adapter_masks": ...}`` for IP-Adapters: :class:`~eqxdiff.models.ip_adapter.IPAdapterAttention`).
        """
        c = self.config
        b, height, width, channels = sample.shape
        self._check_inputs(sample, encoder_hidden_states, text_embeds, time_ids, down_block_additional_residuals,
                           mid_block_additional_residual)
        dtype = sample.dtype
        if c.center_input_sample:
            sample = 2 * sample - 1.0

        emb = embed_time(self, timestep, b, dtype, text_embeds=text_embeds, time_ids=time_ids,
                         timestep_cond=timestep_cond, class_emb=embed_class(self, class_labels, b))
        context = encoder_hidden_states.astype(dtype)
        context = context if self.encoder_hid_proj is None else self.encoder_hid_proj(context)
        mask = encoder_attention_mask

        plan, image = self.plan, IMAGE
        h = constrain(self.conv_in(constrain(sample, plan, image)), plan, image)
        h, skips = run_encoder(self, h, emb, context, mask, cross_attention_kwargs)
        if down_block_additional_residuals is not None:
            skips = add_residuals(skips, down_block_additional_residuals)
        if mid_block_additional_residual is not None:
            h = h + mid_block_additional_residual.astype(dtype)

        # As diffusers: if the size is not a multiple of 2**(blocks-1), upsample to the next skip's size.
        forward_size = height % c.downscale_factor != 0 or width % c.downscale_factor != 0
        for i, block in enumerate(self.up_blocks):
            n = len(block.resnets)
            block_skips, skips = skips[-n:], skips[:-n]
            size = tuple(skips[-1].shape[1:3]) if forward_size and i < len(self.up_blocks) - 1 else None
            fu = None if freeu is None or i > 1 else (freeu[:, i], freeu[:, 2 + i])  # resolution index i
            h = constrain(checkpoint_block(block, plan)(h, block_skips, emb, context, mask, size, fu,
                                                        cross_attention_kwargs), plan, image)

        h = activation(c.act_fn)(self.conv_norm_out(h))
        return constrain(self.conv_out(h), plan, image)

    def _check_inputs(self, sample, context, text_embeds, time_ids, down_res, mid_res):
        check_conditioning(self, sample, context, text_embeds, time_ids)
        if (down_res is None) != (mid_res is None):
            raise ValueError(f"{type(self).__name__}: pass down_block_additional_residuals and "
                             "mid_block_additional_residual together (ControlNet); T2I-Adapter style intra-block "
                             "residuals are not supported")


__all__ = ["UNet2DConditionConfig", "UNet2DConditionModel", "ConfigError"]
