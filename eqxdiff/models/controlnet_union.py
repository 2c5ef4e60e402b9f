"""``ControlNetUnionModel``: one ControlNet for several kinds of control image (xinsir's ControlNet++ "union" for
SDXL: canny, depth, pose, ... picked by a control mode), loadable from diffusers folders.

It is a :class:`~eqxdiff.models.controlnet.ControlNetModel` (held as ``controlnet``; its weights keep their
diffusers names at the top level) with a fusion step before the down blocks. Each control image is embedded as a
ControlNet embeds it; its spatial mean plus the ``task_embedding`` row of its control mode is a token, the latents'
``conv_in`` mean one more; the tokens go through ``num_trans_layer`` CLIP-style residual attention blocks
(``transformer_layes``, diffusers' spelling), and each control image's embedding plus ``spatial_ch_projs`` of its
token is added to ``conv_in``'s output. The time embedding also gets the one-hot ``control_type`` (sinusoidal
embeddings of each entry through ``control_add_embedding``).

A quirk kept for parity: diffusers' blocks use ``torch.nn.MultiheadAttention`` sequence-first while the tokens are
batch-first, so each token attends across the *batch* (the samples of one call, e.g. the two halves of a guided
batch, see each other's tokens), not across the controls. eqxdiff computes the same; a model output depends on
what else is in its batch.

>>> net = eqxdiff.load("path/to/controlnet-union-sdxl")
>>> control_type = jnp.zeros((2, 6)).at[:, [1, 3]].set(1.0)         # modes 1 and 3 on, for each sample
>>> down, mid = net(latents, t, text, [depth, pose], control_type, [1, 3], conditioning_scale=[1.0, 0.5],
...                 text_embeds=pooled, time_ids=time_ids)
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp

from .._typing import Array, Float, Int, PRNGKeyArray, typechecked
from ..core import ConfigError, Plan, constrain
from ..nn import (
    LayerNorm,
    Linear,
    ProjectedAttention,
    TimestepEmbedding,
    activation,
    build_abstract,
    init_normal,
    init_uniform,
    timestep_embedding,
)
from ._base import PretrainedModel
from ._unet_encoder import IMAGE, check_conditioning, embed_class, embed_time
from .controlnet import ControlNetConfig, ControlNetModel, ControlNetOutput
from .unet2d import TimestepLike, UNet2DConditionModel

__all__ = ["ControlNetUnionConfig", "ControlNetUnionModel", "MultiControlNetUnionModel", "ResidualAttentionBlock",
           "SequenceFirstSelfAttention", "control_type_vector"]

_UNION_KEYS = ("num_control_type", "num_trans_channel", "num_trans_head", "num_trans_layer", "num_proj_channel")


@dataclasses.dataclass(frozen=True)
class ControlNetUnionConfig(ControlNetConfig):
    """diffusers' ``ControlNetUnionModel`` config.json: :class:`ControlNetConfig`'s keys (its mid block is always
    ``UNetMidBlock2DCrossAttn`` and its control images RGB: diffusers' forward refuses ``bgr``) plus the union's.

    ``num_control_type``: the control modes (rows of ``task_embedding``, entries of ``control_type``).
    ``num_trans_channel`` / ``num_trans_head`` / ``num_trans_layer``: width, heads and depth of the token
    transformer; ``num_proj_channel``: the width ``spatial_ch_projs`` maps a token to. Both widths are
    ``block_out_channels[0]`` (the tokens are spatial means of ``conv_in``-wide maps, added back to them).
    ``addition_time_embed_dim`` sizes each entry's sinusoidal embedding of ``control_type`` (so it is required).
    diffusers' union takes no ``encoder_hid_dim_type`` and builds no ``encoder_hid_proj`` (``encoder_hid_dim`` is
    kept, unused)."""

    HID_DIM_DEFAULT_TYPE: ClassVar = None
    SUPPORTED_VALUES: ClassVar = {
        **ControlNetConfig.SUPPORTED_VALUES,
        "mid_block_type": ("UNetMidBlock2DCrossAttn",),
        "controlnet_conditioning_channel_order": ("rgb",),
        "encoder_hid_dim_type": (None,),
    }

    conditioning_embedding_out_channels: tuple[int, ...] = (48, 96, 192, 384)
    num_control_type: int = 6
    num_trans_channel: int = 320
    num_trans_head: int = 8
    num_trans_layer: int = 1
    num_proj_channel: int = 320

    def __post_init__(self):
        super().__post_init__()
        ch0 = self.block_out_channels[0]
        self.check(self.num_control_type >= 1, "num_control_type", "must be at least 1")
        self.check(self.num_trans_layer >= 0, "num_trans_layer", "must not be negative")
        for key in ("num_trans_channel", "num_proj_channel"):
            self.check(getattr(self, key) == ch0, key, f"must equal block_out_channels[0]={ch0} (the control "
                       "tokens are spatial means of conv_in-wide feature maps and are added back to them)")
        self.check(self.num_trans_head >= 1 and self.num_trans_channel % self.num_trans_head == 0, "num_trans_head",
                   f"must divide num_trans_channel={self.num_trans_channel}")
        self.check(self.addition_time_embed_dim is not None, "addition_time_embed_dim", "must be set: it sizes the "
                   "sinusoidal embedding of each control_type entry")

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if k != "mid_block_type"}  # not a union key


def control_type_vector(control_mode: Sequence[int], num_control_type: int) -> jax.Array:
    """diffusers' ``control_type``: float32 ``[num_control_type]``, 1 at each of ``control_mode``, else 0."""
    modes = [int(m) for m in control_mode]
    bad = [m for m in modes if not 0 <= m < num_control_type]
    if bad:
        raise ValueError(f"control_mode {bad[0]} is out of range: this ControlNet-Union knows {num_control_type} "
                         f"control modes, 0 to {num_control_type - 1}")
    return jnp.zeros((num_control_type,), jnp.float32).at[jnp.asarray(modes, jnp.int32)].set(1.0)


# -- the token transformer ------------------------------------------------------------------------------------------

class SequenceFirstSelfAttention(eqx.Module):
    """``torch.nn.MultiheadAttention`` as self-attention, sequence-first (its ``batch_first=False`` default) and
    under its names: the fused ``in_proj_weight`` / ``in_proj_bias`` (``[q; k; v]`` on the output axis: a
    :class:`~eqxdiff.nn.Linear` named as torch names them, with its adapter slot), and ``out_proj``. The heads split,
    the kernel and ``out_proj`` are a :class:`~eqxdiff.nn.ProjectedAttention`'s."""

    TORCH_RENAMES: ClassVar = {"attention": "", "in_proj": ""}  # its to_out is torch's out_proj (names="clip")

    in_proj: Linear
    attention: ProjectedAttention

    def __init__(self, dim: int, heads: int, *, dtype=jnp.float32, key: PRNGKeyArray):
        kw, ka = jax.random.split(key)
        bound = math.sqrt(6.0 / (dim + 3 * dim))  # torch's xavier_uniform_ of the fused weight
        in_proj = Linear(dim, 3 * dim, axes=(None, "embed"), names=("in_proj_weight", "in_proj_bias"), dtype=dtype,
                         key=kw)
        self.in_proj = eqx.tree_at(lambda lin: (lin.weight, lin.bias), in_proj,
                                   (init_uniform(kw, (3 * dim, dim), bound, dtype),
                                    jnp.zeros((3 * dim,), dtype)))
        self.attention = ProjectedAttention(dim, heads=heads, dim_head=dim // heads, out_bias=True, names="clip",
                                            token_axis=None, dtype=dtype, key=ka)

    @typechecked
    def __call__(self, x: Float[Array, "seq batch dim"]) -> Float[Array, "seq batch dim"]:
        q, k, v = jnp.split(jnp.swapaxes(self.in_proj(x), 0, 1), 3, axis=-1)
        return jnp.swapaxes(self.attention(q, k, v), 0, 1)


class _QuickGeluMlp(eqx.Module):
    """``c_proj(quick_gelu(c_fc(x)))``, four times wide (CLIP's MLP under OpenAI CLIP's names)."""

    c_fc: Linear
    c_proj: Linear

    def __init__(self, dim: int, *, dtype=jnp.float32, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.c_fc = Linear(dim, 4 * dim, axes=("mlp", "embed"), dtype=dtype, key=k1)
        self.c_proj = Linear(4 * dim, dim, axes=("embed", "mlp"), dtype=dtype, key=k2)

    def __call__(self, x):
        return self.c_proj(activation("quick_gelu")(self.c_fc(x)))


class ResidualAttentionBlock(eqx.Module):
    """diffusers' ``ResidualAttentionBlock`` (OpenAI CLIP's): ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.
    ``x`` is ``[batch, tokens, dim]``, read by the attention sequence-first: each token attends across the batch
    (see the module docstring)."""

    attn: SequenceFirstSelfAttention
    ln_1: LayerNorm
    mlp: _QuickGeluMlp
    ln_2: LayerNorm

    def __init__(self, dim: int, heads: int, *, dtype=jnp.float32, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.attn = SequenceFirstSelfAttention(dim, heads, dtype=dtype, key=ka)
        self.ln_1 = LayerNorm(dim, dtype=dtype)
        self.mlp = _QuickGeluMlp(dim, dtype=dtype, key=km)
        self.ln_2 = LayerNorm(dim, dtype=dtype)

    @typechecked
    def __call__(self, x: Float[Array, "batch tokens dim"]) -> Float[Array, "batch tokens dim"]:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# -- the model --------------------------------------------------------------------------------------------------

Scale = float | int | Float[Array, ""]


def _per_condition(conditioning_scale, n: int) -> list:
    """One scale per control image from a number, a sequence or a ``[n]`` array."""
    if isinstance(conditioning_scale, (int, float)) or (hasattr(conditioning_scale, "ndim")
                                                         and conditioning_scale.ndim == 0):
        return [conditioning_scale] * n
    scales = list(conditioning_scale)
    if len(scales) != n:
        raise ValueError(f"ControlNetUnionModel: conditioning_scale has {len(scales)} entries for {n} control "
                         "images; give one number or one per image")
    return scales


class ControlNetUnionModel(PretrainedModel):
    """ControlNet-Union on channels-last latents (see the module docstring); parameter names are diffusers'
    state-dict names. Built zero-initialised where diffusers is (the ControlNet's zero convolutions and
    ``spatial_ch_projs``)."""

    config_class: ClassVar[type] = ControlNetUnionConfig
    CHECKPOINT_NAMES: ClassVar[tuple[str, ...]] = ("resnet", "transformer")  # tagged by its ControlNet's blocks
    TORCH_RENAMES: ClassVar = {"controlnet": ""}  # the ControlNet's weights at the top level, as diffusers has them
    PARAM_AXES: ClassVar = {"task_embedding": (None, "embed")}

    controlnet: ControlNetModel
    task_embedding: Float[Array, "num_control_type channels"]
    transformer_layes: list[ResidualAttentionBlock]
    spatial_ch_projs: Linear
    control_add_embedding: TimestepEmbedding
    config: ControlNetUnionConfig = eqx.field(static=True)
    plan: Plan | None = eqx.field(static=True, default=None)  # eqxdiff.parallel.with_plan sets it

    def __init__(self, config: ControlNetUnionConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        if not isinstance(config, ControlNetUnionConfig):
            raise ConfigError(f"ControlNetUnionModel takes a ControlNetUnionConfig, got {type(config).__name__}")
        kc, ku = jax.random.split(key)
        self.controlnet = ControlNetModel(config, dtype=dtype, key=kc)
        (self.task_embedding, self.transformer_layes, self.spatial_ch_projs,
         self.control_add_embedding) = _union_parts(config, dtype, ku)
        self.config = config

    @classmethod
    def from_unet(cls, unet: UNet2DConditionModel, *, controlnet_conditioning_channel_order: str = "rgb",
                  conditioning_embedding_out_channels=(16, 32, 96, 256), load_weights_from_unet: bool = True,
                  key: PRNGKeyArray | None = None, **union_keys) -> "ControlNetUnionModel":
        """A new ControlNet-Union for ``unet`` (diffusers' ``ControlNetUnionModel.from_unet``): its config, and with
        ``load_weights_from_unet`` its encoder's weights; the union's layers and the control image's embedding are
        new (``key``), the residual convolutions and ``spatial_ch_projs`` zero. ``union_keys`` set
        ``num_control_type``, ``num_trans_head``, ``num_trans_layer`` ...; the token widths ``num_trans_channel`` /
        ``num_proj_channel`` default to ``block_out_channels[0]`` (diffusers writes 320: the same for SDXL's UNets,
        while at another width its union cannot run). Two differences from diffusers': ``add_embedding`` is copied
        from the UNet, as :meth:`ControlNetModel.from_unet` does (diffusers' union leaves it at its random init), and
        a UNet whose mid block is not ``UNetMidBlock2DCrossAttn`` (the union's) is refused when its weights are
        copied (diffusers fails on their shapes)."""
        unet_config, width = unet.config, unet.config.block_out_channels[0]
        if unet_config.mid_block_type != "UNetMidBlock2DCrossAttn":
            if load_weights_from_unet:
                raise ConfigError("ControlNetUnionModel.from_unet: the UNet's mid block is "
                                  f"{unet_config.mid_block_type}, a union's is UNetMidBlock2DCrossAttn, so its "
                                  "weights cannot be copied; pass load_weights_from_unet=False for a new union of "
                                  "this UNet's shape")
            unet_config = dataclasses.replace(unet_config, mid_block_type="UNetMidBlock2DCrossAttn")
        config = ControlNetUnionConfig.from_unet_config(
            unet_config, conditioning_embedding_out_channels=tuple(conditioning_embedding_out_channels),
            controlnet_conditioning_channel_order=controlnet_conditioning_channel_order,
            **{"num_trans_channel": width, "num_proj_channel": width, **union_keys})
        dtype, key = unet.conv_in.weight.dtype, jax.random.key(0) if key is None else key
        if not load_weights_from_unet:
            return cls(config, dtype=dtype, key=key)
        kc, ku = jax.random.split(key)
        model = build_abstract(cls, config, dtype=dtype, key=key)
        parts = (ControlNetModel.with_unet_encoder(config, unet, key=kc), *_union_parts(config, dtype, ku))
        return eqx.tree_at(lambda m: (m.controlnet, m.task_embedding, m.transformer_layes, m.spatial_ch_projs,
                                      m.control_add_embedding), model, parts)

    @typechecked
    def __call__(
        self,
        sample: Float[Array, "batch height width channels"],
        timestep: TimestepLike,
        encoder_hidden_states: Float[Array, "batch seq cross_dim"],
        controlnet_cond: Sequence[Float[Array, "batch cond_height cond_width cond_channels"]],
        control_type: Float[Array, "batch num_control_type"],
        control_type_idx: Sequence[int] | Int[Array, " conditions"],
        *,
        conditioning_scale: Scale | Sequence[Scale] | Float[Array, " conditions"] = 1.0,
        from_multi: bool = False,
        guess_mode: bool = False,
        text_embeds: Float[Array, "batch text_embed"] | None = None,
        time_ids: Float[Array, "batch num_time_ids"] | Int[Array, "batch num_time_ids"] | None = None,
        class_labels: Float[Array, "..."] | Int[Array, "..."] | None = None,
    ) -> ControlNetOutput:
        """Residuals for a UNet denoising ``sample`` at ``timestep``, steered by the control images
        ``controlnet_cond`` (a list, channels-last, each as :meth:`ControlNetModel.__call__` takes one) of the
        control modes ``control_type_idx`` (one per image; ints or an int array), with ``control_type`` the
        ``[batch, num_control_type]`` one-hot of the modes in use (:func:`control_type_vector`).

        ``conditioning_scale``: one number or one per image (numbers or traced scalars). As diffusers: with one
        image, or ``from_multi`` (a :class:`MultiControlNetUnionModel` passes it), the first scale multiplies the
        residuals; with several images each scales its own image's contribution to the fusion and the residuals
        are left unscaled. ``guess_mode`` scales the residuals from 0.1 to 1 as a ControlNet's (times that first
        scale where it applies). SDXL nets (``text_time``) also need ``text_embeds`` and ``time_ids``; a net with a
        class embedding its ``class_labels``."""
        net, c, plan = self.controlnet, self.config, self.plan
        check_conditioning(self, sample, encoder_hidden_states, text_embeds, time_ids)
        n = len(controlnet_cond)
        if n == 0:
            raise ValueError("ControlNetUnionModel: controlnet_cond is empty; pass a list of control images")
        if len(control_type_idx) != n:
            raise ValueError(f"ControlNetUnionModel: {n} control images need as many control modes in "
                             f"control_type_idx, got {len(control_type_idx)}")
        if isinstance(control_type_idx, Sequence):
            bad = [int(i) for i in control_type_idx if not 0 <= int(i) < c.num_control_type]
            if bad:
                raise ValueError(f"ControlNetUnionModel: control mode {bad[0]} is out of range; this net knows "
                                 f"{c.num_control_type} control modes, 0 to {c.num_control_type - 1}")
        b = sample.shape[0]
        if control_type.shape != (b, c.num_control_type):
            raise ValueError(f"ControlNetUnionModel: control_type must be [{b}, {c.num_control_type}] = [batch, "
                             f"num_control_type] (one-hot of the control modes in use), got {control_type.shape}")
        for i, image in enumerate(controlnet_cond):
            net.check_control_image(sample, image, f"controlnet_cond[{i}]")
        scales = _per_condition(conditioning_scale, n)
        joint = from_multi or n == 1  # diffusers: the first scale on the residuals, else each on its image
        dtype = sample.dtype

        emb = embed_time(net, timestep, b, jnp.float32, text_embeds=text_embeds, time_ids=time_ids,
                         class_emb=embed_class(net, class_labels, b))
        control = timestep_embedding(control_type.reshape(-1), c.addition_time_embed_dim,
                                     flip_sin_to_cos=c.flip_sin_to_cos, freq_shift=c.freq_shift)
        emb = (emb + self.control_add_embedding(control.reshape(b, -1))).astype(dtype)
        context = encoder_hidden_states.astype(dtype)

        h = net.conv_in(constrain(sample, plan, IMAGE))
        idx = jnp.asarray(control_type_idx, jnp.int32)
        conditions, tokens = [], []
        for i, image in enumerate(controlnet_cond):
            condition = net.controlnet_cond_embedding(image.astype(dtype))
            token = _spatial_mean(condition) + self.task_embedding[idx[i]].astype(dtype)
            if not joint:
                token, condition = token * scales[i], condition * scales[i]
            tokens.append(token)
            conditions.append(condition)
        x = jnp.stack([*tokens, _spatial_mean(h)], axis=1)  # [batch, images + 1, channels]
        for layer in self.transformer_layes:
            x = layer(x)
        fused = None
        for i, condition in enumerate(conditions):
            alpha = self.spatial_ch_projs(x[:, i])[:, None, None, :]
            term = condition + (alpha if joint else alpha * scales[i])
            fused = term if fused is None else fused + term
        return net.residuals(h + fused, emb, context, conditioning_scale=scales[0] if joint else 1.0,
                             guess_mode=guess_mode)


def _union_parts(c: ControlNetUnionConfig, dtype, key: PRNGKeyArray) -> tuple:
    """The union's own layers, new (diffusers' init): ``task_embedding``, ``transformer_layes``,
    ``spatial_ch_projs`` (zeros) and ``control_add_embedding``."""
    kt, kl, ke = jax.random.split(key, 3)
    width = c.num_trans_channel
    task = (math.sqrt(width) * init_normal(kt, (c.num_control_type, width), jnp.float32)).astype(dtype)
    layers = [ResidualAttentionBlock(width, c.num_trans_head, dtype=dtype, key=k)
              for k in jax.random.split(kl, c.num_trans_layer)]
    shapes = eqx.filter_eval_shape(Linear, width, c.num_proj_channel, dtype=dtype, key=kl)
    projection = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # zero_module
    add = TimestepEmbedding(c.addition_time_embed_dim * c.num_control_type, c.time_embed_dim, dtype=dtype, key=ke)
    return task, layers, projection, add


def _spatial_mean(x: Array) -> Array:
    return jnp.mean(x.astype(jnp.float32), axis=(1, 2)).astype(x.dtype)


class MultiControlNetUnionModel(eqx.Module):
    """Several ControlNet-Union nets, each with its own control images, modes and scale, residuals summed
    (diffusers' ``MultiControlNetUnionModel``; each net is called with ``from_multi=True``. diffusers skips a net
    whose scale is 0; here it runs and adds zeros, the same sum)."""

    nets: tuple[ControlNetUnionModel, ...]

    def __init__(self, nets):
        self.nets = tuple(nets)
        if not self.nets or not all(isinstance(n, ControlNetUnionModel) for n in self.nets):
            raise TypeError(f"MultiControlNetUnionModel takes ControlNetUnionModels, got "
                            f"{[type(n).__name__ for n in nets]}")

    def __call__(self, sample, timestep, encoder_hidden_states, controlnet_cond, control_type, control_type_idx, *,
                 conditioning_scale, guess_mode: bool = False, text_embeds=None, time_ids=None,
                 class_labels=None) -> ControlNetOutput:
        """As :meth:`ControlNetUnionModel.__call__`, with per net: a list of control images, a ``control_type``,
        a list of modes and one scale."""
        n = len(self.nets)
        if not (len(controlnet_cond) == len(control_type) == len(control_type_idx) == len(conditioning_scale) == n):
            raise ValueError(f"MultiControlNetUnionModel: {n} nets need as many lists of control images, control "
                             f"types, control modes and scales; got {len(controlnet_cond)}, {len(control_type)}, "
                             f"{len(control_type_idx)} and {len(conditioning_scale)}")
        down = mid = None
        for net, images, ctype, modes, scale in zip(self.nets, controlnet_cond, control_type, control_type_idx,
                                                    conditioning_scale):
            d, m = net(sample, timestep, encoder_hidden_states, images, ctype, modes, conditioning_scale=scale,
                       from_multi=True, guess_mode=guess_mode, text_embeds=text_embeds, time_ids=time_ids,
                       class_labels=class_labels)
            down, mid = (d, m) if down is None else (tuple(a + b for a, b in zip(down, d)), mid + m)
        return ControlNetOutput(down, mid)
